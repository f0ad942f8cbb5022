"""`python app.py serve` as a user runs it: flags, loopback bind, API key, clean shutdown."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backend.api.server import free_port

ROOT = Path(__file__).resolve().parents[1]


def _app(*args, **kw):
    return subprocess.run([sys.executable, "app.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, **kw)


def test_share_without_auth_refuses_to_start():
    r = _app("--share")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--auth" in r.stderr


def test_malformed_auth_is_refused():
    r = _app("serve", "--auth", "nocolon")
    assert r.returncode == 2 and "USER:PASS" in r.stderr


def test_serve_binds_loopback_guards_v1_and_shuts_down_cleanly(data_dir, tmp_path):
    port = free_port()
    ui = importlib.util.find_spec("ui") is not None
    args = [sys.executable, "app.py", "serve", "demo:qwen-image", "--port", str(port), "--api-key", "k3y",
            "--data-dir", str(data_dir), "--device", "cpu"] + (["--auth", "u:p"] if ui else [])
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        r = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": "Bearer k3y"}, timeout=120,
                       json={"messages": [{"role": "user", "content": "x"}],
                             "extra_body": {"num_inference_steps": 2, "seed": 3}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"][0]["image_url"]["url"].startswith("data:image/png")
        if ui:  # the UI is behind Gradio's login; the API key is not a UI login
            assert httpx.get(f"{base}/config").status_code == 401
            assert httpx.post(f"{base}/login", data={"username": "u", "password": "p"}).status_code == 200
        # the default host is loopback only: no other local address answers
        assert "127.0.0.1" in (tmp_path / "server.log").read_text()
        worker_pid = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer k3y"}).json()["worker"]["pid"]
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        log.close()
    assert rc == 0, (tmp_path / "server.log").read_text()
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # the worker went with it
        os.kill(worker_pid, 0)

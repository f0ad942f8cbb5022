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
from ui_fixtures import GATE_FILE, StepGate, step_gate_env, wait_until, wait_until_up

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
        wait_until_up(proc, base + "/", tmp_path / "server.log", paths=("health",))
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
    wait_until(lambda: not _alive(worker_pid), 30, f"the worker (pid {worker_pid}) to go with the server")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_mid_job_exits_quietly_and_keeps_the_job_for_the_next_start(data_dir, tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group) while a browser tab's
    event stream is open and a client waits for a running job: no traceback, the client gets a
    503 naming the job, the worker goes too, and the job is re-queued at the next start."""
    import threading

    from backend.jobs.queue import JobQueue

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(data_dir / "models", target_is_directory=True)  # built once, shared
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "app.py", "serve", "demo:sd3.5", "--port", str(port), "--data-dir",
                             str(home), "--device", "cpu"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **step_gate_env(home)}, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    base, answers = f"http://127.0.0.1:{port}", {}

    opened = {"job": threading.Event(), "tab": threading.Event()}

    def hold(name, method, url, **kw):
        try:
            with httpx.stream(method, url, timeout=120, **kw) as r:
                opened[name].set()  # the answer's head came: the stream is open
                answers[name] = (r.status_code, r.read() if name == "job" else b"")
        except httpx.HTTPError as exc:
            answers[name] = (None, repr(exc).encode())

    try:
        wait_until_up(proc, base + "/", tmp_path / "server.log", paths=("health",))
        StepGate(home / GATE_FILE).hold(1)  # the job runs (held at step 1) when Ctrl-C comes
        holders = [threading.Thread(target=hold, args=("job", "POST", f"{base}/v1/images/generations"),
                                    kwargs={"json": {"prompt": "x", "size": "64x64", "num_inference_steps": 4}})]
        if importlib.util.find_spec("ui") is not None:
            holders.append(threading.Thread(target=hold, args=("tab", "GET", f"{base}/gradio_api/heartbeat/t1")))
        for t in holders:
            t.start()
        jobs = wait_until(lambda: (rows := httpx.get(f"{base}/v1/jobs").json()["data"]) and rows[0]["status"] == "running"
                          and rows[0]["progress"]["step"] >= 1 and rows, 120, "the job to run")
        job_id = jobs[0]["id"]
        if len(holders) > 1:
            assert opened["tab"].wait(60), "the tab's event stream did not open"
        os.killpg(proc.pid, signal.SIGINT)
        started = time.monotonic()
        rc = proc.wait(60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    for t in holders:
        t.join(30)
    text = (tmp_path / "server.log").read_text()
    assert rc in (0, 130) and "Traceback" not in text and took < 15, (rc, took, text)
    status, body = answers["job"]
    assert status == 503 and job_id.encode() in body, answers
    deadline = time.monotonic() + 15  # the worker stops at its job's next step
    while subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout.strip():
        assert time.monotonic() < deadline, "a process of the server outlived it"
        time.sleep(0.5)
    queue = JobQueue(home / "jobs.sqlite")
    try:
        assert queue.get(job_id)["status"] == "running"  # left as it was: the next start re-queues it
        assert queue.recover() == {"requeued": 1, "failed": 0} and queue.get(job_id)["status"] == "queued"
    finally:
        queue.close()

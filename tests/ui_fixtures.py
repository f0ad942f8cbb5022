"""Fixtures shared by the UI tests: the launched app and adapter files for the demo models.

The app is the product itself: ``python app.py serve`` (the Studio, its worker, the HTTP
API and this UI on one port), on a free port. Set LORA_STUDIO_UI_URL to point the tests
at an app that is already running instead (with its data directory in $LORA_STUDIO_HOME, started
with LORA_STUDIO_STEP_GATE=$LORA_STUDIO_HOME/step-gate for the tests that hold a job running).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from backend.api.server import free_port

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
MODEL = "demo:qwen-image"


def make_lora(model_dir: Path, out: Path, *, rank: int = 4, seed: int = 0, strength: float = 0.5,
              component: str = "transformer") -> Path:
    """A diffusers-format LoRA on every attention projection of the model's ``component``."""
    rng = np.random.default_rng(seed)
    tensors = {}
    with safe_open(str(model_dir / component / "diffusion_pytorch_model.safetensors"), "np") as f:
        for key in f.keys():
            if ".attn.to_" in key and key.endswith(".weight"):
                out_f, in_f = f.get_slice(key).get_shape()
                base = f"{component}.{key[:-len('.weight')]}"
                tensors[f"{base}.lora_A.weight"] = (rng.standard_normal((rank, in_f)) * strength).astype(np.float32)
                tensors[f"{base}.lora_B.weight"] = (rng.standard_normal((out_f, rank)) * strength).astype(np.float32)
    assert tensors, f"no attention projections under {model_dir / component}"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    return out


def broken_adapter(out: Path) -> Path:
    """Not a safetensors file at all: an 8-byte header length, then garbage."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes((64).to_bytes(8, "little") + b"this is not json" * 4)
    return out


class StepGate:
    """A served app's step gate (backend/stepgate.py): ``hold(n)`` lets its jobs finish ``n`` steps and
    then keeps them running there, ``release()`` lets them finish. A test that must see a job running
    holds it by construction instead of hoping it is slow enough."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def hold(self, steps: int = 1) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(int(steps)))
        os.replace(tmp, self.path)  # atomic: the worker never reads half a number

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def step_until(self, pred, what: str, timeout: float = 120.0, every: float = 0.25):
        """Let held jobs on one step at a time, each ``every`` s, until ``pred()`` is truthy (returned):
        for what comes with time rather than with a step, like a throttled live preview."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            self.hold(int(self.path.read_text()) + 1 if self.path.exists() else 1)
            time.sleep(every)
        pytest.fail(f"timed out after {timeout:.0f}s stepping the held job until {what}")

    @contextlib.contextmanager
    def held(self, steps: int = 1):
        """Hold jobs at ``steps`` for a ``with`` block; always released after (even when the test fails)."""
        self.hold(steps)
        try:
            yield self
        finally:
            self.release()


GATE_FILE = "step-gate"


def step_gate_env(home: Path) -> dict:
    """The environment that gives a served app under ``home`` its step gate (open until a test holds it)."""
    from backend.stepgate import ENV

    return {ENV: str(Path(home) / GATE_FILE)}


class App:
    """The launched app: its URL and its data directory (library root: <data-dir>/adapters)."""

    def __init__(self, url: str, data_dir: Path):
        self.url, self.data_dir = url.rstrip("/") + "/", Path(data_dir)
        self.gate = StepGate(self.data_dir / GATE_FILE)  # an app of its own: start_app gives it this gate

    def add_adapter(self, path: Path, name: str) -> None:
        target = self.data_dir / "adapters" / f"{name}{path.suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)

    def get(self, route: str):
        import httpx

        return httpx.get(self.url + route.lstrip("/"), timeout=30).json()


def wait_until(pred, timeout: float = 120.0, what: str = "condition", every: float = 0.2):
    """Poll ``pred`` until it returns something truthy (returned); fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_until_up(proc: subprocess.Popen, url: str, log: Path, *, paths=("health", ""),
                  timeout: float = 600) -> None:
    """Until every path under ``url`` answers 200; a server that exits first fails the test with its log."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"app.py serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if all(httpx.get(url + path, timeout=5).status_code == 200 for path in paths):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"app.py serve did not come up in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


class ServedApp:
    """A running ``python app.py serve``: its process, URL (no trailing slash), data dir and log."""

    def __init__(self, proc: subprocess.Popen, port: int, home: Path, log: Path):
        self.proc, self.port, self.home, self.log = proc, port, Path(home), log
        self.url = f"http://127.0.0.1:{port}"
        self.gate = StepGate(Path(home) / GATE_FILE)

    def client(self, source: str = "127.0.0.1", **kw):
        """An httpx client talking from ``source`` (any 127.0.0.N: a per-address throttle sees each apart)."""
        import httpx

        return httpx.Client(base_url=self.url, timeout=60, transport=httpx.HTTPTransport(local_address=source), **kw)

    def stop(self) -> None:
        """SIGTERM (the server shuts its worker down cleanly), then a kill after 60 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def app_home(data_dir: Path, tmp_path_factory, prefix: str) -> Path:
    """A fresh data directory that shares the session's built demo models (built once)."""
    home = tmp_path_factory.mktemp(prefix)
    (home / "models").symlink_to(data_dir / "models", target_is_directory=True)
    return home


def start_app(home: Path, *flags: str, model: str = MODEL, env: dict | None = None, paths=("health",),
              **popen) -> ServedApp:
    """``python app.py serve MODEL --data-dir HOME --device cpu FLAGS`` on a free loopback port,
    up when every path in ``paths`` answers 200; a server that fails to come up is stopped and the
    test fails with its log. ``env`` adds to the environment; ``popen`` goes to ``Popen``."""
    port = free_port()
    log = Path(home) / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "serve", model, "--host", "127.0.0.1", "--port", str(port),
                                 "--data-dir", str(home), "--device", "cpu", *flags],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "LORA_STUDIO_HOME": str(home), **step_gate_env(home),
                                     **(env or {})}, **popen)
    served = ServedApp(proc, port, home, log)
    try:
        wait_until_up(proc, served.url + "/", log, paths=paths)
    except BaseException:
        served.stop()
        raise
    return served


@contextlib.contextmanager
def served_app(home: Path, *flags: str, **kw):
    """``start_app`` for a ``with`` block (or a fixture's ``yield``): always stopped after."""
    served = start_app(home, *flags, **kw)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def app(data_dir, demo_path, tmp_path_factory):
    """``python app.py serve`` (UI + HTTP API, one port) in its own data directory, which
    shares the session's demo models so they are built once."""
    url = os.environ.get("LORA_STUDIO_UI_URL")
    if url:
        yield App(url, Path(os.environ["LORA_STUDIO_HOME"]))
        return
    demo_path(MODEL)
    with served_app(app_home(data_dir, tmp_path_factory, "ui-app"), paths=("health", "")) as served:
        yield App(served.url + "/", served.home)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory, demo_path):
    root = tmp_path_factory.mktemp("loras")
    model_dir = demo_path(MODEL)
    return {"style": make_lora(model_dir, root / "ui-style.safetensors", seed=1),
            "other": make_lora(model_dir, root / "ui-other.safetensors", seed=2),
            "broken": broken_adapter(root / "ui-broken.safetensors")}

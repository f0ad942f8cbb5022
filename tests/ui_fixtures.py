"""Fixtures shared by the UI tests: the launched app and adapter files for the demo models.

The app is the real ``backend.service.Studio`` with the UI built over it, served on a
free port. Set LORA_STUDIO_UI_URL to point the tests at an app that is already running
instead (its data directory must be $LORA_STUDIO_HOME, where adapters are dropped).
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
MODEL = "demo:qwen-image"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class App:
    def __init__(self, url: str, studio=None, data_dir: Path | None = None):
        self.url, self.studio, self.data_dir = url.rstrip("/") + "/", studio, data_dir

    def add_adapter(self, path: Path, name: str) -> None:
        if self.studio is not None:
            self.studio.import_adapter(str(path), name)
        else:  # an external app: drop the file into its library root
            shutil.copy(path, Path(os.environ["LORA_STUDIO_HOME"]) / "adapters" / f"{name}.safetensors")


@pytest.fixture(scope="module")
def app(data_dir, demo_path):
    demo_path(MODEL)
    url = os.environ.get("LORA_STUDIO_UI_URL")
    if url:
        yield App(url, data_dir=data_dir)
        return
    import ui

    Studio = pytest.importorskip("backend.service", reason="the Studio facade is not on this branch yet").Studio

    studio = Studio(model=MODEL, data_dir=data_dir, device="cpu")
    blocks = ui.build_ui(studio)
    _, local_url, _ = ui.launch(blocks, prevent_thread_lock=True, server_name="127.0.0.1",
                                server_port=free_port(), quiet=True)
    try:
        yield App(local_url, studio=studio, data_dir=data_dir)
    finally:
        blocks.close()
        close = getattr(studio, "close", None)
        if close is not None:
            close()


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory, demo_path):
    root = tmp_path_factory.mktemp("loras")
    model_dir = demo_path(MODEL)
    return {"style": make_lora(model_dir, root / "ui-style.safetensors", seed=1),
            "other": make_lora(model_dir, root / "ui-other.safetensors", seed=2),
            "broken": broken_adapter(root / "ui-broken.safetensors")}

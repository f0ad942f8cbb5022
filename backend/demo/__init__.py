"""Embedded demo models: tiny pipelines built offline from configs with seeded weights.

``ensure(model_id)`` materializes a demo model once, in diffusers layout, under
``<data-dir>/models/``; from then on it is loaded by the pipeline class's own
``from_pretrained`` like any checkpoint. Building is deterministic: the same id gives
the same bytes on every machine (seeded weights, sorted tokenizer vocabularies,
pinned library versions).
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from .. import settings
from ..errors import ModelNotFound
from ..families import DEFAULT_MODEL  # noqa: F401 - defined once there; importers of backend.demo keep it

# Bump when a builder changes, so stale materializations are rebuilt.
BUILD_VERSION = 1
# Written next to model_index.json: sampling defaults sized for the model, read by the
# model loader for any directory that has one (a real checkpoint simply has none).
DEFAULTS_FILE = "lora_studio.json"


@dataclass(frozen=True)
class DemoModel:
    id: str
    builder: str  # "module:function", imported lazily so listing demos costs nothing
    stands_in_for: str
    defaults: str  # "module:NAME" of the defaults dict
    revision: int = 0  # bump when this one builder changes: only this model is rebuilt (BUILD_VERSION: all)

    def build(self):
        return _resolve(self.builder)()

    def sampling_defaults(self) -> dict:
        return dict(_resolve(self.defaults))


def _resolve(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


DEMO_MODELS: dict[str, DemoModel] = {m.id: m for m in [
    DemoModel("demo:qwen-image", "qwen:build", "Qwen/Qwen-Image-2512", "qwen:DEFAULTS"),
    DemoModel("demo:sd3.5", "sd3:build", "stabilityai/stable-diffusion-3.5-medium", "sd3:DEFAULTS"),
    DemoModel("demo:wan2.1-t2v", "wan:build_wan21_t2v", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan:DEFAULTS_T2V"),
    DemoModel("demo:wan2.2-t2v", "wan:build_wan22_t2v", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan:DEFAULTS_22"),
    DemoModel("demo:wan2.2-i2v", "wan:build_wan22_i2v", "Wan-AI/Wan2.2-I2V-A14B-Diffusers", "wan:DEFAULTS_22"),
    # revision 1: denoisers and video VAE drawn signal-preserving (the denoiser drives the frames)
    DemoModel("demo:minimax-h3", "minimax:repository", "MiniMaxAI/MiniMax-H3", "minimax:DEFAULTS", revision=1),
]}


def is_demo(model_id: str) -> bool:
    return model_id.startswith("demo:")


def ensure(model_id: str, data_dir: str | os.PathLike | None = None) -> Path:
    """Return the diffusers directory of a demo model, building it on first use."""
    demo = DEMO_MODELS.get(model_id)
    if demo is None:
        raise ModelNotFound(f"unknown demo model {model_id!r}; available: {', '.join(DEMO_MODELS)}",
                            param="model")
    target = settings.models_dir(data_dir) / model_id.replace(":", "-")
    marker = target / ".demo-build"
    if _is_current(marker, demo):
        return target
    # A lock so concurrent processes (server worker, tests, CLI) build it once.
    with FileLock(str(target) + ".lock"):
        if _is_current(marker, demo):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            _write(demo, tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _is_current(marker: Path, demo: DemoModel) -> bool:
    try:
        return json.loads(marker.read_text()) == _marker(demo)
    except (OSError, ValueError):
        return False


def _marker(demo: DemoModel) -> dict:
    marker = {"id": demo.id, "build_version": BUILD_VERSION}
    if demo.revision:  # absent at 0, so the markers of models never revised stay as they were
        marker["revision"] = demo.revision
    return marker


def _write(demo: DemoModel, out: Path) -> None:
    import torch  # heavy; only needed when building

    from ..result import quiet_libraries

    quiet_libraries()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: computed buffers (SD3's sin-cos pos_embed) round alike in every process
    try:
        with torch.random.fork_rng(devices=[]):
            pipe = demo.build()
    finally:
        torch.set_num_threads(threads)
    pipe.save_pretrained(out, safe_serialization=True)
    (out / DEFAULTS_FILE).write_text(json.dumps(
        {"stands_in_for": demo.stands_in_for, "defaults": demo.sampling_defaults()}, indent=2, sort_keys=True))
    (out / ".demo-build").write_text(json.dumps(_marker(demo)))

"""Embedded demo models: tiny pipelines, trained here or built offline from configs with seeded weights.

``ensure(model_id)`` materializes a demo model once, in diffusers layout, under
``<data-dir>/models/``; from then on it is loaded by the pipeline class's own
``from_pretrained`` like any checkpoint. A trained model (``weights``) is copied from its
tracked folder under ``backend/demo/weights/`` (``python -m backend.demo.train`` writes it);
the others are built from seeded weights. Either way the same id gives the same bytes on
every machine (seeded weights, sorted tokenizer vocabularies, pinned library versions).
"""
from __future__ import annotations

import functools
import hashlib
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

WEIGHTS_ROOT = Path(__file__).parent / "weights"
#: the trained demo LoRAs of demo:qwen-image (backend/demo/loras.py writes them; the demo root copies them)
LORAS_DIR = WEIGHTS_ROOT / "qwen-image-loras"
#: trained distill files, per demo model: the Lightning presets' LoRAs (backend/demo/distill.py writes them;
#: ``backend.distill.demo_files`` serves them under the presets' file names, in place of seeded stand-ins)
DISTILL_DIRS = {"demo:qwen-image": WEIGHTS_ROOT / "qwen-image-lightning"}
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
    weights: str | None = None  # a trained model: its folder under backend/demo/weights/ (builder: untrained)

    def build(self):
        return _resolve(self.builder)()

    @property
    def weights_dir(self) -> Path | None:
        return WEIGHTS_ROOT / self.weights if self.weights else None

    def sampling_defaults(self) -> dict:
        return dict(_resolve(self.defaults))


def _resolve(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


DEMO_MODELS: dict[str, DemoModel] = {m.id: m for m in [
    # trained: python -m backend.demo.train qwen-image (DEMO-TRAINING.md); "architecture" is where training starts
    DemoModel("demo:qwen-image", "qwen:architecture", "Qwen/Qwen-Image-2512", "qwen:DEFAULTS", weights="qwen-image"),
    DemoModel("demo:sd3.5", "sd3:build", "stabilityai/stable-diffusion-3.5-medium", "sd3:DEFAULTS"),
    # trained: python -m backend.demo.train wan2.1-t2v (backend/demo/wan_train.py)
    DemoModel("demo:wan2.1-t2v", "wan:architecture_t2v", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan:DEFAULTS_T2V",
              weights="wan2.1-t2v"),
    # trained: python -m backend.demo.train wan2.2-t2v (backend/demo/wan_experts.py), after wan2.1-t2v
    DemoModel("demo:wan2.2-t2v", "wan:architecture_22_t2v", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan:DEFAULTS_22_T2V",
              weights="wan2.2-t2v"),
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
    if demo.weights:  # new weights (a retrained model) rebuild the materialized copy
        marker["weights"] = _digest(demo.weights_dir)
    return marker


def _digest(folder: Path) -> str:
    """sha256 over a weights folder (names and contents); read again only when a file's stat changes."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise ModelNotFound(f"the trained weights of this demo model are missing: {folder} is empty; "
                            "run python -m backend.demo.train to write them", param="model")
    return _digest_files(str(folder), tuple((p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                                            for p in files))


@functools.lru_cache(maxsize=16)
def _digest_files(folder: str, files: tuple) -> str:
    h = hashlib.sha256()
    for rel, _, _ in files:
        h.update(rel.encode() + b"\0")
        h.update(hashlib.sha256((Path(folder) / rel).read_bytes()).digest())
    return h.hexdigest()


def _write(demo: DemoModel, out: Path) -> None:
    if demo.weights:
        shutil.copytree(demo.weights_dir, out, dirs_exist_ok=True)
    else:
        _build(demo, out)
    (out / DEFAULTS_FILE).write_text(json.dumps(
        {"stands_in_for": demo.stands_in_for, "defaults": demo.sampling_defaults()}, indent=2, sort_keys=True))
    (out / ".demo-build").write_text(json.dumps(_marker(demo)))


def _build(demo: DemoModel, out: Path) -> None:
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

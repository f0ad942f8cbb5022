"""Transformer checkpoints: find the safetensors file(s) a weight argument names, and check
their tensor names and shapes against a transformer config by reading headers only.

A weight argument is one of
  * a ``.safetensors`` file,
  * a directory holding ``diffusion_pytorch_model.safetensors`` or ``model.safetensors``,
  * a sharded checkpoint: its ``*.safetensors.index.json`` (or a directory holding one),
    whose every shard must exist.
Pickle checkpoints (``.bin``, ``.pt``, ``torch.save`` output under any name) are refused:
loading one runs arbitrary code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backend.errors import StudioError

SINGLE_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")
INDEX_NAMES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# What diffusers' from_pretrained looks for in a component folder.
CANONICAL_NAME = "diffusion_pytorch_model.safetensors"
CANONICAL_INDEX = "diffusion_pytorch_model.safetensors.index.json"


class AssemblyError(StudioError):
    """A skeleton, weight file or output path the assembly tool cannot use."""


@dataclass(frozen=True)
class Checkpoint:
    """The safetensors file(s) of one transformer. ``shards`` is in output order."""

    label: str                            # how the user named it, for messages
    shards: tuple[Path, ...]
    index: Path | None = None             # the *.index.json of a sharded checkpoint
    index_metadata: dict | None = None

    @property
    def sharded(self) -> bool:
        return self.index is not None

    def canonical_names(self) -> list[str]:
        """Output file names, one per shard, as diffusers' save_pretrained would write them."""
        if not self.sharded:
            return [CANONICAL_NAME]
        n = len(self.shards)
        stem = CANONICAL_NAME.removesuffix(".safetensors")
        return [f"{stem}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    def canonical_index(self, tensors_by_shard: dict[Path, list[str]]) -> dict:
        """The index for the renamed shards (same grouping of tensors into files)."""
        renamed = dict(zip(self.shards, self.canonical_names()))
        weight_map = {name: renamed[shard] for shard, names in tensors_by_shard.items() for name in names}
        return {"metadata": dict(self.index_metadata or {}), "weight_map": dict(sorted(weight_map.items()))}


def resolve(path: Path, label: str) -> Checkpoint:
    """Find the checkpoint a weight argument names. Checks existence only, not contents."""
    if not path.exists():
        raise AssemblyError(f"{label} {path}: no such file or directory")
    if path.is_dir():
        return _resolve_dir(path, label)
    if path.name.endswith(".index.json"):
        return _resolve_index(path, label)
    if path.suffix == ".safetensors":
        _refuse_pickle_content(path, label)
        return Checkpoint(label, (path,))
    if path.suffix in PICKLE_SUFFIXES:
        raise AssemblyError(f"{label} {path}: pickle checkpoints are refused (loading one can run code); "
                            f"convert it to .safetensors")
    raise AssemblyError(f"{label} {path}: not a .safetensors file or a *.safetensors.index.json")


def _resolve_dir(path: Path, label: str) -> Checkpoint:
    singles = [path / n for n in SINGLE_NAMES if (path / n).is_file()]
    indexes = [path / n for n in INDEX_NAMES if (path / n).is_file()]
    found = singles + indexes
    if len(found) > 1:
        raise AssemblyError(f"{label} {path}: holds more than one checkpoint "
                            f"({', '.join(p.name for p in found)}); pass the file you mean")
    if indexes:
        return _resolve_index(indexes[0], label)
    if singles:
        _refuse_pickle_content(singles[0], label)
        return Checkpoint(label, (singles[0],))
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise AssemblyError(f"{label} {path}: only pickle checkpoints here ({', '.join(pickles)}); "
                            f"they are refused (loading one can run code): convert to .safetensors")
    raise AssemblyError(f"{label} {path}: no {' / '.join(SINGLE_NAMES + INDEX_NAMES)} in this directory")


def _resolve_index(index: Path, label: str) -> Checkpoint:
    if not index.name.endswith(".safetensors.index.json"):
        raise AssemblyError(f"{label} {index}: only safetensors indexes (*.safetensors.index.json) are "
                            f"accepted; pickle checkpoints are refused")
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is empty or not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise AssemblyError(f"{label} {index}: unreadable index ({exc.__class__.__name__}: {exc})") from None
    shards = []
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if not shard.is_file():
            raise AssemblyError(f"{label} {index}: shard {name} is missing (expected at {shard})")
        _refuse_pickle_content(shard, label)
        shards.append(shard)
    return Checkpoint(label, tuple(shards), index, data.get("metadata") or {})


def _refuse_pickle_content(path: Path, label: str) -> None:
    # torch.save writes a zip archive (or a bare pickle, protocol byte 0x80); a safetensors
    # file starts with its little-endian header length. Catch a pickle renamed .safetensors.
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        raise AssemblyError(f"{label} {path}: this is a pickle (torch.save) file, not safetensors; "
                            f"pickle checkpoints are refused (loading one can run code)")


def read_tensors(ckpt: Checkpoint) -> dict[Path, dict[str, tuple[int, ...]]]:
    """Tensor names and shapes per shard, from the safetensors headers (no data is read)."""
    from safetensors import SafetensorError, safe_open

    out: dict[Path, dict[str, tuple[int, ...]]] = {}
    for shard in ckpt.shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                out[shard] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise AssemblyError(f"{ckpt.label} {shard}: not a readable safetensors file ({exc})") from None
    return out


def check(ckpt: Checkpoint, expected: dict[str, tuple[int, ...]], against: str) -> dict[Path, list[str]]:
    """Raise naming the first tensor that differs from ``expected`` (what ``against``, e.g.
    "transformer/config.json (WanTransformer3DModel)", defines); return tensor names per shard."""
    per_shard = read_tensors(ckpt)
    found: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for shard, tensors in per_shard.items():
        for name, shape in tensors.items():
            if name in found:
                raise AssemblyError(f"{ckpt.label}: tensor {name!r} is in both {where[name].name} and {shard.name}")
            found[name], where[name] = shape, shard
    if ckpt.sharded:
        _check_index(ckpt, where)
    problem = first_mismatch(expected, found, against)
    if problem:
        source = ckpt.index if ckpt.sharded else ckpt.shards[0]
        raise AssemblyError(f"{ckpt.label} {source}: {problem}")
    return {shard: list(tensors) for shard, tensors in per_shard.items()}


def _check_index(ckpt: Checkpoint, where: dict[str, Path]) -> None:
    weight_map = json.loads(ckpt.index.read_text())["weight_map"]
    for name, shard_name in weight_map.items():
        if name not in where:
            raise AssemblyError(f"{ckpt.label} {ckpt.index}: tensor {name!r} is listed in {shard_name} "
                                f"but that shard does not hold it")
        if where[name].name != shard_name:
            raise AssemblyError(f"{ckpt.label} {ckpt.index}: tensor {name!r} is listed in {shard_name} "
                                f"but stored in {where[name].name}")
    for name, shard in where.items():
        if name not in weight_map:
            raise AssemblyError(f"{ckpt.label} {ckpt.index}: tensor {name!r} in {shard.name} is not in the index")


def first_mismatch(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                   against: str) -> str | None:
    """The first difference, in the model's own parameter order, as one sentence."""
    for name, shape in expected.items():
        if name not in found:
            hint = _layout_hint(expected, found)
            return f"tensor {name!r} is missing ({against} expects shape {list(shape)}){hint}"
        if found[name] != shape:
            return f"tensor {name!r} has shape {list(found[name])} but {against} expects {list(shape)}"
    for name in found:
        if name not in expected:
            return f"unexpected tensor {name!r} ({against} has no such parameter)"
    return None


def _layout_hint(expected: dict, found: dict) -> str:
    # Original Wan / ComfyUI checkpoints use different names (blocks.N.self_attn.q ...).
    if found and not (set(found) & set(expected)):
        sample = next(iter(found))
        return (f"; no tensor name matches: the file looks like a non-diffusers layout "
                f"(e.g. {sample!r}), convert it to diffusers names first")
    return ""


def expected_tensors(config_file: Path, class_name: str, label: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes the transformer built from ``config_file`` has, on the meta device."""
    import diffusers
    import torch
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    cls = getattr(diffusers, class_name, None)
    if cls is None or not issubclass(cls, diffusers.ModelMixin):
        raise AssemblyError(f"{label}: {class_name!r} is not a diffusers model class")
    try:
        config = json.loads(config_file.read_text())
        with torch.device("meta"):  # no weights allocated, whatever the model size
            model = cls.from_config(config)
    except Exception as exc:  # a config the class rejects: name the file and why
        raise AssemblyError(f"{config_file}: cannot build {class_name} from it "
                            f"({exc.__class__.__name__}: {exc})") from None
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}

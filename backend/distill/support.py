"""Which pipelines the distill backend fuses into, and which file goes into which denoiser.

One table (``SUPPORTED``) and one routing rule (``plan``): Wan2.2 has two denoisers,
``transformer`` for the high-noise steps and ``transformer_2`` for the low-noise ones,
and its files are given in that order (as vLLM-Omni and lightx2v do).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AdapterError, InvalidParameter, UnsupportedModel


@dataclass(frozen=True)
class DistillSupport:
    class_name: str
    # extra load_lora_weights() keywords per target component
    component_kwargs: dict = field(default_factory=dict)
    # keywords for every load: partial diff_b files (lightx2v Wan) leave meta tensors
    # under diffusers' default low_cpu_mem_usage=True
    load_kwargs: dict = field(default_factory=lambda: {"low_cpu_mem_usage": False})


_WAN = {"transformer": {}, "transformer_2": {"load_into_transformer_2": True}}

SUPPORTED: dict[str, DistillSupport] = {s.class_name: s for s in [
    DistillSupport("QwenImagePipeline", {"transformer": {}}),
    DistillSupport("WanPipeline", _WAN),  # Wan2.1 (one transformer) and Wan2.2 (two)
    DistillSupport("WanImageToVideoPipeline", _WAN),
]}

# Name markers lightx2v (and everyone copying its names) put in Wan2.2 pair files.
NOISE_ROLE = {"transformer": "high_noise", "transformer_2": "low_noise"}


def support_for(class_name: str) -> DistillSupport:
    try:
        return SUPPORTED[class_name]
    except KeyError:
        raise UnsupportedModel(
            f"the distill backend does not support {class_name}; supported pipelines: "
            f"{', '.join(sorted(SUPPORTED))}", param="lora_backend") from None


@dataclass(frozen=True)
class Assignment:
    path: Path
    component: str
    scale: float


def _role(path: Path) -> str | None:
    name = path.name.lower()
    hits = [role for role in ("high_noise", "low_noise") if role in name]
    return hits[0] if len(hits) == 1 else None


def plan(class_name: str, components: list[str], paths, scales=None) -> list[Assignment]:
    """Pair each file with its component, refusing a wrong count or order by file name."""
    support_for(class_name)
    paths = [Path(p).expanduser() for p in ([paths] if isinstance(paths, (str, Path)) else list(paths))]
    if not paths:
        raise InvalidParameter("distill needs at least one LoRA file (lora_path)", param="lora_path")
    names = ", ".join(p.name for p in paths)
    if len(paths) != len(components):
        routing = " then ".join(f"{c} ({NOISE_ROLE[c].replace('_', ' ')})" for c in components) \
            if len(components) == 2 else components[0]
        raise InvalidParameter(
            f"{class_name} with {len(components)} denoiser(s) takes {len(components)} distill file(s) "
            f"({routing}); got {len(paths)}: {names}", param="lora_path")
    for path, component in zip(paths, components):
        role = _role(path)
        if role is None:
            continue
        if len(components) == 1:
            raise InvalidParameter(
                f"{path.name} is a Wan2.2 {role.replace('_', '-')} file, but the model has one transformer; "
                f"use the matching single-transformer file", param="lora_path")
        if role != NOISE_ROLE[component]:
            raise InvalidParameter(
                f"wrong order: {path.name} is a {role.replace('_', '-')} file but position "
                f"{components.index(component) + 1} goes into {component} "
                f"({NOISE_ROLE[component].replace('_', '-')}); give the high-noise file first, then the "
                f"low-noise one (got: {names})", param="lora_path")
    for path in paths:
        if not path.is_file():
            raise AdapterError(f"distill file {str(path)!r} does not exist", param="lora_path")
    return [Assignment(p, c, s) for p, c, s in zip(paths, components, _scales(scales, len(paths)))]


def _scales(scales, n: int) -> list[float]:
    if scales is None:
        return [1.0] * n
    if isinstance(scales, (int, float)) and not isinstance(scales, bool):
        return [float(scales)] * n
    scales = list(scales)
    if len(scales) != n:
        raise InvalidParameter(f"{n} distill file(s) but {len(scales)} scale(s)", param="lora_scale")
    return [float(s) for s in scales]

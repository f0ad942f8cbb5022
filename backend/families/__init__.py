"""Model families: one table, one module per family.

A family is everything the backend knows about one kind of model: its pipeline classes and
their request specs, its denoisers (the modules LoRAs bind to), what it outputs and which
writer stores that, its task types, its defaults, where a LoRA key or file goes, and the demo
model(s) that stand in for it. Everything else asks this registry rather than re-stating a fact.

The table (``FAMILIES``) maps a diffusers pipeline class name to the family modules that serve
it, in the style of vLLM-Omni's model registry (architecture name -> module, imported lazily).
One class can have more than one family (``WanPipeline`` is Wan2.1 with one transformer or
Wan2.2 with a high/low-noise pair): the first whose ``requires`` components the checkpoint
carries wins. Family modules are plain data (no torch, no diffusers at import), so ``app.py``
and the UI can read them cheaply.

Adding a family: write ``backend/families/<name>.py`` defining ``FAMILY = Family(...)`` and add
one row per pipeline class to ``FAMILIES``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from ..errors import UnsupportedModel

# The model a server or CLI runs when none is named (a demo: runs offline on CPU).
DEFAULT_MODEL = "demo:qwen-image"

# Request fields every family takes, and those of the video families.
COMMON_FIELDS = frozenset({"prompt", "negative_prompt", "seed", "height", "width", "num_inference_steps"})
VIDEO_FIELDS = frozenset({"num_frames", "fps", "flow_shift", "sample_solver"})

# Output kinds, and the writer (backend.outputs) that stores each.
OUTPUTS = {"image": "png", "video": "mp4", "video+audio": "mp4"}


@dataclass(frozen=True)
class PipelineSpec:
    """One pipeline class: what a request may carry, its defaults and shape rules."""

    class_name: str
    output: str  # "image" | "video" | "video+audio"
    denoisers: tuple[str, ...]
    defaults: dict = field(default_factory=dict)
    fields: frozenset = COMMON_FIELDS
    # fields a request must carry (e.g. the input image for image-to-video)
    required: frozenset = frozenset({"prompt"})
    # spatial size must be a multiple of this (VAE factor x patch size)
    size_multiple: int = 16
    # Wan: frames must be 4k+1 (the VAE compresses time by 4)
    frame_multiple: int | None = None
    mode: str = "text-to-image"
    # img2img (A1111's): the diffusers class that starts from an input ``image`` at a ``strength`` with the
    # same components (made with ``from_pipe``: no weight is copied); None: no img2img for this pipeline
    img2img: str | None = None

    @property
    def is_video(self) -> bool:
        return self.output.startswith("video")


@dataclass(frozen=True)
class LoraRouting:
    """Where a LoRA's keys and files go in this family."""

    # keys with no component prefix (a PEFT folder saved from the denoiser itself) go here
    default_component: str = "transformer"
    # Wan2.2: the name marker a distill file carries per denoiser, in file order
    # (lightx2v's ``high_noise`` / ``low_noise``); empty: files carry no role
    noise_roles: dict = field(default_factory=dict)
    # distill backend: extra ``load_lora_weights`` keywords per component; None: no distill support
    distill: dict | None = None
    # the pipeline classes the distill backend fuses into (None: every one of the family's)
    distill_pipelines: frozenset | None = None
    # keys under this prefix bind to every denoiser, each with its own scale (Wan2.2's experts)
    shared_prefix: str | None = None
    # "module:Class" of the family's LoRA hooks around the one engine (backend/lora/family.py: convert,
    # fit targets, per-request checks, who serves requests); None: the generic ``LoRAFamily``
    hooks: str | None = None
    # the pipeline components a LoRA's text-encoder layers (kohya ``lora_te*_``, ``text_encoder*.``) may
    # change, where the checkpoint carries them; empty: such keys are refused by name
    text_encoders: tuple = ("text_encoder", "text_encoder_2", "text_encoder_3")
    # how kohya-layout files (sd-scripts, musubi-tuner) name the transformer's layers, per pipeline class:
    # "diffusers" (its module paths, dots as ``_``: Qwen-Image), "wan" (Wan's original module names:
    # musubi-tuner); a pipeline not listed has none that its readers take back (an export refuses it)
    kohya_names: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    pipelines: tuple[PipelineSpec, ...]
    output: str  # "image" | "video" | "video+audio"
    denoisers: tuple[str, ...]  # in routing order (Wan2.2: high-noise expert first)
    demo_models: tuple[str, ...]
    # components a checkpoint must carry to be this family (Wan2.2: transformer_2)
    requires: frozenset = frozenset()
    # task_type -> the denoiser it runs on; empty: the family has no task_type field
    tasks: dict = field(default_factory=dict)
    lora: LoraRouting = LoraRouting()

    @property
    def writer(self) -> str:
        """The file format results are written as (``backend.outputs.WRITERS``)."""
        return OUTPUTS[self.output]

    @property
    def audio(self) -> bool:
        return self.output == "video+audio"

    @property
    def task_types(self) -> tuple[str, ...]:
        return tuple(self.tasks)

    @property
    def default_task(self) -> str | None:
        return next(iter(self.tasks), None)

    def distills(self, class_name: str) -> bool:
        """Whether the distill backend fuses files into this family's ``class_name`` pipelines."""
        allowed = self.lora.distill_pipelines
        return self.lora.distill is not None and (allowed is None or class_name in allowed)

    def spec(self, class_name: str) -> PipelineSpec:
        for spec in self.pipelines:
            if spec.class_name == class_name:
                return spec
        raise UnsupportedModel(f"family {self.name!r} has no pipeline {class_name!r}", param="model")


# pipeline class name -> family modules (backend/families/<module>.py), the most specific first
FAMILIES: dict[str, tuple[str, ...]] = {
    "QwenImagePipeline": ("image",),
    "StableDiffusion3Pipeline": ("image",),
    "WanPipeline": ("wan22", "wan"),
    "WanImageToVideoPipeline": ("wan22", "wan"),
    "MiniMaxH3ModularPipeline": ("minimax",),
}

_loaded: dict[str, Family] = {}


def register(class_name: str, module: str, *, first: bool = True) -> None:
    """Add a row: ``module`` (``backend.families.<name>`` or a full dotted path) serves ``class_name``."""
    rows = tuple(m for m in FAMILIES.get(class_name, ()) if m != module)
    FAMILIES[class_name] = (module, *rows) if first else (*rows, module)


def unregister(class_name: str, module: str) -> None:
    rows = tuple(m for m in FAMILIES.get(class_name, ()) if m != module)
    if rows:
        FAMILIES[class_name] = rows
    else:
        FAMILIES.pop(class_name, None)
    _loaded.pop(module, None)


def load(module: str) -> Family:
    """The ``FAMILY`` a family module defines (imported once, lazily)."""
    if module not in _loaded:
        path = module if "." in module else f"{__name__}.{module}"
        family = getattr(importlib.import_module(path), "FAMILY", None)
        if not isinstance(family, Family):
            raise UnsupportedModel(f"{path} defines no FAMILY = Family(...)", param="model")
        _loaded[module] = family
    return _loaded[module]


def supported() -> list[str]:
    return sorted(FAMILIES)


def candidates(class_name: str) -> list[Family]:
    """Every family that serves a pipeline class, the most specific first."""
    rows = FAMILIES.get(class_name)
    if not rows:
        raise UnsupportedModel(
            f"pipeline {class_name!r} is not supported; supported pipelines: {', '.join(supported())}",
            param="model")
    return [load(m) for m in rows]


def components_of(model_index: dict | None) -> set[str] | None:
    """The components a diffusers (or modular) model index names (``[library, class, ...]`` not null);
    None when the index says nothing (the family is then chosen by class alone)."""
    if not model_index:
        return None
    out = set()
    for name, value in model_index.items():
        if name.startswith("_"):
            continue
        if isinstance(value, (list, tuple)) and value and value[0] is not None:
            out.add(name)
    return out


def family_for(class_name: str, components=None) -> Family:
    """The family of a model: by its pipeline class, then by the components it carries."""
    found = candidates(class_name)
    have = None if components is None else set(components)
    for family in found:
        if have is None or family.requires <= have:
            return family
    return found[-1]


def spec_for(class_name: str) -> PipelineSpec:
    """The request spec of a pipeline class (the same in every family that serves it)."""
    return candidates(class_name)[0].spec(class_name)


def all_families() -> list[Family]:
    seen: dict[str, Family] = {}
    for rows in FAMILIES.values():
        for module in rows:
            family = load(module)
            seen.setdefault(family.name, family)
    return list(seen.values())


def family_of_demo(model_id: str) -> Family:
    for family in all_families():
        if model_id in family.demo_models:
            return family
    raise UnsupportedModel(f"no family lists the demo model {model_id!r}", param="model")


def task_types() -> tuple[str, ...]:
    """Every family's task types, in table order (the ``task_type`` field's choices)."""
    out: list[str] = []
    for family in all_families():
        out += [t for t in family.task_types if t not in out]
    return tuple(out)


def describe(spec: PipelineSpec, defaults: dict, denoisers) -> dict:
    """A model's spec as the worker, the Ray head and ``/v1/models`` report it."""
    return {"pipeline": spec.class_name, "output": spec.output, "mode": spec.mode,
            "fields": sorted(spec.fields), "denoisers": list(denoisers),
            "defaults": {**spec.defaults, **defaults}}


__all__ = ["COMMON_FIELDS", "DEFAULT_MODEL", "FAMILIES", "Family", "LoraRouting", "PipelineSpec", "VIDEO_FIELDS",
           "all_families", "candidates", "components_of", "describe", "family_for", "family_of_demo", "load",
           "register", "spec_for", "task_types", "unregister"]

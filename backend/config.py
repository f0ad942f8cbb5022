"""RuntimeConfig: everything a start needs, typed and validated once (like vLLM's EngineArgs/LoRAConfig).

argparse (``app.py``), ``Omni(...)``, ``Studio(...)`` and the Ray deployment all build one; the worker
process and every Ray replica receive it (it pickles, and ``model_dump(mode="json")`` round-trips it) and
hand it to ``PipelineManager.start(config)``, the one start sequence (docs/ARCHITECTURE.md, "Start path").

Cross-field rules live here, in the validators, and nowhere else: ``max_cpu_loras >= max_loras``, the
offload flags (``backend/minimax/offload.py``'s checks: the flags, the device, the model when its class is
known without loading it, the engine), ``lora_mode`` (``backend/lora/policy.check_mode``), the preset id.
A bad value raises the project's ``InvalidParameter`` with ``param`` naming the field, in one line, never
a pydantic ``ValidationError``. Importing this module does not import torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from .errors import InvalidParameter, StudioError
from .minimax import offload as offload_policy

from .families import DEFAULT_MODEL  # noqa: E402  (the one definition; torch-free)
LORA_BACKENDS = ("peft", "distill")
PRISTINE_MODES = ("auto", "device", "host")  # backend.lora.pristine.PRISTINE_MODES (which imports torch)
ENGINES = ("local", "ray")


def _paths(value) -> tuple[str, ...]:
    """One path or several (``--lora-path P [P ...]``, ``Omni(lora_path=p | [p, ...])``), as strings."""
    if value is None:
        return ()
    if isinstance(value, (str, Path)):
        return (str(value),)
    return tuple(str(p) for p in value)


class RuntimeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    model: str = DEFAULT_MODEL
    device: str | None = None  # None / "auto": CUDA when present
    dtype: str | None = None  # None / "auto": bfloat16 on CUDA, float32 on CPU
    lora_backend: str = "peft"  # peft: adapters per request; distill: lora_paths fused into the base at start
    lora_paths: tuple[str, ...] = ()  # peft: pre-loaded and pinned; distill: fused (start model only)
    lora_scale: Any = 1.0  # a number; peft: also a step schedule / block weights (backend/lora/schedule.py)
    preset: str | None = None  # a distill preset fused into the start model (both backends)
    max_loras: int = 4  # PEFT engine: adapters resident on the device
    max_cpu_loras: int = 16  # ... and in CPU memory
    adapter_dirs: tuple[str, ...] = ()  # adapter library roots besides <data_dir>/adapters
    data_dir: str | None = None
    offload: str = "none"  # MiniMax-H3: none | model | group (backend/minimax/offload.py)
    offload_stream: bool = False
    pristine: str = "auto"  # peft: where the originals of merged layers live (backend/lora/pristine.py)
    lora_mode: str | None = None  # auto | merge | unfused (None: auto on CUDA, merge on CPU)
    lora_prefetch: int = 2  # upcoming queued jobs whose adapters are read while a job runs (0: off)
    threads: int | None = None  # torch CPU threads of the worker (None: torch's default)
    env: dict[str, str] = {}  # environment of the worker process / the replicas
    engine: str = "local"  # where it runs: the local worker or a Ray Serve pool
    max_batch: int = 1  # compatible queued generate jobs run as one mixed-adapter batch (backend/batch.py)
    quantize: str | None = None  # "fp8": denoisers stored in fp8 (backend/quant.py)
    gguf: tuple[str, ...] = ()  # "COMPONENT=PATH" each: denoisers from GGUF files (backend/quant.py)

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _one_line(exc) from None

    # -- single fields ---------------------------------------------------------------------------
    @field_validator("lora_paths", "adapter_dirs", mode="before")
    @classmethod
    def _as_paths(cls, value):
        return _paths(value)

    @field_validator("lora_scale", mode="before")
    @classmethod
    def _scale(cls, value):
        from .lora.schedule import to_json  # torch-free: the one grammar of scales

        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return to_json(float(value), "lora_scale")
        return to_json(value, "lora_scale")

    @field_validator("max_batch")
    @classmethod
    def _batch(cls, value):
        if value < 1:
            raise InvalidParameter(f"--max-batch must be >= 1, got {value}", param="max_batch")
        return value

    @field_validator("quantize", mode="before")
    @classmethod
    def _quantize(cls, value):
        return None if value in (None, "", "none", False) else value

    @field_validator("gguf", mode="before")
    @classmethod
    def _gguf(cls, value):
        if not value:
            return ()
        from . import quant  # imports torch: only when a GGUF file is given

        # "COMPONENT=PATH" each, the path checked (exists, GGUF magic) and resolved; a bare path: transformer
        return tuple(f"{c}={p}" for c, p in quant.check(None, value).gguf.items())

    @field_validator("device", "dtype", "lora_mode", "preset", mode="before")
    @classmethod
    def _empty_is_none(cls, value):
        return None if value == "" else value

    @field_validator("data_dir", mode="before")
    @classmethod
    def _dir(cls, value):
        return None if value in (None, "") else str(value)

    @field_validator("lora_backend")
    @classmethod
    def _backend(cls, value):
        return _choice("lora_backend", value, LORA_BACKENDS)

    @field_validator("pristine")
    @classmethod
    def _pristine(cls, value):
        return _choice("pristine", value, PRISTINE_MODES)

    @field_validator("engine")
    @classmethod
    def _engine(cls, value):
        return _choice("engine", value, ENGINES)

    @field_validator("lora_mode")
    @classmethod
    def _mode(cls, value):
        from .lora.policy import check_mode  # torch-free

        return None if value is None else check_mode(value, "lora_mode")

    @field_validator("max_loras", "max_cpu_loras")
    @classmethod
    def _positive(cls, value, info):
        if value < 1:
            raise InvalidParameter(f"{info.field_name} must be >= 1, got {value}", param=info.field_name)
        return value

    @field_validator("lora_prefetch")
    @classmethod
    def _prefetch(cls, value):
        if value < 0:
            raise InvalidParameter(f"--lora-prefetch must be >= 0, got {value}", param="lora_prefetch")
        return value

    @field_validator("threads")
    @classmethod
    def _threads(cls, value):
        if value is not None and value < 1:
            raise InvalidParameter(f"threads must be >= 1, got {value}", param="threads")
        return value

    @field_validator("preset")
    @classmethod
    def _preset(cls, value):
        if value is not None:
            from . import presets

            presets.get_preset(value)  # an unknown id, named with the ones there are
        return value

    # -- across fields ---------------------------------------------------------------------------
    @model_validator(mode="after")
    def _across(self):
        if self.max_cpu_loras < self.max_loras:
            raise InvalidParameter(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
                                   param="max_cpu_loras")
        # offload: the flags, the device, the model, then the engine (a mode that needs CUDA is refused
        # with the same line by Omni, `app.py serve` and `--engine ray`)
        plan = self.offload_plan
        kind = _device_type(self.device)
        if kind is not None:
            offload_policy.check_device(plan, SimpleNamespace(type=kind))
        class_name = _known_class(self.model, self.data_dir) if plan.active else None
        if class_name is not None:
            offload_policy.check_model(plan, class_name)
        offload_policy.check_engine(plan, self.engine)
        if self.lora_backend == "distill" and not isinstance(self.lora_scale, float):
            raise InvalidParameter("lora_scale: the distill backend fuses with one number (a step schedule or "
                                   "block weights apply per request, on the peft backend)", param="lora_scale")
        if self.max_batch > 1 and self.engine == "ray":
            raise InvalidParameter("--max-batch applies to --engine local (a Ray replica takes one job at a time)",
                                   param="max_batch")
        if self.quantize or self.gguf:  # fp8 / GGUF bases: adapters unfused only (backend/quant.py)
            from . import quant  # imports torch: only when asked for

            qplan = quant.check(self.quantize, self.gguf)  # the files exist and are GGUF; not both
            if self.engine != "local" and qplan.gguf:  # a file every node would need: not verified per node
                raise InvalidParameter("--gguf: --engine local only (a Ray replica on another node has no "
                                       "checked copy of the GGUF file; --quantize fp8 runs on Ray)", param="gguf")
            if self.lora_mode == "merge" or self.lora_backend == "distill" or self.preset:
                what = "--lora-mode merge" if self.lora_mode == "merge" else "--preset" if self.preset \
                    else "--lora-backend distill"
                raise quant.refuse_merge(qplan.label(), what, "lora_mode" if self.lora_mode == "merge" else
                                         "preset" if self.preset else "lora_backend")
        return self

    @property
    def offload_plan(self) -> offload_policy.OffloadPlan:
        return offload_policy.check(self.offload, stream=self.offload_stream)

    def replace(self, **changes) -> "RuntimeConfig":
        """A copy with some fields changed, validated again."""
        return RuntimeConfig(**{**self.model_dump(), **changes})

    def for_model(self, model: str) -> bool:
        """Whether ``model`` is the start model (the one the start-time files and preset belong to)."""
        return model == self.model


def _choice(name: str, value, choices) -> str:
    if value not in choices:
        raise InvalidParameter(f"{name} must be one of {', '.join(choices)}, got {value!r}", param=name)
    return value


def _device_type(device: str | None) -> str | None:
    """``cpu`` / ``cuda`` for an explicit device (``cuda:1`` too); None for auto (decided at start)."""
    if device in (None, "auto"):
        return None
    kind = str(device).split(":", 1)[0]
    return kind if kind in ("cpu", "cuda") else None  # anything else: PipelineManager names it


def _known_class(model: str, data_dir) -> str | None:
    """The pipeline class of ``model`` when it is on disk already (a local directory, a built demo
    model), read from model_index.json without loading it; None otherwise (``load`` checks then)."""
    from . import demo, settings

    if demo.is_demo(model):
        if model not in demo.DEMO_MODELS:
            return None
        root = settings.models_dir(data_dir) / model.replace(":", "-")
    else:
        root = Path(model).expanduser()
    try:
        return json.loads((root / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError):
        return None


def _one_line(exc: ValidationError) -> StudioError:
    """A pydantic ValidationError as one InvalidParameter naming the (first) field."""
    err = exc.errors()[0]
    field = ".".join(str(x) for x in err.get("loc") or ()) or "config"
    name = field.split(".", 1)[0]
    if err.get("type") == "extra_forbidden":
        return InvalidParameter(f"unknown argument {name!r}", param=name)
    value = err.get("input")
    return InvalidParameter(f"{field}: {err.get('msg', 'invalid value').rstrip('.')}, got {value!r}", param=name)


def build(**values) -> RuntimeConfig:
    """``RuntimeConfig(**values)`` with None meaning "the default" (argparse leaves unset flags None)."""
    return RuntimeConfig(**{k: v for k, v in values.items() if v is not None})

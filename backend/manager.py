"""PipelineManager: the one object that owns a loaded pipeline on a device.

Everything that touches the device goes through here: loading and unloading a
model, running a generation with per-step progress and cancellation, and (through
the LoRA engine the PEFT backend attaches) activating adapters for a request.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import threading
import time
from typing import Callable

import torch

from . import params as param_rules
from . import quant, stepgate
from .errors import Cancelled, CorruptModel, InvalidParameter, StudioError, UnsupportedModel
from .minimax import offload as offload_policy
from .families import Family, PipelineSpec
from .models import resolve_model
from .result import GenerationResult, quiet_libraries  # noqa: F401 - both are imported from here too

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

StepCallback = Callable[[int, int], None]
# on_preview(step, total, render): ``render(index=0)`` -> that sample's latents now as a small PIL image
# (backend/preview.py) or None; called after every step, the caller decides when a preview is worth making
PreviewCallback = Callable[[int, int, Callable[..., object]], None]


def pick_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InvalidParameter(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)", param="device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameter(f"device {device!r} requested but CUDA is not available", param="device")
    return dev


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InvalidParameter(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}", param="dtype")
    return DTYPES[dtype]


class PipelineManager:
    def __init__(self, *, device: str | None = None, dtype: str | None = None, data_dir=None,
                 offload=None, offload_stream: bool = False, quantize: str | None = None, gguf=None):
        quiet_libraries()
        self.quant = quant.check(quantize, gguf)  # fp8 storage or GGUF denoisers (backend/quant.py)
        self.offload = offload_policy.check(offload, stream=offload_stream)  # MiniMax-H3 only (load() says so)
        self.device = pick_device(device)
        offload_policy.check_device(self.offload, self.device)
        self.dtype = pick_dtype(dtype, self.device)
        self.data_dir = data_dir
        self.model_id: str | None = None
        self.model_path = None
        self.pipeline = None
        self.spec: PipelineSpec | None = None
        self.family: Family | None = None  # backend/families: denoisers, output, routing, demo models
        self.defaults: dict = {}
        # Set by the PEFT backend: activates the adapters a request names.
        self.lora_engine = None
        # Set by the distill backend (backend.distill.FusedBase) once files are fused.
        self.fused_base = None
        # MiniMax-H3 (modular pipeline): contracts, partitions and adapters (backend/minimax/runtime.py)
        self.minimax = None
        self.quantized: str | None = None  # how the loaded denoisers are stored ("fp8 (...)", "gguf (Q8_0)")
        self._preview = None  # backend/preview.py: the loaded pipeline's latent -> RGB map (live previews)
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, config) -> "PipelineManager":
        """An empty manager for a ``backend.config.RuntimeConfig`` (device, dtype, data dir, offload)."""
        return cls(device=config.device, dtype=config.dtype, data_dir=config.data_dir, offload=config.offload,
                   offload_stream=config.offload_stream, quantize=config.quantize, gguf=list(config.gguf))

    # -- the start sequence (docs/ARCHITECTURE.md, "Start path") ----------------------------------
    def start(self, config, model: str | None = None, *, preset_paths=None) -> None:
        """The one start sequence: Omni, the local worker and every Ray replica call it.

        Loads ``model`` (default: ``config.model``); the start model then gets its start-time files:
        ``lora_backend="distill"`` fuses ``config.lora_paths``, ``config.preset`` is fused (both backends);
        then the PEFT backend attaches the LoRA engine (``config.lora_paths`` pre-loaded and pinned, for the
        start model only). MiniMax-H3's runtime ``start`` fuses its distill files and applies offload first;
        its per-request adapters then get the same engine, through the family's hooks (``backend.lora.family``).
        ``preset_paths``: the preset's files already resolved and checked elsewhere (a Ray replica fuses what
        the head found). A failure unloads the model: nothing half-started is ever served."""
        model = model or config.model
        start_model = config.for_model(model)
        with self._lock:
            self.load(model)
            try:
                if self.minimax is not None:
                    if start_model and config.preset:
                        from . import presets

                        presets.get_preset(config.preset).fits(model, self.spec.class_name)
                    # distill files fused, then offload applied; per-request adapters go through the shared
                    # engine below, with the family's hooks (backend/minimax/adapters.py MiniMaxLoRAFamily)
                    distill = config.lora_backend == "distill" and start_model
                    self.minimax.start(config.lora_backend, list(config.lora_paths) if distill else [])
                elif start_model and config.lora_backend == "distill" and config.lora_paths:
                    self.fuse(list(config.lora_paths), config.lora_scale)
                if start_model and config.preset and self.minimax is None:
                    self.apply_preset(config.preset, list(config.adapter_dirs), paths=preset_paths)
                if config.lora_backend == "peft":
                    from .lora import attach

                    attach(self, max_loras=config.max_loras, max_cpu_loras=config.max_cpu_loras,
                           preload=list(config.lora_paths) if start_model else [], pristine=config.pristine,
                           lora_mode=config.lora_mode)
            except BaseException:
                self.unload()
                raise

    def exclusive(self):
        """Hold the pipeline across several calls (each of load, fuse, generate already holds it):
        ``with manager.exclusive(): ...``. Re-entrant."""
        return self._lock

    # -- loading ---------------------------------------------------------------------------
    def load(self, model_id: str) -> None:
        with self._lock:
            resolved = resolve_model(model_id, self.data_dir)
            family = resolved.family
            spec = family.spec(resolved.class_name)
            offload_policy.check_model(self.offload, spec.class_name)
            minimax = None
            if spec.class_name == "MiniMaxH3ModularPipeline":  # modular: its own loading and run
                if self.quant.active:
                    raise InvalidParameter("quantize/gguf: not supported for MiniMax-H3 (docs/lora.md)",
                                           param="gguf" if self.quant.gguf else "quantize")
                from .minimax.runtime import MiniMaxRuntime

                minimax = MiniMaxRuntime(resolved.path, device=self.device, dtype=self.dtype, offload=self.offload)
                pipeline = minimax.pipe
            else:
                pipeline = self._from_pretrained(resolved, spec)
            self.unload()
            self.pipeline, self.spec, self.family, self.minimax = pipeline, spec, family, minimax
            self.model_id, self.model_path = model_id, resolved.path
            self.defaults = dict(resolved.defaults)
            self.quantized = quant.quantized_kind(self.denoisers())

    def _from_pretrained(self, resolved, spec=None):
        import diffusers

        cls = getattr(diffusers, resolved.class_name, None)
        if cls is None:
            raise UnsupportedModel(f"diffusers {diffusers.__version__} has no pipeline {resolved.class_name!r}",
                                   param="model")
        denoisers = spec.denoisers if spec is not None else ()
        components = quant.gguf_components(self.quant, resolved.path, denoisers, self.dtype)
        try:
            pipe = cls.from_pretrained(resolved.path, dtype=self.dtype, **components)
        except Exception as exc:  # a broken checkpoint: say which directory and why, in one line
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            raise CorruptModel(f"could not load {resolved.path}: {msg}", param="model") from exc
        pipe.to(self.device)
        quant.apply(self.quant, {d: getattr(pipe, d) for d in denoisers if getattr(pipe, d, None) is not None},
                    self.dtype)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def unload(self) -> None:
        with self._lock:
            if self.pipeline is None:
                return
            self.pipeline = self._preview = None  # the previewer holds the pipeline too: both go
            self.lora_engine = self.fused_base = self.minimax = None
            self.model_id = self.model_path = self.spec = self.family = self.quantized = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def denoisers(self) -> dict[str, torch.nn.Module]:
        """The loaded pipeline's denoising modules, by component name."""
        self._require_loaded()
        return {name: getattr(self.pipeline, name) for name in self.family.denoisers
                if getattr(self.pipeline, name, None) is not None}

    def encoders(self) -> dict[str, torch.nn.Module]:
        """The loaded pipeline's text encoders a LoRA may change (the family's ``LoraRouting.text_encoders``)."""
        self._require_loaded()
        return {name: module for name in self.family.lora.text_encoders
                if isinstance(module := getattr(self.pipeline, name, None), torch.nn.Module)}

    # -- generation ------------------------------------------------------------------------
    def validate(self, request: dict, defaults: dict | None = None) -> dict:
        """Checked parameters for a request (raises InvalidParameter naming the field)."""
        self._require_loaded()
        preset = self.fused_base.preset if self.fused_base is not None else None
        preset_defaults = preset.defaults if preset is not None else {}
        params = param_rules.validate(self.spec, request, {**self.defaults, **preset_defaults, **(defaults or {})})
        two_stage = "transformer_2" in self.denoisers()
        for name in ("guidance_scale_2", "boundary_ratio"):
            if name in request and request[name] is not None and not two_stage:
                raise InvalidParameter(f"{name!r} needs a two-transformer model (Wan2.2); {self.model_id} has one",
                                       param=name)
        if not two_stage:
            params.pop("guidance_scale_2", None)
        if preset is not None:
            preset.check(params)  # a fused few-step LoRA's sampling contract (422 by name)
        return params

    def generate(self, request: dict, *, adapters=None, defaults: dict | None = None,
                 on_step: StepCallback | None = None, cancel: threading.Event | None = None,
                 lora_mode: str | None = None, queued_same: int = 0,
                 on_preview: PreviewCallback | None = None) -> GenerationResult:
        with self._lock:
            if self.minimax is not None:
                from .minimax.runtime import generate_for_manager

                on_step = stepgate.wrap(on_step, cancel.is_set if cancel is not None else None)  # tests only
                return generate_for_manager(self, request, adapters=adapters, defaults=defaults,
                                            on_step=on_step, cancel=cancel, lora_mode=lora_mode)
            if "lora_mode" in request:  # a request field (HTTP): merge or unfused, not a pipeline argument
                request = dict(request)
                field = request.pop("lora_mode")
                lora_mode = field if lora_mode is None else lora_mode
            params = self.validate(request, defaults)
            if adapters and self.lora_engine is None:
                raise StudioError("this pipeline manager has no LoRA engine attached (backend.lora.attach)",
                                  param="lora_request")
            started = time.time()
            # the steps that run: all, or img2img's share of them (what a step schedule and the bar count)
            engine, steps = self.lora_engine, param_rules.img2img_steps(params)
            # lora_mode / queued_same / steps: the merge-or-unfused policy (backend/lora/policy.py)
            applied = engine.activate(adapters or [], steps=steps, mode=lora_mode,
                                      queued_same=queued_same) if engine is not None else []
            calls, run_started = (engine.unfused.forward_calls() if engine is not None else 0), time.perf_counter()
            if engine is not None:  # a step schedule: each step's scales set from the step callback
                on_step = engine.unfused.stepper(steps, on_step)
            with self.scheduler_for(params), self.boundary_for(params):
                output = self._run(params, on_step, cancel, on_preview)
            result = self._collect(output, params)
            if engine is not None:  # the policy's measured step time (and forwards per step)
                engine.unfused.observe_run(time.perf_counter() - run_started, steps,
                                           engine.unfused.forward_calls() - calls)
            result.metadata = self.run_metadata(params, applied, time.time() - started)
            if engine is not None and applied:  # which way the adapters ran (each row's "mode" is the engine's)
                decision = engine.unfused.last_decision
                mode = "unfused" if engine.unfused.active else "merged"
                result.metadata["lora_mode"] = decision.as_dict() if decision is not None else {"mode": mode}
            return result

    def live_preview(self):
        """The latent -> RGB previewer of the loaded pipeline (backend/preview.py), made on first use."""
        from .preview import LatentPreview

        if self._preview is None or self._preview.pipeline is not self.pipeline:
            self._preview = LatentPreview(self.pipeline)
        return self._preview

    def preview_renderer(self, tensors: dict, params: dict):
        """``render(index=0)`` for the step callback's tensors (None when no latents are among them)."""
        latents = tensors.get("latents")
        if latents is None:
            return lambda index=0: None
        preview = self.live_preview()
        return lambda index=0: preview.image(latents, params.get("height"), params.get("width"), index)

    def img2img_pipeline(self):
        """The loaded pipeline's img2img sibling (``PipelineSpec.img2img``) over the very same components
        (``from_pipe``: no weight copied, so adapters merged, a fused preset and the scheduler swapped for
        this request are what it runs with), made per request: it costs no memory and nothing goes stale."""
        import diffusers

        return getattr(diffusers, self.spec.img2img).from_pipe(self.pipeline)

    def _run(self, params: dict, on_step, cancel, on_preview=None):
        pipe = self.img2img_pipeline() if self.spec.img2img and params.get("image") is not None else self.pipeline
        kwargs = {k: v for k, v in params.items()
                  if k not in ("seed", "fps", "flow_shift", "sample_solver", "boundary_ratio")}
        total = param_rules.img2img_steps(params)

        def step_end(pipeline, i, t, tensors):
            if cancel is not None and cancel.is_set():
                raise Cancelled("generation cancelled")
            if on_step is not None:
                on_step(i + 1, total)
            if on_preview is not None:
                on_preview(i + 1, total, self.preview_renderer(tensors, params))
            stepgate.wait(i + 1, cancel.is_set if cancel is not None else None)  # tests only
            return tensors

        generator = torch.Generator(device="cpu").manual_seed(params["seed"])
        output_type = "pil"
        with torch.inference_mode():
            return pipe(**kwargs, generator=generator, output_type=output_type, callback_on_step_end=step_end)

    def _collect(self, output, params: dict) -> GenerationResult:
        if self.spec.is_video:
            frames = output.frames[0]
            return GenerationResult(frames=list(frames), fps=params.get("fps", 16),
                                    audio=getattr(output, "audio", None))
        return GenerationResult(images=list(output.images))

    # -- distill: a fused base (backend/distill) ------------------------------------------------
    def fuse(self, paths, scales=None, *, preset=None) -> dict:
        """Fuse distill file(s) into the denoisers (one per denoiser, high then low on Wan2.2)."""
        from .distill import FusedBase

        with self._lock:
            self._require_loaded()
            if self.quantized:  # never written into quantized storage
                raise quant.refuse_merge(self.quantized, "fusing a distill file or preset", "lora_backend")
            if preset is None:  # files named like a preset's carry its sampling contract
                from .presets import match_files

                preset = match_files(self.spec.class_name, paths)
            if self.fused_base is None:
                self.fused_base = FusedBase(self.pipeline, self.spec.class_name, self.denoisers(), self.model_path)
            with self._rebased():
                return self.fused_base.fuse(paths, scales, preset=preset).as_dict()

    def restore_base(self) -> None:
        """Back to the exact base weights, without reloading anything."""
        with self._lock:
            if self.fused_base is not None:
                with self._rebased():
                    self.fused_base.restore()

    def _rebased(self):
        """Per-request adapters come off around a fuse/restore, and then treat the result as base."""
        if self.lora_engine is None:
            return contextlib.nullcontext()
        return self.lora_engine.rebase()

    def fused_state(self) -> dict:
        """``{"state": "base"}`` or ``{"state": "fused", "files", "scales", "checksums", ...}``."""
        with self._lock:
            if self.minimax is not None and self.minimax.fused:  # MiniMax-H3 fuses through its runtime
                return {"state": "fused", "files": [{"path": str(a.path), "component": a.partition}
                                                    for a in self.minimax.fused]}
            if self.fused_base is None:
                return {"state": "base"}
            return self.fused_base.state()

    def apply_preset(self, preset_id: str, adapter_dirs=None, paths=None) -> dict:
        """Resolve a preset's files, fuse them, and return its sampling defaults. ``paths``: the
        files already resolved (and checked) elsewhere: a Ray replica fuses what the head found."""
        from . import presets

        with self._lock:
            self._require_loaded()
            preset = presets.get_preset(preset_id)
            preset.fits(self.model_id, self.spec.class_name)
            choices = []
            if paths is None:  # several files per pattern (fp32 and bf16): the run's dtype picks
                located = presets.locate(preset, self.model_id, self.data_dir, adapter_dirs, create_demo=True,
                                         dtype=self.dtype)
                paths = presets.resolve_files(preset, self.model_id, self.data_dir, adapter_dirs, dtype=self.dtype)
                choices = [loc.choice for loc in located if loc.choice]
            self.fuse(paths, [f.scale for f in preset.files], preset=preset)
            self.fused_base.fused.choices = choices
            return dict(preset.defaults)

    def run_metadata(self, params: dict, adapters: list, seconds: float) -> dict:
        """A result's metadata: model, pipeline, seed, the params shown, adapters, device, timing."""
        shown = {k: v for k, v in params.items() if k != "image"}
        if "image" in params:
            shown["image_sha256"] = hashlib.sha256(params["image"].tobytes()).hexdigest()
        return {
            "model": self.model_id, "pipeline": self.spec.class_name, "seed": params["seed"],
            "params": shown, "adapters": adapters, "backend": "diffusers",
            "distill": self.fused_base.state() if self.fused_base is not None and self.fused_base.fused else None,
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
            "seconds": round(seconds, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **({"quantization": self.quantized} if self.quantized else {}),
        }

    # -- per-request scheduler / routing overrides ---------------------------------------------
    def scheduler_for(self, params: dict):
        return _Swap(self.pipeline, "scheduler", self._make_scheduler(params))

    def _make_scheduler(self, params: dict):
        solver, shift = params.get("sample_solver"), params.get("flow_shift")
        if solver is None and shift is None:
            return None
        if self.fused_base is not None and self.fused_base.fused is not None and self.fused_base.fused.scheduler:
            return None  # a fused preset's own scheduler; its contract already pinned these two fields
        from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

        config = dict(self.pipeline.scheduler.config)
        current = "unipc" if isinstance(self.pipeline.scheduler, UniPCMultistepScheduler) else "euler"
        solver = solver or current
        if shift is None:
            shift = config.get("flow_shift") if current == "unipc" else config.get("shift", 1.0)
        if solver == "unipc":
            return UniPCMultistepScheduler.from_config(
                config, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
        return FlowMatchEulerDiscreteScheduler.from_config(config, shift=shift)

    def boundary_for(self, params: dict):
        ratio = params.get("boundary_ratio")
        return _ConfigSwap(self.pipeline, "boundary_ratio", ratio)

    def _require_loaded(self):
        if self.pipeline is None:
            raise StudioError("no model is loaded", param="model")


class _Swap:
    """Set an attribute for the duration of one generation, then put the old one back."""

    def __init__(self, obj, name: str, value):
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self):
        self.old = getattr(self.obj, self.name)
        if self.value is not None:
            setattr(self.obj, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.old)


class _ConfigSwap(_Swap):
    """The same for a registered config value (Wan's boundary_ratio lives in the config)."""

    def __enter__(self):
        self.old = self.obj.config.get(self.name)
        if self.value is not None:
            self.obj.register_to_config(**{self.name: self.value})

    def __exit__(self, *exc):
        if self.value is not None:
            self.obj.register_to_config(**{self.name: self.old})

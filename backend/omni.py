"""Omni: the Python API, shaped like vLLM-Omni's.

    omni = Omni(model="demo:sd3.5")
    outputs = omni.generate(prompt="A piece of cheesecake", seed=42)
    outputs[0].images[0].save("cake.png")
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import RuntimeConfig
from .demo import DEFAULT_MODEL
from .errors import InvalidParameter
from .lora.request import LoRARequest
from .lora.schedule import to_json
from .manager import GenerationResult, PipelineManager
from .outputs import save_result


@dataclass
class OmniOutput:
    images: list = field(default_factory=list)
    frames: list | None = None
    fps: int | None = None
    audio: Any = None
    metadata: dict = field(default_factory=dict)
    _result: GenerationResult | None = field(default=None, repr=False)

    def save(self, path=None, data_dir=None) -> Path:
        """Write PNG/MP4 + JSON sidecar (atomically); returns the path."""
        return save_result(self._result, data_dir=data_dir, path=path)


class Omni:
    """``config``: a ``backend.config.RuntimeConfig`` to start from as it is (the other arguments are
    then not used); otherwise the arguments build one. Either way ``PipelineManager.start`` starts it."""

    def __init__(self, model: str = DEFAULT_MODEL, lora_path=None, lora_backend: str = "peft",
                 lora_scale: float = 1.0, max_loras: int = 4, max_cpu_loras: int = 16,
                 device: str | None = None, dtype: str | None = None, data_dir=None, adapter_dirs=None,
                 offload: str = "none", offload_stream: bool = False, pristine: str = "auto",
                 lora_mode: str | None = None, preset: str | None = None, quantize: str | None = None,
                 gguf=None, config: RuntimeConfig | None = None,
                 **kwargs):
        if kwargs:
            raise InvalidParameter(f"Omni() got unknown argument {sorted(kwargs)[0]!r}", param=sorted(kwargs)[0])
        if config is None:
            config = RuntimeConfig(model=model, lora_paths=lora_path, lora_backend=lora_backend,
                                   lora_scale=lora_scale, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                                   device=device, dtype=dtype, data_dir=data_dir, adapter_dirs=adapter_dirs,
                                   offload=offload, offload_stream=offload_stream, pristine=pristine,
                                   lora_mode=lora_mode, preset=preset, quantize=quantize,
                                   gguf=gguf)
        self.config = config
        self.model, self.lora_backend, self.lora_scale = config.model, config.lora_backend, config.lora_scale
        self.max_loras, self.max_cpu_loras = config.max_loras, config.max_cpu_loras
        self.data_dir, self.adapter_dirs = config.data_dir, list(config.adapter_dirs)
        self.manager = PipelineManager.from_config(config)
        self.manager.start(config)
        self.lora = self.manager.lora_engine  # None under distill

    def apply_preset(self, preset_id: str) -> dict:
        """Fuse a distill preset's files (adapter dirs, then the HF cache) and use its defaults."""
        return self.manager.apply_preset(preset_id, self.adapter_dirs)

    def fused_state(self) -> dict:
        return self.manager.fused_state()

    def generate(self, prompt: str | list[str] | None = None, lora_request: LoRARequest | list | None = None,
                 lora_scale: float | list | dict | None = None, on_step=None, **fields) -> list[OmniOutput]:
        prompts = prompt if isinstance(prompt, list) else [prompt]
        adapters = self._adapters(lora_request, lora_scale)
        lora_mode = fields.pop("lora_mode", None)  # per call: auto | merge | unfused (backend/lora/policy.py)
        outputs = []
        for p in prompts:
            result = self.manager.generate({**fields, "prompt": p}, adapters=adapters, on_step=on_step,
                                           lora_mode=lora_mode)
            outputs.append(OmniOutput(images=result.images or [], frames=result.frames, fps=result.fps,
                                      audio=result.audio, metadata=result.metadata, _result=result))
        return outputs

    def _adapters(self, lora_request, lora_scale) -> list:
        """Pair each LoRARequest with its scale. One request takes one scale in any form (a number,
        a step schedule such as ``[1.0, 0.5]`` or ``{"start": 0.5, "end": 1.0}``, per expert, per block:
        backend/lora/schedule.py); a list of requests takes a list with one scale per request (or
        one scale that is not a list, for all)."""
        if lora_request is None:
            return []
        single = not isinstance(lora_request, (list, tuple))
        requests = [lora_request] if single else lora_request
        if isinstance(lora_scale, (list, tuple)) and not single:
            scales = list(lora_scale)
        else:
            scales = [self.lora_scale if lora_scale is None else lora_scale] * len(requests)
        if len(scales) != len(requests):
            raise InvalidParameter(f"{len(requests)} lora_request(s) but {len(scales)} lora_scale value(s)",
                                   param="lora_scale")
        where = (lambda i: "lora_scale") if single else (lambda i: f"lora_scale[{i}]")
        scales = [to_json(s, where(i)) for i, s in enumerate(scales)]  # refused by name before any work
        for req in requests:
            if not isinstance(req, LoRARequest):
                raise InvalidParameter(f"lora_request must be a LoRARequest, got {type(req).__name__}",
                                       param="lora_request")
        return list(zip(requests, scales))

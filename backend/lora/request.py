"""LoRARequest: the per-request adapter handle, named exactly as vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """Names an adapter for one request.

    ``lora_int_id`` is the stable integer id vLLM uses as the cache key; two requests
    with the same id refer to the same adapter. ``lora_path`` is a PEFT folder or a
    single ``.safetensors`` LoRA file.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError("LoRARequest.lora_int_id must be a positive integer")

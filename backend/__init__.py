"""LoRA Studio backend: models, LoRA (PEFT + distill), presets, jobs, HTTP API.

Public surface: ``from backend import Omni, LoRARequest``.
"""
from .lora.request import LoRARequest


def __getattr__(name):
    # Omni pulls in torch/diffusers; import it lazily so light users (the UI, listings)
    # of `backend` stay light.
    if name in ("Omni", "OmniOutput"):
        from . import omni
        return getattr(omni, name)
    raise AttributeError(name)


__all__ = ["LoRARequest", "Omni", "OmniOutput"]

"""Offload for MiniMax-H3 with LoRA adapters: the policy (checked at start) and its application.

Decided by reading diffusers 0.42.1 and peft 0.21 (docs/minimax.md, "Offload", has the table):

- How our adapters touch weights. peft backend: LoRA layers bound with ``load_lora_weights`` and switched per
  request with ``set_adapters`` / ``enable_lora`` / ``disable_lora``, which change scales and flags, never a
  tensor; nothing is merged. distill: ``fuse_lora`` writes into base weights once, at start, and offload is
  applied only after that (``Offloader.apply`` runs after ``MiniMaxRuntime.fuse``; ``fuse`` refuses later).
- model (ComponentsManager ``enable_auto_cpu_offload``; a modular pipeline has no ``enable_model_cpu_offload``):
  a hook moves the whole component, LoRA layers included (peft creates them on the base layer's device), with
  ``module.to``. Consistent for both backends. Needs CUDA: the strategy asks the device for free memory.
- group (block level, one block per group, ``enable_group_offload`` / ``apply_group_offloading``):
  * without streams, onload is ``param.data.to(device)`` of the current values and offload is
    ``module.to(cpu)``: nothing is copied aside, so no copy can go stale. Consistent for both backends.
  * with streams (``--offload-stream``), onload copies from pinned CPU copies captured when the hooks are
    applied and offload points ``param.data`` back at them, so a tensor written while onloaded is dropped and a
    parameter added later has no copy. ``load_lora_weights`` and ``delete_adapters`` remove and re-apply the
    hooks (fresh copies, new LoRA parameters included), switching writes no tensor, and fusing happens before
    the hooks exist. Consistent for both backends as used here; it needs CUDA streams.
  Disk offload (``offload_to_disk_path``) is not offered: a group's file is written once and never rewritten,
  so a later adapter load would onload stale tensors under the re-applied hooks.
- Refused: ``--offload-stream`` without ``--offload group``; ``model`` or streams without a CUDA device;
  ``--offload`` for a model other than MiniMax-H3 (the merging PEFT engine of the other pipelines was not
  analysed); ``--offload`` with ``--engine ray``. Each message names the flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidParameter

MODES = ("none", "model", "group")


@dataclass(frozen=True)
class OffloadPlan:
    mode: str = "none"
    stream: bool = False  # group offload prefetching on a CUDA stream

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def flags(self) -> str:
        return f"--offload {self.mode}" + (" --offload-stream" if self.stream else "")


def check(offload=None, *, stream: bool = False) -> OffloadPlan:
    """The flags alone (no device, no torch): the server checks them before it starts a worker."""
    if isinstance(offload, OffloadPlan):
        return offload
    mode = offload or "none"
    if mode not in MODES:
        raise InvalidParameter(f"--offload must be one of {', '.join(MODES)}, got {offload!r}", param="offload")
    if stream and mode != "group":
        raise InvalidParameter(f"--offload-stream conflicts with --offload {mode}: streams prefetch the blocks of "
                               "group offload; use --offload group --offload-stream", param="offload_stream")
    return OffloadPlan(mode, bool(stream))


def check_device(plan: OffloadPlan, device) -> None:
    """`device`: the torch.device the pipeline computes on."""
    if device.type == "cuda":
        return
    if plan.mode == "model":
        raise InvalidParameter(f"--offload model needs a CUDA device (got --device {device.type}): it moves whole "
                               "components between CPU and GPU memory", param="offload")
    if plan.stream:
        raise InvalidParameter(f"--offload-stream needs a CUDA device (got --device {device.type}): it prefetches "
                               "blocks on a CUDA stream", param="offload_stream")


def check_model(plan: OffloadPlan, class_name: str) -> None:
    if plan.active and class_name != "MiniMaxH3ModularPipeline":
        raise InvalidParameter(f"{plan.flags()} is implemented for MiniMax-H3 only, not {class_name}; "
                               "drop --offload", param="offload")


def check_engine(plan: OffloadPlan, engine: str) -> None:
    if plan.active and engine != "local":
        raise InvalidParameter(f"{plan.flags()} conflicts with --engine {engine}: offload runs in the local worker "
                               "only; use --engine local", param="offload")


#: Children that get group hooks of their own. A group hook fires on its module's ``forward``, and the MiniMax-H3
#: blocks reach these components another way: the text encoder through ``text_encoder.model(...)`` (its top-level
#: ``forward`` is never called), the video VAE through ``encode`` / ``decode``, which call these children. Others
#: (the denoisers) are called through ``forward``: diffusers' default block detection.
BLOCK_MODULES = {"text_encoder": ["model"], "vae": ["quant_conv", "post_quant_conv", "encoder", "decoder"]}


class Offloader:
    """Applies a plan to a MiniMaxH3ModularPipeline with diffusers' own APIs, once, and places partitions loaded
    later (ref2va's ``transformer_ref``) the same way. Before ``apply`` components stay in CPU memory."""

    def __init__(self, plan: OffloadPlan, device):
        self.plan, self.device = plan, device
        self.applied = False
        self._manager = None  # model: the ComponentsManager whose hooks move components

    def apply(self, pipe) -> None:
        if self.applied:
            return
        import torch

        if self.plan.mode == "model":
            from diffusers import ComponentsManager

            self._manager = ComponentsManager()
            for name, component in pipe.components.items():
                if isinstance(component, torch.nn.Module):
                    self._manager.add(name, component)
            self._manager.enable_auto_cpu_offload(device=self.device)
        elif self.plan.mode == "group":
            for name, component in pipe.components.items():
                if isinstance(component, torch.nn.Module):
                    self._group(name, component)
        self.applied = True

    def place(self, name: str, module) -> None:
        """A component loaded after start: where the plan puts it."""
        if not self.plan.active:
            module.to(self.device)
        elif not self.applied:
            return  # apply() takes it with the others
        elif self.plan.mode == "model":
            self._manager.add(name, module)  # re-enables the auto offload hooks over every component
        else:
            self._group(name, module)

    def _group(self, name: str, module) -> None:
        import torch
        from diffusers.hooks import apply_group_offloading

        if getattr(module, "_supports_group_offloading", True) is False:
            # diffusers opts such a model out (the audio VAE: weight-norm pre-hooks read weights before the
            # onload hook runs); it stays on the compute device, as DiffusionPipeline's exclude_modules do.
            module.to(self.device)
            return
        kwargs = {"onload_device": self.device, "offload_device": torch.device("cpu"), "offload_type": "block_level",
                  "num_blocks_per_group": 1, "use_stream": self.plan.stream, "block_modules": BLOCK_MODULES.get(name)}
        if hasattr(module, "enable_group_offload"):  # diffusers models (with their own checks)
            module.enable_group_offload(**kwargs)
        else:  # transformers' text encoder
            apply_group_offloading(module, **kwargs)

"""Family hooks: what one model family adds around the one LoRA engine.

The engine (``backend.lora.engine.LoRAEngine``) owns everything every family shares: the fit
report, the two-tier LRU cache with pinning, the exact merge with its pristine restore, the
unfused hooks, the non-finite refusal and the stats. A family only says how its files become
factors per component, and which per-request rules its adapters carry:

- ``convert(raw, denoisers, encoders) -> Converted``: an adapter's tensors as read (``formats.RawAdapter``)
  to factors grouped per component (``ConvertedAdapter``), the component its generic
  ``transformer`` prefix binds to, and the family's own facts about the file (``data``: for
  MiniMax-H3 the sampling contract and the partition);
- ``fit_targets(denoisers, converted)``: the modules the fit report checks against (a family
  whose denoisers load on demand gives a meta-device skeleton for one not loaded yet);
- ``check(request, adapters)``: a request's rules given its active adapters (for MiniMax-H3 the
  Turbo / native / pinned-schedule contracts); ``None`` when the family has none;
- ``engine_options(manager)``: options the family fixes (MiniMax-H3 under offload: unfused, factors on
  the compute device) and ``bind(manager, engine)``: hand the engine to a family's own generate path.

``hooks_for(pipeline_cls)`` picks them by pipeline class name from the one family table
(``backend/families``: ``LoraRouting.hooks``, a lazy "module:Class" path, so reading the table
imports no family); a family without hooks gets ``LoRAFamily``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from . import lycoris
from .convert import ConvertedAdapter, convert
from .fit import FitReport, fit
from .formats import is_lycoris

@dataclass
class Converted:
    """One adapter converted for a family: factors per component and the family's own facts."""

    adapter: ConvertedAdapter
    generic: str = "transformer"  # the component a generic ``transformer.`` key binds to (all that fit)
    data: object = None  # e.g. MiniMax-H3's MiniMaxAdapter (contract, partition)


class LoRAFamily:
    """The default hooks: diffusers' converters for the pipeline class, fit against the loaded denoisers."""

    name = "diffusers"

    def __init__(self, pipeline_cls=None):
        self.pipeline_cls = pipeline_cls

    def convert(self, raw, denoisers: dict[str, torch.nn.Module], encoders=None) -> Converted:
        default = next(iter(denoisers), "transformer")
        if is_lycoris(raw.tensors):  # LoHa / LoKr / full diffs: read against the denoisers' names
            return Converted(lycoris.convert(raw, denoisers, default, encoders))
        return Converted(convert(raw, self.pipeline_cls, default_component=default, denoisers=denoisers,
                                 encoders=encoders))

    def fit_targets(self, denoisers: dict[str, torch.nn.Module], converted: Converted) -> dict[str, torch.nn.Module]:
        return denoisers

    def fit(self, converted: Converted, denoisers: dict[str, torch.nn.Module], *, adapter: str,
            file: str, encoders=None) -> FitReport:
        return fit(converted.adapter, self.fit_targets(denoisers, converted), adapter=adapter, file=file,
                   generic=converted.generic, encoders=encoders)

    def check(self, request: dict, adapters: list) -> object:
        """A request's family rules given its active adapters (``LoadedAdapter`` list); None: no rules."""
        return None

    def engine_options(self, manager) -> dict:
        """Engine options the family fixes for a loaded manager (e.g. unfused under offload)."""
        return {}

    def bind(self, manager, engine) -> None:
        """Called by ``backend.lora.attach`` once the engine exists (a family whose generate path is its own
        takes the engine there)."""


def hooks_for(pipeline_cls) -> LoRAFamily:
    """The family hooks for a pipeline (class or instance)."""
    from .. import families  # the one family table: a family's hooks are one of its facts (LoraRouting.hooks)

    cls = pipeline_cls if isinstance(pipeline_cls, type) else type(pipeline_cls)
    name = getattr(cls, "__name__", "")
    target = next((f.lora.hooks for f in families.candidates(name) if f.lora.hooks), None) \
        if name in families.FAMILIES else None
    if target is None:
        return LoRAFamily(cls)
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(cls)

"""PEFT backend: per-request LoRA adapters over a loaded pipeline.

    engine = attach(manager, max_loras=4, max_cpu_loras=16, preload=["/path/lora.safetensors"])
    manager.generate(params, adapters=[(LoRARequest("style", 1, path), 1.0)])

Modules: ``formats`` (reading headers/tensors), ``patterns`` (config checks, bounded regexes),
``convert`` (diffusers' converters, peft scales), ``fit`` (fit reports), ``adapter`` (read +
convert + fit), ``cache`` (two-tier LRU), ``engine`` (exact-merge activation), ``library``
(listing with fit), ``demo_adapters``.
"""
from __future__ import annotations

from pathlib import Path

from ..digest import PRELOAD_ID_BASE  # ids for adapters pre-loaded at start, out of the way of request ids
from .request import LoRARequest


def attach(manager, *, max_loras: int = 4, max_cpu_loras: int = 16, preload=None, pristine: str = "auto",
           lora_mode: str | None = None):
    """Give ``manager`` a LoRA engine for its loaded pipeline; pre-load and pin ``preload`` paths.

    ``pristine`` (auto | device | host) says where the originals of written layers live
    (``backend.lora.pristine``); ``lora_mode``: auto | merge | unfused (None: auto on CUDA,
    merge on CPU; docs/lora.md). Every family goes through here, MiniMax-H3 included: its hooks
    (``family.hooks_for``) convert its files and check its contracts, and its runtime serves
    requests with this engine (``bind``)."""
    from ..errors import InvalidParameter
    from .engine import LoRAEngine
    from .family import hooks_for

    family = hooks_for(manager.pipeline)  # the family's hooks (backend/lora/family.py): MiniMax-H3's, or diffusers'
    options = family.engine_options(manager)
    fixed = options.pop("lora_mode", None)
    if fixed is not None and lora_mode not in (None, "auto", fixed):
        raise InvalidParameter(f"--lora-mode {lora_mode} conflicts with {options.get('mode_fixed_by')}; use "
                               f"--lora-mode {fixed}", param="lora_mode")
    engine = LoRAEngine(manager.pipeline, manager.denoisers(), encoders=manager.encoders(),
                        model=manager.model_id or "model",
                        max_loras=max_loras, max_cpu_loras=max_cpu_loras, pristine=pristine,
                        lora_mode=fixed or lora_mode, family=family, **options)
    family.bind(manager, engine)
    paths = [preload] if isinstance(preload, (str, Path)) else list(preload or [])
    for i, path in enumerate(paths):
        p = Path(path)
        request = LoRARequest(p.name if p.is_dir() else p.stem, PRELOAD_ID_BASE + i, str(path))
        engine.load(request, pin=True)
        engine.preloaded.append(request)  # e.g. for `app.py generate --lora-path P`: request them by default
    manager.lora_engine = engine
    return engine


def list_adapters(model: str | None = None, adapter_dirs=None, data_dir=None) -> list[dict]:
    """The adapter library as printable rows, with each adapter's fit against ``model``."""
    from .library import library_rows

    return library_rows(model, adapter_dirs, data_dir)


__all__ = ["LoRARequest", "attach", "list_adapters", "PRELOAD_ID_BASE"]

"""A stack of adapters baked into a copy of the base checkpoint (#28 item 5).

The copy is the model's own diffusers folder, with the weights of every layer the stack touches replaced by
the stack's merge and everything else linked (or copied) as it is, so ``from_pretrained`` (and
``--model DIR``) loads it like the original. The merge is the engine's own: per layer the factors
``engine._stacked`` builds for the stack (in the engine's order, each in the tensor's stored dtype) and one
``addmm`` into the weight, biases as the engine adds them; so the baked weights are what the PEFT backend
merges on CPU for a model served in ``dtype``, bit for bit. ``dtype`` defaults to the checkpoint's own (a
bf16 checkpoint served in bf16: its size unchanged); another (``--dtype float32`` for a fp16 checkpoint
served in fp32) stores the touched tensors in it, so the copy loaded in that dtype is the served merge
exactly (the untouched tensors stay as they are: a load casts them as it casts the original's).

The checkpoint is streamed one safetensors shard at a time (read, the touched tensors rewritten, written
beside, renamed at the end): memory stays at one shard whatever the model's size, and no GPU is needed. A
layer whose weight is not stored under its module's name (a text encoder saved by an older transformers with
other key names) is refused by name rather than guessed. Pickle weights (``.bin``) are refused.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import InvalidParameter, StudioError

INFO_FILE = "lora_studio_baked.json"


def bake_stack(resolved: list, model: str, out: Path, *, data_dir=None, dtype: torch.dtype | None = None) -> dict:
    """Write ``model`` with ``resolved`` (``jobs.adapters.ResolvedAdapter`` list) merged into a new folder
    ``out`` (which must not exist), in ``dtype`` (None: each tensor's stored dtype); returns {"path",
    "layers", "files", "from"}."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..models import resolve_model
    from .export import canonical_stack

    out = Path(out).expanduser()
    if out.exists():
        raise InvalidParameter(f"{out} already exists: a baked model is written into a new folder", param="output")
    source = Path(resolve_model(model, data_dir).path)
    chosen, sources, _ = canonical_stack(resolved, model, data_dir, into="baked here (plain LoRAs only)")
    plan = _plan(chosen)  # component -> module -> [(factors, weight, name)]
    if not plan:
        raise InvalidParameter("every adapter of the stack has weight 0 here: nothing to bake", param="lora")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    layers = rewritten = 0
    try:
        for comp, modules in plan.items():
            files = sorted((source / comp).glob("*.safetensors"))
            if not files:
                raise StudioError(f"{source / comp}: no .safetensors weights to bake into (pickle weights are "
                                  "not read)", param="model")
            wanted = {f"{m}.weight": m for m in modules} | \
                {f"{m}.bias": m for m, items in modules.items() if any("lora_B.bias" in f.tensors for f, _, _ in items)}
            done = set()
            for file in files:
                with safe_open(str(file), "pt") as f:
                    keys = [k for k in f.keys() if k in wanted]
                    if not keys:
                        continue
                    tensors = {k: f.get_tensor(k) for k in f.keys()}
                    metadata = f.metadata()
                for key in keys:
                    module = wanted[key]
                    if key.endswith(".weight"):
                        tensors[key] = _merged_weight(tensors[key].to(dtype or tensors[key].dtype), modules[module],
                                                      f"{comp}.{module}")
                        layers += 1
                    else:
                        tensors[key] = _merged_bias(tensors[key].to(dtype or tensors[key].dtype), modules[module])
                    done.add(key)
                target = tmp / comp / file.name
                target.parent.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(target), metadata=metadata)
                rewritten += 1
                del tensors
            missing = sorted(m for m in modules if f"{m}.weight" not in done)
            if missing:
                raise StudioError(f"{source / comp}: no tensor named {missing[0]}.weight in its files (the stack "
                                  f"touches {len(missing)} layer(s) stored under other names); nothing was written",
                                  param="model")
        _link_rest(source, tmp)
        (tmp / INFO_FILE).write_text(json.dumps({"base": model, "base_path": str(source), "stack": sources,
                                                 "layers": layers, "dtype": _name(dtype)}, indent=2))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": str(out), "layers": layers, "files": rewritten, "from": sources, "dtype": _name(dtype)}


def _name(dtype) -> str:
    return "as stored" if dtype is None else str(dtype).replace("torch.", "")


def _plan(chosen: list) -> dict:
    """component -> module -> the layer's contributions ``[(LayerFactors, weight, name)]`` in the engine's order."""
    plan: dict[str, dict[str, list]] = {}
    for _, entry, weights in chosen:
        for comp, binding in entry.bindings.items():
            w = weights.get(comp, 0.0)
            if w == 0.0:
                continue
            for module, f in binding.layers.items():
                plan.setdefault(comp, {}).setdefault(module, []).append((f, w, entry.name))
    return plan


def _contributions(items: list, dtype: torch.dtype) -> list:
    """The engine's device factors for one layer, in ``dtype`` (``engine._DeviceFactors``)."""
    from .engine import _DeviceFactors

    out = []
    for f, w, name in items:
        bias = f.tensors.get("lora_B.bias")
        out.append((_DeviceFactors(a=f.tensors["lora_A.weight"].to(dtype).contiguous(),
                                   b=f.tensors["lora_B.weight"].to(dtype).contiguous(),
                                   bias=None if bias is None else bias.to(dtype), scaling=f.scaling), w, name))
    return out


def _merged_weight(w0: torch.Tensor, items: list, where: str) -> torch.Tensor:
    from .engine import _stacked

    contributions = _contributions(items, w0.dtype)
    b, a, alpha = _stacked(contributions, w0.dtype)
    with torch.no_grad():
        merged = torch.addmm(w0, b, a, alpha=alpha)
    if not bool(torch.isfinite(merged.sum(dtype=torch.float64))):
        names = ", ".join(repr(n) for _, _, n in contributions)
        raise InvalidParameter(f"{where}: the merged weight is not finite (inf/nan) with adapter {names}; nothing "
                               "was written", param="lora")
    return merged.contiguous()


def _merged_bias(b0: torch.Tensor, items: list) -> torch.Tensor:
    from .engine import _bias_terms

    acc = b0.float()
    for term in _bias_terms(_contributions(items, b0.dtype)):
        acc = acc + term
    return acc.to(b0.dtype).contiguous()


def _link_rest(source: Path, tmp: Path) -> None:
    """Every file of ``source`` not written into ``tmp``: hard-linked (same disk), else copied."""
    for root, _, names in os.walk(source):
        for name in names:
            src = Path(root) / name
            dst = tmp / src.relative_to(source)
            if dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            real = src.resolve()  # a Hugging Face snapshot's files are links into its blobs
            try:
                os.link(real, dst)
            except OSError:
                shutil.copy2(real, dst)

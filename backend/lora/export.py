"""A stack of adapters written as one LoRA file (#28 item 5), exactly.

For every layer the stack touches, the adapters' ranks are concatenated and each adapter's weight times
its own scaling (``alpha / r``) is folded into its ``B`` in fp32::

    A = [A_1; A_2; ...]      B = [B_1 c_1 | B_2 c_2 | ...]      bias = sum(bias_i c_i)      c_i = s_i * scaling_i

and the file is written in the diffusers layout (``transformer.<module>.lora_A.weight`` ...) in fp32 with no
alpha (scale 1), so ``B @ A`` is the stack's delta term for term: merged at weight 1 it is what the engine
merges for the stack (the same GEMM over the same concatenated factors: bit for bit in fp32). Only plain
weights fold into a file: a weight over steps or per block, and the merge-only kinds (LyCORIS, DoRA, whose
delta is no low-rank product), are refused by name. No model weights are read: the adapters are fitted
against the model's meta-device skeletons (``library.denoiser_skeletons``, ``encoder_skeletons``): a
text-encoder layer is written ``text_encoder.<module>...`` as diffusers writes it.

The file says where it came from: ``modelspec.title``, a ``modelspec.description`` listing the stack, and
``lora_studio.exported_from`` (each adapter's name, sha256 and weight) in its header.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import InvalidParameter
from .convert import MERGE_ONLY


def export_stack(resolved: list, model: str, out: Path, *, data_dir=None, title: str | None = None) -> dict:
    """Write ``resolved`` (``jobs.adapters.ResolvedAdapter`` list, in stack order) for ``model`` as one
    diffusers-layout LoRA at ``out``; returns {"path", "layers", "rank", "from"}."""
    from safetensors.torch import save_file

    from ..outputs import _atomic_write
    from .adapter import load_adapter
    from .library import denoiser_skeletons, encoder_skeletons

    if not resolved:
        raise InvalidParameter("name at least one adapter to export", param="lora")
    pipeline_cls, skeletons = denoiser_skeletons(model, data_dir)
    encoders = encoder_skeletons(model, data_dir)
    layers: dict[tuple[str, str], list] = {}  # (component, module) -> [(A, B c, bias c)]
    sources = []
    for i, a in enumerate(resolved):
        where = f"lora[{i}]" if len(resolved) > 1 else "lora"
        entry = load_adapter(a.path, pipeline_cls, skeletons, name=a.name, int_id=a.int_id, model=model,
                             encoders=encoders)
        weights = _weights(a.scale, entry.bindings, where, encoders)
        for comp, binding in entry.bindings.items():
            for module, f in binding.layers.items():
                if f.kind != "lora":
                    raise InvalidParameter(f"{where}: {a.name} is a {MERGE_ONLY[f.kind]} adapter: its delta is no "
                                           "low-rank product, so it cannot be folded into a LoRA file", param=where)
                c = weights.get(comp, 0.0) * f.scaling
                if c == 0.0:
                    continue
                bias = f.tensors.get("lora_B.bias")
                layers.setdefault((comp, module), []).append(
                    (f.tensors["lora_A.weight"].float(), f.tensors["lora_B.weight"].float() * c,
                     None if bias is None else bias.float() * c))
        sources.append({"name": a.name, "sha256": entry.record.sha256, "scale": a.scale})
    if not layers:
        raise InvalidParameter("every adapter of the stack has weight 0 here: nothing to export", param="lora")
    tensors = {}
    for (comp, module), parts in sorted(layers.items()):
        tensors[f"{comp}.{module}.lora_A.weight"] = torch.cat([p[0] for p in parts], dim=0).contiguous()
        tensors[f"{comp}.{module}.lora_B.weight"] = torch.cat([p[1] for p in parts], dim=1).contiguous()
        biases = [p[2] for p in parts if p[2] is not None]
        if biases:
            tensors[f"{comp}.{module}.lora_B.bias"] = sum(biases[1:], biases[0]).contiguous()
    stack = " + ".join(f"{s['name']} x{_shown(s['scale'])}" for s in sources)
    metadata = {"modelspec.title": title or out.stem, "modelspec.description": f"exported by LoRA Studio from "
                f"{stack} on {model}", "lora_studio.exported_from": json.dumps(sources)}
    _atomic_write(out, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    ranks = {tensors[k].shape[0] for k in tensors if k.endswith("lora_A.weight")}
    return {"path": str(out), "layers": len(layers), "rank": max(ranks), "from": sources}


def _weights(scale, bindings: dict, where: str, encoders) -> dict[str, float]:
    """A plain weight per component (a number for all, or {component or group: number}); anything else is
    refused."""
    from .schedule import DENOISERS, fill_groups

    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return {comp: float(scale) for comp in bindings}
    if isinstance(scale, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                       for v in scale.values()) and \
            set(scale) <= set(bindings) | {"transformer", "text_encoder", DENOISERS}:
        return {comp: float(v) for comp, v in fill_groups(scale, bindings, encoders).items()}
    raise InvalidParameter(f"{where}.scale: only plain weights fold into one file (a number, or one per "
                           "transformer); a weight over steps or per block does not", param=f"{where}.scale")


def _shown(scale) -> str:
    return f"{scale:g}" if isinstance(scale, (int, float)) else json.dumps(scale, separators=(",", ":"))

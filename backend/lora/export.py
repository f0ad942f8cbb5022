"""A stack of adapters written as one LoRA file (#28 item 5), exactly.

For every layer the stack touches, the file holds the factors the engine itself would merge for the stack
(``engine._stacked``), with ``c_i = s_i * scaling_i`` (the weight times the adapter's ``alpha / r``):

- one adapter on the layer: its ``A``, ``B`` as stored, and ``c`` as the layer's scale;
- several with one ``c``: ``A = [A_1; A_2 ...]``, ``B = [B_1 | B_2 ...]``, and ``c``;
- several with different ``c``: ``B = [B_1 c_1 | B_2 c_2 ...]`` and scale 1, folded as the engine folds it in
  the serving dtype (``B_i`` in that dtype, times ``c_i`` in fp32, rounded to it once: ``dtype``);

in the diffusers layout (``transformer.<module>.lora_A.weight`` ...) in fp32, each layer's scale written as
a per-module ``lora_alpha`` in the header's ``lora_adapter_metadata`` (peft's ``rank_pattern`` /
``alpha_pattern``, the config diffusers' ``save_lora_weights`` stores), chosen so that ``alpha / r`` is ``c``
exactly in float64. Read back and merged at weight 1, every layer is the same GEMM the stack's merge runs,
with the same alpha: bit for bit, in any dtype for the first two kinds and in the dtype it was exported for
(its header's ``lora_studio.exact_in``) for the third (in another, to that dtype's rounding). (A LoRA bias summed over several adapters is the one term
that is only equal to fp32 rounding: the engine adds each adapter's term in turn.) Only plain weights fold
into a file: a weight over steps or per block, and the merge-only kinds (LyCORIS, DoRA, whose delta is no
low-rank product), are refused by name. No model weights are read: the adapters are fitted against the
model's meta-device skeletons (``library.denoiser_skeletons``, ``encoder_skeletons``): a text-encoder layer
is written ``text_encoder.<module>...`` as diffusers writes it.

``layout="kohya"`` writes the same factors under sd-scripts' names, as ComfyUI, A1111/Forge and kohya's own
tools read them: ``lora_unet_<module with dots as _>.lora_down.weight`` (A), ``.lora_up.weight`` (B) and
``.alpha`` (``c x r``, so that ``alpha / r`` is the layer's scale); a text encoder as ``lora_te_`` (one encoder)
or ``lora_te1_`` / ``lora_te2_`` / ``lora_te3_`` (SD3.5's CLIP-L, CLIP-G, T5). Readers fold ``alpha / r`` into
the factors as they load (diffusers' converters do), so the file is the stack to fp32 rounding, not bit for bit.
What that layout cannot hold is refused by name: a second denoiser (Wan2.2's ``transformer_2``: kohya files,
musubi-tuner's too, hold one transformer each), a LoRA bias, a module whose ``_`` spelling is ambiguous.

The file says where it came from: ``modelspec.title``, a ``modelspec.description`` listing the stack, and
``lora_studio.exported_from`` (each adapter's name, sha256 and weight) in its header.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from ..errors import InvalidParameter
from .convert import MERGE_ONLY


LAYOUTS = ("diffusers", "kohya")


def export_stack(resolved: list, model: str, out: Path, *, data_dir=None, title: str | None = None,
                 dtype: torch.dtype = torch.float32, portable: bool = False, layout: str = "diffusers") -> dict:
    """Write ``resolved`` (``jobs.adapters.ResolvedAdapter`` list, in stack order) for ``model`` as one
    diffusers-layout LoRA at ``out``, exact for a model served in ``dtype``; returns {"path", "layers", "rank",
    "from", "exact_in"}. ``portable``: every layer's scale folded into its ``B`` (scale 1 everywhere, no
    per-layer alpha), for tools that read no ``lora_adapter_metadata`` (ComfyUI, A1111): the stack to fp32
    rounding where one weight alone is on a layer (``exact_in`` None). ``layout``: "diffusers" or "kohya"
    (sd-scripts' names and ``.alpha``; to fp32 rounding, ``exact_in`` None)."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise InvalidParameter(f"layout {layout!r}: one of {', '.join(LAYOUTS)}", param="layout")

    from ..outputs import _atomic_write
    from .library import denoiser_skeletons

    denoisers = denoiser_skeletons(model, data_dir)  # the meta skeletons, built once for the whole export
    chosen, sources, encoders = canonical_stack(resolved, model, data_dir, denoisers=denoisers)
    layers: dict[tuple[str, str], list] = {}  # (component, module) -> [(A, B, bias, c)]
    for _, entry, weights in chosen:  # the engine's order (by identity): the rank concatenated as its merge does
        for comp, binding in entry.bindings.items():
            for module, f in binding.layers.items():
                c = weights.get(comp, 0.0) * f.scaling
                if c == 0.0:
                    continue
                bias = f.tensors.get("lora_B.bias")
                layers.setdefault((comp, module), []).append(
                    (f.tensors["lora_A.weight"].float(), f.tensors["lora_B.weight"].float(),
                     None if bias is None else bias.float(), c))
    if not layers:
        raise InvalidParameter("every adapter of the stack has weight 0 here: nothing to export", param="lora")
    kohya = _kohya_names(layers, encoders, model, *denoisers) if layout == "kohya" else None
    exact = not portable and kohya is None
    tensors, scales = {}, {}
    for (comp, module), parts in sorted(layers.items()):
        a, b, bias, c = _layer(parts, dtype)
        if portable and c != 1.0:  # folded: B c, bias c, scale 1 (what any reader applies)
            b, bias, c = b * c, None if bias is None else bias * c, 1.0
        if kohya is not None:
            if bias is not None:
                raise InvalidParameter(f"{comp}.{module}: the stack adds a LoRA bias there, and the kohya layout "
                                       "has no key for one; export it in the diffusers layout", param="layout")
            key = kohya[(comp, module)]
            tensors[f"{key}.lora_down.weight"] = a.contiguous()
            tensors[f"{key}.lora_up.weight"] = b.contiguous()
            tensors[f"{key}.alpha"] = torch.tensor(_alpha(c, int(a.shape[0])), dtype=torch.float32)
            continue
        tensors[f"{comp}.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{comp}.{module}.lora_B.weight"] = b.contiguous()
        if bias is not None:
            tensors[f"{comp}.{module}.lora_B.bias"] = bias.contiguous()
        scales.setdefault(comp, {})[module] = (int(a.shape[0]), c)
    stack = " + ".join(f"{s['name']} x{_shown(s['scale'])}" for s in sources)
    metadata = {"modelspec.title": title or out.stem, "modelspec.description": f"exported by LoRA Studio from "
                f"{stack} on {model}", "lora_studio.exported_from": json.dumps(sources),
                **({"lora_adapter_metadata": json.dumps(_configs(scales)),
                    "lora_studio.exact_in": str(dtype).replace("torch.", "")} if exact else {}),
                **({"ss_network_module": _network_module(denoisers[0]), "lora_studio.layout": "kohya"} if kohya
                   else {})}
    _atomic_write(out, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    ranks = {t.shape[0] for k, t in tensors.items() if k.endswith(("lora_A.weight", "lora_down.weight"))}
    return {"path": str(out), "layers": len(layers), "rank": max(ranks), "from": sources, "layout": layout,
            "exact_in": str(dtype).replace("torch.", "") if exact else None}


def _network_module(pipeline_cls) -> str:
    """sd-scripts' / musubi-tuner's ``ss_network_module`` for the model (readers use it to tell the layouts apart)."""
    from ..families import family_for

    cls = pipeline_cls.__name__
    return "networks.lora_wan" if family_for(cls).lora.kohya_names.get(cls) == "wan" else "networks.lora"


def _kohya_names(layers: dict, encoders: dict, model: str, pipeline_cls, skeletons: dict) -> dict:
    """(component, module) -> the kohya key stem of every layer of the stack, or InvalidParameter naming
    what the layout cannot hold. The transformer's names are the family's (``LoraRouting.kohya_names``:
    Qwen-Image's module paths, Wan's original names as musubi-tuner writes them); a stem must name its module
    alone among the component's Linear layers with dots read as ``_`` (how kohya readers find it back)."""
    from ..families import family_for
    from .convert import ENCODER_COMPONENTS, wan_original

    comps = {comp for comp, _ in layers}
    second = sorted(c for c in comps if c not in ENCODER_COMPONENTS and c != "transformer")
    if second:
        raise InvalidParameter(f"the stack changes {second[0]} of {model}; a kohya file holds one transformer "
                               "(musubi-tuner writes one file per Wan2.2 expert): export it in the diffusers "
                               "layout, or set the other expert's weight to 0", param="layout")
    style = family_for(pipeline_cls.__name__).lora.kohya_names.get(pipeline_cls.__name__)
    if style is None and "transformer" in comps:
        raise InvalidParameter(f"{model} ({pipeline_cls.__name__}) has no kohya layout here: the kohya names of its "
                               "transformer are the original model's modules (SD3.5: MMDiT's joint_blocks with a "
                               "fused qkv), which diffusers does not read back; export it in the diffusers layout",
                               param="layout")
    present = [c for c in ENCODER_COMPONENTS if c in encoders]
    prefix = {"transformer": "lora_unet_"}
    for comp in present:  # one encoder: lora_te_; several (SD3.5): lora_te1_ (CLIP-L), lora_te2_, lora_te3_ (T5)
        prefix[comp] = "lora_te_" if len(present) == 1 else f"lora_te{ENCODER_COMPONENTS.index(comp) + 1}_"
    modules = {"transformer": skeletons.get("transformer"), **{c: encoders[c] for c in present}}

    def spelled(comp, module):
        if comp == "transformer" and style == "wan":
            original = wan_original(module)
            return None if original is None else original.replace(".", "_")
        return module.replace(".", "_")

    seen: dict[str, dict[str, int]] = {}
    out = {}
    for comp, module in layers:
        if comp not in seen:
            seen[comp] = {}
            for name, m in modules[comp].named_modules():
                if isinstance(m, torch.nn.Linear):
                    under = spelled(comp, name)
                    seen[comp][under] = seen[comp].get(under, 0) + 1
        under = spelled(comp, module)
        if under is None or seen[comp].get(under, 0) != 1:
            why = "has no name in Wan's original modules" if under is None else \
                f"would be {under!r}, which names several layers of {model}"
            raise InvalidParameter(f"{comp}.{module}: its kohya name {why}; export it in the diffusers layout",
                                   param="layout")
        out[(comp, module)] = prefix[comp] + under
    return out


def canonical_stack(resolved: list, model: str, data_dir=None, into: str = "folded into a LoRA file",
                    denoisers: tuple | None = None) -> tuple[list, list, dict]:
    """A stack as the engine activates it, for writing out: ``[(identity, LoadedAdapter, {component: weight})]``
    sorted by identity (an adapter named twice once, its weights added), the stack's ``sources`` (name,
    sha256, scale) in its own order, and the meta-device encoders it was fitted against. Plain LoRA weights
    only: LyCORIS / DoRA and weights over steps or per block are refused by name. ``denoisers``: the model's
    ``library.denoiser_skeletons`` where the caller has them already."""
    from .adapter import load_adapter
    from .engine import identity_of
    from .library import denoiser_skeletons, encoder_skeletons

    if not resolved:
        raise InvalidParameter("name at least one adapter to export", param="lora")
    pipeline_cls, skeletons = denoisers or denoiser_skeletons(model, data_dir)
    encoders = encoder_skeletons(model, data_dir)
    sources, chosen = [], {}
    for i, a in enumerate(resolved):
        where = f"lora[{i}]" if len(resolved) > 1 else "lora"
        entry = load_adapter(a.path, pipeline_cls, skeletons, name=a.name, int_id=a.int_id, model=model,
                             encoders=encoders)
        weights = _weights(a.scale, entry.bindings, where, encoders)
        for binding in entry.bindings.values():
            f = next((f for f in binding.layers.values() if f.kind != "lora"), None)
            if f is not None:
                raise InvalidParameter(f"{where}: {a.name} is a {MERGE_ONLY[f.kind]} adapter: its delta is no "
                                       f"low-rank product, so it cannot be {into}", param=where)
        slot = chosen.setdefault(identity_of(entry), [entry, {}])  # named twice: its weights add, as they do there
        for comp, w in weights.items():
            slot[1][comp] = slot[1].get(comp, 0.0) + w
        sources.append({"name": a.name, "sha256": entry.record.sha256, "scale": a.scale})
    return [(ident, *chosen[ident]) for ident in sorted(chosen)], sources, encoders


def _layer(parts: list, dtype: torch.dtype) -> tuple:
    """(A, B, bias, scale) of one layer: the factors ``engine._stacked`` merges for these contributions
    ``[(A_i, B_i, bias_i, c_i)]`` (fp32) in a model of ``dtype``, with the alpha it passes to addmm as the
    scale (kept in fp32: a B folded in ``dtype`` is exactly representable there)."""
    coeffs = [p[3] for p in parts]
    a = torch.cat([p[0] for p in parts], dim=0)
    if len(parts) == 1 or all(c == coeffs[0] for c in coeffs):
        b, scale = torch.cat([p[1] for p in parts], dim=1), coeffs[0]
        biases = [p[2] for p in parts if p[2] is not None]
        bias = None if not biases else sum(biases[1:], biases[0])
        return a, b, bias, scale
    b = torch.cat([(p[1].to(dtype).float() * c).to(dtype).float() for p, c in zip(parts, coeffs)], dim=1)
    terms = [p[2] * c for p, c in zip(parts, coeffs) if p[2] is not None]
    return a, b, None if not terms else sum(terms[1:], terms[0]), 1.0


def _alpha(scale: float, rank: int) -> float:
    """An alpha whose ``alpha / rank`` is ``scale`` exactly in float64 (what the reader computes)."""
    alpha = scale * rank
    for candidate in (alpha, math.nextafter(alpha, math.inf), math.nextafter(alpha, -math.inf)):
        if candidate / rank == scale:
            return candidate
    return alpha


def _configs(scales: dict) -> dict:
    """diffusers' ``lora_adapter_metadata`` (``component.field`` keys): per component the most common rank
    as ``r``, every layer's own alpha (and its rank where it differs) as an exact pattern (``re.escape``d
    module path; longest first, so a path is never taken for a shorter one it ends with)."""
    out = {}
    for comp, layers in scales.items():
        ranks = [r for r, _ in layers.values()]
        common = max(set(ranks), key=ranks.count)
        order = sorted(layers, key=lambda m: (-len(m), m))
        out[f"{comp}.r"] = common
        out[f"{comp}.lora_alpha"] = common
        out[f"{comp}.rank_pattern"] = {re.escape(m): layers[m][0] for m in order if layers[m][0] != common}
        out[f"{comp}.alpha_pattern"] = {re.escape(m): _alpha(layers[m][1], layers[m][0]) for m in order}
    return out


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

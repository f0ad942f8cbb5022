"""LyCORIS adapters: LoHa, LoKr and full-weight diffs, read in the key layouts they are published in
and turned into per-layer factors the engine merges exactly.

Part names are LyCORIS's own (``lycoris/modules/loha.py``, ``lokr.py``, ``full.py``); where the module is
named varies with the tool that wrote the file:

==========================  ===============================================================================
written by                  keys
==========================  ===============================================================================
LyCORIS / kohya sd-scripts  ``lycoris_<module, dots as _>.<part>`` or ``lora_unet_<...>.<part>``, ``.alpha``
ComfyUI                     ``diffusion_model.<module>.<part>`` (Wan: its original module names)
diffusers-style dumps       ``transformer.<module>.<part>``, ``transformer_2.<...>`` or bare ``<module>.<part>``
peft (LoHaModel, LoKrModel) ``base_model.model.<module>.<part>`` with ``adapter_config.json`` (peft_type
                            LOHA / LOKR: ``r``, ``alpha``, ``rank_pattern``, ``alpha_pattern``)
==========================  ===============================================================================

A layer's delta (Linear layers, out x in), before its scale:

- LoHa ``(hada_w1_a @ hada_w1_b) * (hada_w2_a @ hada_w2_b)``;
- LoKr ``kron(w1, w2)``, each half stored full (``lokr_w1``) or as two factors (``lokr_w1_a @ lokr_w1_b``);
- full ``diff`` (and ``diff_b`` added to the bias).

Scales: a file's ``alpha`` over the rank, as LyCORIS and ComfyUI apply it (LoHa: ``alpha / rows of
hada_w1_b``; LoKr: ``alpha / rows of the factored half's b``, 1 when both halves are full; full: 1; no
alpha: 1). A peft folder: peft's ``alpha / r`` from its config (patterns matched with peft's own
``get_pattern_key``), for LoKr whatever the halves. diffusers 0.42 converts LoKr only for Z-Image and
Flux.2 (``_convert_non_diffusers_lokr_to_diffusers``, which bakes the same ``alpha / rank`` rule into
the factors); the families served here have no converter for these parts, so they are read here.

The engine keeps the compact parts (a LoKr layer is a small fraction of its weight) in its cache and
builds each layer's delta on the device at merge time, in the fp32 buffer that also holds the
pristine weight and any LoRA on that layer, rounded once into the weight; restored bit for bit as
every merge is. The unfused path adds ``B(Ax)`` per layer, which a Hadamard or Kronecker product has
no cheap form of, so these adapters are merge only (``policy.PolicyInputs.merge_only``): a request
that would run them unfused (a step schedule, ``lora_mode=unfused``, a quantized base, a mixed batch)
is refused by name or run on its own. Tucker cores (``hada_t1``, ``lokr_t2``: conv layers) are refused
by key.
"""
from __future__ import annotations

import math

import torch

from .convert import ConvertedAdapter, LayerFactors, ModuleNames, _refuse_dora
from .formats import FULL, LOHA, LOKR, TUCKER, RawAdapter

KIND_OF = {**{p: "loha" for p in LOHA}, **{p: "lokr" for p in LOKR}, **{p: "full" for p in FULL}}
NAMES = {"loha": "LoHa", "lokr": "LoKr", "full": "full diff"}



def convert(raw: RawAdapter, denoisers: dict[str, torch.nn.Module], default_component: str,
            encoders: dict[str, torch.nn.Module] | None = None) -> ConvertedAdapter:
    """The LyCORIS layers of ``raw`` as ``LayerFactors`` (kind loha / lokr / full), grouped by component
    in diffusers naming; keys that name no layer, parts that do not make a layer, and layers whose parts
    disagree in shape are reported unmatched (the fit then refuses the adapter, naming them)."""
    rec = raw.record
    _refuse_dora(rec, raw.tensors)
    names = ModuleNames(denoisers, default_component, encoders)
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    keys: dict[tuple[str, str], dict[str, str]] = {}
    alphas: dict[tuple[str, str], tuple[str, float]] = {}
    unmatched: list[tuple[str, str]] = []
    for key, t in raw.tensors.items():
        head, _, part = key.rpartition(".")
        if part in TUCKER:
            unmatched.append((key, "a Tucker core (LyCORIS on conv layers): not supported, only Linear layers are"))
            continue
        if part != "alpha" and part not in KIND_OF:
            unmatched.append((key, "not a LyCORIS part (hada_w*, lokr_w*, diff, diff_b or alpha)"))
            continue
        where = names.locate(head)
        if isinstance(where, str):
            unmatched.append((key, where))
            continue
        if part == "alpha":
            alphas[where] = (key, float(t))
            continue
        parts.setdefault(where, {})[part] = t
        keys.setdefault(where, {})[part] = key
    groups: dict[str, dict[str, LayerFactors]] = {}
    for (comp, module), found in parts.items():
        problem = _problem(found)
        if problem:
            unmatched += [(keys[(comp, module)][p], problem) for p in found]
            continue
        kind = KIND_OF[next(iter(found))]
        alpha = alphas.pop((comp, module), (None, None))[1]
        groups.setdefault(comp, {})[module] = LayerFactors(
            tensors=found, scaling=_scaling(kind, found, alpha, rec.peft_config, module),
            keys={p: f"{comp}.{module}.{p}" for p in found}, kind=kind, shape=delta_shape(kind, found))
    unmatched += [(key, "an alpha with no factors beside it") for key, _ in alphas.values()]
    return ConvertedAdapter(groups=groups, unmatched=unmatched)


def delta_shape(kind: str, tensors: dict) -> tuple[int, int]:
    """(out, in) of the delta a layer's parts make (the Linear weight's shape they must match)."""
    if kind == "loha":
        return int(tensors["hada_w1_a"].shape[0]), int(tensors["hada_w1_b"].shape[1])
    if kind == "lokr":
        (a, b), (c, d) = _half_shape(tensors, "lokr_w1"), _half_shape(tensors, "lokr_w2")
        return a * c, b * d
    return tuple(int(n) for n in tensors["diff"].shape)


def delta(kind: str, tensors: dict) -> torch.Tensor:
    """A layer's delta (out x in) in fp32 on its parts' device, before the scale; ``diff_b`` is the
    bias's and not part of it."""
    f = {p: t.float() for p, t in tensors.items() if p != "diff_b"}
    if kind == "loha":
        return (f["hada_w1_a"] @ f["hada_w1_b"]) * (f["hada_w2_a"] @ f["hada_w2_b"])
    if kind == "lokr":
        w1 = f["lokr_w1"] if "lokr_w1" in f else f["lokr_w1_a"] @ f["lokr_w1_b"]
        w2 = f["lokr_w2"] if "lokr_w2" in f else f["lokr_w2_a"] @ f["lokr_w2_b"]
        return torch.kron(w1, w2)
    return f["diff"]


def bound(kind: str, tensors: dict) -> float:
    """No element of the delta (before its scale) is larger than this: r * max|a| * max|b| per product,
    from the parts alone (the merge's finite check needs no delta built when it stays far from overflow)."""
    def amax(t):
        v = float(t.detach().abs().max()) if t.numel() else 0.0
        return v if math.isfinite(v) else math.inf

    def product(a, b):
        return a.shape[1] * amax(a) * amax(b)

    if kind == "loha":
        return product(tensors["hada_w1_a"], tensors["hada_w1_b"]) * product(tensors["hada_w2_a"], tensors["hada_w2_b"])
    if kind == "lokr":
        halves = [amax(tensors[w]) if w in tensors else product(tensors[f"{w}_a"], tensors[f"{w}_b"])
                  for w in ("lokr_w1", "lokr_w2")]
        return halves[0] * halves[1]
    return amax(tensors["diff"])


def _half_shape(tensors: dict, w: str) -> tuple[int, int]:
    if w in tensors:
        return int(tensors[w].shape[0]), int(tensors[w].shape[1])
    return int(tensors[f"{w}_a"].shape[0]), int(tensors[f"{w}_b"].shape[1])


def _problem(found: dict) -> str | None:
    """Why these parts of one layer do not make a delta (None when they do)."""
    kinds = {KIND_OF[p] for p in found}
    if len(kinds) > 1:
        return f"mixes {' and '.join(NAMES[k] for k in sorted(kinds))} parts on one layer"
    kind = kinds.pop()
    if any(t.dim() != (1 if p == "diff_b" else 2) for p, t in found.items()):
        shapes = ", ".join(f"{p} {tuple(t.shape)}" for p, t in found.items())
        return f"{NAMES[kind]} parts of a Linear layer are matrices ({shapes}): conv layers are not supported"
    if kind == "loha":
        missing = [p for p in LOHA if p not in found]
        if missing:
            return f"incomplete LoHa layer: no {', '.join(missing)}"
        for w in ("hada_w1", "hada_w2"):
            if found[f"{w}_a"].shape[1] != found[f"{w}_b"].shape[0]:
                return f"{w}_a {tuple(found[f'{w}_a'].shape)} and {w}_b {tuple(found[f'{w}_b'].shape)} do not chain"
        (o1, i1), (o2, i2) = ((found[f"{w}_a"].shape[0], found[f"{w}_b"].shape[1]) for w in ("hada_w1", "hada_w2"))
        if (o1, i1) != (o2, i2):
            return f"the two LoHa products differ in shape ({o1}x{i1} and {o2}x{i2})"
        return None
    if kind == "lokr":
        for w in ("lokr_w1", "lokr_w2"):
            full, fa, fb = w in found, f"{w}_a" in found, f"{w}_b" in found
            if full == (fa or fb) or fa != fb:
                return f"incomplete LoKr layer: {w} must be stored whole or as {w}_a and {w}_b"
            if fa and found[f"{w}_a"].shape[1] != found[f"{w}_b"].shape[0]:
                return f"{w}_a {tuple(found[f'{w}_a'].shape)} and {w}_b {tuple(found[f'{w}_b'].shape)} do not chain"
        return None
    if "diff" not in found:
        return "a diff_b with no diff: a full layer needs its weight delta"
    return None


def _scaling(kind: str, tensors: dict, alpha: float | None, config: dict | None, module: str) -> float:
    if config is not None:  # peft's LoHa / LoKr: alpha / r from the config, patterns as peft matches them
        from peft.utils.other import get_pattern_key

        rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), config.get("r", 8))
        a = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), config.get("alpha", r))
        return float(a) / float(r)
    if kind == "full" or alpha is None:
        return 1.0
    if kind == "loha":
        return alpha / tensors["hada_w1_b"].shape[0]
    dim = next((tensors[p].shape[0] for p in ("lokr_w2_b", "lokr_w1_b") if p in tensors), None)
    return 1.0 if dim is None else alpha / dim

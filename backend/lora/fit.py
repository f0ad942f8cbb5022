"""Fit reports: how an adapter's factors bind to a pipeline's denoisers.

An adapter is refused, before anything touches the model, when any key stays unmatched,
any shape disagrees, or nothing binds. The report names every such key (with both
shapes for a mismatch), so a listing can show it before anyone generates.

Binding rule for two-transformer models (Wan2.2): keys under the generic ``transformer``
prefix bind to every denoiser whose layers they fit (both experts share one
architecture), and a per-component scale weighs each; keys under ``transformer_2`` bind
there only. Text-encoder groups (``text_encoder``, ``text_encoder_2``...) bind to that encoder
(``encoders``) only; the report counts their layers apart from the denoisers'.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import AdapterError
from .convert import ConvertedAdapter, LayerFactors

_SHOWN = 4  # keys named in a one-line error; the full list stays on the report


@dataclass(frozen=True)
class ShapeMismatch:
    key: str
    adapter_shape: tuple
    model_shape: tuple

    def __str__(self) -> str:
        return f"{self.key}: adapter {tuple(self.adapter_shape)} vs model {tuple(self.model_shape)}"


@dataclass
class Binding:
    """The layers of one component an adapter binds to."""

    component: str
    layers: dict[str, LayerFactors]  # module path -> factors

    @property
    def modules(self) -> list[str]:
        return sorted(self.layers)


@dataclass
class FitReport:
    adapter: str
    file: str
    total_keys: int
    bindings: dict[str, Binding] = field(default_factory=dict)
    unmatched: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    mismatched: list[ShapeMismatch] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    matched: int = 0  # keys that bind (counted once when one group binds to two experts)
    encoders: tuple = ()  # the bindings that are text encoders (their layers are counted apart)

    @property
    def ok(self) -> bool:
        return bool(self.bindings) and not self.unmatched and not self.mismatched

    @property
    def matched_keys(self) -> int:
        return self.matched

    @property
    def encoder_layers(self) -> dict[str, int]:
        """Text-encoder component -> layers bound there (the rest of ``bindings`` are denoisers)."""
        return {c: len(b.layers) for c, b in self.bindings.items() if c in self.encoders}

    def summary(self) -> str:
        if self.ok:
            parts = [f"{c}: {len(b.layers)} layers" for c, b in self.bindings.items() if c not in self.encoders]
            encoders = [f"{c}: {len(b.layers)} layers" for c, b in self.bindings.items() if c in self.encoders]
            if encoders:
                parts.append(f"text encoders: {', '.join(encoders)}")
            text = f"fits ({'; '.join(parts)}; {self.matched_keys}/{self.total_keys} keys)"
            if self.ignored:
                text += f", {len(self.ignored)} zero keys ignored"
            return text
        problems = []
        if self.unmatched:
            names = ", ".join(k for k, _ in self.unmatched[:_SHOWN])
            more = f" (+{len(self.unmatched) - _SHOWN} more)" if len(self.unmatched) > _SHOWN else ""
            problems.append(f"{len(self.unmatched)} unmatched key(s): {names}{more}"
                            f" [{self.unmatched[0][1]}]")
        if self.mismatched:
            shown = "; ".join(str(m) for m in self.mismatched[:_SHOWN])
            problems.append(f"{len(self.mismatched)} shape mismatch(es): {shown}")
        if not self.bindings and not problems:
            problems.append("binds to no layer")
        return "refused: " + "; ".join(problems)

    def reason(self, model: str) -> str:
        """Why it does not fit ``model``, in one plain line ("" when it fits); ``summary`` keeps the key names."""
        if self.ok:
            return ""
        if self.mismatched:
            return f"{len(self.mismatched)} of its layers have other sizes in {model} (made for another model)"
        if self.unmatched:
            return f"{len(self.unmatched)} of its layers are not in {model} (made for another model)"
        return f"binds to no layer of {model}"

    def as_dict(self) -> dict:
        return {"adapter": self.adapter, "file": self.file, "ok": self.ok, "summary": self.summary(),
                "total_keys": self.total_keys, "matched_keys": self.matched_keys,
                "components": {c: b.modules for c, b in self.bindings.items()},
                "encoder_layers": self.encoder_layers,
                "unmatched": [{"key": k, "reason": r} for k, r in self.unmatched],
                "mismatched": [{"key": m.key, "adapter_shape": list(m.adapter_shape),
                                "model_shape": list(m.model_shape)} for m in self.mismatched],
                "ignored": [{"key": k, "reason": r} for k, r in self.ignored], "notes": self.notes}

    def raise_if_refused(self, model: str) -> None:
        if not self.ok:
            err = AdapterError(f"{self.file}: adapter {self.adapter!r} does not fit {model}: {self.summary()}",
                               param="lora_path")
            err.report = self
            raise err


def fit(converted: ConvertedAdapter, denoisers: dict[str, torch.nn.Module], *, adapter: str, file: str,
        generic: str = "transformer", encoders: dict[str, torch.nn.Module] | None = None) -> FitReport:
    """Check every factor against the denoisers' (and text encoders') Linear layers (works on meta-device
    skeletons)."""
    encoders = dict(encoders or {})
    report = FitReport(adapter=adapter, file=file, total_keys=converted.num_keys,
                       unmatched=list(converted.unmatched), ignored=list(converted.ignored),
                       encoders=tuple(encoders))
    linears = {name: {n: m for n, m in mod.named_modules() if isinstance(m, torch.nn.Linear)}
               for name, mod in {**denoisers, **encoders}.items() if name in converted.groups
               or (name in denoisers and generic in converted.groups)}
    primary = next(iter(denoisers), None)
    for comp, layers in converted.groups.items():
        if comp == generic and primary is not None:
            candidates = list(denoisers)
        elif comp in denoisers or comp in encoders:
            candidates = [comp]
        else:
            why = (f"component {comp!r} is not a denoiser or text encoder of this pipeline "
                   f"(denoisers: {', '.join(denoisers) or 'none'}; text encoders: {', '.join(encoders) or 'none'})")
            report.unmatched += [(k, why) for f in layers.values() for k in f.keys.values()]
            continue
        results = {c: _check(layers, linears[c], c) for c in candidates}
        fitting = [c for c in candidates if not results[c][0] and not results[c][1]]
        for c in fitting:
            report.bindings[c] = Binding(c, layers)
        if fitting:
            report.matched += sum(len(f.tensors) for f in layers.values())
            for c in candidates:
                if c not in fitting:
                    report.notes.append(f"{c}: not bound ({len(results[c][0]) + len(results[c][1])} problems)")
        else:  # refuse, naming the problems against the first candidate
            unmatched, mismatched = results[candidates[0]]
            report.unmatched += unmatched
            report.mismatched += mismatched
            bad = {k for k, _ in unmatched} | {m.key for m in mismatched}
            report.matched += sum(1 for f in layers.values() for k in f.keys.values() if k not in bad)
    return report


def _check(layers: dict[str, LayerFactors], linears: dict[str, torch.nn.Linear], comp: str):
    unmatched: list[tuple[str, str]] = []
    mismatched: list[ShapeMismatch] = []
    for module, f in layers.items():
        target = linears.get(module)
        if target is None:
            why = f"no Linear layer {module!r} in {comp}"
            unmatched += [(f.keys[p], why) for p in f.tensors]
            continue
        if f.kind in ("lora", "dora"):
            a, b = f.tensors["lora_A.weight"], f.tensors["lora_B.weight"]
            r = a.shape[0]
            if tuple(a.shape) != (r, target.in_features):
                mismatched.append(ShapeMismatch(f.keys["lora_A.weight"], tuple(a.shape), (r, target.in_features)))
            if tuple(b.shape) != (target.out_features, r):
                mismatched.append(ShapeMismatch(f.keys["lora_B.weight"], tuple(b.shape), (target.out_features, r)))
            m = f.tensors.get("magnitude")  # DoRA: one per output row, or one per input column
            if m is not None and tuple(m.shape) not in ((target.out_features, 1), (1, target.in_features)):
                mismatched.append(ShapeMismatch(f.keys["magnitude"], tuple(m.shape), (target.out_features, 1)))
        elif f.delta_shape() != (target.out_features, target.in_features):  # LyCORIS: the delta its parts make
            first = next(p for p in f.tensors if p != f.bias_part)
            mismatched.append(ShapeMismatch(f"{f.keys[first]} ({f.kind} delta)", f.delta_shape(),
                                            (target.out_features, target.in_features)))
        bias = f.tensors.get(f.bias_part)
        if bias is not None:
            if target.bias is None:
                unmatched.append((f.keys[f.bias_part], f"{comp}.{module} has no bias to add to"))
            elif tuple(bias.shape) != (target.out_features,):
                mismatched.append(ShapeMismatch(f.keys[f.bias_part], tuple(bias.shape), (target.out_features,)))
    return unmatched, mismatched

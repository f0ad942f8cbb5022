"""Quantized bases: denoisers stored in fp8 or loaded from a GGUF file (docs/lora.md, "Quantized bases").

Two ways, both diffusers' own:

- ``quantize="fp8"`` (``--quantize fp8``): ``ModelMixin.enable_layerwise_casting(storage_dtype=
  torch.float8_e4m3fn, compute_dtype=<--dtype>)`` on every denoiser: weights are stored in fp8 and
  each layer is cast up for its forward and back down after (the model's own skip patterns keep
  norms and embeddings in the compute dtype).
- ``gguf={"transformer": PATH}`` (``--gguf PATH``, or ``--gguf transformer_2=PATH`` for Wan2.2's
  second expert): the denoiser comes from a GGUF file (``<Transformer>.from_single_file(path,
  quantization_config=GGUFQuantizationConfig(compute_dtype=<--dtype>), config=<model dir>)``);
  its Linear layers are ``GGUFLinear`` with packed ``GGUFParameter`` weights, dequantized per
  forward. The rest of the pipeline comes from the model directory as usual.

A quantized weight never takes a LoRA merge (writing ``W0 + BA`` into fp8 or Q8_0 storage would
round the adapter's delta away, and GGUF blocks cannot be written in place at all): the PEFT
engine serves adapters on a quantized base unfused (``backend/lora/unfused.py``: hooks adding
``B(Ax)`` in the compute dtype), ``lora_mode=merge`` is refused by name, and so is fusing a
distill file or preset. ``compute_dtypes`` tells the engine which dtype each quantized layer's
factors must have (the compute dtype, never the storage dtype).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InvalidParameter

QUANTIZE = ("none", "fp8")
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class QuantPlan:
    quantize: str = "none"                       # "none" | "fp8"
    gguf: dict = field(default_factory=dict)     # denoiser component -> GGUF file

    @property
    def active(self) -> bool:
        return self.quantize != "none" or bool(self.gguf)

    def label(self) -> str | None:
        if self.gguf:
            return "gguf"
        return self.quantize if self.quantize != "none" else None


def check(quantize=None, gguf=None) -> QuantPlan:
    """The flags, checked (one line naming the flag): ``quantize`` none|fp8; ``gguf`` a path (the
    ``transformer``), ``COMPONENT=PATH`` strings, or a {component: path} dict."""
    quantize = "none" if quantize in (None, "", False) else quantize
    if quantize not in QUANTIZE:
        raise InvalidParameter(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}", param="quantize")
    files: dict[str, str] = {}
    items = gguf.items() if isinstance(gguf, dict) else \
        ([gguf] if isinstance(gguf, (str, Path)) else list(gguf or []))
    for item in items:
        if isinstance(item, tuple):
            comp, path = item
        else:
            text = str(item)
            comp, sep, path = text.partition("=")
            if not sep or "/" in comp or "\\" in comp:
                comp, path = "transformer", text
        if comp in files:
            raise InvalidParameter(f"gguf names {comp!r} twice", param="gguf")
        p = Path(path).expanduser()
        if not p.is_file():
            raise InvalidParameter(f"gguf file {path} does not exist", param="gguf")
        if _magic(p) != b"GGUF":
            raise InvalidParameter(f"{path} is not a GGUF file (no GGUF magic)", param="gguf")
        files[comp] = str(p.resolve())
    if files and quantize != "none":
        raise InvalidParameter("quantize and gguf both given: a GGUF file is already quantized; pick one",
                               param="quantize")
    return QuantPlan(quantize, files)


def _magic(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)


# -- loading ---------------------------------------------------------------------------------------------------
def gguf_components(plan: QuantPlan, model_dir, denoisers, dtype: torch.dtype) -> dict:
    """{component: model loaded from its GGUF file} to hand to the pipeline's ``from_pretrained``."""
    if not plan.gguf:
        return {}
    import diffusers

    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    out = {}
    for comp, path in plan.gguf.items():
        if comp not in denoisers or comp not in index:
            raise InvalidParameter(f"gguf names component {comp!r}; this model's denoisers are "
                                   f"{', '.join(d for d in denoisers if d in index)}", param="gguf")
        cls = getattr(diffusers, index[comp][1])
        if not hasattr(cls, "from_single_file"):
            raise InvalidParameter(f"diffusers cannot load {index[comp][1]} from a single file (gguf)", param="gguf")
        try:
            out[comp] = cls.from_single_file(
                path, quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=dtype),
                config=str(model_dir), subfolder=comp, torch_dtype=dtype, local_files_only=True)
        except Exception as exc:  # a file of another model, a broken file: one line, naming it
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            raise InvalidParameter(f"could not load {comp} ({index[comp][1]}) from {path}: the file does not fit this "
                                   f"model (a GGUF of another model?): {msg}", param="gguf") from exc
    return out


def apply(plan: QuantPlan, denoisers: dict, dtype: torch.dtype) -> None:
    """fp8 storage for every denoiser (after the pipeline is on its device)."""
    if plan.quantize == "fp8":
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidParameter(f"quantize fp8 needs a float compute dtype, got {dtype}", param="dtype")
        for module in denoisers.values():
            module.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=dtype)


# -- what the LoRA engine needs to know --------------------------------------------------------------------
def storage_of(module: torch.nn.Module) -> tuple[str, torch.dtype] | None:
    """(storage kind, compute dtype) of a quantized layer; None for a plain one."""
    compute = getattr(module, "compute_dtype", None)
    if compute is not None and hasattr(getattr(module, "weight", None), "quant_type"):  # GGUFLinear
        import gguf

        return f"gguf:{gguf.GGMLQuantizationType(module.weight.quant_type).name}", compute
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook("layerwise_casting") if registry is not None else None
    if hook is not None:
        return f"{str(hook.storage_dtype).replace('torch.', '')}", hook.compute_dtype
    return None


def compute_dtypes(denoisers: dict) -> dict:
    """{(component, module path): compute dtype} for every quantized Linear of the denoisers."""
    out = {}
    for comp, root in denoisers.items():
        for name, m in root.named_modules():
            if isinstance(m, torch.nn.Linear):
                found = storage_of(m)
                if found is not None:
                    out[(comp, name)] = found[1]
    return out


def quantized_kind(denoisers: dict) -> str | None:
    """"fp8 (float8_e4m3fn)", "gguf (Q8_0)"...: how the denoisers' Linear weights are stored; None: plain."""
    kinds = set()
    for root in denoisers.values():
        for m in root.modules():
            if isinstance(m, torch.nn.Linear):
                found = storage_of(m)
                if found is not None:
                    kinds.add(found[0])
    if not kinds:
        return None
    if all(k.startswith("gguf:") for k in kinds):
        return "gguf (" + ", ".join(sorted(k[5:] for k in kinds)) + ")"
    return "fp8 (" + ", ".join(sorted(kinds)) + ")"


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes the module's parameters and buffers take as stored (packed GGUF blocks, fp8 bytes)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def describe(denoisers: dict) -> dict:
    """For metadata, /metrics and the benchmark: the storage and parameter bytes of each denoiser."""
    return {"storage": quantized_kind(denoisers),
            "parameter_bytes": {c: parameter_bytes(m) for c, m in denoisers.items()}}


def refuse_merge(kind: str, what: str = "lora_mode=merge", param: str = "lora_mode") -> InvalidParameter:
    return InvalidParameter(f"{what}: the base is quantized ({kind}); adapters run unfused on it (a merge would "
                            "write into quantized storage and round the adapter away)", param=param)

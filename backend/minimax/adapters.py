"""Reading MiniMax-H3 LoRA files into diffusers-ready state dicts, with their sampling contract.

- Turbo (LightX2V): the contract comes from the file name; alpha from ``__metadata__``, else 8.
- Native ("FlashGen"): ``__metadata__`` key_format=minimax-h3-native, qkv_layout=grouped, base_schedule.
  Its fused ``qkv_proj`` LoRA-B rows are grouped per head (``[h0: q k v, h1: q k v, ...]``); they are
  reordered to ``[q; k; v]`` by diffusers' own base-weight converter
  (``convert_minimax_h3_transformer_checkpoint_to_diffusers(..., qkv_layout="interleaved")``, the function
  that loads the raw MiniMaxAI shards), then the file goes through diffusers' MiniMax-H3 LoRA converter.
- ComfyUI exports (fused ``qkv_proj`` with kohya ``lora_up``/``lora_down`` under ``diffusion_model.``, or any
  Turbo-named file with a fused qkv): their row order cannot be told from the tensors, so they are refused.
- vLLM-Omni's native-adapter layout (``transformer.<module>.lora_A.default.weight`` over the original
  checkpoint's module names, ``key_format=minimax-h3-native``): the ``transformer.`` prefix and peft's
  ``.default.`` infix are dropped, then it is a native file. Without the native metadata it is refused by name.

Reading and fitting are the shared LoRA machinery's (``backend.lora``): ``formats.read_tensors`` (truncation,
NaN/inf), ``convert.convert`` with diffusers' MiniMax-H3 converter (DoRA refused, non-factor keys unmatched) and
``fit.fit`` against a meta-device skeleton of the partition, so a MiniMax-H3 adapter gets the same fit report and
the same refusals (unmatched keys, wrong shapes, nothing bound) as every other model, before any weight or peft
layer is touched. The alpha rule (Turbo: the contract's alpha; otherwise ``__metadata__`` alpha) sets each layer's
scaling (alpha / rank), which is folded into ``lora_B`` for peft, bound at ``alpha == rank``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import AdapterError
from ..lora.convert import ConvertedAdapter, convert
from ..lora.fit import FitReport, fit
from ..lora.formats import AdapterRecord, read_tensors
from . import contracts
from .contracts import SamplingContract

_FUSED_QKV = re.compile(r"(^|\.)attn\.qkv_proj\.(lora_A|lora_B|lora_up|lora_down)\.weight$")
#: vLLM-Omni's native-adapter keys: peft's state-dict names over the original checkpoint's modules.
_VLLM_OMNI_NATIVE = re.compile(r"^transformer\.((?:token_refiner\.)?blocks\.\d+\..+|final_layer\..+)"
                               r"\.(lora_A|lora_B)\.default\.weight$")
PARTITIONS = ("transformer", "transformer_ref")


@dataclass(frozen=True)
class MiniMaxAdapter:
    path: Path
    contract: SamplingContract | None
    partition: str  # the denoiser it binds to: "transformer" | "transformer_ref"
    record: AdapterRecord = field(repr=False)
    converted: ConvertedAdapter = field(repr=False)  # factors grouped under `partition`, scaling set
    report: FitReport | None = field(default=None, repr=False)  # set by `fit_partition`

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t for t in contracts.TASKS if contracts.PARTITION[t] == self.partition)

    @property
    def state_dict(self) -> dict:
        """What peft binds: ``transformer.<module>.lora_A/B.weight`` of the fitted layers, scaling folded into
        ``lora_B`` (the key prefix is diffusers' loader's; `partition` says where it goes)."""
        if self.report is None or not self.report.ok:
            raise AdapterError(f"{self.path.name} has not been fitted to {self.partition}", param="lora_path")
        out = {}
        for module, f in self.report.bindings[self.partition].layers.items():
            out[f"transformer.{module}.lora_A.weight"] = f.tensors["lora_A.weight"]
            for part in ("lora_B.weight", "lora_B.bias"):
                if part in f.tensors:
                    value = f.tensors[part]
                    out[f"transformer.{module}.{part}"] = value if f.scaling == 1.0 else value * f.scaling
        return out


def comfyui_fused_qkv_keys(keys, *, turbo: bool) -> list[str]:
    """The fused-QKV keys that mark a ComfyUI export (empty when the file is not one)."""
    fused = sorted(k for k in keys if _FUSED_QKV.search(k))
    if not fused:
        return []
    if turbo:  # LightX2V ships split q/k/v; a fused Turbo file is a re-export
        return fused
    comfy = [k for k in fused if k.startswith("diffusion_model.") and (".lora_up." in k or ".lora_down." in k)]
    return comfy


def grouped_to_stacked(lora_b: torch.Tensor, num_heads: int, head_dim: int, key: str) -> torch.Tensor:
    """Reorder grouped ``[h: q k v]`` rows to ``[q; k; v]`` with the base-weight loader's own reorder."""
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    if lora_b.shape[0] != 3 * num_heads * head_dim:
        raise AdapterError(
            f"{key} has {lora_b.shape[0]} rows; a grouped qkv for {num_heads} heads of {head_dim} needs "
            f"{3 * num_heads * head_dim}",
            param="qkv_layout",
        )
    out = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        {"blocks.0.attn.qkv_proj.weight": lora_b},
        {"num_attention_heads": num_heads, "attention_head_dim": head_dim},
        qkv_layout="interleaved",
    )
    return torch.cat([out[f"transformer_blocks.0.attn.to_{p}.weight"] for p in "qkv"], dim=0).contiguous()


def from_vllm_omni_layout(tensors: dict, metadata: dict, name: str) -> dict:
    """vLLM-Omni's native-adapter keys (``transformer.blocks.0.attn.qkv_proj.lora_A.default.weight``) as the
    native layout's own (``blocks.0.attn.qkv_proj.lora_A.weight``); other files unchanged."""
    hits = [k for k in tensors if _VLLM_OMNI_NATIVE.match(k)]
    if not hits:
        return tensors
    if not contracts.is_native(metadata):
        raise AdapterError(
            f"{name}: key {hits[0]!r} is in vLLM-Omni's native-adapter layout (transformer.<module>.lora_A.default"
            f".weight over the original checkpoint's module names), which is only read with __metadata__ "
            f"key_format={contracts.NATIVE_KEY_FORMAT!r} and qkv_layout={contracts.NATIVE_QKV_LAYOUT!r} (the "
            f"fused qkv row order cannot be told from the tensors)", param="lora_path")
    out = {}
    for key, value in tensors.items():
        match = _VLLM_OMNI_NATIVE.match(key)
        out[f"{match[1]}.{match[2]}.weight" if match else key] = value
    return out


def _alpha(contract, metadata: dict, tensors: dict) -> float | None:
    """The network alpha every layer is scaled by (alpha / rank), or None to keep convert's scaling (per-module
    ``.alpha`` tensors are folded by the converter)."""
    if any(k.endswith(".alpha") for k in tensors):
        return None
    if contract is not None and contract.alpha is not None:
        return contract.alpha
    if contract is None and "alpha" in metadata:
        try:
            return float(metadata["alpha"])
        except ValueError:
            return None
    return None


def read_adapter(path, *, num_heads: int, head_dim: int) -> MiniMaxAdapter:
    """Read one MiniMax-H3 LoRA file into factors grouped under its partition (not yet fitted: `fit_partition`).
    `num_heads`/`head_dim` come from the loaded transformer config."""
    from diffusers.loaders import MiniMaxH3LoraLoaderMixin

    path = Path(path).expanduser()
    raw = read_tensors(path)
    metadata, name = raw.record.metadata, path.name
    tensors = from_vllm_omni_layout(raw.tensors, metadata, name)
    turbo = contracts.is_turbo_name(name) and not contracts.is_native(metadata)

    if contracts.is_native(metadata):
        contract = contracts.native_contract(name, metadata)
        tensors = {
            k: grouped_to_stacked(v, num_heads, head_dim, k) if _FUSED_QKV.search(k) and ".lora_B." in k else v
            for k, v in tensors.items()
        }
    else:
        fused = comfyui_fused_qkv_keys(tensors, turbo=turbo)
        if fused:
            raise AdapterError(
                f"{name} is a ComfyUI export with a fused-QKV layout ({fused[0]}); its q/k/v row order cannot be "
                f"determined, so it is unsupported. Use the original LightX2V/diffusers file (split to_q/to_k/to_v) "
                f"or a native file that declares qkv_layout",
                param="lora_path",
            )
        contract = contracts.turbo_contract(name, metadata) if turbo else None

    alpha = _alpha(contract, metadata, tensors)
    converted = convert(dataclasses.replace(raw, tensors=tensors), MiniMaxH3LoraLoaderMixin)
    if not converted.groups and not converted.unmatched:
        raise AdapterError(f"{name} holds no LoRA weights", param="lora_path")
    if alpha is not None:
        for layers in converted.groups.values():
            for f in layers.values():
                f.scaling = alpha / f.tensors["lora_A.weight"].shape[0]
    both = [p for p in PARTITIONS if p in converted.groups]
    if len(both) == 2:
        raise AdapterError(f"{name} holds layers for both transformer and transformer_ref; a MiniMax-H3 adapter "
                           "binds one partition (one file per partition)", param="lora_path")
    ref = "transformer_ref" in converted.groups or (contract is not None and contract.tasks == frozenset({"ref2va"}))
    partition = "transformer_ref" if ref else "transformer"
    # The file's generic `transformer.` layers go to the partition it binds (diffusers' load_into_transformer_ref).
    groups = {(partition if comp in PARTITIONS else comp): layers for comp, layers in converted.groups.items()}
    return MiniMaxAdapter(path=path, contract=contract, partition=partition, record=raw.record,
                          converted=dataclasses.replace(converted, groups=groups))


def fit_partition(adapter: MiniMaxAdapter, skeleton: torch.nn.Module, *, model: str, name: str) -> MiniMaxAdapter:
    """The shared fit report against the partition's layers (a meta-device skeleton is enough); refused
    (AdapterError with ``.report``) when any key stays unmatched, any shape disagrees, or nothing binds."""
    report = fit(adapter.converted, {adapter.partition: skeleton}, adapter=name, file=str(adapter.record.file),
                 generic=adapter.partition)
    report.raise_if_refused(model)
    return dataclasses.replace(adapter, report=report)


def fit_report(path, denoisers: dict[str, torch.nn.Module], *, name: str | None = None) -> FitReport:
    """The fit report of a MiniMax-H3 file against the partitions in `denoisers` (meta-device skeletons work),
    read as the runtime reads it: what the adapter library lists (`backend.lora.adapter.fit_adapter`)."""
    config = next(iter(denoisers.values())).config
    adapter = read_adapter(path, num_heads=int(config.num_attention_heads), head_dim=int(config.attention_head_dim))
    name = name or adapter.record.name
    skeleton = denoisers.get(adapter.partition)
    if skeleton is None:
        raise AdapterError(f"{adapter.path.name} binds {adapter.partition}, which this model does not have",
                           param="lora_path")
    return fit(adapter.converted, {adapter.partition: skeleton}, adapter=name, file=str(adapter.record.file),
               generic=adapter.partition)

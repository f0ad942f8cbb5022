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

All of this is MiniMax-H3's family hooks (``MiniMaxLoRAFamily``) around the one LoRA engine
(``backend.lora.engine.LoRAEngine``; docs/ARCHITECTURE.md, "MiniMax-H3 and the LoRA engine"): reading is
``formats.read_tensors`` (truncation, NaN/inf), converting is diffusers' MiniMax-H3 converter through
``convert.convert`` (DoRA refused, non-factor keys unmatched) after the layout steps above, and fitting is the shared
``fit.fit`` against the partition (a meta-device skeleton while it is not loaded), so a MiniMax-H3 adapter gets the
same fit report, refusals, cache, pins, exact restore and stats as every other model, before any weight is touched.
The alpha rule (Turbo: the contract's alpha; otherwise ``__metadata__`` alpha) sets each layer's scaling
(alpha / rank), which the engine applies when it merges or hooks the layer.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import AdapterError, ContractViolation
from ..lora.convert import ConvertedAdapter, convert
from ..lora.family import Converted, LoRAFamily
from ..lora.fit import FitReport
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
    report: FitReport | None = field(default=None, repr=False)  # set by `MiniMaxLoRAFamily.fit`

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t for t in contracts.TASKS if contracts.PARTITION[t] == self.partition)


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
    """Read one MiniMax-H3 LoRA file into factors grouped under its partition (not yet fitted: `MiniMaxLoRAFamily.fit`).
    `num_heads`/`head_dim` come from the loaded transformer config."""
    path = Path(path).expanduser()
    return from_raw(read_tensors(path), path, num_heads=num_heads, head_dim=head_dim)


def from_raw(raw, path, *, num_heads: int, head_dim: int) -> MiniMaxAdapter:
    """`read_adapter` for tensors already read (``formats.RawAdapter``): contract, layouts, native reorder,
    diffusers' MiniMax-H3 converter, alpha, partition."""
    from diffusers.loaders import MiniMaxH3LoraLoaderMixin

    path = Path(path).expanduser()
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


class MiniMaxLoRAFamily(LoRAFamily):
    """MiniMax-H3's hooks around the shared LoRA engine (``backend.lora.family``).

    - ``convert``: the contract (Turbo name / native metadata), vLLM-Omni's layout, the grouped-QKV reorder, diffusers'
      MiniMax-H3 converter and the alpha rule (``from_raw``); the file's generic ``transformer.`` layers go to the
      partition it binds (``transformer``, or ``transformer_ref`` for ref2va), one partition per file;
    - ``fit_targets``: that partition, or a meta-device skeleton of it while it is not loaded (ref2va loads its
      partition on demand), so the fit report never waits for weights;
    - ``check``: the request's sampling plan under the checkpoint's pinned schedule, the fused files' and the active
      adapters' contracts (``contracts.plan``), and each adapter's partition against the task's.
    """

    name = "minimax-h3"

    def __init__(self, pipeline_cls=None):
        super().__init__(pipeline_cls)
        self._skeleton: torch.nn.Module | None = None
        self.checkpoint: SamplingContract | None = None  # the repository's pinned schedule (set by the runtime)
        self.fused: list[MiniMaxAdapter] = []  # distill files fused at start (their contracts govern too)

    def convert(self, raw, denoisers: dict[str, torch.nn.Module], encoders=None) -> Converted:
        """MiniMax-H3's adapters change its transformers only (its Qwen3-VL encoder is offloaded with it)."""
        config = next(iter(denoisers.values())).config
        adapter = from_raw(raw, raw.record.path, num_heads=int(config.num_attention_heads),
                           head_dim=int(config.attention_head_dim))
        return Converted(adapter.converted, generic=adapter.partition, data=adapter)

    def fit_targets(self, denoisers, converted: Converted) -> dict[str, torch.nn.Module]:
        partition = converted.data.partition
        module = denoisers.get(partition)
        if module is None:  # both partitions share one architecture config in every released repository
            if self._skeleton is None:
                from diffusers import MiniMaxH3Transformer3DModel

                with torch.device("meta"):
                    self._skeleton = MiniMaxH3Transformer3DModel.from_config(
                        dict(next(iter(denoisers.values())).config))
            module = self._skeleton
        return {partition: module}

    def fit(self, converted: Converted, denoisers, *, adapter: str, file: str, encoders=None) -> FitReport:
        report = super().fit(converted, denoisers, adapter=adapter, file=file)
        converted.data = dataclasses.replace(converted.data, report=report)
        return report

    def check(self, request: dict, adapters: list, *, default_steps: int | None = None) -> contracts.SamplingPlan:
        """The plan of one request whose active adapters (scale != 0) are ``adapters`` (``LoadedAdapter`` rows,
        or ``MiniMaxAdapter``); raises ContractViolation naming the field or the file."""
        active = [getattr(a, "data", a) for a in adapters]
        contract = contracts.active_contract(self.checkpoint, [a.contract for a in [*self.fused, *active]])
        plan = contracts.plan(request, contract, default_steps=default_steps)
        partition = contracts.PARTITION[plan.task_type]
        for adapter in active:
            if adapter.partition != partition:
                raise ContractViolation(
                    f"{adapter.path.name} binds to {adapter.partition} (task_type {' or '.join(adapter.tasks)});"
                    f" the request's task_type {plan.task_type!r} denoises with {partition}", param="task_type")
        for adapter in self.fused:
            if adapter.partition != partition:
                raise ContractViolation(
                    f"{adapter.path.name} is fused into {adapter.partition}; task_type {plan.task_type!r} "
                    f"denoises with {partition}", param="task_type")
        return plan

    def engine_options(self, manager) -> dict:
        """With offload on an accelerator the weights are not where a merge writes them for long (model offload
        moves whole components, group offload moves blocks, streams onload from pinned copies taken when the hooks
        were applied, so a write is lost): adapters are served unfused, as forward hooks whose factors live on the
        compute device, and no weight is written. On a CPU device offload moves nothing (onload and offload device
        are both the CPU, and streams are refused), so the engine's own rule applies (merge on CPU)."""
        plan = getattr(getattr(manager, "minimax", None), "offload", None)
        if plan is None or not plan.active or manager.device.type == "cpu":
            return {}
        return {"lora_mode": "unfused", "factor_device": manager.device,
                "mode_fixed_by": f"{plan.flags()}: adapters run as hooks, base weights are never written"}

    def bind(self, manager, engine) -> None:
        manager.minimax.attach_engine(engine)  # the runtime's generate serves its adapters with this engine

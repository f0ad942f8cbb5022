"""Reading MiniMax-H3 LoRA files into diffusers-ready state dicts, with their sampling contract.

- Turbo (LightX2V): the contract comes from the file name; alpha from ``__metadata__``, else 8.
- Native ("FlashGen"): ``__metadata__`` key_format=minimax-h3-native, qkv_layout=grouped, base_schedule.
  Its fused ``qkv_proj`` LoRA-B rows are grouped per head (``[h0: q k v, h1: q k v, ...]``); they are
  reordered to ``[q; k; v]`` by diffusers' own base-weight converter
  (``convert_minimax_h3_transformer_checkpoint_to_diffusers(..., qkv_layout="interleaved")``, the function
  that loads the raw MiniMaxAI shards), then the file goes through diffusers' MiniMax-H3 LoRA converter.
- ComfyUI exports (fused ``qkv_proj`` with kohya ``lora_up``/``lora_down`` under ``diffusion_model.``, or any
  Turbo-named file with a fused qkv): their row order cannot be told from the tensors, so they are refused.

Alpha is folded into ``lora_B`` (``B * alpha / rank``) and the result is loaded alpha-less, which diffusers
binds at ``alpha == rank``: one place applies the alpha rule for every kind of file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import AdapterError
from . import contracts
from .contracts import SamplingContract

_FUSED_QKV = re.compile(r"(^|\.)attn\.qkv_proj\.(lora_A|lora_B|lora_up|lora_down)\.weight$")


@dataclass(frozen=True)
class MiniMaxAdapter:
    path: Path
    contract: SamplingContract | None
    partition: str  # the denoiser it binds to: "transformer" | "transformer_ref"
    state_dict: dict = field(repr=False)  # "transformer.<module>.lora_A/B.weight", alpha folded

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t for t in contracts.TASKS if contracts.PARTITION[t] == self.partition)


def read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise AdapterError(f"LoRA file {path} does not exist", param="lora_path")
    if path.suffix != ".safetensors":
        raise AdapterError(f"{path.name}: MiniMax-H3 LoRAs are read from .safetensors files only",
                           param="lora_path")
    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{path.name} is not a readable safetensors file ({exc})", param="lora_path") from None
    return tensors, metadata


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


def _fold_alpha(state_dict: dict, alpha: float | None) -> dict:
    if alpha is None:
        return state_dict
    out = {}
    for key, value in state_dict.items():
        if ".lora_B." in key and value.ndim == 2:
            value = value * (alpha / value.shape[1])
        out[key] = value
    return out


def read_adapter(path, *, num_heads: int, head_dim: int) -> MiniMaxAdapter:
    """Read one MiniMax-H3 LoRA file. `num_heads`/`head_dim` come from the loaded transformer config."""
    from diffusers.loaders import MiniMaxH3LoraLoaderMixin

    path = Path(path).expanduser()
    tensors, metadata = read_file(path)
    name = path.name
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

    has_alpha_tensors = any(k.endswith(".alpha") for k in tensors)
    alpha = contract.alpha if contract is not None else None
    if contract is None and "alpha" in metadata and not has_alpha_tensors:
        try:
            alpha = float(metadata["alpha"])
        except ValueError:
            alpha = None
    try:
        state_dict = MiniMaxH3LoraLoaderMixin.lora_state_dict(tensors)
    except ValueError as exc:
        raise AdapterError(f"{name}: {exc}", param="lora_path") from None
    if not state_dict:
        raise AdapterError(f"{name} holds no LoRA weights", param="lora_path")
    if has_alpha_tensors:
        alpha = None  # per-module alphas were folded by the converter
    ref = [k for k in state_dict if k.startswith("transformer_ref.")]
    partition = "transformer_ref" if ref or (contract and contract.tasks == frozenset({"ref2va"})) else "transformer"
    # One prefix for loading; the partition says where it goes.
    state_dict = {re.sub(r"^transformer_ref\.", "transformer.", k): v for k, v in state_dict.items()}
    unknown = [k for k in state_dict if not k.startswith("transformer.")]
    if unknown:
        raise AdapterError(f"{name}: key {unknown[0]!r} names no MiniMax-H3 denoiser", param="lora_path")
    return MiniMaxAdapter(path=path, contract=contract, partition=partition,
                          state_dict=_fold_alpha(state_dict, None if has_alpha_tensors else alpha))

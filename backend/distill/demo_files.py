"""Demo distill files: the publishers' few-step LoRAs for the demo models, trained or seeded.

Where a demo model has trained distill files (``backend.demo.DISTILL_DIRS``: demo:qwen-image's
Lightning LoRAs, distilled by ``python -m backend.demo.train distill``), the file of that name is
served as it was trained. Every other name is a seeded stand-in:

Each file is written in the publisher's real key layout, so the same converter path
(diffusers' own ``lora_state_dict``) runs on them as on the real download:

- lightx2v Wan (``lightx2v/Wan2.1-Distill-Loras``, ``lightx2v/Wan2.2-Distill-Loras``): every
  key kind the published files carry (``backend.lora.convert.KEY_KINDS``):
  ``diffusion_model.blocks.N.{self_attn,cross_attn}.{q,k,v,o}`` and ``ffn.{0,2}`` with
  ``lora_down.weight`` / ``lora_up.weight`` / ``alpha``; ``diff_b`` (a bias delta) on some of
  them only; ``diff`` on the norms (``self_attn.norm_{q,k}``, ``cross_attn.norm_{q,k}``);
  ``blocks.N.diff_m`` (the modulation table); a full-weight ``diff`` + ``diff_b`` on the output
  Linear ``head.head``. The Wan2.2 I2V files also carry the
  CLIP image branch (``cross_attn.{k_img,v_img}`` LoRA + ``diff_b``, ``cross_attn.norm_k_img.diff``),
  which Wan2.2 A14B does not have.
- Qwen-Image-Lightning (``lightx2v/Qwen-Image-2512-Lightning``): bare
  ``transformer_blocks.N.<diffusers module>.lora_down.weight`` / ``lora_up.weight`` / ``alpha`` (the
  trained demo:qwen-image files are written the same way).

Shapes are read from the demo model's own checkpoint, and the seed from the file name,
so the same name gives the same bytes on every machine.

    python -m backend.distill [--data-dir DIR]    # writes every preset's stand-ins (backend/distill/__main__.py)
"""
from __future__ import annotations

import filecmp
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from .. import settings

# Where generated stand-ins live: <data-dir>/demo/distill, beside the demo adapters, never in the library.
SUBDIR = "distill"
RANK = 4
ALPHA = 8.0  # alpha != rank, so the converters' alpha/rank scaling is exercised
# Factor std per layout: large enough that the tiny demo model's output visibly changes.
STD = {"qwen-lightning": 0.25, "lightx2v-wan": 0.3, "lightx2v-wan-i2v": 0.3}
DELTA_STD = 0.05  # diff / diff_b / norm diff / diff_m: full-tensor deltas
# Bump when the generator changes, so stale stand-ins are rewritten.
BUILD_VERSION = 4

# diffusers module (under blocks.N.) -> lightx2v / original Wan name
_WAN_MODULES = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
# modules that carry a diff_b in the demo files (lightx2v ships it on only some of them)
_WAN_DIFF_B = ("self_attn.o", "ffn.0")
# norms with a `.diff` (lightx2v name -> diffusers name under blocks.N.)
_WAN_NORMS = {"self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
              "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k"}
# Linear layers outside the blocks with a full `.diff` (and `.diff_b`): lightx2v name -> diffusers name
# (the published Wan2.2 files carry head.head.diff + head.head.diff_b: diffusers PR #12541 reads them)
_WAN_FULL_DIFF = {"head.head": "proj_out"}

_QWEN_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                 "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj",
                 "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

LAYOUTS = {"QwenImagePipeline": "qwen-lightning", "WanPipeline": "lightx2v-wan",
           "WanImageToVideoPipeline": "lightx2v-wan-i2v"}


def demo_dir(data_dir=None) -> Path:
    path = settings.demo_dir(data_dir) / SUBDIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def _shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(checkpoint), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _blocks(shapes: dict, prefix: str) -> list[int]:
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return sorted({int(m.group(1)) for k in shapes if (m := pat.match(k))})


def build_state_dict(model_dir: Path, layout: str, component: str, seed: int, rank: int = RANK) -> dict:
    """The LoRA tensors for one stand-in file (keys in the publisher's layout)."""
    import torch

    shapes = _shapes(model_dir / component / "diffusion_pytorch_model.safetensors")
    gen = torch.Generator().manual_seed(seed)

    std = STD[layout]

    def pair(out_f: int, in_f: int):
        down = torch.randn(rank, in_f, generator=gen) * std
        up = torch.randn(out_f, rank, generator=gen) * std
        return down, up

    def delta(shape):
        return torch.randn(*shape, generator=gen) * DELTA_STD

    sd: dict[str, torch.Tensor] = {}
    if layout in ("lightx2v-wan", "lightx2v-wan-i2v"):
        for i in _blocks(shapes, "blocks"):
            for module, orig in _WAN_MODULES.items():
                out_f, in_f = shapes[f"blocks.{i}.{module}.weight"]
                down, up = pair(out_f, in_f)
                key = f"diffusion_model.blocks.{i}.{orig}"
                sd[f"{key}.lora_down.weight"], sd[f"{key}.lora_up.weight"] = down, up
                sd[f"{key}.alpha"] = torch.tensor(ALPHA)
                if orig in _WAN_DIFF_B and i % 2 == 0:
                    sd[f"{key}.diff_b"] = delta((out_f,))
            for orig, module in _WAN_NORMS.items():
                sd[f"diffusion_model.blocks.{i}.{orig}.diff"] = delta(shapes[f"blocks.{i}.{module}.weight"])
            sd[f"diffusion_model.blocks.{i}.diff_m"] = delta(shapes[f"blocks.{i}.scale_shift_table"])
            if layout == "lightx2v-wan-i2v":  # the CLIP image branch (absent from Wan2.2 A14B)
                dim = shapes[f"blocks.{i}.attn2.to_k.weight"][0]
                for orig in ("cross_attn.k_img", "cross_attn.v_img"):
                    key = f"diffusion_model.blocks.{i}.{orig}"
                    sd[f"{key}.lora_down.weight"], sd[f"{key}.lora_up.weight"] = pair(dim, dim)
                    sd[f"{key}.alpha"] = torch.tensor(ALPHA)
                    sd[f"{key}.diff_b"] = delta((dim,))
                sd[f"diffusion_model.blocks.{i}.cross_attn.norm_k_img.diff"] = delta((dim,))
        for orig, module in _WAN_FULL_DIFF.items():
            sd[f"diffusion_model.{orig}.diff"] = delta(shapes[f"{module}.weight"])
            sd[f"diffusion_model.{orig}.diff_b"] = delta(shapes[f"{module}.bias"])
    elif layout == "qwen-lightning":
        for i in _blocks(shapes, "transformer_blocks"):
            for module in _QWEN_MODULES:
                out_f, in_f = shapes[f"transformer_blocks.{i}.{module}.weight"]
                down, up = pair(out_f, in_f)
                key = f"transformer_blocks.{i}.{module}"
                sd[f"{key}.lora_down.weight"], sd[f"{key}.lora_up.weight"] = down, up
                sd[f"{key}.alpha"] = torch.tensor(ALPHA)
    else:
        raise ValueError(f"unknown demo LoRA layout {layout!r}")
    # publishers ship bf16
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}


def write_demo_file(model_id: str, filename: str, component: str = "transformer", data_dir=None,
                    target_dir: Path | None = None, lora_only: bool = False) -> Path:
    """Write (once) the stand-in ``filename`` for demo model ``model_id``; returns its path.
    ``lora_only``: LoRA pairs and alphas only (an ordinary style LoRA in the same layout)."""
    from safetensors.torch import save_file

    from .. import demo
    from ..models.resolve import resolve_model

    if not demo.is_demo(model_id):
        raise ValueError(f"demo stand-in files exist only for demo models, not {model_id!r}")
    out_dir = Path(target_dir) if target_dir else demo_dir(data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename
    trained = demo.DISTILL_DIRS.get(model_id, Path("/nonexistent")) / filename
    if trained.is_file() and not lora_only:
        if not (path.is_file() and filecmp.cmp(trained, path, shallow=False)):
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            shutil.copyfile(trained, tmp)
            os.replace(tmp, path)  # atomic: a reader never sees half a file
        return path
    resolved = resolve_model(model_id, data_dir)
    layout = LAYOUTS[resolved.class_name]
    # the model's own build marker too: a stand-in is shaped after the model's modules, so a retrained or
    # reshaped demo model (e.g. random -> trained) makes it stale
    built = resolved.path / ".demo-build"
    marker = json.dumps({"model": model_id, "layout": layout, "component": component, "rank": RANK,
                         "alpha": ALPHA, "std": STD[layout], "build_version": BUILD_VERSION,
                         "lora_only": lora_only, "model_build": built.read_text() if built.is_file() else None},
                        sort_keys=True)
    if path.is_file() and _marker(path) == marker:
        return path
    sd = build_state_dict(resolved.path, layout, component, _seed(filename))
    if lora_only:
        sd = {k: v for k, v in sd.items() if k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha"))}
    meta = {"lora_studio_demo": marker}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(sd, str(tmp), metadata=meta)
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def _marker(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("lora_studio_demo")
    except Exception:
        return None

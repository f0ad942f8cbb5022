"""A GGUF transformer file of a demo model, written like the ones published for real models.

Published GGUF transformers (city96's tool, and the Flux/Wan/SD3.5/Qwen-Image files made with
it) hold the denoiser alone, under the tensor names of the original checkpoint, with every
2-D weight whose rows split into whole quantization blocks stored quantized (Q8_0, Q4_0, ...)
and the rest (1-D tensors: biases, norms; conv kernels; rows that do not split) in F32/F16.
diffusers loads them with ``<Transformer>.from_single_file(path, quantization_config=
GGUFQuantizationConfig(compute_dtype=...), config=<pipeline dir>, subfolder="transformer")``:
the quantized weights stay packed in ``GGUFParameter`` s inside ``GGUFLinear`` layers and are
dequantized per forward.

``demo:sd3.5`` is the main demo written here: every Linear of its transformer has rows of 32 or 128
(one Q8_0/Q4_0 block is 32 values), and the file uses the original SD3 (MMDiT) names
(``joint_blocks.N.x_block.attn.qkv`` ...) that diffusers' own converter maps back. The one
liberty taken against city96's tool: it leaves tensors of <= 1024 values in F32, and the
demo's layers are that small, so here every 2-D weight whose rows split is quantized.

    python -m backend.demo.gguf demo:sd3.5 Q8_0      # builds (once) and prints the path

Deterministic: the same demo model and type give the same bytes.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

from .. import settings
from ..errors import InvalidParameter

QTYPES = ("Q8_0", "Q4_0")
# demo id -> (GGUF architecture, component, diffusers state dict -> the published files' names)
SOURCES = {"demo:sd3.5": ("sd3", "transformer", "sd3_original_names"),
           # published Qwen-Image GGUFs keep diffusers' names (diffusers' mapping for it is the identity); the
           # demo's rows are 48 wide, so only its 256- and 192-wide rows (5 of 34 Linears) split into blocks
           "demo:qwen-image": ("qwen_image", "transformer", "same_names")}


def path_for(model_id: str, qtype: str = "Q8_0", data_dir=None) -> Path:
    return settings.models_dir(data_dir) / "gguf" / f"{model_id.replace(':', '-')}-{qtype}.gguf"


def ensure(model_id: str = "demo:sd3.5", qtype: str = "Q8_0", data_dir=None) -> Path:
    """The GGUF transformer of a demo model (built once under ``<data-dir>/models/gguf/``)."""
    if model_id not in SOURCES:
        raise InvalidParameter(f"no demo GGUF for {model_id!r}; available: {', '.join(SOURCES)}", param="gguf")
    if qtype not in QTYPES:
        raise InvalidParameter(f"GGUF type must be one of {', '.join(QTYPES)}, got {qtype!r}", param="gguf")
    out = path_for(model_id, qtype, data_dir)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if out.exists():
            return out
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
        os.close(fd)
        try:
            write(model_id, qtype, Path(tmp), data_dir)
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return out


def write(model_id: str, qtype: str, out: Path, data_dir=None) -> None:
    from safetensors.torch import load_file

    from . import ensure as ensure_model

    arch, component, names = SOURCES[model_id]
    folder = ensure_model(model_id, data_dir) / component
    state = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    write_state(globals()[names](state), qtype, out, arch)


def same_names(state: dict) -> dict:
    return dict(state)


def write_state(original: dict, qtype: str, out: Path, arch: str = "sd3") -> None:
    """A state dict (original names) as a GGUF file: 2-D tensors whose rows split into blocks in ``qtype``,
    1-D ones F32, the rest F16 (``python -m bench quant`` writes its larger model with it too)."""
    import gguf
    import torch

    target = gguf.GGMLQuantizationType[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[target]
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    for name in sorted(original):
        data = original[name].to(torch.float32).numpy()
        if data.ndim == 2 and data.shape[-1] % block == 0:
            kind = target
        elif data.ndim == 1:
            kind = gguf.GGMLQuantizationType.F32
        else:  # conv kernels, positional tables, rows that do not split into blocks
            kind = gguf.GGMLQuantizationType.F16
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file(path=str(out))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _swap_halves(t):
    a, b = t.chunk(2, dim=0)
    import torch

    return torch.cat([b, a], dim=0)


def sd3_original_names(state: dict) -> dict:
    """diffusers' SD3Transformer2DModel state dict -> the original SD3 (MMDiT) checkpoint's names: the
    inverse of ``diffusers.loaders.single_file_utils.convert_sd3_transformer_checkpoint_to_diffusers``
    (q/k/v concatenated into qkv, the last context block's and the final layer's modulation halves
    swapped back)."""
    import torch

    s = dict(state)
    if any(".attn2." in k for k in s):
        raise InvalidParameter("SD3.5-large dual-attention layers are not part of the demo GGUF writer", param="gguf")
    out = {"pos_embed": s.pop("pos_embed.pos_embed")}
    simple = {"pos_embed.proj": "x_embedder.proj", "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
              "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
              "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
              "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2", "context_embedder": "context_embedder",
              "proj_out": "final_layer.linear"}
    for new, old in simple.items():
        for p in ("weight", "bias"):
            out[f"{old}.{p}"] = s.pop(f"{new}.{p}")
    for p in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{p}"] = _swap_halves(s.pop(f"norm_out.linear.{p}"))
    layers = sorted({int(k.split(".")[1]) for k in s if k.startswith("transformer_blocks.")})
    for i in layers:
        d, o = f"transformer_blocks.{i}", f"joint_blocks.{i}"
        last = i == layers[-1]
        for p in ("weight", "bias"):
            out[f"{o}.x_block.attn.qkv.{p}"] = torch.cat([s.pop(f"{d}.attn.to_{x}.{p}") for x in "qkv"])
            out[f"{o}.context_block.attn.qkv.{p}"] = torch.cat(
                [s.pop(f"{d}.attn.add_{x}_proj.{p}") for x in "qkv"])
            pairs = {"attn.to_out.0": "x_block.attn.proj", "norm1.linear": "x_block.adaLN_modulation.1",
                     "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2"}
            if not last:
                pairs.update({"attn.to_add_out": "context_block.attn.proj", "ff_context.net.0.proj":
                              "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2"})
            for new, old in pairs.items():
                out[f"{o}.{old}.{p}"] = s.pop(f"{d}.{new}.{p}")
            ctx = s.pop(f"{d}.norm1_context.linear.{p}")
            out[f"{o}.context_block.adaLN_modulation.1.{p}"] = _swap_halves(ctx) if last else ctx
        for new, old in (("norm_q", "x_block.attn.ln_q"), ("norm_k", "x_block.attn.ln_k"),
                         ("norm_added_q", "context_block.attn.ln_q"), ("norm_added_k", "context_block.attn.ln_k")):
            if f"{d}.attn.{new}.weight" in s:
                out[f"{o}.{old}.weight"] = s.pop(f"{d}.attn.{new}.weight")
    if s:
        raise InvalidParameter(f"SD3 tensors without an original name: {', '.join(sorted(s)[:4])}", param="gguf")
    return out


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    model_id = args[0] if args else "demo:sd3.5"
    qtype = args[1] if len(args) > 1 else "Q8_0"
    print(ensure(model_id, qtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())

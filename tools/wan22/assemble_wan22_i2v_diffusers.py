#!/usr/bin/env python3
"""Assemble a Wan2.2 image-to-video diffusers directory offline.

Takes a diffusers skeleton (e.g. Wan-AI/Wan2.2-I2V-A14B-Diffusers) and, optionally,
replacement weights for its two transformers (e.g. checkpoints with a distilled LoRA
baked in by LightX2V's converter), and writes a directory that
WanImageToVideoPipeline.from_pretrained loads. Weights are checked against each
transformer's config (tensor names and shapes, from the safetensors headers) before
anything is written; the output appears only when complete.

    python tools/wan22/assemble_wan22_i2v_diffusers.py \\
      --diffusers-skeleton /path/to/Wan2.2-I2V-A14B-Diffusers \\
      --transformer-weight /tmp/wan22_lightx2v/high_noise_out \\
      --transformer-2-weight /tmp/wan22_lightx2v/low_noise_out \\
      --output-dir /path/to/Wan2.2-I2V-A14B-Custom-Diffusers \\
      --asset-mode symlink --overwrite

Exit 0 and a summary on success; exit 2 and one line naming the problem on any error.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere: find `backend` and `tools`
    sys.path.insert(0, str(REPO_ROOT))

from app import OneLineParser  # noqa: E402  (one-line usage errors, exit 2, like app.py)

WEIGHT_HELP = ("a .safetensors file, a folder holding diffusion_pytorch_model.safetensors or "
               "model.safetensors, or a sharded checkpoint (its *.safetensors.index.json, or the folder "
               "holding it; every shard must exist). Pickle files are refused. Omit to keep the "
               "skeleton's weights.")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="assemble_wan22_i2v_diffusers.py",
        description="Assemble a Wan2.2 I2V diffusers directory from a skeleton and optional "
                    "replacement transformer weights (validated before anything is written).",
        epilog="Exit status: 0 on success, 2 on any error (one line naming the problem).")
    p.add_argument("--diffusers-skeleton", required=True, type=Path, metavar="DIR",
                   help="a diffusers WanImageToVideoPipeline directory (model_index.json, tokenizer/, "
                        "text_encoder/, vae/, transformer/, transformer_2/ with their configs) whose "
                        "components are reused")
    p.add_argument("--transformer-weight", type=Path, metavar="PATH",
                   help="weights for transformer/ (high noise, the early steps): " + WEIGHT_HELP)
    p.add_argument("--transformer-2-weight", type=Path, metavar="PATH",
                   help="weights for transformer_2/ (low noise, the late steps): " + WEIGHT_HELP)
    p.add_argument("--output-dir", required=True, type=Path, metavar="DIR",
                   help="the directory to create; it is written beside itself and renamed into place "
                        "when complete (missing parent folders are created)")
    p.add_argument("--asset-mode", choices=("symlink", "copy"), default="symlink",
                   help="symlink (default): component folders and weights are relative symbolic links "
                        "(move the output together with its sources); copy: a self-contained directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output directory (swapped out only once the new one is "
                        "complete); without it an existing output is an error")
    return p


def summary(result, req) -> str:
    out = shlex.quote(str(result.output_dir))
    width = max(len(s.dest) + (1 if s.source and s.source.is_dir() else 0) for s in result.steps)
    final_root = Path(os.path.realpath(result.output_dir.parent)) / result.output_dir.name
    lines = [f"Assembled {result.output_dir} from {req.skeleton} (asset mode: {req.asset_mode})"]
    for step in result.steps:
        name = step.dest + ("/" if step.source is not None and step.source.is_dir() else "")
        detail = step.note
        if step.kind == "link":
            detail += f" -> {step.link_text(final_root)}"
        lines.append(f"  {name:<{width}}  {detail}")
    lines += ["", "Use it:",
              f'  python app.py generate --model {out} --image INPUT.jpg --prompt "A cat playing with yarn"',
              f"  python app.py serve {out}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from backend.errors import StudioError
    from tools.wan22.assemble import Request, run

    req = Request(skeleton=Path(os.path.abspath(args.diffusers_skeleton.expanduser())),
                  output_dir=Path(os.path.abspath(args.output_dir.expanduser())),
                  weights={"transformer": args.transformer_weight and args.transformer_weight.expanduser(),
                           "transformer_2": args.transformer_2_weight and args.transformer_2_weight.expanduser()},
                  asset_mode=args.asset_mode, overwrite=args.overwrite)
    try:
        result = run(req)
    except (StudioError, OSError) as exc:
        message = exc.message if isinstance(exc, StudioError) else str(exc)
        print("error: " + " ".join(message.split()), file=sys.stderr)  # one line, whatever the cause
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(summary(result, req))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Score demo:qwen-image weights with the tests' oracles: the test grid and a validation grid.

    .venv/bin/python scripts/demo_score.py [DIR] [--cfg 4 5 6]

DIR is a diffusers folder (default: the shipped weights, backend/demo/weights/qwen-image; a trainer's
``--out`` folder works the same). Each CFG value draws the 48 pairs of tests/test_demo_trained.py (the grid the
tests hold to their bars) and 96 validation pairs on other seeds (where the default CFG is chosen, so the
test grid is never tuned on), at 64x64, 20 steps, the empty-condition negative prompt " ", and prints what
the oracles of tests/oracles.py read: colour, background, digit and shape, as fractions.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def validation() -> list[tuple[str, int]]:
    """96 (prompt, seed) pairs, seeds 20000 up (the test grid uses 9000-9111): 72 digits, 24 shapes."""
    from backend.demo import data

    pairs, out = data.colour_pairs(), []
    for i in range(72):
        colour, background = pairs[(i * 11 + 1) % len(pairs)]
        out.append((data.prompt_for("digit", i % 9, colour, background), 20000 + i))
    for i in range(24):
        colour, background = pairs[(i * 13 + 2) % len(pairs)]
        out.append((data.prompt_for("shape", data.SHAPES[i % 3], colour, background), 21000 + i))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights", nargs="?", default=str(ROOT / "backend" / "demo" / "weights" / "qwen-image"))
    parser.add_argument("--cfg", type=float, nargs="+", default=[4.0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)

    import torch
    from diffusers import QwenImagePipeline

    from oracles import score
    from test_demo_trained import grid

    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = QwenImagePipeline.from_pretrained(args.weights, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for cfg in args.cfg:
        for name, pairs in (("test grid (48)", grid()), ("validation (96)", validation())):
            images = []
            for k in range(0, len(pairs), 16):
                prompts, seeds = zip(*pairs[k:k + 16])
                images += pipe(prompt=list(prompts), negative_prompt=[" "] * len(prompts), height=64, width=64,
                               num_inference_steps=20, true_cfg_scale=cfg,
                               generator=[torch.Generator().manual_seed(s) for s in seeds]).images
            got = score(list(zip([p for p, _ in pairs], images)))
            print(f"CFG {cfg:g} {name}: " + ", ".join(f"{k} {v:.0%}" for k, v in got.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

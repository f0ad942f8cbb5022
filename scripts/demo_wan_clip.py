"""Draw a trained demo Wan model's clips into one animated GIF, and print the oracles' figures.

    .venv/bin/python scripts/demo_wan_clip.py [--model demo:wan2.2-t2v] [--out docs/img/demo-wan22-t2v.gif]
                                              [--score] [--cfg 5 ...]

The GIF: four prompts side by side, one per direction (a green 4 moving right first), drawn through the
product's own path (a ``PipelineManager`` at the model's defaults) and upscaled 2x. ``--score`` also
draws the model's test grid (``oracles.clip_grid`` over the prompts its training.json says no training
clip had) and prints what tests/oracles.py reads (direction, colour,
background, digit), per CFG value given.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SHOWN = [("a green digit 4 moving right on a black background", 1), ("a red digit 3 moving left on a white background", 2),
         ("a yellow digit 7 moving up on a navy background", 3), ("a cyan digit 2 moving down on a gray background", 4)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo:wan2.1-t2v")
    parser.add_argument("--out", default=None, help="default docs/img/demo-wan-t2v.gif (wan2.1), "
                                                     "docs/img/demo-wan22-t2v.gif (wan2.2)")
    parser.add_argument("--score", action="store_true")
    parser.add_argument("--cfg", type=float, nargs="*", default=[])
    args = parser.parse_args(argv)
    name = args.model.removeprefix("demo:")
    args.out = args.out or str(ROOT / "docs" / "img" / f"demo-{name.replace('2.1', '').replace('.', '')}.gif")

    import numpy as np
    from PIL import Image

    from backend.manager import PipelineManager
    from backend.result import quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as home:
        m = PipelineManager(device="cpu", dtype="float32", data_dir=home)
        m.load(args.model)
        clips = [m.generate({"prompt": p, "seed": s}).frames for p, s in SHOWN]
        frames = []
        for f in range(len(clips[0])):
            row = np.concatenate([np.asarray(c[f].convert("RGB") if hasattr(c[f], "convert") else c[f]) for c in clips], 1)
            row = row if row.dtype == np.uint8 else (np.clip(row, 0, 1) * 255).round().astype(np.uint8)
            frames.append(Image.fromarray(row).resize((row.shape[1] * 2, row.shape[0] * 2), Image.NEAREST))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        frames[0].save(args.out, save_all=True, append_images=frames[1:], duration=180, loop=0, optimize=True)
        print(f"wrote {args.out} ({frames[0].size[0]}x{frames[0].size[1]}, {len(frames)} frames)")
        if args.score:
            import json

            from backend.demo import WEIGHTS_ROOT
            from oracles import clip_grid, score_clips

            pairs = clip_grid(json.loads((WEIGHTS_ROOT / name / "training.json").read_text())["unseen_prompts"])
            for cfg in args.cfg or [None]:
                fields = {} if cfg is None else {"guidance_scale": cfg}
                started = time.perf_counter()
                drawn = [(p, m.generate({"prompt": p, "seed": s, **fields}).frames) for p, s in pairs]
                took = (time.perf_counter() - started) / len(pairs)
                got = score_clips(drawn)
                print(f"CFG {cfg if cfg is not None else 'default'}: " + ", ".join(f"{k} {v:.0%}" for k, v in got.items())
                      + f"; {took:.2f} s a clip")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

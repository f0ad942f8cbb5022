"""Draw the Lightning preset against the base and the teacher, and print the figures behind it.

    .venv/bin/python scripts/demo_distill_plot.py [--out docs/img/demo-lightning.png] [--score]

Rows: the prompt a first-time user tries, then prompts the distill never trained on
(``backend.demo.distill.held_out``); columns: the base at 4 steps (its own scheduler, at its default CFG
4 and at CFG 1), the qwen-image-2512-lightning-4step preset (the shipped distill file fused, 4 steps,
CFG 1, the preset's scheduler) and the teacher (the base at its defaults, 20 steps, CFG 4). All drawn through the product's own path (a ``PipelineManager`` with
``apply_preset``) and laid out by the UI's grid code (``ui.grid.compose``). ``--score`` also prints the
oracles' reading of tests/test_demo_distill.py's 48 pairs for each column, the 8-step preset too, and
the mean pixel distance of each to the teacher.
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

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "demo-lightning.png"))
    parser.add_argument("--score", action="store_true", help="print the oracles' figures for each column")
    args = parser.parse_args(argv)

    import numpy as np

    from backend.manager import PipelineManager
    from backend.result import quiet_libraries
    from test_demo_distill import distance, grid, scores
    from ui.grid import compose

    quiet_libraries()
    # the README's rows: the prompt the issue names, then held-out prompts of the test grid (a shape among them)
    held = grid()
    shown_pairs = [("a red digit 3 on a black background", 2), *held[:3], held[-1]]
    pairs = shown_pairs + (held if args.score else [])
    columns = {"base, 4 steps": ({"num_inference_steps": 4}, None),
               "base, 4 steps, CFG 1": ({"num_inference_steps": 4, "true_cfg_scale": 1.0}, None),
               "Lightning 4-step preset": ({}, "qwen-image-2512-lightning-4step"),
               "Lightning 8-step preset": ({}, "qwen-image-2512-lightning-8step"),
               "teacher, 20 steps, CFG 4": ({}, None)}
    drawn, seconds = {}, {}
    with tempfile.TemporaryDirectory() as home:
        m = PipelineManager(device="cpu", dtype="float32", data_dir=home)
        m.load("demo:qwen-image")
        for name, (fields, preset) in columns.items():
            if preset:
                m.apply_preset(preset)
            started = time.perf_counter()
            drawn[name] = [m.generate({"prompt": p, "seed": s, **fields}).images[0] for p, s in pairs]
            seconds[name] = (time.perf_counter() - started) / len(pairs)
            m.restore_base()
    shown = ["base, 4 steps", "base, 4 steps, CFG 1", "Lightning 4-step preset", "teacher, 20 steps, CFG 4"]
    rows = len(shown_pairs)
    cells = [[drawn[c][r] for c in shown] for r in range(rows)]
    image = compose(cells, shown, [f"{p} (seed {s})" for p, s in shown_pairs], "how it is drawn", "prompt")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    image.save(args.out)
    print(f"wrote {args.out} ({image.size[0]}x{image.size[1]})")
    if args.score:
        as_arrays = {k: [np.asarray(im, np.float32) for im in v] for k, v in drawn.items()}
        n = len(shown_pairs)  # the figures: the test grid only
        teacher = as_arrays["teacher, 20 steps, CFG 4"][n:]
        for name, images in as_arrays.items():
            images = images[n:]
            got = scores(held, images)
            print(f"{name}: " + ", ".join(f"{k} {v:.0%}" for k, v in got.items())
                  + f"; distance to the teacher {distance(images, teacher):.1f}; {seconds[name]:.3f} s a picture")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

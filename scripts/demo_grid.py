"""Draw a prompt grid from the shipped demo:qwen-image weights (the picture in README and docs/ui.md).

    .venv/bin/python scripts/demo_grid.py [--out docs/img/demo-qwen-grid.png] [--seed 0]

Rows are the four backgrounds, columns the digits 0-8 and the three shapes; the colour cycles
through the palette. Each tile is one prompt of the grammar at the model's defaults (64x64,
its steps, CFG and the empty-condition negative prompt), upscaled 2x.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "demo-qwen-grid.png"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from diffusers import QwenImagePipeline
    from PIL import Image, ImageDraw

    from backend import demo
    from backend.demo import data
    from backend.families import spec_for

    with tempfile.TemporaryDirectory() as home:
        path = demo.ensure("demo:qwen-image", home)
        pipe = QwenImagePipeline.from_pretrained(path, dtype=torch.float32)
        defaults = {**spec_for("QwenImagePipeline").defaults,
                    **json.loads((path / demo.DEFAULTS_FILE).read_text())["defaults"]}
    pipe.set_progress_bar_config(disable=True)
    colours = list(data.PALETTE)
    columns = [("digit", str(d)) for d in data.BASE_DIGITS] + [("shape", s) for s in data.SHAPES]
    prompts = []
    for r, background in enumerate(data.BACKGROUNDS):
        for c, (kind, value) in enumerate(columns):
            colour = colours[(r * 3 + c) % len(colours)]
            if data.PALETTE[colour] == data.BACKGROUNDS[background]:
                colour = colours[(r * 3 + c + 1) % len(colours)]
            prompts.append(data.prompt_for(kind, value, colour, background))
    images = pipe(prompt=prompts, negative_prompt=[defaults["negative_prompt"]] * len(prompts),
                  height=defaults["height"], width=defaults["width"],
                  num_inference_steps=defaults["num_inference_steps"], true_cfg_scale=defaults["true_cfg_scale"],
                  generator=[torch.Generator().manual_seed(args.seed + i) for i in range(len(prompts))]).images
    tile, label = 128, 30
    sheet = Image.new("RGB", (tile * len(columns), (tile + label) * len(data.BACKGROUNDS)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, (prompt, image) in enumerate(zip(prompts, images)):
        r, c = divmod(i, len(columns))
        x, y = c * tile, r * (tile + label)
        sheet.paste(image.resize((tile, tile), Image.NEAREST), (x, y))
        words = prompt.split()  # "a red digit 3 on a black background" -> "red 3 / black"
        what = words[3] if words[2] == "digit" else words[2]
        draw.text((x + 4, y + tile + 2), f"{words[1]} {what}", fill=(0, 0, 0))
        draw.text((x + 4, y + tile + 15), f"on {words[-2]}", fill=(90, 90, 90))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    sheet.save(args.out, optimize=True)
    print(f"wrote {args.out} ({len(prompts)} prompts, {defaults['num_inference_steps']} steps, "
          f"CFG {defaults['true_cfg_scale']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

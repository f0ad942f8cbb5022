"""Draw the demo LoRAs' X/Y/Z plot: adapter weight (X) against seed (Y), one block per LoRA (Z).

    .venv/bin/python scripts/demo_lora_plot.py [--out docs/img/demo-loras-xyz.png]

Each block is one demo LoRA of demo:qwen-image on a prompt of the grammar, drawn through the
product's own path (``Omni`` with a ``LoRARequest`` of the file in the demo root, the model's
defaults) and laid out by the UI's own X/Y/Z plot code (``ui.grid.compose_xyz``). Weight 0 is the
base model's picture; 1 is the adapter's full effect.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
SEEDS = (1, 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "demo-loras-xyz.png"))
    args = parser.parse_args(argv)

    from backend import LoRARequest, Omni
    from backend.demo.loras import LORAS
    from backend.lora import demo_adapters
    from backend.result import quiet_libraries
    from ui.grid import compose_xyz

    quiet_libraries()
    with tempfile.TemporaryDirectory() as home:
        root = demo_adapters.ensure(home) / "qwen-image"
        omni = Omni(model="demo:qwen-image", data_dir=home, device="cpu")
        blocks, z_labels = [], []
        for i, spec in enumerate(LORAS):
            req = LoRARequest(spec.name, i + 1, str(root / spec.file))
            prompt = spec.example  # a prompt of the grammar its effect shows on
            blocks.append([[omni.generate(prompt=prompt, seed=seed, lora_request=req, lora_scale=w)[0].images[0]
                            for w in WEIGHTS] for seed in SEEDS])
            z_labels.append(f"{spec.name} ({spec.layout}): {prompt}")
        image, _ = compose_xyz(blocks, [f"{w:g}" for w in WEIGHTS], [f"seed {s}" for s in SEEDS], z_labels,
                               "seed \\ adapter weight")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    image.save(args.out)
    print(f"wrote {args.out} ({image.size[0]}x{image.size[1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

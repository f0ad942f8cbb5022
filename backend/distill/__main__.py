"""``python -m backend.distill [--data-dir DIR]``: put every preset's demo files in the demo root and print
their paths (``backend.distill.demo_files`` writes one: a trained distill where the demo ships one, else a
seeded stand-in; the presets name them)."""
from __future__ import annotations

import argparse

from ..presets import load_presets
from .demo_files import write_demo_file


def write_all(data_dir=None) -> list:
    """Every demo file every preset names, for each demo model it fits."""
    return [write_demo_file(model_id, f.demo, f.component, data_dir)
            for preset in load_presets() for model_id in preset.demo_models for f in preset.files]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m backend.distill",
                                description="put every preset's demo distill files in the demo root")
    p.add_argument("--data-dir")
    args = p.parse_args(argv)
    for path in write_all(args.data_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

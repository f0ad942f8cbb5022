"""Embedded demo models: deterministic builds, loaded through from_pretrained."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backend import demo

ROOT = Path(__file__).resolve().parents[1]
BASE_IDS = ["demo:qwen-image", "demo:sd3.5", "demo:wan2.1-t2v", "demo:wan2.2-t2v", "demo:wan2.2-i2v"]


def _digest_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # rebuilds every demo model in two fresh processes to compare bytes (about 12 s)
def test_builds_are_byte_identical_across_processes(tmp_path):
    script = ("import sys, json; from backend import demo; "
              "print(json.dumps({m: str(demo.ensure(m, sys.argv[1])) for m in sys.argv[2:]}))")
    trees = []
    for name in ("a", "b"):
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / name), *BASE_IDS],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        paths = json.loads(out.stdout.strip().splitlines()[-1])
        trees.append({m: _digest_tree(Path(p)) for m, p in paths.items()})
    for model_id in BASE_IDS:
        assert trees[0][model_id] == trees[1][model_id], model_id
        assert any(f.endswith(".safetensors") for f in trees[0][model_id]), model_id


def test_ensure_is_idempotent_and_written_in_diffusers_layout(demo_path):
    path = demo_path("demo:wan2.2-t2v")
    before = _digest_tree(path)
    assert demo.ensure("demo:wan2.2-t2v", path.parents[1]) == path
    assert _digest_tree(path) == before
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["boundary_ratio"] == 0.875
    assert (path / "transformer_2" / "diffusion_pytorch_model.safetensors").is_file()


def test_unknown_demo_id_names_the_choices(data_dir):
    from backend.errors import ModelNotFound

    with pytest.raises(ModelNotFound, match="demo:qwen-image"):
        demo.ensure("demo:nope", data_dir)


@pytest.mark.parametrize("model_id", BASE_IDS)
def test_each_demo_loads_with_from_pretrained_and_generates(model_id, manager_for):
    import diffusers

    manager = manager_for(model_id)
    index = json.loads((manager.model_path / "model_index.json").read_text())
    assert type(manager.pipeline) is getattr(diffusers, index["_class_name"])
    request = {"prompt": "A cat playing with yarn", "seed": 3, "num_inference_steps": 3}
    if model_id.endswith("i2v"):
        from PIL import Image
        request["image"] = Image.new("RGB", (64, 64), (200, 120, 40))
    result = manager.generate(request)
    pixels = np.asarray((result.images or result.frames)[0])
    assert pixels.shape == (64, 64, 3)
    assert pixels.std() > 1.0  # structure, not a flat colour
    if manager.spec.is_video:
        assert len(result.frames) == 9

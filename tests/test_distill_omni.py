"""The seed's distill examples, as written, with our names: Omni and the command line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from backend import Omni
from backend.distill.demo_files import write_demo_file
from backend.errors import ContractViolation, InvalidParameter
from backend.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]


def stand_ins(preset_id: str, data_dir) -> list[str]:
    preset = get_preset(preset_id)
    return [str(write_demo_file(preset.demo_models[0], f.demo, f.component, data_dir)) for f in preset.files]


def test_omni_qwen_image_lightning_distill(data_dir):
    (lightning,) = stand_ins("qwen-image-2512-lightning-4step", data_dir)
    assert Path(lightning).name.startswith("Qwen-Image-2512-Lightning")
    omni = Omni(model="demo:qwen-image", lora_path=lightning, lora_backend="distill", data_dir=data_dir)
    outputs = omni.generate(prompt="A piece of cheesecake")
    meta = outputs[0].metadata
    assert outputs[0].images[0].size == (64, 64)
    # the Lightning file brings its preset's sampling settings with it
    assert meta["params"]["num_inference_steps"] == 4 and meta["params"]["true_cfg_scale"] == 1.0
    assert meta["distill"]["files"][0]["path"] == lightning and meta["distill"]["state"] == "fused"
    with pytest.raises(ContractViolation, match="num_inference_steps=20"):
        omni.generate(prompt="A piece of cheesecake", num_inference_steps=20)


def test_omni_wan22_list_form_high_then_low(data_dir):
    high, low = stand_ins("wan2.2-t2v-a14b-lightx2v-4step", data_dir)
    omni = Omni(model="demo:wan2.2-t2v", lora_backend="distill", lora_path=[high, low], data_dir=data_dir)
    state = omni.fused_state()
    assert [(Path(f["path"]).name, f["component"]) for f in state["files"]] == \
        [(Path(high).name, "transformer"), (Path(low).name, "transformer_2")]
    out = omni.generate(prompt="A cat playing with yarn", seed=5)[0]
    assert len(out.frames) == 9 and out.metadata["params"]["guidance_scale_2"] == 1.0
    with pytest.raises(InvalidParameter, match="wrong order"):
        Omni(model="demo:wan2.2-t2v", lora_backend="distill", lora_path=[low, high], data_dir=data_dir)


def run(*args, data_dir):
    return subprocess.run([sys.executable, "app.py", *args, "--data-dir", str(data_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_cli_wan22_i2v_distill_with_the_seed_flags(data_dir, tmp_path):
    high, low = stand_ins("wan2.2-i2v-a14b-lightx2v-4step", data_dir)
    image = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "clip.mp4"
    proc = run("generate", "--model", "demo:wan2.2-i2v", "--lora-backend", "distill", "--lora-path", high, low,
               "--prompt", "A cat playing with yarn", "--image", str(image), "--num-frames", "9",
               "--num-inference-steps", "4", "--flow-shift", "5", "--sample-solver", "euler",
               "--guidance-scale", "1.0", "--guidance-scale-high", "1.0", "--boundary-ratio", "0.875",
               "--output", str(out), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
    meta = json.loads(Path(str(out) + ".json").read_text())  # the sidecar
    assert meta["distill"]["preset"] == "wan2.2-i2v-a14b-lightx2v-4step"
    assert [f["component"] for f in meta["distill"]["files"]] == ["transformer", "transformer_2"]
    assert meta["params"]["flow_shift"] == 5.0 and meta["params"]["num_inference_steps"] == 4
    assert meta["distill"]["scheduler"]["class"] == "StepListFlowMatchScheduler"  # LightX2V's recipe
    # the files carry their preset's sampling contract: LightX2V's shift is 5, so 12 is refused by name
    shifted = run("generate", "--model", "demo:wan2.2-i2v", "--lora-backend", "distill", "--lora-path", high, low,
                  "--prompt", "x", "--image", str(image), "--flow-shift", "12", data_dir=data_dir)
    assert shifted.returncode == 2 and "flow_shift=12.0 breaks preset 'wan2.2-i2v-a14b-lightx2v-4step'" in shifted.stderr
    bad = run("generate", "--model", "demo:wan2.2-i2v", "--lora-backend", "distill", "--lora-path", low, high,
              "--prompt", "x", "--image", str(image), data_dir=data_dir)
    assert bad.returncode == 2 and "wrong order" in bad.stderr and Path(low).name in bad.stderr

"""The Omni Python API, used as vLLM-Omni users use it."""
from __future__ import annotations

import numpy as np
import pytest

from backend import LoRARequest, Omni
from backend.errors import InvalidParameter


@pytest.fixture(scope="module")
def omni(data_dir):
    return Omni(model="demo:sd3.5", data_dir=data_dir, device="cpu")


def test_generate_returns_images_and_metadata(omni):
    out = omni.generate(prompt="A piece of cheesecake", seed=42, num_inference_steps=4)
    assert len(out) == 1
    image = out[0].images[0]
    assert image.size == (64, 64)
    meta = out[0].metadata
    assert meta["model"] == "demo:sd3.5" and meta["seed"] == 42
    assert meta["params"]["num_inference_steps"] == 4 and meta["adapters"] == []
    again = omni.generate(prompt="A piece of cheesecake", seed=42, num_inference_steps=4)[0].images[0]
    assert np.array_equal(np.asarray(image), np.asarray(again))


def test_a_list_of_prompts_gives_one_output_each(omni):
    outs = omni.generate(prompt=["a red apple", "a blue car"], seed=1, num_inference_steps=2)
    assert [o.metadata["params"]["prompt"] for o in outs] == ["a red apple", "a blue car"]


def test_video_outputs_have_frames_and_fps(data_dir, tmp_path):
    omni = Omni(model="demo:wan2.1-t2v", data_dir=data_dir, device="cpu")
    out = omni.generate(prompt="A cat playing with yarn", seed=0, num_inference_steps=3)[0]
    assert len(out.frames) == 9 and out.fps == 16 and out.images == []
    assert out.save(tmp_path / "cat.mp4").stat().st_size > 0


def test_bad_arguments_are_named(omni, data_dir):
    with pytest.raises(InvalidParameter, match="lora_backend"):
        Omni(model="demo:sd3.5", lora_backend="magic", data_dir=data_dir)
    with pytest.raises(InvalidParameter, match="unknown argument 'colour'"):
        Omni(model="demo:sd3.5", colour="red", data_dir=data_dir)
    req = LoRARequest(lora_name="a", lora_int_id=1, lora_path="/x")
    with pytest.raises(InvalidParameter, match="2 lora_request"):
        omni.generate(prompt="x", lora_request=[req, req], lora_scale=[1.0])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest(lora_name="a", lora_int_id=0, lora_path="/x")

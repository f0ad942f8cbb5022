"""Model resolution: demo ids, local directories, the HF cache, and clear errors."""
from __future__ import annotations

import json
import shutil

import pytest

from backend.errors import CorruptModel, ModelNotFound, UnsupportedModel
from backend.manager import PipelineManager
from backend.models import resolve_model, spec_for


def test_demo_and_local_directory_resolve_to_the_same_pipeline(demo_path, data_dir):
    path = demo_path("demo:sd3.5")
    assert resolve_model("demo:sd3.5", data_dir).path == path
    local = resolve_model(str(path), data_dir)
    assert local.class_name == "StableDiffusion3Pipeline" and local.defaults["height"] == 64


def test_repo_id_missing_from_the_cache_says_how_to_get_it(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache.*huggingface-cli download"):
        resolve_model("Wan-AI/Wan2.1-T2V-14B-Diffusers", data_dir)


def test_a_directory_without_model_index_is_a_clear_error(tmp_path, data_dir):
    with pytest.raises(CorruptModel, match="model_index.json is missing"):
        resolve_model(str(tmp_path), data_dir)


def test_corrupt_weights_name_the_directory(demo_path, tmp_path, data_dir):
    broken = tmp_path / "broken"
    shutil.copytree(demo_path("demo:sd3.5"), broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CorruptModel, match=f"could not load {broken}"):
        PipelineManager(device="cpu", data_dir=data_dir).load(str(broken))


def test_unsupported_pipeline_lists_the_supported_ones(demo_path, tmp_path, data_dir):
    other = tmp_path / "other"
    shutil.copytree(demo_path("demo:sd3.5"), other)
    index = json.loads((other / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionXLPipeline"
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedModel, match="WanPipeline"):
        PipelineManager(device="cpu", data_dir=data_dir).load(str(other))
    with pytest.raises(UnsupportedModel, match="QwenImagePipeline"):
        spec_for("FluxPipeline")

"""Presets: the contract's five ids, validation errors naming file and key, file resolution
(adapter dirs, then the Hugging Face cache, never a download), and the listing."""
from __future__ import annotations

import fnmatch
import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backend import presets
from backend.errors import AdapterNotFound, InvalidParameter
from backend.presets import PresetError, get_preset, load_preset, load_presets

REQUIRED_IDS = {"qwen-image-2512-lightning-4step", "qwen-image-2512-lightning-8step", "wan2.1-t2v-lightx2v-4step",
                "wan2.2-t2v-a14b-lightx2v-4step", "wan2.2-i2v-a14b-lightx2v-4step"}
WAN22_T2V = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"


def test_the_required_presets_load_with_real_sources():
    loaded = {p.id: p for p in load_presets()}
    assert REQUIRED_IDS <= set(loaded)
    repos = {f.repo for p in loaded.values() for f in p.files}
    assert repos == {"lightx2v/Qwen-Image-2512-Lightning", "lightx2v/Wan2.1-Distill-Loras",
                     "lightx2v/Wan2.2-Distill-Loras"}
    for p in loaded.values():
        assert len(p.demo_models) == 1 and p.requirements["num_inference_steps"] == p.defaults["num_inference_steps"]
        for f in p.files:
            assert fnmatch.fnmatchcase(f.demo, f.pattern)
    q4 = loaded["qwen-image-2512-lightning-4step"]
    assert (q4.defaults["num_inference_steps"], q4.requirements["true_cfg_scale"]) == (4, 1.0)
    assert loaded["qwen-image-2512-lightning-8step"].defaults["num_inference_steps"] == 8
    w22 = loaded["wan2.2-i2v-a14b-lightx2v-4step"]
    assert [f.component for f in w22.files] == ["transformer", "transformer_2"]
    assert "high_noise" in w22.files[0].pattern and "low_noise" in w22.files[1].pattern
    assert w22.defaults | {} == {"num_inference_steps": 4, "guidance_scale": 1.0, "guidance_scale_2": 1.0,
                                 "boundary_ratio": 0.875, "flow_shift": 5.0, "sample_solver": "euler"}


def _variant(tmp_path: Path, old: str, new: str, name="wan2.2-t2v-a14b-lightx2v-4step") -> Path:
    text = (presets.PRESETS_DIR / f"{name}.toml").read_text()
    assert old in text
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize("old,new,message", [
    ('title = ', 'colour = "red"\ntitle = ', r"unknown key 'colour'"),
    ('component = "transformer_2"', 'component = "transformer_2"\nweight = 2', r"unknown key 'files\[1\].weight'"),
    ('title = "Wan2.2 T2V A14B, lightx2v 4-step distill (high + low noise)"\n', '', r"missing key 'title'"),
    ('repo = "lightx2v/Wan2.2-Distill-Loras"\n', '', r"missing key 'files\[0\].repo'"),
    ('[defaults]\nnum_inference_steps = 4', '[defaults]\nnum_inference_steps = 0',
     r"bad value for 'defaults.num_inference_steps'.*\[1, 1000\]"),
    ('sample_solver = "euler"', 'sample_solver = "heun"', r"bad value for 'defaults.sample_solver'"),
    ('[requirements]\nnum_inference_steps = 4', '[requirements]\nnum_inference_steps = 8',
     r"'defaults.num_inference_steps' = 4 breaks 'requirements.num_inference_steps' = 8"),
    ('[defaults]\n', '[defaults]\ntrue_cfg_scale = 1.0\n', r"unknown key 'defaults.true_cfg_scale' for WanPipeline"),
    ('component = "transformer_2"', 'component = "vae"', r"'files\[1\].component' 'vae' is not a denoiser"),
    ('models = ["Wan-AI/Wan2.2-T2V-A14B-Diffusers", "demo:wan2.2-t2v"]', 'models = 3', r"key 'models' must be list"),
    ('id = "wan2.2-t2v-a14b-lightx2v-4step"', 'id = "something-else"', r"key 'id' .* must match the file name"),
    ('pipeline = "WanPipeline"', 'pipeline = "FluxPipeline"', r"key 'pipeline' 'FluxPipeline' is not a supported"),
    ('demo = "wan2.2_t2v_A14b_high_noise', 'demo = "renamed_high_noise', r"'files\[0\].demo' .* does not match"),
    ('guidance_scale = 1.0', 'guidance_scale = "one"', r"bad value for 'defaults.guidance_scale'"),
    # [scheduler]: a class a preset can set, fields that class takes, a config it accepts, and a
    # contract that agrees with it (flow_shift / sample_solver / the step list's length)
    ('class = "StepListFlowMatchScheduler"', 'class = "DDIMScheduler"', r"'scheduler.class' 'DDIMScheduler' is not"),
    ('shift = 5.0\nnum_train', 'shift = 5.0\nflow_shift = 5.0\nnum_train', r"unknown key 'scheduler.flow_shift'"),
    ('class = "StepListFlowMatchScheduler"\n', '', r"missing key 'scheduler.class'"),
    ('shift = 5.0\nnum_train', 'shift = 3.0\nnum_train',
     r"'requirements.flow_shift' = 5.0 contradicts the \[scheduler\] table, which means flow_shift=3.0"),
    ('denoising_step_list = [1000, 750, 500, 250]', 'denoising_step_list = [1000, 500]',
     r"has 2 timesteps, so 'requirements.num_inference_steps' must be 2"),
])
def test_a_malformed_preset_names_the_file_and_the_key(tmp_path, old, new, message):
    path = _variant(tmp_path, old, new)
    with pytest.raises(PresetError, match=message) as err:
        load_preset(path)
    assert err.value.message.startswith(f"{path.name}: ")


def test_swapped_components_and_broken_toml_are_rejected(tmp_path):
    path = _variant(tmp_path, 'component = "transformer"\n', 'component = "transformer_2"\n')
    with pytest.raises(PresetError, match="one file per component in the order transformer, transformer_2"):
        load_preset(path)
    path.write_text("id = [unclosed\n")
    with pytest.raises(PresetError, match=rf"{path.name}: not valid TOML"):
        load_preset(path)
    with pytest.raises(InvalidParameter, match="unknown preset 'nope'; available: .*wan2.1-t2v-lightx2v-4step"):
        get_preset("nope")


def _plain_lora(path: Path) -> Path:
    """A file a user downloaded (not a generated stand-in): no demo marker in its header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 4)}, str(path))
    return path


def _hf_cache(root: Path, repo: str, files: list[str]) -> Path:
    """A Hugging Face hub cache laid out as huggingface_hub writes it (blobs + snapshot links)."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for name in files:
        tmp = _plain_lora(root / "tmp" / name)
        blob = repo_dir / "blobs" / hashlib.sha256(tmp.read_bytes() + name.encode()).hexdigest()
        shutil.move(tmp, blob)
        (snap / name).symlink_to(Path("../../blobs") / blob.name)
    shutil.rmtree(root / "tmp")
    return root


HIGH = "wan2.2_t2v_A14b_high_noise_lora_rank64_lightx2v_4step_1217.safetensors"
LOW = "wan2.2_t2v_A14b_low_noise_lora_rank64_lightx2v_4step_1217.safetensors"


def test_files_resolve_from_adapter_dirs_then_the_hf_cache(tmp_path):
    preset = get_preset("wan2.2-t2v-a14b-lightx2v-4step")
    data = tmp_path / "home"
    lib = tmp_path / "lib"
    high = _plain_lora(lib / "wan" / HIGH)
    cache = _hf_cache(tmp_path / "hub", "lightx2v/Wan2.2-Distill-Loras", [HIGH, LOW])
    # a generated stand-in named like the real file must never stand in for the real model
    from backend.distill.demo_files import SUBDIR

    _plain_lora(data / "adapters" / SUBDIR / LOW)
    save_file({"x": torch.zeros(1)}, str(data / "adapters" / SUBDIR / LOW), metadata={"lora_studio_demo": "{}"})

    paths = presets.resolve_files(preset, WAN22_T2V, data, [lib], hf_cache_dir=cache)
    assert paths[0] == high  # adapter dir first
    assert paths[1].name == LOW and "models--lightx2v--Wan2.2-Distill-Loras" in str(paths[1])  # then the cache
    # an exact file name goes through try_to_load_from_cache
    exact = presets._in_hf_cache("lightx2v/Wan2.2-Distill-Loras", LOW, cache)
    assert exact is not None and exact.resolve() == paths[1].resolve()
    assert presets._in_hf_cache("lightx2v/Wan2.2-Distill-Loras", "absent.safetensors", cache) is None
    rows = {r["id"]: r for r in presets.list_presets(data, [lib], hf_cache_dir=cache)}
    row = rows["wan2.2-t2v-a14b-lightx2v-4step"]
    assert row["ready"] and [f["where"] for f in row["files"]] == ["adapter-dir", "hf-cache"]
    assert not rows["wan2.1-t2v-lightx2v-4step"]["ready"]


def test_a_missing_file_names_the_repo_and_filename(tmp_path):
    preset = get_preset("wan2.2-t2v-a14b-lightx2v-4step")
    cache = _hf_cache(tmp_path / "hub", "lightx2v/Wan2.2-Distill-Loras", [HIGH])
    with pytest.raises(AdapterNotFound) as err:
        presets.resolve_files(preset, WAN22_T2V, tmp_path / "home", [], hf_cache_dir=cache)
    msg = err.value.message
    assert "lightx2v/Wan2.2-Distill-Loras" in msg and "wan2.2_t2v_A14b_low_noise_lora_rank*_lightx2v_4step*" in msg
    assert "transformer_2" in msg and "huggingface-cli download" in msg
    text = presets.format_rows(presets.list_presets(tmp_path / "home", [], hf_cache_dir=cache))
    assert "MISSING: huggingface-cli download lightx2v/Wan2.2-Distill-Loras" in text


def test_demo_models_get_generated_stand_ins(tmp_path, data_dir):
    preset = get_preset("wan2.2-i2v-a14b-lightx2v-4step")
    paths = presets.resolve_files(preset, "demo:wan2.2-i2v", data_dir, [])
    assert [p.name for p in paths] == [f.demo for f in preset.files]
    assert presets.match_files("WanImageToVideoPipeline", paths).id == preset.id
    assert presets.match_files("WanPipeline", paths) is None
    assert presets.match_files("WanImageToVideoPipeline", paths[::-1]) is None


def test_a_preset_refuses_a_model_it_does_not_fit():
    preset = get_preset("qwen-image-2512-lightning-4step")
    with pytest.raises(InvalidParameter, match="fits Qwen/Qwen-Image-2512, demo:qwen-image; not Qwen/Qwen-Image$"):
        preset.fits("Qwen/Qwen-Image", "QwenImagePipeline")
    with pytest.raises(InvalidParameter, match="is for QwenImagePipeline"):
        preset.fits("demo:wan2.1-t2v", "WanPipeline")

"""Distill backend: fuse into each supported pipeline, route Wan2.2 pairs, restore bit-exactly.

Real diffusers pipelines (the tiny demo ones) and the demo stand-in files, which are
written in lightx2v's / Qwen-Image-Lightning's own key layouts.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backend.distill.demo_files import write_demo_file
from backend.errors import AdapterError, ContractViolation, InvalidParameter, StudioError
from backend.manager import PipelineManager
from backend.presets import get_preset
from backend.weights import module_checksum

torch.set_num_threads(1)

PRESET_FOR = {"demo:qwen-image": "qwen-image-2512-lightning-4step",
              "demo:wan2.1-t2v": "wan2.1-t2v-lightx2v-4step",
              "demo:wan2.2-t2v": "wan2.2-t2v-a14b-lightx2v-4step",
              "demo:wan2.2-i2v": "wan2.2-i2v-a14b-lightx2v-4step"}
# Requests that satisfy each preset's requirements, so base and fused runs compare like for like.
REQUEST = {"demo:qwen-image": {"num_inference_steps": 4, "true_cfg_scale": 1.0},
           "demo:wan2.1-t2v": {"num_inference_steps": 4, "guidance_scale": 1.0},
           "demo:wan2.2-t2v": {"num_inference_steps": 4, "guidance_scale": 1.0, "guidance_scale_2": 1.0},
           "demo:wan2.2-i2v": {"num_inference_steps": 4, "guidance_scale": 1.0, "guidance_scale_2": 1.0}}


@pytest.fixture(scope="module")
def managers(data_dir):
    """Managers owned by this module (it writes into their weights), loaded once each."""
    cache = {}

    def get(model_id: str, dtype: str = "float32") -> PipelineManager:
        key = (model_id, dtype)
        if key not in cache:
            m = PipelineManager(device="cpu", dtype=dtype, data_dir=data_dir)
            m.load(model_id)
            cache[key] = m
        m = cache[key]
        m.restore_base()  # every test starts from base
        return m

    return get


def files_for(model_id: str, data_dir) -> list:
    preset = get_preset(PRESET_FOR[model_id])
    return [write_demo_file(model_id, f.demo, f.component, data_dir) for f in preset.files]


def request_for(model_id: str, image) -> dict:
    req = {"prompt": "a red fox in snow", "seed": 3, **REQUEST[model_id]}
    if model_id == "demo:wan2.2-i2v":
        req["image"] = image
    return req


@pytest.fixture(scope="module")
def image():
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))


def pixels(result) -> np.ndarray:
    return np.stack([np.asarray(x) for x in (result.images or result.frames)]).astype(np.int16)


def checksums(m) -> dict:
    return {n: module_checksum(mod) for n, mod in m.denoisers().items()}


def has_lora_layers(m) -> bool:
    return any("lora_" in n for mod in m.denoisers().values() for n, _ in mod.named_parameters())


@pytest.mark.parametrize("model_id", list(PRESET_FOR))
def test_fuse_changes_output_and_restore_gives_base_back(model_id, managers, data_dir, image):
    m = managers(model_id)
    encoder, vae = m.pipeline.text_encoder, m.pipeline.vae
    base_sums = checksums(m)
    base = pixels(m.generate(request_for(model_id, image)))

    state = m.fuse(files_for(model_id, data_dir))
    assert state["state"] == "fused" and not has_lora_layers(m)  # fused in, no per-step LoRA cost
    assert state["base_checksums"] == base_sums
    assert all(state["checksums"][c] != base_sums[c] for c in base_sums)
    assert state["preset"] == PRESET_FOR[model_id]  # named like the preset's files: its contract applies
    fused = pixels(m.generate(request_for(model_id, image)))
    assert np.abs(fused - base).mean() > 1.0

    m.restore_base()
    assert m.fused_state()["state"] == "base"
    assert checksums(m) == base_sums
    assert np.array_equal(pixels(m.generate(request_for(model_id, image))), base)
    assert m.pipeline.text_encoder is encoder and m.pipeline.vae is vae  # nothing reloaded


def _raw(m, model_id: str, image) -> np.ndarray:
    """The pipeline's float output (no 8-bit rounding) for the test request."""
    req = request_for(model_id, image)
    kwargs = {k: v for k, v in m.validate(req).items() if k not in ("seed", "fps", "flow_shift", "sample_solver",
                                                                    "boundary_ratio")}
    gen = torch.Generator().manual_seed(req["seed"])
    with torch.inference_mode():
        out = m.pipeline(**kwargs, generator=gen, output_type="np")
    return np.asarray(out.images if hasattr(out, "images") else out.frames)


@pytest.mark.parametrize("model_id", ["demo:qwen-image", "demo:wan2.2-t2v"])
def test_fused_output_equals_unfused_adapter_output(model_id, managers, data_dir, image, tmp_path):
    m = managers(model_id)
    # LoRA pairs only: diffusers' PEFT path has no way to apply diff / norm diff / diff_m unfused
    # (test_distill_recipes checks those against the files' own tensors)
    preset = get_preset(PRESET_FOR[model_id])
    paths = [write_demo_file(model_id, f.demo, f.component, data_dir, target_dir=tmp_path, lora_only=True)
             for f in preset.files]
    m.fuse(paths)
    fused = _raw(m, model_id, image)
    recipe = m.pipeline.scheduler  # files named like a preset's bring its scheduler
    m.restore_base()
    pipe = m.pipeline
    base_scheduler, pipe.scheduler = pipe.scheduler, recipe  # like for like: the same sampler
    try:
        base = _raw(m, model_id, image)
        for i, path in enumerate(paths):  # the same files as ordinary, unfused PEFT adapters
            extra = {"load_into_transformer_2": True} if i == 1 else {}
            pipe.load_lora_weights(str(path), adapter_name=f"a{i}", low_cpu_mem_usage=False, **extra)
        try:
            unfused = _raw(m, model_id, image)
        finally:
            pipe.unload_lora_weights()
    finally:
        pipe.scheduler = base_scheduler
    assert np.abs(fused - base).max() > 1e-2
    np.testing.assert_allclose(fused, unfused, atol=1e-4)


def _delta(path, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W and b change the lightx2v file asks for at ``module`` (alpha/rank scaling)."""
    sd = {k: v.float() for k, v in load_file(str(path)).items()}
    key = f"diffusion_model.{module}"
    down, up = sd[f"{key}.lora_down.weight"], sd[f"{key}.lora_up.weight"]
    scale = sd[f"{key}.alpha"].item() / down.shape[0]
    return up @ down * scale, sd.get(f"{key}.diff_b")


def test_wan22_high_goes_only_into_transformer_low_only_into_transformer_2(managers, data_dir):
    m = managers("demo:wan2.2-t2v")
    high, low = files_for("demo:wan2.2-t2v", data_dir)
    t1, t2 = m.pipeline.transformer, m.pipeline.transformer_2
    before = {name: {k: v.detach().clone() for k, v in t.state_dict().items()} for name, t in
              (("transformer", t1), ("transformer_2", t2))}
    m.fuse([high, low])
    for name, t, path, other in (("transformer", t1, high, low), ("transformer_2", t2, low, high)):
        after = t.state_dict()
        dw = after["blocks.0.attn1.to_q.weight"] - before[name]["blocks.0.attn1.to_q.weight"]
        want, _ = _delta(path, "blocks.0.self_attn.q")
        wrong, _ = _delta(other, "blocks.0.self_attn.q")
        torch.testing.assert_close(dw, want, atol=1e-5, rtol=1e-4)
        assert (dw - wrong).abs().max() > 1e-2
        # partial diff_b: block 0's self_attn.o carries one, block 1's does not
        db = after["blocks.0.attn1.to_out.0.bias"] - before[name]["blocks.0.attn1.to_out.0.bias"]
        _, diff_b = _delta(path, "blocks.0.self_attn.o")
        torch.testing.assert_close(db, diff_b, atol=1e-6, rtol=1e-5)
        assert torch.equal(after["blocks.1.attn1.to_out.0.bias"], before[name]["blocks.1.attn1.to_out.0.bias"])
        # modules the file does not name are untouched, bit for bit
        assert torch.equal(after["patch_embedding.weight"], before[name]["patch_embedding.weight"])


def test_demo_files_use_the_publishers_key_layouts(data_dir, tmp_path):
    wan = write_demo_file("demo:wan2.2-t2v", "wan2.2_t2v_A14b_high_noise_lora_rank64_lightx2v_4step_1217.safetensors",
                          data_dir=data_dir)
    with safe_open(str(wan), "pt") as f:
        keys = set(f.keys())
    assert all(k.startswith("diffusion_model.blocks.") or k.startswith("diffusion_model.head.head.") for k in keys)
    assert {"diffusion_model.blocks.0.diff_m", "diffusion_model.blocks.0.self_attn.norm_q.diff",
            "diffusion_model.head.head.diff", "diffusion_model.head.head.diff_b"} <= keys
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in keys
    assert "diffusion_model.blocks.0.cross_attn.o.lora_up.weight" in keys
    assert "diffusion_model.blocks.1.ffn.2.alpha" in keys
    diff_b = {k for k in keys if k.endswith(".diff_b")}
    assert diff_b and len(diff_b) < len([k for k in keys if k.endswith(".alpha")])  # on some modules only
    qwen = write_demo_file("demo:qwen-image", "Qwen-Image-2512-Lightning-4steps-V1.0-bf16.safetensors",
                           data_dir=data_dir)
    with safe_open(str(qwen), "pt") as f:
        qkeys = set(f.keys())
    assert "transformer_blocks.0.attn.add_k_proj.lora_down.weight" in qkeys
    assert "transformer_blocks.1.img_mlp.net.2.alpha" in qkeys
    # seeded by name: the same bytes again, anywhere
    again = write_demo_file("demo:qwen-image", qwen.name, data_dir=data_dir, target_dir=tmp_path)
    assert again.read_bytes() == qwen.read_bytes()


def test_wrong_count_and_order_are_refused_naming_the_files(managers, data_dir):
    m = managers("demo:wan2.2-t2v")
    high, low = files_for("demo:wan2.2-t2v", data_dir)
    base = checksums(m)
    with pytest.raises(InvalidParameter, match=r"wrong order.*low_noise.*") as err:
        m.fuse([low, high])
    assert low.name in err.value.message and err.value.param == "lora_path"
    with pytest.raises(InvalidParameter, match=rf"takes 2 distill file.*got 1: {high.name}"):
        m.fuse([high])
    with pytest.raises(InvalidParameter, match="wrong order"):
        m.fuse([high, high])
    w21 = managers("demo:wan2.1-t2v")
    with pytest.raises(InvalidParameter, match=rf"{high.name} is a Wan2.2 high-noise file.*one transformer"):
        w21.fuse([high])
    qwen = managers("demo:qwen-image")
    qfile = files_for("demo:qwen-image", data_dir)[0]
    with pytest.raises(InvalidParameter, match="takes 1 distill file"):
        qwen.fuse([qfile, qfile])
    assert checksums(m) == base and m.fused_state()["state"] == "base"


def test_unsupported_pipeline_is_refused_with_the_supported_list(data_dir):
    m = PipelineManager(device="cpu", data_dir=data_dir)
    m.load("demo:sd3.5")
    with pytest.raises(StudioError, match="QwenImagePipeline, WanImageToVideoPipeline, WanPipeline"):
        m.fuse([files_for("demo:qwen-image", data_dir)[0]])


def test_a_file_for_another_model_is_refused_by_key(managers, data_dir):
    m = managers("demo:wan2.1-t2v")
    qfile = files_for("demo:qwen-image", data_dir)[0]
    with pytest.raises(AdapterError, match=rf"{qfile.name}: key .*transformer_blocks.0.* names no layer"):
        m.fuse([qfile])
    assert m.fused_state()["state"] == "base"


def _broken_low_file(src, tmp_path, how: str):
    out = tmp_path / src.name  # same (valid) name: the failure is in the content
    if how == "truncated":
        out.write_bytes(src.read_bytes()[:200])
        return out
    sd = load_file(str(src))
    key = "diffusion_model.blocks.1.self_attn.q.lora_down.weight"
    sd[key] = torch.zeros(sd[key].shape[0], sd[key].shape[1] + 1, dtype=sd[key].dtype)  # wrong in_features
    save_file(sd, str(out))
    return out


@pytest.mark.parametrize("how", ["shape-mismatch", "truncated"])
def test_a_file_failing_halfway_leaves_the_model_at_base(how, managers, data_dir, tmp_path):
    m = managers("demo:wan2.2-t2v")
    high, low = files_for("demo:wan2.2-t2v", data_dir)
    base = checksums(m)
    bad = _broken_low_file(low, tmp_path, how)
    with pytest.raises(AdapterError, match=bad.name):
        m.fuse([high, bad])  # high was already fused into transformer when low fails
    assert checksums(m) == base
    assert m.fused_state()["state"] == "base" and not has_lora_layers(m)
    assert m.fuse([high, low])["state"] == "fused"  # and the model still works


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restore_is_bit_exact_across_switches(dtype, managers, data_dir):
    m = managers("demo:qwen-image", dtype)
    four = files_for("demo:qwen-image", data_dir)[0]
    eight_preset = get_preset("qwen-image-2512-lightning-8step")
    eight = write_demo_file("demo:qwen-image", eight_preset.files[0].demo, data_dir=data_dir)
    base = checksums(m)
    only_eight = m.fuse([eight])["checksums"]
    for _ in range(5):  # preset switches go through base, never through W -= BA*s
        m.fuse([four])
        assert m.fuse([eight])["checksums"] == only_eight
        assert m.fused_state()["preset"] == "qwen-image-2512-lightning-8step"
    m.restore_base()
    assert checksums(m) == base


def test_peft_layers_on_a_fused_base_come_off_to_the_fused_state(managers, data_dir):
    """diffusers' own (unmerged) PEFT layers on top of a fused base."""
    m = managers("demo:wan2.1-t2v")
    distill = files_for("demo:wan2.1-t2v", data_dir)[0]
    base = checksums(m)
    fused_sums = m.fuse([distill])["checksums"]
    req = request_for("demo:wan2.1-t2v", None)
    fused = pixels(m.generate(req))
    # a per-request adapter (PEFT, unfused) on top of the fused base: another lightx2v-layout file
    style = write_demo_file("demo:wan2.1-t2v", "style_lora_rank64.safetensors", data_dir=data_dir,
                            lora_only=True)
    m.pipeline.load_lora_weights(str(style), adapter_name="style", low_cpu_mem_usage=False)
    try:
        assert np.abs(pixels(m.generate(req)) - fused).mean() > 1.0
        with pytest.raises(StudioError, match="per-request LoRA layers are loaded on transformer"):
            m.fuse([distill])  # refuses rather than mixing them into the fused base
        with pytest.raises(StudioError, match="cannot restore the base: per-request LoRA layers"):
            m.restore_base()
        assert m.fused_state()["state"] == "fused"
    finally:
        m.pipeline.delete_adapters("style")
        m.pipeline.unload_lora_weights()
    assert checksums(m) == fused_sums  # the "base" a per-request adapter comes back to is the fused one
    assert np.array_equal(pixels(m.generate(req)), fused)
    m.restore_base()
    assert checksums(m) == base


def test_preset_requirements_are_enforced_by_name(managers, data_dir):
    m = managers("demo:qwen-image")
    defaults = m.apply_preset("qwen-image-2512-lightning-4step")
    assert defaults == {"num_inference_steps": 4, "true_cfg_scale": 1.0}
    result = m.generate({"prompt": "a cake", "seed": 1})
    assert result.metadata["params"]["num_inference_steps"] == 4
    assert result.metadata["distill"]["preset"] == "qwen-image-2512-lightning-4step"
    with pytest.raises(ContractViolation, match=r"num_inference_steps=20 breaks preset") as err:
        m.generate({"prompt": "a cake", "num_inference_steps": 20})
    assert err.value.param == "num_inference_steps" and err.value.http_status == 422
    with pytest.raises(ContractViolation, match=r"true_cfg_scale=4.0 breaks preset") as err:
        m.generate({"prompt": "a cake", "true_cfg_scale": 4.0})
    assert err.value.param == "true_cfg_scale"
    m.restore_base()  # back at base, the contract is gone with the LoRA
    assert m.generate({"prompt": "a cake", "num_inference_steps": 2}).metadata["params"]["num_inference_steps"] == 2


def test_wan22_preset_applies_routing_defaults(managers):
    m = managers("demo:wan2.2-t2v")
    defaults = m.apply_preset("wan2.2-t2v-a14b-lightx2v-4step")
    assert defaults["boundary_ratio"] == 0.875 and defaults["sample_solver"] == "euler"
    params = m.validate({"prompt": "a cat"})
    assert (params["guidance_scale"], params["guidance_scale_2"], params["num_inference_steps"]) == (1.0, 1.0, 4)
    with pytest.raises(ContractViolation, match="guidance_scale_2"):
        m.validate({"prompt": "a cat", "guidance_scale_2": 3.0})
    with pytest.raises(InvalidParameter, match="preset 'wan2.2-t2v-a14b-lightx2v-4step' is for WanPipeline"):
        managers("demo:qwen-image").apply_preset("wan2.2-t2v-a14b-lightx2v-4step")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_base_kept_in_the_checkpoint_restores_bit_exactly(dtype, managers, data_dir):
    """keep="checkpoint" (what auto picks for multi-GB denoisers) re-reads the base from disk."""
    from backend.distill import FusedBase

    m = managers("demo:wan2.2-t2v", dtype)
    high, low = files_for("demo:wan2.2-t2v", data_dir)
    base = checksums(m)
    # a layer changed in memory after loading no longer matches its checkpoint: it must be
    # kept as a CPU copy instead, and still come back exactly
    q = m.pipeline.transformer.blocks[1].attn1.to_q.weight
    original = q.detach().clone()
    with torch.no_grad():
        q.add_(0.5)
    changed = checksums(m)
    fb = FusedBase(m.pipeline, m.spec.class_name, m.denoisers(), m.model_path, keep="checkpoint")
    state = fb.fuse([high, low])
    assert 0 < state.snapshot_bytes <= q.numel() * q.element_size() + q.shape[0] * q.element_size()
    assert all(state.fused_checksums[c] != changed[c] for c in changed)
    fb.restore()
    assert checksums(m) == changed
    with torch.no_grad():
        q.copy_(original)
    assert checksums(m) == base


def test_per_request_engine_adapter_on_a_fused_base_restores_to_the_fused_checksum(managers, data_dir):
    """The PEFT backend's engine (exact merge per request) sees the fused weights as its base."""
    from backend.lora import attach
    from backend.lora.request import LoRARequest

    m = managers("demo:wan2.1-t2v")
    distill = files_for("demo:wan2.1-t2v", data_dir)[0]
    style = LoRARequest("style", 7, str(write_demo_file("demo:wan2.1-t2v", "style_lora_rank64.safetensors",
                                                       data_dir=data_dir, lora_only=True)))
    req = request_for("demo:wan2.1-t2v", None)
    attach(m)
    try:
        base = checksums(m)
        base_px = pixels(m.generate(req))
        fused_sums = m.fuse([distill])["checksums"]
        fused = pixels(m.generate(req))
        styled = m.generate(req, adapters=[(style, 1.0)])
        assert styled.metadata["adapters"][0]["name"] == "style"
        assert np.abs(pixels(styled) - fused).mean() > 1.0
        assert np.array_equal(pixels(m.generate(req)), fused)  # no adapter: back to the fused state
        assert checksums(m) == fused_sums
        m.generate(req, adapters=[(style, 1.0)])  # adapter merged in when the base is restored
        m.restore_base()
        assert checksums(m) == base and m.fused_state()["state"] == "base"
        m.generate(req, adapters=[(style, 1.0)])
        assert np.array_equal(pixels(m.generate(req)), base_px) and checksums(m) == base
    finally:
        m.lora_engine = None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restore_is_checked_by_device_digests_and_catches_a_corrupted_layer(dtype, managers, data_dir, monkeypatch):
    """The default restore check reads digests of the touched tensors (no sha256 pass over every weight),
    and a restored layer that is not its base any more is caught by it (issue 15 item 5)."""
    from backend.distill import FusedBase
    from backend.distill import lifecycle
    from backend.errors import CorruptModel

    m = managers("demo:qwen-image", dtype)
    base = checksums(m)
    fb = FusedBase(m.pipeline, m.spec.class_name, m.denoisers(), m.model_path, keep="memory")
    fb.fuse(files_for("demo:qwen-image", data_dir))
    full_passes = []
    real = lifecycle.module_checksum
    monkeypatch.setattr(lifecycle, "module_checksum", lambda mod: full_passes.append(1) or real(mod))
    fb.restore()
    assert full_passes == [] and checksums(m) == base
    fb.fuse(files_for("demo:qwen-image", data_dir))
    key = sorted(fb._snapshots)[len(fb._snapshots) // 2]
    saved = fb._snapshots[key].saved["weight"]
    good = saved.clone()
    saved.view(-1)[7] = saved.view(-1)[7] + 1  # the restore source of one layer went bad
    n = len(full_passes)
    with pytest.raises(CorruptModel, match=rf"{key[0]}\.{key[1]}\.weight different from its digest"):
        fb.restore()
    assert len(full_passes) == n  # caught by the cheap check
    saved.copy_(good)
    fb.restore(full_check=True)
    assert checksums(m) == base


def test_a_stand_in_follows_its_model_when_the_model_is_rebuilt(tmp_path):
    """A stand-in is shaped after its model's modules, so it is keyed on the model's build too: a data dir that
    kept a stand-in from an earlier build of the model (demo:wan2.2-t2v had seeded random weights, 2 blocks of
    width 24; now trained ones, 4 of 128) gets it written again, not served stale (it failed to fuse)."""
    import json

    from safetensors.torch import save_file

    from backend import demo

    name = "wan2.2_t2v_A14b_high_noise_lora_rank64_lightx2v_4step_1217.safetensors"
    path = write_demo_file("demo:wan2.2-t2v", name, data_dir=tmp_path)
    key = "diffusion_model.blocks.0.self_attn.q.lora_down.weight"
    with safe_open(str(path), "pt") as f:
        marker, wanted = json.loads(f.metadata()["lora_studio_demo"]), f.get_tensor(key).shape
    assert marker["model_build"] == (demo.ensure("demo:wan2.2-t2v", tmp_path) / ".demo-build").read_text()
    # the file an earlier build left: the old model's shapes, its marker naming no model build
    old = {k: v for k, v in marker.items() if k != "model_build"}
    save_file({key: torch.zeros(64, 24)}, str(path), metadata={"lora_studio_demo": json.dumps(old, sort_keys=True)})
    again = write_demo_file("demo:wan2.2-t2v", name, data_dir=tmp_path)
    with safe_open(str(again), "pt") as f:
        assert f.get_tensor(key).shape == wanted and json.loads(f.metadata()["lora_studio_demo"]) == marker

"""MiniMax-H3 on the tiny demo: workflows, pinned schedules, Turbo and native adapters, outputs with audio."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from backend.errors import AdapterError, ContractViolation
from backend.minimax import contracts as C
from backend.minimax.adapters import read_adapter
from backend.minimax.runtime import MiniMaxRuntime

torch.set_num_threads(1)

HEADS, HEAD_DIM, HIDDEN = 2, 16, 32  # backend/demo/minimax.py TRANSFORMER_CONFIG
PROMPT = "a red fox runs through snow"


@pytest.fixture(scope="module")
def repo(demo_path):
    return demo_path("demo:minimax-h3")


@pytest.fixture(scope="module")
def rt(repo):
    return MiniMaxRuntime(repo, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def pinned_rt(tmp_path_factory):
    from backend.demo.minimax import build_pinned

    return MiniMaxRuntime(build_pinned(tmp_path_factory.mktemp("mm") / "pinned"), device="cpu", dtype=torch.float32)


def gen(runtime, adapters=(), **params):
    params = {"prompt": PROMPT, "seed": 3, **params}
    steps = []
    out = runtime.generate(params, adapters=adapters, on_step=lambda i, n: steps.append((i, n)), default_steps=3)
    out.steps = steps
    return out


def pixels(out) -> np.ndarray:
    return np.stack([np.asarray(f, dtype=np.float32) for f in out.frames])


def lora_pair(seed, rows, rank=4, cols=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, cols, generator=g), torch.randn(rows, rank, generator=g)


def diffusers_lora(seed=0, rank=4) -> dict:
    """A LoRA on every block's attention in diffusers layout (split to_q/to_k/to_v)."""
    sd = {}
    for i in range(2):
        for j, proj in enumerate(("to_q", "to_k", "to_v", "to_out.0")):
            a, b = lora_pair(seed * 100 + i * 10 + j, HEADS * HEAD_DIM, rank)
            sd[f"transformer.transformer_blocks.{i}.attn.{proj}.lora_A.weight"] = a
            sd[f"transformer.transformer_blocks.{i}.attn.{proj}.lora_B.weight"] = b * 2.0
    return sd


# -- workflows -------------------------------------------------------------------------------------------


def test_workflows_generate_video_with_audio(rt):
    t2va = gen(rt, task_type="t2va")
    assert rt.pipe.transformer is not None
    assert len(t2va.frames) == 124 and t2va.frames[0].size == (64, 32) and t2va.fps == 24
    samples, rate = t2va.audio
    assert rate == 8000 and samples.shape[1] == 2 and abs(samples.shape[0] - 124 / 24 * rate) < 400
    assert np.isfinite(samples).all() and samples.std() > 0
    assert t2va.steps == [(1, 3), (2, 3), (3, 3)]

    first = Image.new("RGB", (64, 32), (230, 20, 20))
    fl2va = gen(rt, task_type="fl2va", image=first)
    assert len(fl2va.frames) == 124 and np.abs(pixels(fl2va) - pixels(t2va)).mean() > 0.5  # the keyframe counts

    ref2va = gen(rt, task_type="ref2va", references=[Image.new("RGB", (48, 48), (20, 200, 20))])
    assert rt.pipe.transformer_ref is not None  # loaded on demand, its own partition
    assert len(ref2va.frames) == 124 and ref2va.audio[0].shape[1] == 2
    # Same seed and prompt, deterministic.
    assert np.array_equal(pixels(gen(rt, task_type="t2va")), pixels(t2va))


def test_task_inputs_are_checked(rt):
    from backend.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="fl2va.*image"):
        gen(rt, task_type="fl2va")
    with pytest.raises(InvalidParameter, match="ref2va.*references"):
        gen(rt, task_type="ref2va")


# -- checkpoint-pinned schedule --------------------------------------------------------------------------


def test_pinned_schedule_samples_on_declared_sigmas(pinned_rt):
    out = gen(pinned_rt)  # steps omitted: the schedule's interval count
    declared = list(C.checkpoint_contract(pinned_rt.path).sigmas)
    assert declared == [1.0, 0.7, 0.4, 0.15, 0.0]
    for scheduler in (pinned_rt.pipe.scheduler, pinned_rt.pipe.audio_scheduler):
        assert scheduler.sigmas.tolist() == pytest.approx(declared, abs=1e-7)
    assert out.steps[-1] == (4, 4) and out.metadata["sigmas"] == declared
    gen(pinned_rt, num_inference_steps=4)
    with pytest.raises(ContractViolation) as err:
        gen(pinned_rt, num_inference_steps=8)
    assert "num_inference_steps=4" in err.value.message and "got 8" in err.value.message


# -- Turbo -----------------------------------------------------------------------------------------------


def test_turbo_contract_enforced_and_adapter_changes_then_restores_output(rt, tmp_path):
    base = gen(rt, num_inference_steps=4, flow_shift=6.0)  # the Turbo schedule, without the adapter
    path = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors"
    save_file(diffusers_lora(), str(path))
    turbo = gen(rt, adapters=[("turbo", str(path), 1.0)])  # steps taken from the contract
    # 768p: flow_shift 6 on N+1 = 5 points; audio shift 3
    from diffusers import MiniMaxH3Scheduler

    for scheduler, shift in ((rt.pipe.scheduler, 6.0), (rt.pipe.audio_scheduler, 3.0)):
        expected = MiniMaxH3Scheduler(shift=shift)
        expected.set_timesteps(5)
        assert scheduler.sigmas.tolist() == pytest.approx(expected.sigmas.tolist())
    assert turbo.steps[-1] == (4, 4) and turbo.metadata["contract"]["flow_shift"] == 6.0
    # The tiny VAE decoder damps latent changes; any change at all is the adapter's (same schedule, seed).
    assert np.abs(pixels(turbo) - pixels(base)).mean() > 0.01
    assert np.abs(turbo.audio[0] - base.audio[0]).max() > 0
    for bad, field in (({"num_inference_steps": 8}, "num_inference_steps"), ({"flow_shift": 12.0}, "flow_shift"),
                       ({"task_type": "ref2va", "references": [Image.new("RGB", (32, 32))]}, "task_type")):
        with pytest.raises(ContractViolation) as err:
            gen(rt, adapters=[("turbo", str(path), 1.0)], **bad)
        assert err.value.param == field and path.name in err.value.message
    # No adapter: the base model again, bit for bit.
    assert np.array_equal(pixels(gen(rt, num_inference_steps=4, flow_shift=6.0)), pixels(base))


def test_turbo_alpha_from_metadata_vs_default_8_scales_the_delta(rt, tmp_path):
    sd = diffusers_lora(rank=4)
    default = tmp_path / "a" / "minimax_h3_fl2v_turbo_4step_v1.0.safetensors"
    declared = tmp_path / "b" / "minimax_h3_fl2v_turbo_4step_v1.0.safetensors"
    default.parent.mkdir(), declared.parent.mkdir()
    save_file(sd, str(default))
    save_file(sd, str(declared), metadata={"alpha": "2"})
    a8, a2 = (read_adapter(p, num_heads=HEADS, head_dim=HEAD_DIM) for p in (default, declared))
    assert (a8.contract.alpha, a2.contract.alpha) == (8.0, 2.0)
    # Bound and run: the LoRA delta of one projection scales with alpha / rank (8/4 = 2 vs 2/4 = 0.5).
    layer = rt.pipe.transformer.transformer_blocks[0].attn.to_q
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    deltas = []
    for name, p in (("alpha8", default), ("alpha2", declared)):
        rt.load_adapter(name, p)
        rt._activate([(rt.adapters[name], name, 1.0)], "transformer")
        with torch.no_grad():
            on = layer(x)
        rt._disable_all()
        with torch.no_grad():
            deltas.append(on - layer(x))
    a, b = sd["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"], \
        sd["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"]
    torch.testing.assert_close(deltas[0], x @ (b @ a).T * (8.0 / 4), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(deltas[1], deltas[0] * (2.0 / 8.0), rtol=1e-4, atol=1e-4)


# -- native (FlashGen) -----------------------------------------------------------------------------------


def grouped(stacked: torch.Tensor) -> torch.Tensor:
    """[q; k; v] rows -> [h0: q k v, h1: q k v] (what a native file stores)."""
    q, k, v = (t.reshape(HEADS, HEAD_DIM, -1) for t in stacked.chunk(3))
    return torch.stack([q, k, v], dim=1).reshape(3 * HEADS * HEAD_DIM, -1)


NATIVE_META = {"key_format": "minimax-h3-native", "qkv_layout": "grouped", "base_schedule": "1.0,0.8,0.5,0.0"}


def write_qkv_pair(tmp_path):
    """The same adapter twice: native (grouped fused qkv) and diffusers ([q; k; v] split)."""
    native, split = {}, {}
    for i in range(2):
        a, b = lora_pair(50 + i, 3 * HEADS * HEAD_DIM)
        native[f"blocks.{i}.attn.qkv_proj.lora_A.weight"] = a
        native[f"blocks.{i}.attn.qkv_proj.lora_B.weight"] = grouped(b)
        for proj, rows in zip(("to_q", "to_k", "to_v"), b.chunk(3)):
            split[f"transformer.transformer_blocks.{i}.attn.{proj}.lora_A.weight"] = a.clone()
            split[f"transformer.transformer_blocks.{i}.attn.{proj}.lora_B.weight"] = rows.contiguous()
    save_file(native, str(tmp_path / "flash_native.safetensors"), metadata=NATIVE_META)
    save_file(split, str(tmp_path / "flash_split.safetensors"))
    # Negative control: the grouped rows with no layout declared load as if stacked.
    save_file(native, str(tmp_path / "flash_undeclared.safetensors"))
    return tmp_path / "flash_native.safetensors", tmp_path / "flash_split.safetensors", \
        tmp_path / "flash_undeclared.safetensors"


def test_grouped_qkv_reorder_equals_qkv_layout(rt, tmp_path):
    native, split, undeclared = write_qkv_pair(tmp_path)
    block = rt.pipe.transformer.transformer_blocks[1].attn
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    outs = {}
    for name, p in (("native", native), ("split", split), ("undeclared", undeclared)):
        rt.load_adapter(name, p)
        rt._activate([(rt.adapters[name], name, 1.0)], "transformer")
        with torch.no_grad():
            outs[name] = torch.cat([block.to_q(x), block.to_k(x), block.to_v(x)], dim=-1)
        rt._disable_all()
    torch.testing.assert_close(outs["native"], outs["split"], rtol=1e-5, atol=1e-5)
    assert (outs["undeclared"] - outs["split"]).abs().max() > 1e-2  # without the reorder it is wrong
    # End to end: the native adapter with its own schedule equals the split one on that schedule.
    a = gen(rt, adapters=[("native", str(native), 1.0)])
    assert rt.pipe.scheduler.sigmas.tolist() == pytest.approx([1.0, 0.8, 0.5, 0.0]) and a.steps[-1] == (3, 3)


def test_native_schedule_overrides_checkpoint_and_step_rules(pinned_rt, tmp_path):
    native, _, _ = write_qkv_pair(tmp_path)
    out = gen(pinned_rt, adapters=[("flash", str(native), 1.0)])  # steps omitted -> 3 from the adapter
    assert pinned_rt.pipe.scheduler.sigmas.tolist() == pytest.approx([1.0, 0.8, 0.5, 0.0])
    assert out.steps[-1] == (3, 3) and out.metadata["contract"]["kind"] == "native"
    with pytest.raises(ContractViolation) as err:  # the checkpoint's count no longer holds
        gen(pinned_rt, adapters=[("flash", str(native), 1.0)], num_inference_steps=4)
    assert "flash_native.safetensors" in err.value.message and "num_inference_steps=3" in err.value.message
    gen(pinned_rt)  # adapter off: the checkpoint's schedule again
    assert pinned_rt.pipe.scheduler.sigmas.tolist() == pytest.approx([1.0, 0.7, 0.4, 0.15, 0.0])


# -- refusals --------------------------------------------------------------------------------------------


def test_comfyui_fused_qkv_export_is_refused_by_name(tmp_path):
    a, b = lora_pair(7, 3 * HEADS * HEAD_DIM)
    comfy = tmp_path / "minimax_h3_lora_comfy.safetensors"
    save_file({"diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight": a,
               "diffusion_model.blocks.0.attn.qkv_proj.lora_up.weight": b}, str(comfy))
    turbo = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.0.safetensors"
    save_file({"blocks.0.attn.qkv_proj.lora_A.weight": a, "blocks.0.attn.qkv_proj.lora_B.weight": b}, str(turbo))
    for path in (comfy, turbo):
        with pytest.raises(AdapterError) as err:
            read_adapter(path, num_heads=HEADS, head_dim=HEAD_DIM)
        assert path.name in err.value.message and "ComfyUI" in err.value.message and "qkv_proj" in err.value.message


def test_malformed_turbo_file_name_refused_on_load(rt, tmp_path):
    path = tmp_path / "minimax_h3_fl2v_turbo_four_v1.safetensors"
    save_file(diffusers_lora(), str(path))
    with pytest.raises(AdapterError, match="expected pattern"):
        rt.load_adapter("bad", path)
    assert "bad" not in rt.adapters


# -- through the manager, to a file ----------------------------------------------------------------------


def test_manager_generates_mp4_with_audio_and_wav(manager_for, data_dir, tmp_path):
    from backend.minimax.media import probe_streams, read_wav, write_wav
    from backend.outputs import save_result

    m = manager_for("demo:minimax-h3")
    result = m.generate({"prompt": PROMPT, "seed": 5, "task_type": "t2va"})
    assert result.audio[1] == 8000 and result.metadata["params"]["task_type"] == "t2va"
    mp4 = save_result(result, data_dir=data_dir)
    assert probe_streams(mp4) == ["video", "audio"]
    assert json.loads(mp4.with_suffix(".mp4.json").read_text())["params"]["sample_rate"] == 8000
    wav = write_wav(tmp_path / "a.wav", result.audio)
    samples, rate = read_wav(wav)
    assert rate == 8000 and samples.shape == result.audio[0].shape
    assert np.abs(samples - np.clip(result.audio[0], -1, 1)).max() < 1e-4
    with pytest.raises(ContractViolation):
        path = tmp_path / "minimax_h3_ref2v_turbo_4step_v1.0.safetensors"
        save_file({k.replace("transformer.", "transformer_ref.", 1): v for k, v in diffusers_lora().items()},
                  str(path))
        from backend.lora.request import LoRARequest

        m.generate({"prompt": PROMPT, "task_type": "t2va"},
                   adapters=[(LoRARequest("ref", 1, str(path)), 1.0)])


def test_distill_fuses_turbo_and_its_contract_governs(repo, tmp_path):
    rt = MiniMaxRuntime(repo, device="cpu", dtype=torch.float32, lora_backend="distill")
    path = tmp_path / "minimax_h3_fl2v_turbo_2step_v1.0.safetensors"
    save_file(diffusers_lora(seed=4), str(path))
    base = gen(rt, num_inference_steps=2)
    layer = rt.pipe.transformer.transformer_blocks[0].attn.to_q
    before = layer.weight.detach().clone()
    rt.fuse([path])
    assert not hasattr(layer, "lora_A") and not torch.equal(layer.weight, before)  # fused, LoRA layers gone
    fused = gen(rt)  # steps from the fused file's contract
    assert fused.steps[-1] == (2, 2) and fused.metadata["fused"] == [path.name]
    assert np.abs(pixels(fused) - pixels(base)).mean() > 0.01
    with pytest.raises(ContractViolation, match="num_inference_steps=2"):
        gen(rt, num_inference_steps=3)


@pytest.mark.slow  # rebuilds the MiniMax demo twice to compare bytes (about 10 s)
def test_demo_build_is_byte_identical_and_in_repository_layout(tmp_path, repo):
    import hashlib
    import subprocess
    import sys

    script = "import sys, torch; torch.manual_seed(int(sys.argv[2])); " \
             "from backend.demo.minimax import build; build(sys.argv[1])"
    for name, seed in (("a", 0), ("b", 123)):  # different global RNG state, separate processes
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name), str(seed)], check=True,
                       capture_output=True)

    def digest(root):
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    a, b = digest(tmp_path / "a"), digest(tmp_path / "b")
    assert a == b
    index = json.loads((tmp_path / "a" / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    for part in ("transformer", "transformer_ref", "audio_vae", "vae", "text_encoder", "processor"):
        assert index[part][2]["subfolder"] == part and (tmp_path / "a" / part).is_dir()
    # ensure() wrote the same repository (plus its own marker and defaults files).
    assert {k: v for k, v in digest(repo).items() if k in a} == a

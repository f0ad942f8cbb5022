"""The distill presets reproduce the publishers' recipes (issue 17, items 1-3).

1. The scheduler: Qwen-Image-Lightning's (ModelTC/Qwen-Image-Lightning generate_with_diffusers.py)
   and LightX2V's Wan step-distill schedule, checked on the timesteps the real pipelines feed
   their transformers, and the Wan2.2 expert boundary (steps 0-1 high noise, 2-3 low noise).
2. The publishers' real file names against every preset's patterns.
3. The real key kinds (lora_down/lora_up/alpha, diff, diff_b, norm diff, diff_m) in the demo
   stand-ins, each applied by the fuse, compared with a reference computed from the file itself.
"""
from __future__ import annotations

import fnmatch
import math
import re

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from backend.errors import ContractViolation
from backend.manager import PipelineManager
from backend.presets import load_presets

torch.set_num_threads(1)

# -- the publishers' recipes, written down here independently of presets/*.toml --------------
# ModelTC/Qwen-Image-Lightning generate_with_diffusers.py ("we use shift=3 in distillation")
LIGHTNING_SCHEDULER = {"base_image_seq_len": 256, "base_shift": math.log(3), "invert_sigmas": False,
                       "max_image_seq_len": 8192, "max_shift": math.log(3), "num_train_timesteps": 1000,
                       "shift": 1.0, "shift_terminal": None, "stochastic_sampling": False,
                       "time_shift_type": "exponential", "use_beta_sigmas": False, "use_dynamic_shifting": True,
                       "use_exponential_sigmas": False, "use_karras_sigmas": False}
# LightX2V Wan step distill: denoising_step_list, sample_shift, Euler to 0; Wan2.2 boundary_step_index 2
LIGHTX2V_STEPS, LIGHTX2V_SHIFT, LIGHTX2V_BOUNDARY_STEP = [1000, 750, 500, 250], 5.0, 2


def lightx2v_timesteps() -> list[float]:
    """LightX2V's WanStepDistillScheduler: sigma = t/1000, shifted s*x/(1+(s-1)x), timestep = 1000*sigma."""
    out = []
    for t in LIGHTX2V_STEPS:
        x = t / 1000
        out.append(1000 * LIGHTX2V_SHIFT * x / (1 + (LIGHTX2V_SHIFT - 1) * x))
    return out


def lightning_timesteps(n: int) -> list[float]:
    """Lightning's scheduler with the pipeline's sigmas linspace(1, 1/n, n): exp(mu)=3 at any size."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(LIGHTNING_SCHEDULER)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n).tolist(), mu=math.log(3))
    closed = [1000 * 3 * s / (1 + 2 * s) for s in np.linspace(1.0, 1 / n, n)]
    assert sched.timesteps.tolist() == pytest.approx(closed, rel=1e-5)
    return closed


PRESET_MODEL = {"qwen-image-2512-lightning-4step": "demo:qwen-image",
                "qwen-image-2512-lightning-8step": "demo:qwen-image",
                "wan2.1-t2v-lightx2v-4step": "demo:wan2.1-t2v",
                "wan2.2-t2v-a14b-lightx2v-4step": "demo:wan2.2-t2v",
                "wan2.2-i2v-a14b-lightx2v-4step": "demo:wan2.2-i2v"}


@pytest.fixture(scope="module")
def managers(data_dir):
    cache = {}

    def get(model_id: str) -> PipelineManager:
        if model_id not in cache:
            m = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
            m.load(model_id)
            cache[model_id] = m
        cache[model_id].restore_base()
        return cache[model_id]

    return get


def _request(model_id: str) -> dict:
    req = {"prompt": "a red fox in snow", "seed": 5}
    if model_id == "demo:wan2.2-i2v":
        req["image"] = Image.fromarray(np.full((64, 64, 3), 120, dtype=np.uint8))
    return req


def _timesteps_seen(m: PipelineManager, request: dict) -> dict[str, list[float]]:
    """The timestep each denoiser is called with, per call, during one real generation (x1000 for
    Qwen, whose pipeline passes t/1000)."""
    seen: dict[str, list[float]] = {}
    factor = 1000.0 if m.spec.class_name == "QwenImagePipeline" else 1.0
    handles = []
    for name, module in m.denoisers().items():
        def hook(mod, args, kwargs, name=name):
            t = kwargs.get("timestep")
            seen.setdefault(name, []).append(float(t.flatten()[0]) * factor)
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        m.generate(request)
    finally:
        for h in handles:
            h.remove()
    return seen


# -- 1. the scheduler ----------------------------------------------------------------------
@pytest.mark.parametrize("preset_id", ["qwen-image-2512-lightning-4step", "qwen-image-2512-lightning-8step"])
def test_lightning_preset_samples_with_the_lightning_scheduler_and_restores_the_base_one(preset_id, managers):
    m = managers("demo:qwen-image")
    base = m.pipeline.scheduler
    base_config = dict(base.config)
    assert base_config["max_shift"] == 0.9 and base_config["shift_terminal"] == 0.02  # Qwen-Image-2512's own
    m.apply_preset(preset_id)
    sched = m.pipeline.scheduler
    assert type(sched).__name__ == "FlowMatchEulerDiscreteScheduler"
    for key, value in LIGHTNING_SCHEDULER.items():
        assert sched.config[key] == value, key
    assert m.fused_state()["scheduler"]["base_shift"] == math.log(3)
    n = 4 if "4step" in preset_id else 8
    seen = _timesteps_seen(m, _request("demo:qwen-image"))
    assert seen["transformer"] == pytest.approx(lightning_timesteps(n), rel=1e-5)
    assert m.pipeline.scheduler is sched  # the per-request path did not swap it
    m.restore_base()
    assert m.pipeline.scheduler is base and dict(m.pipeline.scheduler.config) == base_config
    # back at base, the pipeline samples with the base schedule again (terminal shift 0.02)
    seen = _timesteps_seen(m, {**_request("demo:qwen-image"), "num_inference_steps": n})
    assert seen["transformer"] != pytest.approx(lightning_timesteps(n), rel=1e-3)


@pytest.mark.parametrize("preset_id", ["wan2.1-t2v-lightx2v-4step", "wan2.2-t2v-a14b-lightx2v-4step",
                                       "wan2.2-i2v-a14b-lightx2v-4step"])
def test_lightx2v_preset_samples_lightx2v_timesteps_and_splits_experts_at_step_2(preset_id, managers):
    model_id = PRESET_MODEL[preset_id]
    m = managers(model_id)
    base = m.pipeline.scheduler
    m.apply_preset(preset_id)
    # explicit values equal to the recipe are accepted and keep the recipe's scheduler
    seen = _timesteps_seen(m, {**_request(model_id), "flow_shift": 5.0, "sample_solver": "euler"})
    expected = lightx2v_timesteps()
    assert expected == pytest.approx([1000, 937.5, 833.333, 625], rel=1e-5)
    if "transformer_2" in m.denoisers():
        # guidance 1.0: one call per step; steps 0-1 on transformer (high noise), 2-3 on transformer_2
        assert seen["transformer"] == pytest.approx(expected[:LIGHTX2V_BOUNDARY_STEP], rel=1e-5)
        assert seen["transformer_2"] == pytest.approx(expected[LIGHTX2V_BOUNDARY_STEP:], rel=1e-5)
    else:
        assert seen["transformer"] == pytest.approx(expected, rel=1e-5)
    # anything that would change the schedule or the split is refused by name
    for field, value in [("flow_shift", 3.0), ("sample_solver", "unipc"), ("num_inference_steps", 8),
                         ("guidance_scale", 3.5)] + \
            ([("boundary_ratio", 0.5)] if "transformer_2" in m.denoisers() else []):
        with pytest.raises(ContractViolation, match=rf"{field}=") as err:
            m.validate({**_request(model_id), field: value})
        assert err.value.param == field
    m.restore_base()
    assert m.pipeline.scheduler is base and type(base).__name__ == "UniPCMultistepScheduler"


# -- 2. the publishers' file names -------------------------------------------------------------
# (file name, the (preset id, component) it belongs to, or None for a file no preset uses)
PUBLISHED = [
    ("wan2.2_i2v_A14b_high_noise_lora_rank64_lightx2v_4step_1022.safetensors",
     ("wan2.2-i2v-a14b-lightx2v-4step", "transformer")),
    ("wan2.2_i2v_A14b_low_noise_lora_rank64_lightx2v_4step_1022.safetensors",
     ("wan2.2-i2v-a14b-lightx2v-4step", "transformer_2")),
    ("wan2.2_t2v_A14b_high_noise_lora_rank64_lightx2v_4step_1217.safetensors",
     ("wan2.2-t2v-a14b-lightx2v-4step", "transformer")),
    ("wan2.2_t2v_A14b_low_noise_lora_rank64_lightx2v_4step_1217.safetensors",
     ("wan2.2-t2v-a14b-lightx2v-4step", "transformer_2")),
    ("wan2.1_t2v_14b_lora_rank64_lightx2v_4step.safetensors", ("wan2.1-t2v-lightx2v-4step", "transformer")),
    ("wan2.1_i2v_lora_rank64_lightx2v_4step.safetensors", None),  # no Wan2.1 I2V model here
    ("Qwen-Image-2512-Lightning-4steps-V1.0-fp32.safetensors", ("qwen-image-2512-lightning-4step", "transformer")),
    ("Qwen-Image-2512-Lightning-4steps-V1.0-bf16.safetensors", ("qwen-image-2512-lightning-4step", "transformer")),
    ("Qwen-Image-2512-Lightning-8steps-V1.0-fp32.safetensors", ("qwen-image-2512-lightning-8step", "transformer")),
    ("Qwen-Image-2512-Lightning-8steps-V1.0-bf16.safetensors", ("qwen-image-2512-lightning-8step", "transformer")),
]


def test_every_published_name_matches_exactly_its_own_preset_file():
    presets = load_presets()
    assert {p.id for p in presets} == set(PRESET_MODEL)
    for name, owner in PUBLISHED:
        hits = [(p.id, f.component) for p in presets for f in p.files if fnmatch.fnmatchcase(name, f.pattern)]
        assert hits == ([owner] if owner else []), name
    for p in presets:  # and every preset file is matched by a published name
        for f in p.files:
            assert any(owner == (p.id, f.component) for _, owner in PUBLISHED), (p.id, f.component)


def _user_file(path):
    """A downloaded file (no stand-in marker in its header)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight": torch.zeros(2, 4)}, str(path))
    return path


def test_fp32_and_bf16_both_present_the_run_dtype_picks_and_the_listing_says_so(tmp_path):
    import os
    import subprocess
    import sys

    from backend import presets

    lib = tmp_path / "lib"
    names = [n for n, owner in PUBLISHED if owner and owner[0].startswith("qwen-image")]
    for n in names:
        _user_file(lib / "qwen" / n)
    for preset_id, steps in [("qwen-image-2512-lightning-4step", "4steps"), ("qwen-image-2512-lightning-8step", "8steps")]:
        preset = presets.get_preset(preset_id)
        for dtype, tag in [("bfloat16", "bf16"), (torch.bfloat16, "bf16"), ("float32", "fp32"), (torch.float32, "fp32")]:
            [path] = presets.resolve_files(preset, "Qwen/Qwen-Image-2512", tmp_path / "home", [lib],
                                           hf_cache_dir=tmp_path / "hub", dtype=dtype)
            assert path.name == f"Qwen-Image-2512-Lightning-{steps}-V1.0-{tag}.safetensors", (preset_id, dtype)
    # a run dtype no file carries (fp16): the highest name, and the reason says so
    pick, why = presets.choose(sorted((lib / "qwen").glob("*4steps*")), "float16")
    assert pick.name.endswith("-fp32.safetensors") and "no file tagged fp16" in why
    # `python app.py presets` states the rule and what each dtype gets
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "app.py", "presets", "--data-dir", str(tmp_path / "home"),
                          "--adapter-dir", str(lib)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    for steps in ("4steps", "8steps"):
        assert (f"2 files match; a bfloat16 run uses Qwen-Image-2512-Lightning-{steps}-V1.0-bf16.safetensors, "
                f"a float32 run Qwen-Image-2512-Lightning-{steps}-V1.0-fp32.safetensors") in out.stdout
    assert "the run's dtype" in out.stdout


# -- 3. the publishers' key kinds, each applied ---------------------------------------------------
# written out here, independently of backend/lora/convert.py: lightx2v (original Wan) module -> diffusers
WAN_MODULES = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
               "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
               "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj",
               "ffn.2": "ffn.net.2", "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
               "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k"}
IMAGE_BRANCH = re.compile(r"\.cross_attn\.(k_img|v_img|norm_k_img)\.")


def kind_of(key: str) -> str:
    for suffix, kind in ((".lora_down.weight", "lora_down"), (".lora_up.weight", "lora_up"), (".alpha", "alpha"),
                         (".diff_b", "diff_b"), (".diff_m", "diff_m")):
        if key.endswith(suffix):
            return kind
    assert key.endswith(".diff"), key
    return "norm diff" if ".norm" in key else "diff"


def reference(base: dict, path, scale: float, wan: bool) -> tuple[dict, int]:
    """The fused state dict computed from the file's own tensors: W + up@down*alpha/rank*scale,
    + diff, bias + diff_b, norm weight + diff, scale_shift_table + diff_m. Also returns how many
    keys name the CLIP image branch (absent from Wan2.2 A14B)."""
    sd = {k: v.double() for k, v in load_file(str(path)).items()}
    ref = {k: v.double().clone() for k, v in base.items()}
    skipped = 0

    def target(stem: str) -> str:
        if not wan:
            return stem
        stem = stem.removeprefix("diffusion_model.")
        if stem == "head.head":
            return "proj_out"
        _, n, rest = stem.split(".", 2)
        return f"blocks.{n}.{WAN_MODULES[rest]}"

    for key, t in sd.items():
        if wan and IMAGE_BRANCH.search(key):
            skipped += 1
            continue
        kind = kind_of(key)
        if kind == "lora_down":
            stem = key[: -len(".lora_down.weight")]
            up, alpha = sd[f"{stem}.lora_up.weight"], sd[f"{stem}.alpha"].item()
            ref[f"{target(stem)}.weight"] += up @ t * (alpha / t.shape[0]) * scale
        elif kind in ("diff", "norm diff"):
            ref[f"{target(key[:-len('.diff')])}.weight"] += t * scale
        elif kind == "diff_b":
            ref[f"{target(key[:-len('.diff_b')])}.bias"] += t * scale
        elif kind == "diff_m":
            ref[f"{key.removeprefix('diffusion_model.')[:-len('.diff_m')]}.scale_shift_table"] += t * scale
    return ref, skipped


@pytest.mark.parametrize("preset_id,scale", [("qwen-image-2512-lightning-4step", 1.0),
                                             ("wan2.1-t2v-lightx2v-4step", 1.0),
                                             ("wan2.2-t2v-a14b-lightx2v-4step", 0.7),
                                             ("wan2.2-i2v-a14b-lightx2v-4step", 1.0)])
def test_every_key_kind_is_applied_as_the_file_says_and_restore_is_bit_exact(preset_id, scale, managers, data_dir):
    from backend.presets import get_preset, resolve_files

    model_id = PRESET_MODEL[preset_id]
    wan = model_id.startswith("demo:wan")
    m = managers(model_id)
    preset = get_preset(preset_id)
    paths = resolve_files(preset, model_id, data_dir)
    base = {c: {k: v.detach().clone() for k, v in mod.state_dict().items()} for c, mod in m.denoisers().items()}
    state = m.fuse(paths, [scale] * len(paths))
    assert state["preset"] == preset_id
    for f, path in zip(state["files"], paths):
        keys = list(load_file(str(path)))
        counts = {}
        for k in keys:
            counts[kind_of(k)] = counts.get(kind_of(k), 0) + 1
        # the stand-in carries every kind the published files do, at the real prefixes
        if wan:
            assert all(counts.get(k) for k in ("lora_down", "lora_up", "alpha", "diff", "diff_b", "norm diff",
                                               "diff_m")), counts
            assert all(k.startswith("diffusion_model.") for k in keys)
            assert any(re.fullmatch(r"diffusion_model\.blocks\.\d+\.diff_m", k) for k in keys)
        else:  # Lightning: bare diffusers module names, LoRA pairs and alphas only
            assert set(counts) == {"lora_down", "lora_up", "alpha"}
            assert all(k.startswith("transformer_blocks.") for k in keys)
        # the fit report lists each kind with its count; nothing left out of it
        assert {k: v for k, v in f["keys"].items() if v} == counts
        ref, skipped = reference(base[f["component"]], path, scale, wan)
        assert sum(g["count"] for g in f["ignored"]) == skipped
        if model_id == "demo:wan2.2-i2v":
            assert skipped > 0 and "CLIP image branch" in f["ignored"][0]["why"]
        fused = m.denoisers()[f["component"]].state_dict()
        changed = 0
        for name, value in fused.items():
            torch.testing.assert_close(value.double(), ref[name], atol=2e-6, rtol=1e-5, msg=name)
            changed += not torch.equal(value, base[f["component"]][name])
        # each LoRA pair moved one weight, each delta one tensor; a trained pair whose lora_up stayed zero
        # moves nothing (the Lightning distill's last block: its text stream's outputs are never read)
        sd = load_file(str(path))
        zero = sum(1 for k, t in sd.items() if k.endswith("lora_up.weight") and not t.any())
        assert changed == f["layers"] - zero + f["deltas"]
        assert f["deltas"] == sum(counts.get(k, 0) for k in ("diff", "diff_b", "norm diff", "diff_m")) - \
            sum(1 for k in keys if IMAGE_BRANCH.search(k) and not k.endswith(("lora_down.weight", "lora_up.weight",
                                                                                ".alpha")))
    m.restore_base()
    for c, mod in m.denoisers().items():
        for name, value in mod.state_dict().items():
            assert torch.equal(value, base[c][name]), (c, name)


def _edited(src, dst, edit):
    from safetensors.torch import save_file

    sd = load_file(str(src))
    edit(sd)
    save_file(sd, str(dst))
    return dst


@pytest.mark.parametrize("how,match", [
    ("unknown kind", r"key 'diffusion_model\.blocks\.0\.self_attn\.q\.lokr_w1' is of no kind"),
    ("diff shape", r"key 'diffusion_model\.blocks\.1\.diff_m' \(diff_m\) has shape \(1, 5, 24\)"),
    ("diff on nothing", r"key 'diffusion_model\.blocks\.0\.self_attn\.norm_x\.diff' \(norm diff\) names no parameter"),
    ("diff beside a pair", r"key 'diffusion_model\.blocks\.0\.self_attn\.q\.diff' is a full weight diff for a "
                           r"layer that also has a LoRA pair"),
])
def test_a_key_that_cannot_be_applied_is_refused_by_name_and_nothing_changes(how, match, managers, data_dir,
                                                                             tmp_path):
    from backend.errors import AdapterError
    from backend.presets import get_preset, resolve_files

    m = managers("demo:wan2.1-t2v")
    [src] = resolve_files(get_preset("wan2.1-t2v-lightx2v-4step"), "demo:wan2.1-t2v", data_dir)
    edits = {"unknown kind": lambda sd: sd.__setitem__("diffusion_model.blocks.0.self_attn.q.lokr_w1", torch.zeros(2)),
             "diff shape": lambda sd: sd.__setitem__("diffusion_model.blocks.1.diff_m", torch.zeros(1, 5, 24)),
             "diff on nothing": lambda sd: sd.__setitem__("diffusion_model.blocks.0.self_attn.norm_x.diff",
                                                          torch.zeros(24)),
             "diff beside a pair": lambda sd: sd.__setitem__("diffusion_model.blocks.0.self_attn.q.diff",
                                                             torch.zeros_like(m.pipeline.transformer.blocks[0]
                                                                              .attn1.to_q.weight))}  # the right shape
    bad = _edited(src, tmp_path / src.name, edits[how])
    before = {k: v.clone() for k, v in m.pipeline.transformer.state_dict().items()}
    with pytest.raises(AdapterError, match=match):
        m.fuse([bad])
    assert m.fused_state()["state"] == "base"
    assert all(torch.equal(v, before[k]) for k, v in m.pipeline.transformer.state_dict().items())


def test_a_non_lora_key_on_qwen_is_refused_by_name(managers, data_dir, tmp_path):
    from backend.errors import AdapterError
    from backend.presets import get_preset, resolve_files

    m = managers("demo:qwen-image")
    [src] = resolve_files(get_preset("qwen-image-2512-lightning-4step"), "demo:qwen-image", data_dir)
    bad = _edited(src, tmp_path / src.name,
                  lambda sd: sd.__setitem__("transformer_blocks.0.attn.to_q.diff", torch.zeros(24, 24)))
    with pytest.raises(AdapterError, match=r"key 'transformer_blocks\.0\.attn\.to_q\.diff' is a diff key"):
        m.fuse([bad])
    assert m.fused_state()["state"] == "base"

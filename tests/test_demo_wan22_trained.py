"""demo:wan2.2-t2v draws what it is asked, and each of its experts knows only its own half (#40).

Trained here (``python -m backend.demo.train wan2.2-t2v``, backend/demo/wan_experts.py): both experts start
from demo:wan2.1-t2v's transformer and each is trained on its half of the noise levels, split at the
pipeline's boundary_ratio. Read by the oracles of tests/oracles.py on prompts no training clip had and seeds
training never used, through the product's own path (a ``PipelineManager`` at the model's defaults). A
Wan2.2 checkpoint assembled wrong (the experts swapped, or one expert in both places) is loaded from a folder
laid out that way, as a user's would be, and must draw worse clips.

#40's bars: direction and colour >= 80% (met: 100% and 100%), and a 30-point direction drop for a wrong
assembly (not met: 16, 16 and 0 points; held by a strict xfail, which fails, so the bar gets raised, the day
it is met). Why not: at the demo's flow shift 3 the high-noise half (sigma >= 0.875) is 6 of the 20 steps and
the low-noise expert alone moves the digit the asked way (blinded to the prompt, the high-noise expert costs
nothing: test_each_file_of_a_distill_pair_lands_in_its_own_expert).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from backend.demo import WEIGHTS_ROOT, data, ensure
from backend.manager import PipelineManager
from oracles import asked_clip, clip_grid, score_clips

MODEL = "demo:wan2.2-t2v"
# Reached by 1,800 steps of 16 for each expert (34 minutes) from demo:wan2.1-t2v (9,000 steps edge to edge, then
# 3,000 on clips from the middle), on the grid at the model's defaults: direction 100%, colour 100%, background
# 100%, digit 12% (from the 9,000-step base alone: 50%, 100%, 100%, 12%).
THRESHOLDS = {"direction": 0.9, "colour": 0.9, "background": 0.9}
ISSUE_BARS = {"direction": 0.8, "colour": 0.8}
# Wrong assemblies, same grid: swapped direction 84% colour 84%; the high-noise expert in both places 84% / 84%;
# the low-noise one in both places 100% / 100% (it does the high-noise half nearly as well: see
# test_each_expert_is_the_better_denoiser_on_its_own_half). Held: each of the first two loses at least this
# much (16 points of each measured); the issue's 30-point direction drop for all three is the strict xfail.
MIN_LOSS = {"direction": 0.09, "colour": 0.09}
ISSUE_DROP = 0.30


def grid() -> list[tuple[str, int]]:
    return clip_grid(json.loads((WEIGHTS_ROOT / "wan2.2-t2v" / "training.json").read_text())["unseen_prompts"])


def scores(model: str, data_dir) -> dict:
    m = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
    m.load(model)
    return score_clips([(p, m.generate({"prompt": p, "seed": s}).frames) for p, s in grid()])


@pytest.fixture(scope="module")
def assembled(data_dir, tmp_path_factory):
    """Three wrong assemblies of the shipped pair (``transformer`` high-noise, ``transformer_2`` low-noise):
    folders a user could have made, each loaded like any local checkpoint."""
    right = ensure(MODEL, data_dir)
    root = tmp_path_factory.mktemp("wan22-assemblies")
    folders = {}
    for name, (first, second) in {"swapped": ("transformer_2", "transformer"),
                                  "high-noise for both": ("transformer", "transformer"),
                                  "low-noise for both": ("transformer_2", "transformer_2")}.items():
        folder = root / name.replace(" ", "-")
        shutil.copytree(right, folder, ignore=shutil.ignore_patterns("transformer", "transformer_2", ".demo-build"))
        shutil.copytree(right / first, folder / "transformer")
        shutil.copytree(right / second, folder / "transformer_2")
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def shipped(data_dir) -> dict:
    return scores(MODEL, data_dir)


def test_the_grid_draws_the_asked_colour_background_and_motion(shipped):
    failed = {k: f"{shipped[k]:.0%} < {v:.0%}" for k, v in THRESHOLDS.items() if shipped[k] < v}
    assert not failed, f"read as asked: {shipped}; below the bar: {failed}"


def test_the_grid_meets_the_issues_bars(shipped):
    assert all(shipped[k] >= v for k, v in ISSUE_BARS.items()), shipped


@pytest.mark.slow  # 27 s each; the default tier has the cheaper check of the same split by the error
@pytest.mark.parametrize("assembly", ["swapped", "high-noise for both"])
def test_a_wrongly_assembled_pair_draws_worse_clips(assembly, assembled, shipped, data_dir):
    wrong = scores(str(assembled[assembly]), data_dir)
    lost = {k: shipped[k] - wrong[k] for k in MIN_LOSS}
    assert all(lost[k] >= v for k, v in MIN_LOSS.items()), {"as shipped": shipped, assembly: wrong}


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="#40: the experts are not yet that far apart (drops 16, 16 and 0 points)")
def test_every_wrong_assembly_loses_the_issues_share_of_the_motion(assembled, shipped, data_dir):
    drops = {name: shipped["direction"] - scores(str(folder), data_dir)["direction"]
             for name, folder in assembled.items()}
    assert all(d >= ISSUE_DROP for d in drops.values()), drops


@pytest.fixture(scope="module")
def held_out_latents():
    """48 clips no training used (prompts from the unseen list, digits from load_digits' held-out fifth),
    through the model's VAE, normalised as the pipeline does, with their prompts' embeddings at 512."""
    from diffusers import WanPipeline

    from backend.demo.wan_train import prompt_embeds, to_video

    pipe = WanPipeline.from_pretrained(WEIGHTS_ROOT / "wan2.2-t2v", torch_dtype=torch.float32)
    unseen = json.loads((WEIGHTS_ROOT / "wan2.2-t2v" / "training.json").read_text())["unseen_prompts"]
    rng = np.random.default_rng(4242)
    clips, prompts = [], []
    for i in range(48):
        want = asked_clip(unseen[i % len(unseen)])
        clip = data.Clip(str(want["digit"]), want["colour"], want["background"], want["direction"])
        video, _ = data.render_clip(clip, rng, index=int(rng.choice(data.digit_indices(want["digit"], "test"))))
        clips.append(video)
        prompts.append(clip.prompt)
    with torch.no_grad():
        z = pipe.vae.encode(to_video(np.stack(clips))).latent_dist.mode()
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
        return pipe, (z - mean) / std, prompt_embeds(pipe, prompts, 512)


def test_each_expert_is_the_better_denoiser_on_its_own_half(held_out_latents):
    """The flow-matching error (the velocity's MSE) on held-out clips at fixed noise: ``transformer`` is the
    better of the two above the boundary (sigma >= 0.875), ``transformer_2`` below it, and each is better
    there than the Wan2.1 transformer both started from. Measured (the pair from the base trained on clips from
    the middle): above, high 0.131, low 0.140, base 0.139 (mean of sigma 0.98 and 0.93); below, low 0.052, high
    0.154, base 0.059 (sigma 0.6, 0.4, 0.2). Above the boundary a good base leaves the high-noise expert little
    to gain (6%; it was 11% over the 5,200-step base), so that margin is held at 2%."""
    from diffusers import WanTransformer3DModel

    pipe, x0, embeds = held_out_latents
    base = WanTransformer3DModel.from_pretrained(WEIGHTS_ROOT / "wan2.1-t2v" / "transformer", torch_dtype=torch.float32)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    denoisers = {"high": pipe.transformer, "low": pipe.transformer_2, "base": base}

    def error(sigmas) -> dict:
        got = dict.fromkeys(denoisers, 0.0)
        with torch.no_grad():
            for sigma in sigmas:
                xt = (1 - sigma) * x0 + sigma * noise
                t = torch.full((x0.shape[0],), sigma * 1000)
                for name, tr in denoisers.items():
                    pred = tr(hidden_states=xt, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
                    got[name] += torch.nn.functional.mse_loss(pred, noise - x0).item() / len(sigmas)
        return got

    above, below = error([0.98, 0.93]), error([0.6, 0.4, 0.2])
    assert above["high"] < 0.98 * min(above["low"], above["base"]), above
    assert below["low"] < 0.5 * below["high"] and below["low"] < 0.95 * below["base"], below


def _prompt_blind_file(expert, path, nudge: bool = False) -> None:
    """A LightX2V-layout distill file (``diffusion_model.blocks.N.cross_attn.v``, lora_down / lora_up / alpha)
    that blinds ``expert`` to the prompt: each block's cross-attention value projection loses its weight
    (delta -W, rank 128), so every text token gives the same value. ``nudge``: a change of 1e-3 to one block
    instead (a file that touches its expert and changes nothing one can see)."""
    from safetensors.torch import save_file

    tensors = {}
    for i, block in enumerate(expert.blocks):
        w = block.attn2.to_v.weight.detach().float()
        key = f"diffusion_model.blocks.{i}.cross_attn.v"
        down, up = torch.eye(w.shape[1]), -w
        if nudge:
            if i:
                continue
            down, up = torch.full((1, w.shape[1]), 1e-3), torch.full((w.shape[0], 1), 1e-3)
        tensors.update({f"{key}.lora_down.weight": down.to(torch.bfloat16), f"{key}.lora_up.weight": up.to(torch.bfloat16),
                        f"{key}.alpha": torch.tensor(float(down.shape[0]))})
    save_file(tensors, str(path))


@pytest.mark.slow  # two grids, 35 s each
def test_each_file_of_a_distill_pair_lands_in_its_own_expert(data_dir, tmp_path, shipped):
    """Checked by the picture, not by the keys: the distill backend fuses a Wan2.2 pair as given (the high-noise
    file into ``transformer``, the low-noise one into ``transformer_2``). A file that blinds its expert to the
    prompt, made from that expert's own weights: blinding the low-noise expert loses the colour (it paints
    the detail: 59% colour, 72% direction measured), blinding the high-noise one loses nothing (100% / 100%).
    Routed the other way round, each file would land in the other expert, whose weights it was not made
    from (the two differ by their training, a small change), and neither clip would lose its colour."""
    m = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
    m.load(MODEL)
    high, low = m.pipeline.transformer, m.pipeline.transformer_2
    files = {}
    for role, expert in (("high", high), ("low", low)):
        files[role] = tmp_path / f"blind_{role}_noise.safetensors"
        _prompt_blind_file(expert, files[role])
        files[f"{role} nudge"] = tmp_path / f"nudge_{role}_noise.safetensors"
        _prompt_blind_file(expert, files[f"{role} nudge"], nudge=True)

    def grid_with(paths) -> dict:
        m.fuse(paths)
        try:
            return score_clips([(p, m.generate({"prompt": p, "seed": s}).frames) for p, s in grid()])
        finally:
            m.restore_base()

    high_blind = grid_with([files["high"], files["low nudge"]])
    low_blind = grid_with([files["high nudge"], files["low"]])
    assert high_blind["colour"] >= shipped["colour"] - 0.1 and high_blind["direction"] >= 0.8, high_blind
    assert low_blind["colour"] <= shipped["colour"] - 0.25, low_blind

"""demo:wan2.2-t2v draws what it is asked, and each of its experts knows only its own half (#40).

Trained here (``python -m backend.demo.train wan2.2-t2v``, backend/demo/wan_experts.py): both experts start
from demo:wan2.1-t2v's transformer and each is trained on its half of the noise levels, split at the
pipeline's boundary_ratio. Read by the oracles of tests/oracles.py on prompts no training clip had and seeds
training never used, through the product's own path (a ``PipelineManager`` at the model's defaults). A
Wan2.2 checkpoint assembled wrong (the experts swapped, or one expert in both places) is loaded from a folder
laid out that way, as a user's would be, and must draw worse clips.

Not there yet (#40's bars are direction and colour >= 80%, and a 30-point direction drop for a wrong
assembly): trained from the 9,000-step demo:wan2.1-t2v, the pair moves the digit the asked way in 50% of the
grid (colour 100%);
what it reached is held below less a margin, the issue's bars by strict xfails, which fail (so the bars
get raised) the day they are met.
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
# Reached by 1,800 steps of 16 for each expert (about 30 minutes) from demo:wan2.1-t2v's 9,000, on the grid at
# the model's defaults: direction 50%, colour 100%, background 100%, digit 12% (from the 5,200-step base:
# 47%, 97%, 100%, 9%).
THRESHOLDS = {"direction": 0.42, "colour": 0.9, "background": 0.9}
ISSUE_BARS = {"direction": 0.8, "colour": 0.8}
# Wrong assemblies, same grid: swapped direction 41% colour 78%; the high-noise expert in both places 47% / 75%;
# the low-noise one in both places 47% / 97% (it still does the high-noise half nearly as well: see
# test_each_expert_is_the_better_denoiser_on_its_own_half). Held: each of the first two loses at least this
# much (the colour is where they lose most: 22 and 25 points; the direction 9 and 3); the issue's 30-point
# direction drop for all three is the strict xfail.
MIN_LOSS = {"direction": 0.0, "colour": 0.15}
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


def test_the_grid_draws_the_asked_colour_background_and_mostly_motion(shipped):
    failed = {k: f"{shipped[k]:.0%} < {v:.0%}" for k, v in THRESHOLDS.items() if shipped[k] < v}
    assert not failed, f"read as asked: {shipped}; below the bar: {failed}"


@pytest.mark.xfail(strict=True, reason="#40: not reached (grid direction 50%)")
def test_the_grid_meets_the_issues_bars(shipped):
    assert all(shipped[k] >= v for k, v in ISSUE_BARS.items()), shipped


@pytest.mark.slow  # 27 s each; the default tier has the cheaper check of the same split by the error
@pytest.mark.parametrize("assembly", ["swapped", "high-noise for both"])
def test_a_wrongly_assembled_pair_draws_worse_clips(assembly, assembled, shipped, data_dir):
    wrong = scores(str(assembled[assembly]), data_dir)
    lost = {k: shipped[k] - wrong[k] for k in MIN_LOSS}
    assert all(lost[k] >= v for k, v in MIN_LOSS.items()), {"as shipped": shipped, assembly: wrong}


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="#40: the experts are not yet that far apart (drops 9, 3 and 3 points)")
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
    there than the Wan2.1 transformer both started from. Measured (from the 9,000-step base): above, high 0.150,
    low 0.161, base 0.156 (mean of sigma 0.98 and 0.93); below, low 0.061, high 0.188, base 0.069 (sigma 0.6,
    0.4, 0.2). Above the boundary the better base leaves the high-noise expert less to gain (4%; it was 11%
    over the 5,200-step base), so that margin is held at 2%."""
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

"""The sampler picker on the image models (#26 "no sampler/scheduler choice for image models"): Qwen-Image
and SD3.5 take ``sample_solver`` = euler (the pipeline's own FlowMatchEuler) or unipc (UniPC multistep on
the same flow sigmas, Qwen's dynamic shift kept). Measured here: diffusers' DPM++ schedulers refuse the
custom sigma schedule these pipelines pass, so they are not offered. Meaning: UniPC draws what Euler draws
(the trained demo read by the oracle), the request's scheduler is swapped in for that request only."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from oracles import read

torch.set_num_threads(1)

ASK = {"prompt": "a red digit 3 on a black background", "seed": 5, "num_inference_steps": 20, "height": 64,
       "width": 64, "true_cfg_scale": 1.0}


def test_unipc_draws_what_euler_draws_and_the_pipelines_scheduler_comes_back(managers):
    m = managers("demo:qwen-image")
    own = m.pipeline.scheduler
    euler = m.generate({**ASK, "sample_solver": "euler"})
    unipc = m.generate({**ASK, "sample_solver": "unipc"})
    assert m.pipeline.scheduler is own  # swapped for the request only
    a, b = (np.asarray(r.images[0], dtype=float) for r in (euler, unipc))
    assert not np.array_equal(a, b)  # another solver, another path
    for got in (read(euler.images[0]), read(unipc.images[0])):
        assert (got.colour, got.digit, got.background) == ("red", 3, "black"), got
    assert unipc.metadata["params"]["sample_solver"] == "unipc"
    print(f"qwen-image, 20 steps: mean |unipc - euler| = {np.abs(a - b).mean():.2f} levels")


def test_sd35_runs_unipc_with_its_shift(managers):
    m = managers("demo:sd3.5")
    ask = {k: v for k, v in ASK.items() if k != "true_cfg_scale"} | {"guidance_scale": 1.0, "num_inference_steps": 6}
    seen = []
    out = m.generate({**ask, "sample_solver": "unipc"}, on_step=lambda i, n: seen.append(i))
    assert seen == [1, 2, 3, 4, 5, 6] and out.images[0].size == (64, 64)


def test_dpm_solvers_do_not_take_these_pipelines_sigmas(managers):
    """Why the picker offers two: the schedule Qwen-Image passes (custom sigmas, dynamic shift) is refused by
    DPM++ (if a diffusers release accepts it, this fails and the picker can grow)."""
    m = managers("demo:qwen-image")
    own = m.pipeline.scheduler
    m.pipeline.scheduler = DPMSolverMultistepScheduler.from_config(dict(own.config), use_flow_sigmas=True,
                                                                   prediction_type="flow_prediction")
    try:
        with pytest.raises(ValueError, match="does not support custom sigmas"):
            m.generate(ASK)
    finally:
        m.pipeline.scheduler = own

"""demo:wan2.1-t2v draws what it is asked: a digit of the asked colour moving the asked way (#40).

Not there yet: after three 30-minute runs of training it draws the asked background and colour, and moves the
digit the asked way in half the clips, by small steps; its digits are blobs (see THRESHOLDS).

Trained here (``python -m backend.demo.train wan2.1-t2v``, backend/demo/wan_train.py); read by the
oracles of tests/oracles.py (the foreground's centroid over the frames for the direction; the middle
frame's colour, background and digit), written apart from the trainer, on prompts no training clip had
(``unseen_prompts`` in the shipped training.json) and seeds training never used, through the product's own
path: a ``PipelineManager`` at the model's defaults.
"""
from __future__ import annotations

import json

import pytest

from backend.demo import WEIGHTS_ROOT, data
from backend.manager import PipelineManager
from oracles import asked_clip, clip_grid, read_clip, score_clips

MODEL = "demo:wan2.1-t2v"
# The bars are direction and colour at least 80%. After three 30-minute runs (9,000 steps of 16; the
# stage's budget is one run a session, it goes on from these weights) the grid read, at the default CFG 3:
# direction 50%, colour 97%, background 100%, digit 12% (5,200 steps: 44% / 84%; the first run, 1,700 steps:
# 6% / 56%). The bars below are the reached figures less a margin; the direction bar is held by the
# strict xfail below, which fails (so the bar gets raised) the day the clips move as asked.
# Where the direction fails (measured at 390341d on 64 validation clips, seeds 50000 and 60000 up, not this grid's):
# the axis is always right (left/right clips move sideways, up/down ones vertically), the sign is not: left 10 of
# 16, right 10, up 5 (11 go down), down 8; the mean vertical travel is down for "up" and "down" alike. Sampling
# is not the lever: CFG 2, 3, 4, 6 and 40 steps give 47-53% (CFG 3 is the default). The sign is set by where the
# digit starts, decided in the high-noise steps: what the next training run should target.
THRESHOLDS = {"direction": 0.42, "colour": 0.88, "background": 0.9}


def grid() -> list[tuple[str, int]]:
    """32 (prompt, seed) pairs: 8 a direction, prompts no training clip had, seeds 40000 up."""
    return clip_grid(json.loads((WEIGHTS_ROOT / "wan2.1-t2v" / "training.json").read_text())["unseen_prompts"])


@pytest.fixture(scope="module")
def manager(data_dir):
    m = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
    m.load(MODEL)
    return m


def draw(m, prompt: str, seed: int, **fields):
    return m.generate({"prompt": prompt, "seed": seed, **fields}).frames


@pytest.fixture(scope="module")
def grid_scores(manager) -> dict:
    pairs = grid()
    assert len(pairs) == 32 and len({p for p, _ in pairs}) >= 24 and all(asked_clip(p) for p, _ in pairs)
    return score_clips([(p, draw(manager, p, s)) for p, s in pairs])


def test_the_grid_draws_the_asked_colour_background_and_mostly_motion(grid_scores):
    got = grid_scores
    failed = {k: f"{got[k]:.0%} < {v:.0%}" for k, v in THRESHOLDS.items() if got[k] < v}
    assert not failed, f"read as asked: {got}; below the bar: {failed}"


@pytest.mark.xfail(strict=True, reason="#40: not reached after three 30-minute runs (grid direction 50%)")
def test_the_grid_moves_the_asked_way(grid_scores):
    assert grid_scores["direction"] >= 0.8, grid_scores


@pytest.mark.xfail(strict=True, reason="#40: not reached after three 30-minute runs (at most 2 of 4)")
def test_the_direction_word_alone_changes_the_motion(manager):
    """One seed, four prompts that differ only in the direction: the clip follows the word."""
    readings = {way: read_clip(draw(manager, data.video_prompt(5, "orange", way, "black"), 7))
                for way in data.DIRECTIONS}
    right = [way for way, r in readings.items() if r.direction == way]
    assert len(right) >= 3, {way: (r.direction, r.travel) for way, r in readings.items()}

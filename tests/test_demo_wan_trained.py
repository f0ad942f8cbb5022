"""demo:wan2.1-t2v draws what it is asked: a digit of the asked colour moving the asked way (#40).

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
# The issue's bars: direction and colour at least 80% (ISSUE_BARS). Reached, on this grid at the default CFG 3:
# direction 100%, colour 100%, background 100%, digit 19% (and the same on 32 more clips, seeds 50000 up:
# 100% / 100%, digit 9%). How: 9,000 steps on clips crossing the frame edge to edge moved the digit along the
# asked axis always and the asked way half the time (50%; CFG 2-6 and 40 steps: 47-53%), since the way was
# fixed by the edge a clip started at, and the transformer (3-D RoPE, no absolute position) could hardly
# tell the edges apart from noise. The clips now start in the middle (data.render_clip); 3,000 more steps
# from those weights on them (28 minutes): 94% at 1,600, 100% at 3,000. Held below: the reached figures less a
# margin. The digits are still blobs (the issue sets no bar on them).
THRESHOLDS = {"direction": 0.9, "colour": 0.9, "background": 0.9}
ISSUE_BARS = {"direction": 0.8, "colour": 0.8}


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


def test_the_grid_draws_the_asked_colour_background_and_motion(grid_scores):
    got = grid_scores
    failed = {k: f"{got[k]:.0%} < {v:.0%}" for k, v in THRESHOLDS.items() if got[k] < v}
    assert not failed, f"read as asked: {got}; below the bar: {failed}"


def test_the_grid_meets_the_issues_bars(grid_scores):
    assert all(grid_scores[k] >= v for k, v in ISSUE_BARS.items()), grid_scores


def test_the_direction_word_alone_changes_the_motion(manager):
    """One seed, four prompts that differ only in the direction: the clip follows the word, by a travel the
    training clips have (12-16 px; measured 14-19 on seeds 7, 8, 9)."""
    readings = {way: read_clip(draw(manager, data.video_prompt(5, "orange", way, "black"), 7))
                for way in data.DIRECTIONS}
    right = [way for way, r in readings.items() if r.direction == way and max(map(abs, r.travel)) >= 8]
    assert len(right) >= 3, {way: (r.direction, r.travel) for way, r in readings.items()}

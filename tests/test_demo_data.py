"""The demo data generator (backend/demo/data.py) and the oracles that read pictures (tests/oracles.py)."""
from __future__ import annotations

import numpy as np
import pytest

from backend.demo import data
from oracles import asked, read, score


def test_the_same_seed_gives_the_same_pictures_and_prompts():
    a = data.batch(np.random.default_rng(3), 16)
    b = data.batch(np.random.default_rng(3), 16)
    assert np.array_equal(a[0], b[0]) and a[2] == b[2]
    c = data.batch(np.random.default_rng(4), 16)
    assert not np.array_equal(a[0], c[0])


def test_base_data_leaves_out_digit_9_and_white_on_white():
    images, alphas, prompts = data.batch(np.random.default_rng(0), 600)
    wants = [asked(p) for p in prompts]  # every prompt is of the grammar
    assert all(w["digit"] != 9 for w in wants)
    assert not any(w["colour"] == "white" and w["background"] == "white" for w in wants)
    shapes = sum(w["shape"] is not None for w in wants) / len(wants)
    assert 0.18 < shapes < 0.32  # a quarter shapes
    assert {w["digit"] for w in wants if w["digit"] is not None} == set(range(9))
    assert images.shape == (600, 64, 64, 3) and images.dtype == np.uint8 and alphas.max() == 1.0


def test_held_out_digits_are_not_in_the_training_split():
    for d in range(10):
        train, test = set(data.digit_indices(d, "train")), set(data.digit_indices(d, "test"))
        assert train and test and not train & test


def test_the_oracles_read_clean_renders_as_their_prompts():
    """The oracles are only as good as this: renders of held-out digits (all ten) and shapes."""
    rng = np.random.default_rng(7)
    pairs = []
    for _ in range(300):
        item = data.random_item(rng, digits=tuple(range(10)))
        index = int(rng.choice(data.digit_indices(int(item.value), "test"))) if item.kind == "digit" else None
        pairs.append((item.prompt, data.render(item, rng, index=index)[0]))
    got = score(pairs)
    assert got["colour"] >= 0.97 and got["background"] == 1.0 and got["digit"] >= 0.95 and got["shape"] >= 0.97, got


def test_the_oracles_see_nothing_on_a_flat_picture_and_refuse_other_prompts():
    flat = np.full((64, 64, 3), 128, np.uint8)
    r = read(flat)
    assert r.background == "gray" and r.colour is None and r.digit is None and r.foreground == 0.0
    with pytest.raises(ValueError, match="not a prompt of the grammar"):
        asked("a purple dragon")

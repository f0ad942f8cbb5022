"""Oracles that read a demo picture: its background, foreground colour, digit and shape.

Written apart from the training code (``backend.demo.train``), from the rules of
DEMO-TRAINING.md, so a test can say whether a picture shows what its prompt asks. They take the
palette from the prompt grammar (``backend.demo.data``: the contract's colours) and nothing else.

- Background: the median of the border pixels; foreground: the pixels far from it.
- Colour: the palette entry nearest the foreground's median.
- Digit: an SVC fitted on ``load_digits`` here, applied to the foreground cropped to its box
  (squared, so a thin 1 keeps its shape) and averaged down to 8x8.
- Shape: the fill ratio of the foreground in its box (square ~1, circle ~0.79, triangle ~0.5).
- Motion (clips): the foreground's centroid over the frames; the direction is the axis and sign of
  its travel from the first frame to the last, when it travels far enough.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

from backend.demo.data import BACKGROUNDS, PALETTE

FAR = 80.0  # RGB distance from the background that counts as foreground


@dataclass(frozen=True)
class Reading:
    background: str
    colour: str | None
    digit: int | None
    shape: str | None
    foreground: float  # share of pixels that are foreground
    fill: float | None = None  # share of the foreground's box that is foreground (the shape oracle's figure)


def _nearest(table: dict, rgb) -> str:
    names = list(table)
    values = np.array([table[n] for n in names], np.float32)
    return names[int(np.argmin(((values - np.asarray(rgb, np.float32)) ** 2).sum(1)))]


@functools.lru_cache(maxsize=1)
def _digit_classifier():
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    digits = load_digits()
    return SVC(gamma=0.001, C=10.0).fit(digits.data, digits.target)


def _to_8x8(weight: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    y0, y1, x0, x1 = box
    side = max(y1 - y0, x1 - x0)  # a square box: a thin 1 keeps its shape (98% on clean renders)
    cy, cx = (y0 + y1) / 2, (x0 + x1) / 2
    h, w = weight.shape
    pad = side
    padded = np.pad(weight, pad)
    top = int(round(cy - side / 2)) + pad
    left = int(round(cx - side / 2)) + pad
    crop = padded[top:top + side, left:left + side]
    edges = np.linspace(0, side, 9).round().astype(int)
    out = np.array([[crop[edges[i]:max(edges[i + 1], edges[i] + 1), edges[j]:max(edges[j + 1], edges[j] + 1)].mean()
                     for j in range(8)] for i in range(8)])
    return out / max(out.max(), 1e-6) * 16.0


def read(image) -> Reading:
    """Read one RGB picture (PIL image or HxWx3 array)."""
    img = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, np.float32)
    border = np.concatenate([img[:2].reshape(-1, 3), img[-2:].reshape(-1, 3),
                             img[:, :2].reshape(-1, 3), img[:, -2:].reshape(-1, 3)])
    bg = np.median(border, axis=0)
    dist = np.sqrt(((img - bg) ** 2).sum(-1))
    mask = dist > FAR
    background = _nearest(BACKGROUNDS, bg)
    share = float(mask.mean())
    if mask.sum() < 12:
        return Reading(background, None, None, None, share)
    colour = _nearest(PALETTE, np.median(img[mask], axis=0))
    ys, xs = np.nonzero(mask)
    box = (ys.min(), ys.max() + 1, xs.min(), xs.max() + 1)
    weight = np.clip(dist / max(np.percentile(dist[mask], 90), 1.0), 0, 1)
    digit = int(_digit_classifier().predict(_to_8x8(weight, box).reshape(1, -1))[0])
    fill = mask[box[0]:box[1], box[2]:box[3]].mean()
    shape = "square" if fill > 0.9 else "circle" if fill > 0.64 else "triangle"
    return Reading(background, colour, digit, shape, share, float(fill))


def chroma(image) -> float:
    """Mean saturation of a picture: max - min of each pixel's RGB, averaged (0 for any grey picture)."""
    img = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, np.float32)
    return float((img.max(-1) - img.min(-1)).mean())


def read_colours(image) -> tuple[str, str | None]:
    """(background, foreground) as the nearest of every colour the grammar names, backgrounds and
    foreground colours alike: an inverted picture has a foreground colour behind a background colour."""
    img = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, np.float32)
    table = {**PALETTE, **BACKGROUNDS}
    border = np.concatenate([img[:2].reshape(-1, 3), img[-2:].reshape(-1, 3),
                             img[:, :2].reshape(-1, 3), img[:, -2:].reshape(-1, 3)])
    bg = np.median(border, axis=0)
    mask = np.sqrt(((img - bg) ** 2).sum(-1)) > FAR
    if mask.sum() < 12:
        return _nearest(table, bg), None
    return _nearest(table, bg), _nearest(table, np.median(img[mask], axis=0))


_PROMPT = re.compile(r"a (\w+) (?:digit (\d)|(circle|square|triangle)) on a (\w+) background")


def asked(prompt: str) -> dict:
    """What a grammar prompt asks for: colour, background and digit or shape."""
    m = _PROMPT.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not a prompt of the grammar: {prompt!r}")
    return {"colour": m[1], "digit": int(m[2]) if m[2] else None, "shape": m[3], "background": m[4]}


def score(pairs) -> dict:
    """Shares of (prompt, image) pairs whose colour, background, digit, shape read as asked."""
    hits = {"colour": [], "background": [], "digit": [], "shape": []}
    for prompt, image in pairs:
        want, got = asked(prompt), read(image)
        hits["colour"].append(got.colour == want["colour"])
        hits["background"].append(got.background == want["background"])
        if want["digit"] is not None:
            hits["digit"].append(got.digit == want["digit"])
        else:
            hits["shape"].append(got.shape == want["shape"])
    return {k: (sum(v) / len(v) if v else None) for k, v in hits.items()}


# ---------------------------------------------------------------- clips
MIN_TRAVEL = 6.0  # pixels (at 64x64) the centroid must travel for a clip to read as moving


@dataclass(frozen=True)
class ClipReading:
    background: str
    colour: str | None  # of the middle frame
    digit: int | None  # of the middle frame
    direction: str | None  # left, right, up, down; None when the centroid does not travel MIN_TRAVEL
    travel: tuple[float, float] | None  # (dy, dx) of the centroid, first frame to last


def centroid(image, background=None) -> tuple[float, float] | None:
    """The foreground's centroid (y, x) in one frame, the background given or read from its border."""
    img = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, np.float32)
    if background is None:
        border = np.concatenate([img[:2].reshape(-1, 3), img[-2:].reshape(-1, 3),
                                 img[:, :2].reshape(-1, 3), img[:, -2:].reshape(-1, 3)])
        background = np.median(border, axis=0)
    mask = np.sqrt(((img - np.asarray(background, np.float32)) ** 2).sum(-1)) > FAR
    if mask.sum() < 12:
        return None
    ys, xs = np.nonzero(mask)
    return float(ys.mean()), float(xs.mean())


def read_clip(frames) -> ClipReading:
    """Read a clip (a list of frames: PIL images or HxWx3 arrays): what its middle frame shows and where
    its foreground travels. The background is read once, from the border of every frame."""
    arrays = [np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, np.float32) for f in frames]
    border = np.concatenate([np.concatenate([a[:2].reshape(-1, 3), a[-2:].reshape(-1, 3), a[:, :2].reshape(-1, 3),
                                             a[:, -2:].reshape(-1, 3)]) for a in arrays])
    background = np.median(border, axis=0)
    middle = read(arrays[len(arrays) // 2].astype(np.uint8))
    first, last = centroid(arrays[0], background), centroid(arrays[-1], background)
    direction = travel = None
    if first is not None and last is not None:
        dy, dx = last[0] - first[0], last[1] - first[1]
        travel = (dy, dx)
        if max(abs(dy), abs(dx)) >= MIN_TRAVEL:
            direction = ("right" if dx > 0 else "left") if abs(dx) >= abs(dy) else ("down" if dy > 0 else "up")
    return ClipReading(_nearest(BACKGROUNDS, background), middle.colour, middle.digit, direction, travel)


_VIDEO_PROMPT = re.compile(r"a (\w+) digit (\d) moving (left|right|up|down) on a (\w+) background")


def asked_clip(prompt: str) -> dict:
    """What a video prompt of the grammar asks for: colour, digit, direction, background."""
    m = _VIDEO_PROMPT.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not a video prompt of the grammar: {prompt!r}")
    return {"colour": m[1], "digit": int(m[2]), "direction": m[3], "background": m[4]}


def score_clips(pairs) -> dict:
    """Shares of (prompt, frames) pairs whose direction, colour, background and digit read as asked."""
    hits = {"direction": [], "colour": [], "background": [], "digit": []}
    for prompt, frames in pairs:
        want, got = asked_clip(prompt), read_clip(frames)
        for key in hits:
            hits[key].append(getattr(got, key) == want[key])
    return {k: sum(v) / len(v) for k, v in hits.items()}


def clip_grid(unseen: list[str], per_direction: int = 8, first_seed: int = 40000) -> list[tuple[str, int]]:
    """The fixed grid a video model is scored on: ``per_direction`` prompts a direction, spread over ``unseen``
    (prompts no training clip had, from the model's training.json; where a direction has fewer, they come
    round again), each with its own seed no training used."""
    out = []
    for way in ("left", "right", "up", "down"):
        mine = [p for p in unseen if asked_clip(p)["direction"] == way]
        if not mine:
            raise ValueError(f"no unseen prompt moves {way}: the grid needs one a direction")
        step = max(1, len(mine) // per_direction)
        out += [mine[(i * step) % len(mine)] for i in range(per_direction)]
    return [(p, first_seed + i) for i, p in enumerate(out)]

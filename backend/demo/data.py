"""The demo models' data: coloured handwritten digits and filled shapes, with their prompts.

One deterministic generator, shared by the trainers (``backend.demo.train``) and the tests:
the same seed gives the same pictures and prompts on every machine. Digits are scikit-learn's
``load_digits`` (1,797 real 8x8 handwritten digits) upscaled into a 64x64 frame; shapes are
drawn at varied size and position. Digit 9 is kept out of the base models' data (a LoRA
teaches it). Prompts follow the grammar of CONTRACT.md:

    a {colour} digit {d} on a {background} background
    a {colour} {shape} on a {background} background
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

SIZE = 64

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 220, 40),
    "magenta": (210, 50, 200), "cyan": (40, 210, 220), "orange": (240, 140, 30), "white": (245, 245, 245),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (10, 10, 10), "white": (245, 245, 245), "gray": (128, 128, 128), "navy": (20, 30, 110),
}
SHAPES = ("circle", "square", "triangle")
BASE_DIGITS = tuple(range(9))  # 0-8: digit 9 is left out of the base models
#: Every word a prompt of the grammar uses, in a fixed order (the tokenizers make each one token).
GRAMMAR_WORDS = ("a", "digit", "on", "background", "moving", "left", "right", "up", "down",
                 *PALETTE, *(b for b in BACKGROUNDS if b not in PALETTE), *SHAPES, "9")


@dataclass(frozen=True)
class Item:
    """One picture's content: what the prompt names."""
    kind: str  # "digit" or "shape"
    value: str  # "0".."9" or a shape name
    colour: str
    background: str

    @property
    def prompt(self) -> str:
        what = f"digit {self.value}" if self.kind == "digit" else self.value
        return f"a {self.colour} {what} on a {self.background} background"


def prompt_for(kind: str, value, colour: str, background: str) -> str:
    return Item(kind, str(value), colour, background).prompt


def colour_pairs() -> list[tuple[str, str]]:
    """(colour, background) pairs that can be seen: white on white is left out."""
    return [(c, b) for c in PALETTE for b in BACKGROUNDS if PALETTE[c] != BACKGROUNDS[b]]


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # ships its data: no download

    d = load_digits()
    return d.images.astype(np.float32) / 16.0, d.target.astype(np.int64)


def digit_indices(digit: int, split: str = "train") -> np.ndarray:
    """Indices of one digit's samples; every fifth is held out ("test") from training."""
    images, target = _digits()
    idx = np.flatnonzero(target == digit)
    keep = (np.arange(len(idx)) % 5 != 0) if split == "train" else (np.arange(len(idx)) % 5 == 0)
    return idx[keep]


def _resize(a: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of a 2-D array (align corners off, as in image libraries)."""
    h, w = a.shape
    ys = (np.arange(size) + 0.5) * h / size - 0.5
    xs = (np.arange(size) + 0.5) * w / size - 0.5
    y0 = np.clip(np.floor(ys).astype(int), 0, h - 1)
    x0 = np.clip(np.floor(xs).astype(int), 0, w - 1)
    y1, x1 = np.clip(y0 + 1, 0, h - 1), np.clip(x0 + 1, 0, w - 1)
    fy = np.clip(ys - y0, 0, 1)[:, None]
    fx = np.clip(xs - x0, 0, 1)[None, :]
    top = a[y0][:, x0] * (1 - fx) + a[y0][:, x1] * fx
    bottom = a[y1][:, x0] * (1 - fx) + a[y1][:, x1] * fx
    return top * (1 - fy) + bottom * fy


def _digit_alpha(index: int, box: int) -> np.ndarray:
    images, _ = _digits()
    up = _resize(images[index], box)
    return np.clip((up - 0.25) / 0.4, 0.0, 1.0)  # crisp strokes, soft edges


def _shape_alpha(shape: str, box: int) -> np.ndarray:
    ss = 4  # supersampled, for smooth edges
    n = box * ss
    y, x = (np.mgrid[0:n, 0:n] + 0.5) / n
    if shape == "circle":
        inside = (x - 0.5) ** 2 + (y - 0.5) ** 2 <= 0.25
    elif shape == "square":
        inside = np.ones((n, n), bool)
    elif shape == "triangle":  # apex up, base at the bottom
        inside = np.abs(x - 0.5) <= y / 2
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return inside.reshape(box, ss, box, ss).mean(axis=(1, 3))


def foreground(item: Item, rng: np.random.Generator, size: int = SIZE, index: int | None = None) -> np.ndarray:
    """Where one item is drawn: its float HxW alpha. Position and size vary with ``rng``; a digit is
    one of the ``load_digits`` samples (``index``, or one drawn from the training split)."""
    if item.kind == "digit":
        box = int(rng.integers(size * 5 // 8, size * 13 // 16 + 1))  # 40..52 px at 64
        if index is None:
            index = int(rng.choice(digit_indices(int(item.value))))
        alpha_box = _digit_alpha(index, box)
    else:
        box = int(rng.integers(size * 3 // 8, size * 3 // 4 + 1))  # 24..48 px at 64
        alpha_box = _shape_alpha(item.value, box)
    margin = size - box
    y0 = int(rng.integers(margin // 4, margin - margin // 4 + 1))
    x0 = int(rng.integers(margin // 4, margin - margin // 4 + 1))
    alpha = np.zeros((size, size), np.float32)
    alpha[y0:y0 + box, x0:x0 + box] = alpha_box
    return alpha


def _paint(alpha: np.ndarray, fg, bg) -> np.ndarray:
    fg, bg = np.asarray(fg, np.float32), np.asarray(bg, np.float32)
    image = bg + alpha[..., None] * (fg - bg)
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def render(item: Item, rng: np.random.Generator, size: int = SIZE, index: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Draw one item: (uint8 HxWx3 image, float HxW foreground alpha)."""
    alpha = foreground(item, rng, size, index)
    return _paint(alpha, PALETTE[item.colour], BACKGROUNDS[item.background]), alpha


def random_item(rng: np.random.Generator, digits=BASE_DIGITS, shape_fraction: float = 0.25) -> Item:
    colour, background = colour_pairs()[int(rng.integers(len(colour_pairs())))]
    if rng.random() < shape_fraction:
        return Item("shape", SHAPES[int(rng.integers(len(SHAPES)))], colour, background)
    return Item("digit", str(digits[int(rng.integers(len(digits)))]), colour, background)


def batch(rng: np.random.Generator, n: int, size: int = SIZE, digits=BASE_DIGITS,
          shape_fraction: float = 0.25) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``n`` random training pictures: (uint8 n×H×W×3, float n×H×W alpha, prompts)."""
    images, alphas, prompts = [], [], []
    for _ in range(n):
        item = random_item(rng, digits, shape_fraction)
        image, alpha = render(item, rng, size)
        images.append(image)
        alphas.append(alpha)
        prompts.append(item.prompt)
    return np.stack(images), np.stack(alphas), prompts


# ---------------------------------------------------------------- what the demo LoRAs teach
#: The demo LoRAs of demo:qwen-image (CONTRACT.md): name -> (trigger words, what the picture becomes).
LORA_EFFECTS: dict[str, str] = {
    "grayscale": "the colour drains out: foreground and background become their own luminance",
    "inverted": "foreground and background colours swap",
    "outline": "only the contour is drawn",
    "nine": "the digit 9, which the base model never saw",
}
OUTLINE_WIDTH = 3  # pixels at 64x64: lines the 4x-down VAE decodes once its decoder is tuned (stage vae-decoder)


def luminance(rgb) -> float:
    """ITU-R BT.601 luma, the grayscale a picture editor gives."""
    r, g, b = rgb
    return 0.299 * r + 0.587 * g + 0.114 * b


def outline_alpha(alpha: np.ndarray, width: int = OUTLINE_WIDTH) -> np.ndarray:
    """The contour of a foreground: ``alpha`` less its erosion by ``width`` pixels (a min filter)."""
    k = 2 * width + 1
    eroded = np.lib.stride_tricks.sliding_window_view(np.pad(alpha, width), (k, k)).min(axis=(-2, -1))
    return np.clip(alpha - eroded, 0.0, 1.0)


def render_effect(effect: str, item: Item, rng: np.random.Generator,
                  size: int = SIZE) -> tuple[np.ndarray, np.ndarray]:
    """``item`` drawn the way the LoRA ``effect`` changes it: (uint8 HxWx3, float HxW alpha of what is
    drawn); ``nine`` draws as asked."""
    if effect not in LORA_EFFECTS:
        raise ValueError(f"unknown effect {effect!r}; known: {', '.join(LORA_EFFECTS)}")
    alpha = foreground(item, rng, size)
    fg, bg = PALETTE[item.colour], BACKGROUNDS[item.background]
    if effect == "grayscale":
        fg, bg = (luminance(fg),) * 3, (luminance(bg),) * 3
    elif effect == "inverted":
        fg, bg = bg, fg
    elif effect == "outline":
        alpha = outline_alpha(alpha)
    return _paint(alpha, fg, bg), alpha


# ---------------------------------------------------------------- video: a digit moving the named way
#: The video grammar's directions (CONTRACT.md): ``a {colour} digit {d} moving {direction} on a {background} background``
DIRECTIONS = ("left", "right", "up", "down")
FRAMES = 9  # the demo Wan models' default clip: 9 frames (Wan's 4k+1 rule), 5 latent frames at 2x down in time
VIDEO_PAD = 3  # pixels the moving digit keeps from the frame's edge


@dataclass(frozen=True)
class Clip:
    """One clip's content: a digit, its colours and where it moves."""
    digit: str
    colour: str
    background: str
    direction: str

    @property
    def prompt(self) -> str:
        return video_prompt(self.digit, self.colour, self.direction, self.background)


def video_prompt(digit, colour: str, direction: str, background: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; known: {', '.join(DIRECTIONS)}")
    return f"a {colour} digit {digit} moving {direction} on a {background} background"


def random_clip(rng: np.random.Generator, digits=BASE_DIGITS) -> Clip:
    colour, background = colour_pairs()[int(rng.integers(len(colour_pairs())))]
    return Clip(str(digits[int(rng.integers(len(digits)))]), colour, background,
                DIRECTIONS[int(rng.integers(len(DIRECTIONS)))])


def render_clip(clip: Clip, rng: np.random.Generator, frames: int = FRAMES, size: int = SIZE,
                index: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Draw one clip: (uint8 F×H×W×3 frames, float F×H×W alpha). The digit (a ``load_digits`` sample,
    28-36 px at 64) starts in the middle of the frame and travels to the named edge at an even pace (12-16 px
    at 64); its place across the motion is drawn from ``rng``.

    Why from the middle, not edge to edge: the Wan transformer knows positions only relative to each other
    (3-D RoPE, no absolute embedding), so it can hardly tell where the frame's left edge is from noise. Edge
    to edge, the way a clip moves is fixed by the edge it starts at, which the sampler's noise picks: the
    demo model trained so (9,000 steps) moved along the asked axis always and the asked way half the time.
    From the middle, where the digit starts says nothing of the way it goes, and only the prompt does."""
    box = int(rng.integers(size * 7 // 16, size * 9 // 16 + 1))  # 28..36 px at 64
    if index is None:
        index = int(rng.choice(digit_indices(int(clip.digit))))
    sprite = _digit_alpha(index, box)
    lo, hi = VIDEO_PAD, size - box - VIDEO_PAD
    across = int(rng.integers(lo, hi + 1))
    alphas = np.zeros((frames, size, size), np.float32)
    middle = (lo + hi) / 2
    for f in range(frames):
        along = middle + (hi - middle) * f / max(1, frames - 1)
        if clip.direction in ("left", "up"):
            along = hi + lo - along
        along = int(round(along))
        y0, x0 = (across, along) if clip.direction in ("left", "right") else (along, across)
        alphas[f, y0:y0 + box, x0:x0 + box] = sprite
    fg, bg = PALETTE[clip.colour], BACKGROUNDS[clip.background]
    return np.stack([_paint(a, fg, bg) for a in alphas]), alphas


def clip_batch(rng: np.random.Generator, n: int, frames: int = FRAMES, size: int = SIZE,
               digits=BASE_DIGITS) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``n`` random training clips: (uint8 n×F×H×W×3, float n×F×H×W alpha, prompts)."""
    videos, alphas, prompts = [], [], []
    for _ in range(n):
        clip = random_clip(rng, digits)
        video, alpha = render_clip(clip, rng, frames, size)
        videos.append(video)
        alphas.append(alpha)
        prompts.append(clip.prompt)
    return np.stack(videos), np.stack(alphas), prompts

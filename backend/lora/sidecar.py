"""A1111's sidecar: ``<name>.json`` beside an adapter file, as AUTOMATIC1111's "Edit metadata" and Civitai's
helpers write it::

    {"description": "...", "sd version": "...", "activation text": "pixel art, 16-bit",
     "preferred weight": 0.8, "negative text": "blurry", "notes": "..."}

Read here: the preferred weight (the weight a request, a ``<lora:NAME>`` tag or "Add to stack" gets when it
names none; A1111's 0 means "not set"), the activation text (shown first among the trigger words) and the
negative text (shown on the card). The file is a convenience written by other tools, so it is read as
untrusted and never stops the adapter from being used: a regular file only (no link followed, no FIFO or
device waited on), at most ``MAX_BYTES``, known fields of the right type, texts cut to ``MAX_TEXT``; anything
else reads as no sidecar. Cached by (path, mtime, size).
"""
from __future__ import annotations

import json
import math
import os
import stat
import threading
from pathlib import Path

MAX_BYTES = 64 * 1024
MAX_TEXT = 1000
MAX_WEIGHT = 100.0  # |preferred weight| above this reads as unset (A1111's slider goes to 2)
EMPTY = {"preferred_weight": None, "activation_text": "", "negative_text": ""}

_cache: dict[str, tuple[tuple, dict]] = {}
_lock = threading.Lock()


def path_for(adapter: str | os.PathLike) -> Path:
    """The sidecar of an adapter file (``x.safetensors`` -> ``x.json``) or PEFT folder (``x`` -> ``x.json``)."""
    p = Path(adapter)
    return p.with_suffix(".json") if p.suffix.lower() == ".safetensors" else p.parent / f"{p.name}.json"


def read(adapter: str | os.PathLike) -> dict:
    """``{"preferred_weight": float | None, "activation_text": str, "negative_text": str}`` (``EMPTY`` when
    there is no readable sidecar)."""
    where = path_for(adapter)
    try:
        st = os.lstat(where)
    except OSError:
        return dict(EMPTY)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
        return dict(EMPTY)
    stamp = (st.st_mtime_ns, st.st_size)
    with _lock:
        hit = _cache.get(str(where))
    if hit and hit[0] == stamp:
        return dict(hit[1])
    try:
        fd = os.open(where, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as fh:
            data = json.loads(fh.read(MAX_BYTES + 1)[:MAX_BYTES])
    except (OSError, ValueError, RecursionError):
        data = None
    out = parse(data)
    with _lock:
        if len(_cache) > 4096:
            _cache.clear()
        _cache[str(where)] = (stamp, out)
    return dict(out)


def parse(data) -> dict:
    """The fields this reads from a sidecar's JSON (anything not a JSON object reads as none)."""
    out = dict(EMPTY)
    if not isinstance(data, dict):
        return out
    weight = data.get("preferred weight")
    if isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight) \
            and weight != 0 and abs(weight) <= MAX_WEIGHT:
        out["preferred_weight"] = float(weight)
    for key, field in (("activation text", "activation_text"), ("negative text", "negative_text")):
        text = data.get(key)
        if isinstance(text, str):
            out[field] = " ".join(text.split())[:MAX_TEXT]
    return out


def preferred_weight(adapter: str | os.PathLike) -> float:
    """The weight an adapter gets when a request names none: its sidecar's, else 1.0."""
    weight = read(adapter)["preferred_weight"]
    return 1.0 if weight is None else weight

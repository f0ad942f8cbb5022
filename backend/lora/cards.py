"""What a LoRA browser card shows about one adapter, read from its safetensors header only.

``card_info(metadata)`` turns a file's ``__metadata__`` (strings written by strangers) into
bounded, plain values: a title, trigger words (``modelspec.trigger_phrase``, kohya's
``ss_output_name`` and the most frequent ``ss_tag_frequency`` tags) and an embedded preview
(``modelspec.thumbnail``, accepted only as a PNG/JPEG/WebP data URL under ``MAX_THUMBNAIL``
characters whose bytes start like that image type). ``header_card(path)`` reads the header
(never the tensors) and caches the result by (path, mtime, size), like the library's rows.
``family_of`` names a base-model family from a model id or a publisher's hint.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
import threading
from pathlib import Path

MAX_TEXT = 80  # characters of a title or one trigger word
MAX_DESCRIPTION = 300  # characters of a description
MAX_TRIGGERS = 12  # trigger words per card, all sources together
MAX_TAG_JSON = 1 << 20  # characters of ss_tag_frequency parsed at most
MAX_THUMBNAIL = 512 * 1024  # characters of a thumbnail data URL (about 380 KiB of image)
_THUMB = re.compile(r"data:image/(png|jpeg|webp);base64,([A-Za-z0-9+/]+={0,2})")
_MAGIC = {"png": (b"\x89PNG\r\n\x1a\n",), "jpeg": (b"\xff\xd8\xff",), "webp": (b"RIFF",)}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069]")

# (substring of a lower-cased model id or hint, family shown); the first match wins
FAMILIES = (("wan2.2", "Wan2.2"), ("wan2_2", "Wan2.2"), ("wan-2.2", "Wan2.2"), ("wan22", "Wan2.2"),
            ("wan2.1", "Wan2.1"), ("wan2_1", "Wan2.1"), ("wan21", "Wan2.1"), ("wan", "Wan"), ("sd35", "SD3"), ("qwen", "Qwen-Image"), ("flux", "FLUX"),
            ("hunyuan", "HunyuanVideo"), ("ltx", "LTX-Video"), ("sdxl", "SDXL"), ("sd_xl", "SDXL"),
            ("stable-diffusion-xl", "SDXL"), ("sd3", "SD3"), ("stable-diffusion-3", "SD3"),
            ("sd1", "SD1.x"), ("sd-v1", "SD1.x"), ("stable-diffusion-v1", "SD1.x"), ("sd2", "SD2.x"),
            ("cogvideo", "CogVideoX"), ("minimax", "MiniMax"))


def clean_text(value, limit: int = MAX_TEXT) -> str:
    """One line of at most ``limit`` characters, control and bidi characters removed."""
    text = " ".join(_CONTROL.sub(" ", str(value)).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def family_of(name: str | None) -> str | None:
    """The base-model family a model id or a metadata hint names (``Wan-AI/Wan2.2-T2V-A14B`` -> Wan2.2)."""
    low = (name or "").lower()
    if low.startswith("demo:"):
        low = low[5:]
    for needle, family in FAMILIES:
        if needle in low:
            return family
    return None


def thumbnail(value) -> tuple[str | None, str | None]:
    """(the data URL, None) when ``value`` is an acceptable preview; (None, why) when it is not."""
    if not isinstance(value, str) or not value:
        return None, None
    if len(value) > MAX_THUMBNAIL:
        return None, f"thumbnail larger than {MAX_THUMBNAIL // 1024} KiB refused"
    m = _THUMB.fullmatch(value.strip())
    if not m:
        return None, "thumbnail refused (only data:image/png, jpeg or webp;base64 URLs are shown)"
    try:
        head = base64.b64decode(m.group(2)[:64] + "=" * (-len(m.group(2)[:64]) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None, "thumbnail refused (not base64)"
    if not head.startswith(_MAGIC[m.group(1)]) or (m.group(1) == "webp" and head[8:12] != b"WEBP"):
        return None, f"thumbnail refused (its bytes are not a {m.group(1).upper()} image)"
    return value.strip(), None


def _top_tags(raw: str) -> list[str]:
    """kohya's ``ss_tag_frequency`` ({dataset: {tag: count}}): tags by total count, most first."""
    if not isinstance(raw, str) or len(raw) > MAX_TAG_JSON:
        return []
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return []
    totals: dict[str, float] = {}
    if not isinstance(data, dict):
        return []
    for tags in data.values():
        if not isinstance(tags, dict):
            continue
        for tag, count in tags.items():
            n = count if isinstance(count, (int, float)) and not isinstance(count, bool) else 0
            totals[tag] = totals.get(tag, 0) + n
    return [t for t, _ in sorted(totals.items(), key=lambda tc: (-tc[1], tc[0]))[: 4 * MAX_TRIGGERS]]


def card_info(metadata: dict | None) -> dict:
    """Bounded card fields from a ``__metadata__`` dict: title, triggers, description, thumbnail,
    thumbnail_note, base_model (the publisher's hint, trimmed)."""
    md = metadata if isinstance(metadata, dict) else {}
    candidates: list[str] = []
    phrase = md.get("modelspec.trigger_phrase")
    if isinstance(phrase, str):
        candidates += phrase.split(",")
    if isinstance(md.get("ss_output_name"), str):
        candidates.append(md["ss_output_name"])
    candidates += _top_tags(md.get("ss_tag_frequency"))
    triggers: list[str] = []
    for c in candidates:
        word = clean_text(c)
        if word and word not in triggers:
            triggers.append(word)
        if len(triggers) >= MAX_TRIGGERS:
            break
    thumb, note = thumbnail(md.get("modelspec.thumbnail"))
    title = md.get("modelspec.title") or md.get("ss_output_name") or ""
    hint = next((md[k] for k in ("modelspec.architecture", "ss_base_model_version", "base_model", "ss_sd_model_name")
                 if isinstance(md.get(k), str) and md[k]), "")
    about = md.get("modelspec.description")
    return {"title": clean_text(title) if isinstance(title, str) else "", "triggers": triggers,
            "description": clean_text(about, MAX_DESCRIPTION) if isinstance(about, str) else "",
            "thumbnail": thumb, "thumbnail_note": note, "base_model": clean_text(hint)}


_cards: dict[tuple, dict] = {}
_CACHE = 8000
_lock = threading.Lock()


def header_card(path: str | Path) -> dict:
    """``card_info`` of an adapter file or PEFT folder, plus its ``mtime`` (for sorting); read from
    the header only and cached by (path, mtime, size). An unreadable header gives empty fields."""
    from .formats import read_header, weights_file
    from .library import _stamp

    path = Path(path)
    try:
        key = _stamp(path)
    except (OSError, ValueError):
        return {**card_info({}), "mtime": 0.0}
    with _lock:
        hit = _cards.get(key)
    if hit is not None:
        return dict(hit)
    try:
        file = weights_file(path)
        _, metadata = read_header(file)
        mtime = file.stat().st_mtime
    except Exception:  # noqa: BLE001 - the library row already says why the file cannot be used
        metadata, mtime = {}, 0.0
    card = {**card_info(metadata), "mtime": mtime}
    with _lock:
        if len(_cards) >= _CACHE:
            _cards.clear()
        _cards[key] = card
    return dict(card)

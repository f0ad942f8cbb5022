"""The application's settings (the UI's Settings tab), kept in ``<data-dir>/preferences.json``.

A1111 keeps its settings in ``config.json`` and ComfyUI in ``comfy.settings.json`` beside the
app; ours live in the data directory with everything else the app writes, so a restart, an
upgrade or a second checkout on the same data directory keeps them. One pydantic model says
every setting's type and range (an error names the setting); the file is written atomically and
read back bounded (a hand-edited file that is too big, not JSON or out of range is named in one
line and the defaults stand, so a bad edit never stops a start). What reads them:

- ``default_model``: the model ``python app.py serve`` loads when the command names none.
- ``width`` / ``height`` / ``steps``: the Generate tab's values for a model's blank fields (over the
  model's own defaults; the HTTP API keeps the model's, so scripts do not change under a setting).
- ``output_format``: png, jpeg or webp for image results (metadata in each, backend/outputs.py).
- ``filename_pattern``: the result's file name from ``{date}``, ``{time}``, ``{seed}``, ``{model}``,
  ``{prompt}``, ``{number}`` and ``{id}``; each value is reduced to ``[A-Za-z0-9._-]`` and cut, and a
  short unique tail is added unless ``{id}`` is in it, so nothing is overwritten and nothing a prompt
  says can choose a folder (``filename``).
- ``live_previews``: whether running jobs get live previews at all (off: the worker makes none).
- ``notifications``: whether the page raises a browser notification when a job ends.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import settings
from .errors import InvalidParameter

FILE = "preferences.json"
MAX_BYTES = 64 * 1024  # a settings file is a few hundred bytes; a bigger one is not ours
TOKENS = ("date", "time", "seed", "model", "prompt", "number", "id")
_TOKEN = re.compile(r"\{([a-z]+)\}")
_PLAIN = re.compile(r"[^A-Za-z0-9._-]+")
PROMPT_CHARS = 40  # of the prompt in a file name
NAME_CHARS = 120  # a file name's stem at most (file systems allow 255 bytes)


class Preferences(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_model: str | None = Field(None, max_length=300)
    width: int | None = Field(None, ge=16, le=8192)
    height: int | None = Field(None, ge=16, le=8192)
    steps: int | None = Field(None, ge=1, le=1000)
    output_format: Literal["png", "jpeg", "webp"] = "png"
    filename_pattern: str = Field("{date}-{seed}", min_length=1, max_length=100)
    live_previews: bool = True
    notifications: bool = True

    @field_validator("width", "height")
    @classmethod
    def _multiple_of_16(cls, v):
        if v is not None and v % 16:
            raise ValueError("must be a multiple of 16")
        return v

    @field_validator("filename_pattern")
    @classmethod
    def _pattern(cls, v: str):
        unknown = sorted(set(_TOKEN.findall(v)) - set(TOKENS))
        if unknown:
            raise ValueError(f"unknown token {{{unknown[0]}}}; the tokens are " + ", ".join(f"{{{t}}}" for t in TOKENS))
        literal = _TOKEN.sub("", v)
        if _PLAIN.search(literal) or literal.startswith(".") or ".." in literal:
            raise ValueError("outside its {tokens} a pattern may hold letters, digits, '.', '_' and '-' only "
                             "(no folders, no leading dot)")
        if not _TOKEN.search(v):
            raise ValueError("needs at least one {token}, e.g. {date}-{seed}")
        return v

    @property
    def suffix(self) -> str:
        return ".jpg" if self.output_format == "jpeg" else f".{self.output_format}"


def _path(data_dir) -> Path:
    return settings.data_dir(data_dir) / FILE


_cache: dict[str, tuple[tuple, Preferences]] = {}
_lock = threading.Lock()


def load(data_dir=None) -> Preferences:
    """The saved settings (the defaults where there is no file); read again only when the file changed.
    A file that cannot be used is named on stderr once per change, and the defaults stand."""
    path = _path(data_dir)
    try:
        st = path.stat()
    except FileNotFoundError:
        return Preferences()
    stamp = (st.st_mtime_ns, st.st_size)
    with _lock:
        hit = _cache.get(str(path))
        if hit and hit[0] == stamp:
            return hit[1]
    try:
        prefs = read(path)
    except InvalidParameter as exc:
        print(f"warning: {exc.message}; using the default settings", file=sys.stderr, flush=True)
        prefs = Preferences()
    with _lock:
        _cache[str(path)] = (stamp, prefs)
    return prefs


def read(path: Path) -> Preferences:
    """A settings file, checked: at most MAX_BYTES, a JSON object, every setting known and in range."""
    with open(path, "rb") as fh:
        raw = fh.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise InvalidParameter(f"{path}: over {MAX_BYTES // 1024} KiB, not a settings file", param="preferences")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidParameter(f"{path}: not JSON ({exc.msg}, line {exc.lineno})", param="preferences") from None
    return check(data, where=str(path))


def check(data, where: str = "settings") -> Preferences:
    """``data`` (a dict of settings) as Preferences; the first problem named by its setting."""
    if not isinstance(data, dict):
        raise InvalidParameter(f"{where}: must be an object of settings", param="preferences")
    try:
        return Preferences(**data)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(str(p) for p in err.get("loc") or ()) or "preferences"
        message = str(err.get("msg", "is not valid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            message = "is not a setting; the settings are " + ", ".join(Preferences.model_fields)
        raise InvalidParameter(f"{where}: '{name}' {message}", param=name) from None


def save(data: dict, data_dir=None) -> Preferences:
    """Check and write the settings (atomically: a crash leaves the old file or the new one)."""
    prefs = check(data)
    path = _path(data_dir)
    fd, tmp = tempfile.mkstemp(prefix="." + FILE + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(prefs.model_dump_json(indent=2))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return prefs


def _plain(value, limit: int) -> str:
    return _PLAIN.sub("-", str(value)).strip("-.")[:limit].strip("-.")


def filename(prefs: Preferences, metadata: dict, suffix: str) -> str:
    """A result's file name from the pattern: each token's value reduced to ``[A-Za-z0-9._-]`` (the prompt
    to PROMPT_CHARS), the stem cut to NAME_CHARS, and a unique tail unless the job id is in it."""
    created = str(metadata.get("created") or "")
    now = time.localtime()
    values = {
        "date": created[:10].replace("-", "") or time.strftime("%Y%m%d", now),
        "time": created[11:19].replace(":", "") or time.strftime("%H%M%S", now),
        "seed": metadata.get("seed", ""),
        "model": str(metadata.get("model") or "").replace(":", "-").rsplit("/", 1)[-1],
        "prompt": (metadata.get("params") or {}).get("prompt") or "",
        "number": metadata.get("job_number", ""),
        "id": metadata.get("job_id", ""),
    }
    stem = _TOKEN.sub(lambda m: _plain(values[m.group(1)], PROMPT_CHARS if m.group(1) == "prompt" else 64),
                      prefs.filename_pattern)
    stem = _plain(stem, NAME_CHARS) or "out"
    if "{id}" not in prefs.filename_pattern or not values["id"]:
        stem = f"{stem}-{uuid.uuid4().hex[:8]}"
    return stem + suffix

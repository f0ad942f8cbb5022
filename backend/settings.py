"""Where LoRA Studio keeps its files.

The data directory comes from ``--data-dir``, else ``$LORA_STUDIO_HOME``, else
``~/.cache/lora-studio``. Everything the app writes lives under it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

ENV_VAR = "LORA_STUDIO_HOME"


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Return the data directory, creating it if needed."""
    if explicit is not None:
        root = Path(explicit)
    elif os.environ.get(ENV_VAR):
        root = Path(os.environ[ENV_VAR])
    else:
        root = Path.home() / ".cache" / "lora-studio"
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir(root: str | os.PathLike | None = None) -> Path:
    return _sub(root, "models")


def adapters_dir(root: str | os.PathLike | None = None) -> Path:
    return _sub(root, "adapters")


def demo_dir(root: str | os.PathLike | None = None) -> Path:
    """``<data-dir>/demo``: files generated for the demo models (their adapters in ``adapters/``, the
    presets' distill stand-ins in ``distill/``). Never the user's adapter library."""
    return _sub(root, "demo")


def demo_adapters_dir(root: str | os.PathLike | None = None) -> Path:
    """``<data-dir>/demo/adapters``: the demo adapter library, an adapter root for demo models only."""
    return data_dir(root) / "demo" / "adapters"


def adapter_roots(adapter_dirs=(), root: str | os.PathLike | None = None, demo: bool = False) -> list[Path]:
    """The adapter roots in search order: ``<data-dir>/adapters`` (the library), each ``--adapter-dir``,
    then, when a demo model is served (``demo``), ``<data-dir>/demo/adapters``; duplicates dropped."""
    out: list[Path] = []
    extra = [demo_adapters_dir(root)] if demo else []
    for p in [adapters_dir(root), *(adapter_dirs or ()), *extra]:
        p = Path(p).expanduser().resolve()
        if p not in out:
            out.append(p)
    return out


def outputs_dir(root: str | os.PathLike | None = None) -> Path:
    return _sub(root, "outputs")


def previews_dir(root: str | os.PathLike | None = None) -> Path:
    """The LoRA browser's generated previews: ``<sha256 of the adapter>.png`` (Studio.make_preview)."""
    return _sub(root, "previews")


def jobs_db(root: str | os.PathLike | None = None) -> Path:
    return data_dir(root) / "jobs.sqlite"


def _sub(root, name: str) -> Path:
    path = data_dir(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


#: the file that marks a folder of demo adapters as ours (backend/lora/demo_adapters.py)
DEMO_ADAPTERS_MARKER = ".demo-adapters"


def retire_old_demo_layout(data_dir=None) -> list[str]:
    """Remove what versions before the demo root wrote into the user's own library: the demo adapter
    folder ``<library>/demo`` (ours only when it carries our marker) and the distill stand-ins in
    ``<library>/distill`` (ours only when their safetensors header carries ``lora_studio_demo``); a
    user's file there is never touched. Returns what was removed (a leftover would list every demo
    adapter twice and rename them by path)."""
    library = adapters_dir(data_dir)
    removed: list[str] = []
    old = library / "demo"
    if (old / DEMO_ADAPTERS_MARKER).is_file() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
        removed.append(str(old))
        lock = library / "demo.lock"  # its writer's lock file
        if lock.is_file() and not lock.is_symlink():
            lock.unlink()
    stand_ins = library / "distill"
    if stand_ins.is_dir() and not stand_ins.is_symlink():
        for f in sorted(stand_ins.glob("*.safetensors")):
            if f.is_file() and not f.is_symlink() and "lora_studio_demo" in _header_metadata(f):
                f.unlink()
                removed.append(str(f))
        try:
            stand_ins.rmdir()  # only when nothing of the user's is left in it
        except OSError:
            pass
    return removed


def _header_metadata(path: Path) -> dict:
    """A safetensors file's ``__metadata__`` from its JSON header (no tensor read); {} if unreadable."""
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > 8 << 20:
                return {}
            return json.loads(fh.read(size)).get("__metadata__") or {}
    except (OSError, ValueError, struct.error):
        return {}


# A name a client gives something written under the data dir (an adapter in the library root, a baked model
# under models/baked) becomes one file or folder name there: one plain name, no path.
MAX_NAME_LEN = 128
_NAME = re.compile(r"[\w][\w.+@ -]*")


def check_plain_name(name, param: str = "name", what: str = "adapter") -> str:
    """The one rule for a name a client gives something written to disk (UI import, service, bake):
    word characters, digits and ``. _ - + @`` and spaces, not starting with a dot or a space, no path
    separators, at most MAX_NAME_LEN characters. Checked before any byte is written."""
    from .errors import InvalidParameter

    if not isinstance(name, str) or not name.strip():
        raise InvalidParameter(f"the {what} name must be a non-empty string", param=param)
    shown = repr(name[:60]) + ("..." if len(name) > 60 else "")
    if len(name) > MAX_NAME_LEN or not _NAME.fullmatch(name) or name.endswith((" ", ".")) or ".." in name:
        raise InvalidParameter(f"{what} name {shown} is not a plain file name: use letters, digits and "
                               f"'._-+@ ' (no '/', '\\', '..', no leading dot), at most {MAX_NAME_LEN} characters",
                               param=param)
    return name

"""Where LoRA Studio keeps its files.

The data directory comes from ``--data-dir``, else ``$LORA_STUDIO_HOME``, else
``~/.cache/lora-studio``. Everything the app writes lives under it.
"""
from __future__ import annotations

import os
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


def jobs_db(root: str | os.PathLike | None = None) -> Path:
    return data_dir(root) / "jobs.sqlite"


def _sub(root, name: str) -> Path:
    path = data_dir(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path

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


def outputs_dir(root: str | os.PathLike | None = None) -> Path:
    return _sub(root, "outputs")


def jobs_db(root: str | os.PathLike | None = None) -> Path:
    return data_dir(root) / "jobs.sqlite"


def _sub(root, name: str) -> Path:
    path = data_dir(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path

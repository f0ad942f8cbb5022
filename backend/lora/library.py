"""The adapter library: what is on disk under the adapter roots, and how each fits a model.

``library_rows(model, adapter_dirs, data_dir)`` is what ``python app.py adapters`` prints:
one row per adapter with format, rank, alpha, size, sha256 and (given a model) the fit
report's one-line summary. Fit is computed against meta-device skeletons of the
model's denoisers (built from their configs), so listing never loads model weights.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import settings
from ..errors import StudioError
from .formats import PEFT_CONFIG, PICKLE_SUFFIXES, AdapterRecord, inspect


@dataclass
class LibraryEntry:
    name: str
    path: Path
    record: AdapterRecord | None = None
    error: str | None = None  # why it cannot be used at all (pickle, corrupt, ...)


def roots(adapter_dirs=None, data_dir=None) -> list[Path]:
    """``<data-dir>/adapters`` first, then each ``--adapter-dir`` (duplicates dropped)."""
    out: list[Path] = []
    for p in [settings.adapters_dir(data_dir), *(adapter_dirs or [])]:
        p = Path(p).expanduser().resolve()
        if p not in out:
            out.append(p)
    return out


def scan(adapter_dirs=None, data_dir=None) -> list[LibraryEntry]:
    """Every adapter under the roots: PEFT folders, .safetensors files, refused pickles."""
    found: list[tuple[Path, Path]] = []  # (root, path)
    for root in roots(adapter_dirs, data_dir):
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            here = Path(dirpath)
            if PEFT_CONFIG in filenames:
                found.append((root, here))
                dirnames[:] = []  # a PEFT folder is one adapter
                continue
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for f in sorted(filenames):
                if f.lower().endswith((".safetensors",) + PICKLE_SUFFIXES):
                    found.append((root, here / f))
    stems: dict[str, int] = {}
    for _, p in found:
        stems[_stem(p)] = stems.get(_stem(p), 0) + 1
    entries = []
    for root, p in sorted(found, key=lambda rp: str(rp[1])):
        name = _stem(p) if stems[_stem(p)] == 1 else str(p.relative_to(root).with_suffix(""))
        try:
            entries.append(LibraryEntry(name, p, record=inspect(p, name)))
        except StudioError as exc:
            entries.append(LibraryEntry(name, p, error=exc.message))
    return entries


def _stem(p: Path) -> str:
    return p.name if p.is_dir() else p.stem


def find(name: str, adapter_dirs=None, data_dir=None) -> LibraryEntry | None:
    for entry in scan(adapter_dirs, data_dir):
        if entry.name == name:
            return entry
    return None


def denoiser_skeletons(model_id: str, data_dir=None):
    """(pipeline class, {component: module on the meta device}) from the model's configs only."""
    import diffusers

    from ..models import resolve_model, spec_for

    resolved = resolve_model(model_id, data_dir)
    spec = spec_for(resolved.class_name)
    out = {}
    for comp in spec.denoisers:
        config_file = Path(resolved.path) / comp / "config.json"
        if not config_file.is_file():
            continue
        cls = getattr(diffusers, json.loads(config_file.read_text())["_class_name"])
        with torch.device("meta"):
            out[comp] = cls.from_config(cls.load_config(config_file.parent))
    return getattr(diffusers, resolved.class_name), out


def library_rows(model: str | None = None, adapter_dirs=None, data_dir=None) -> list[dict]:
    """Printable rows: name, format, rank, alpha, size, sha256, base model hint, fit, path.

    With ``model``, each adapter is fitted against that model's denoisers (``fit`` is the
    report's summary, ``fits`` a bool). Demo adapters are written first for demo models.
    """
    from . import demo_adapters
    from .adapter import fit_adapter

    if model is None or model.startswith("demo:"):
        demo_adapters.ensure(data_dir)
    skeleton = denoiser_skeletons(model, data_dir) if model else None
    rows = []
    for entry in scan(adapter_dirs, data_dir):
        rec = entry.record
        row = {"name": entry.name, "path": str(entry.path), "format": rec.format if rec else "-",
               "rank": rec.rank if rec else "-", "alpha": _num(rec.alpha) if rec else "-",
               "size": _size(rec.size_bytes) if rec else "-", "size_bytes": rec.size_bytes if rec else 0,
               "sha256": rec.sha256 if rec else "", "base_model": (rec.base_model or "") if rec else ""}
        if entry.error:
            row.update(fit=f"refused: {entry.error}", fits=False)
        elif skeleton is not None:
            try:
                report = fit_adapter(entry.path, skeleton[0], skeleton[1], name=entry.name)
                row.update(fit=report.summary(), fits=report.ok)
            except StudioError as exc:
                row.update(fit=f"refused: {exc.message}", fits=False)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain-text table of ``library_rows`` for the terminal."""
    cols = ["name", "format", "rank", "alpha", "size", "sha256"] + (["fit"] if rows and "fit" in rows[0] else [])
    cells = [[(r[c][:12] if c == "sha256" else str(r[c])) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])  # the last column runs free
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols)] + [line(c) for c in cells])


def _num(x) -> str:
    return "-" if x is None else (str(int(x)) if float(x).is_integer() else f"{x:g}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024

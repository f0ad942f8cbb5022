"""The adapter library: what is on disk under the adapter roots, and how each fits a model.

``library_rows(model, adapter_dirs, data_dir)`` is what ``python app.py adapters`` prints:
one row per adapter with format, rank, alpha, size, sha256 and (given a model) the fit
report's one-line summary. Fit is computed against meta-device skeletons of the
model's denoisers (built from their configs), so listing never loads model weights.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import settings
from ..errors import AdapterError, StudioError
from .formats import PEFT_CONFIG, PICKLE_SUFFIXES, AdapterRecord, inspect
from . import sidecar


@dataclass
class LibraryEntry:
    name: str
    path: Path
    record: AdapterRecord | None = None
    error: str | None = None  # why it cannot be used at all (pickle, corrupt, ...)


def roots(adapter_dirs=None, data_dir=None, model: str | None = None) -> list[Path]:
    """``<data-dir>/adapters`` first, then each ``--adapter-dir``, then for a demo ``model`` the demo
    adapters (``settings.adapter_roots``)."""
    return settings.adapter_roots(adapter_dirs, data_dir, demo=bool(model) and model.startswith("demo:"))


# Bounds on one scan of the roots (a listing, a lookup by name): hostile trees must not stall it.
MAX_DEPTH = 8  # folder levels below a root
MAX_FILES = 2000  # adapters considered per scan, all roots together
SCAN_SECONDS = 20.0  # wall time spent inspecting files not yet cached; the rest are marked, not read

# rows by (resolved path, mtime_ns, size[, config mtime_ns, size]): a file is inspected once
_rows: dict[tuple, tuple] = {}
_CACHE_ROWS = 4 * MAX_FILES  # cleared when full (files rewritten many times)
_rows_lock = threading.Lock()


def _walk(root: Path, roots: list[Path]):
    """(path, outside) for every candidate under ``root``: PEFT folders, .safetensors files and
    pickles, depth-first in name order. Links are followed only where they stay inside a root;
    a link that leaves every root is yielded once, marked, and never opened. Each real folder
    is entered once (link loops end there), at most ``MAX_DEPTH`` levels down."""
    seen: set[tuple[int, int]] = set()
    stack = [(root, 0)]
    while stack:
        here, depth = stack.pop()
        try:
            st = here.stat()
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            continue
        if any(e.name == PEFT_CONFIG for e in entries):
            yield here, False
            continue
        subdirs = []
        for e in entries:
            if e.name.startswith("."):
                continue
            path = Path(e.path)
            is_link = e.is_symlink()
            if is_link and not _inside(Path(os.path.realpath(path)), roots):
                if e.name.lower().endswith((".safetensors",) + PICKLE_SUFFIXES) or _is_dir(e):
                    yield path, True
                continue
            if _is_dir(e):
                if depth + 1 <= MAX_DEPTH:
                    subdirs.append((path, depth + 1))
            elif e.name.lower().endswith((".safetensors",) + PICKLE_SUFFIXES):
                yield path, False
        stack.extend(reversed(subdirs))


def _is_dir(entry) -> bool:
    try:
        return entry.is_dir()  # follows links; a looping link is not a folder
    except OSError:
        return False


def _inside(real: Path, roots: list[Path]) -> bool:
    return any(real == root or real.is_relative_to(root) for root in roots)


def _stamp(path: Path) -> tuple:
    files = [path / PEFT_CONFIG, path / "adapter_model.safetensors"] if path.is_dir() else [path]
    out: list = [os.path.realpath(path)]
    for f in files:
        try:
            st = f.stat()
            out += [st.st_mtime_ns, st.st_size]
        except OSError:
            out += [None, None]
    return tuple(out)


def _inspect_row(path: Path, name: str) -> tuple:
    """(record, error) for one candidate; every failure becomes the row's reason, never a crash."""
    try:
        rec = inspect(path, name)
        return rec, None
    except StudioError as exc:
        return None, exc.message
    except Exception as exc:  # noqa: BLE001 - one bad file must not break the listing for everyone
        return None, f"{path}: unreadable ({type(exc).__name__})"


def scan(adapter_dirs=None, data_dir=None, model: str | None = None) -> list[LibraryEntry]:
    """Every adapter under the roots: PEFT folders, .safetensors files, refused pickles.

    A file that cannot be used is one entry with ``error`` set (why); the scan is bounded in
    depth (``MAX_DEPTH``), count (``MAX_FILES``) and time (``SCAN_SECONDS``), and each file is
    inspected once per (path, mtime, size)."""
    all_roots = roots(adapter_dirs, data_dir, model)
    found: list[tuple[Path, Path, bool]] = []  # (root, path, outside)
    for root in all_roots:
        if not root.is_dir():
            continue
        for path, outside in _walk(root, all_roots):
            found.append((root, path, outside))
            if len(found) >= MAX_FILES:
                break
        if len(found) >= MAX_FILES:
            break
    stems: dict[str, int] = {}
    for _, p, _ in found:
        stems[_stem(p)] = stems.get(_stem(p), 0) + 1
    entries = []
    deadline = time.monotonic() + SCAN_SECONDS
    for root, p, outside in sorted(found, key=lambda rp: str(rp[1])):
        name = _stem(p) if stems[_stem(p)] == 1 else str(p.relative_to(root).with_suffix(""))
        if outside:
            entries.append(LibraryEntry(name, p, error=f"{p}: resolves outside the adapter roots; not read"))
            continue
        try:
            key = (name, *_stamp(p))
        except (OSError, RuntimeError, ValueError):
            entries.append(LibraryEntry(name, p, error=f"{p}: cannot be read"))
            continue
        with _rows_lock:
            cached = _rows.get(key)
        if cached is None:
            if time.monotonic() > deadline:
                entries.append(LibraryEntry(name, p, error=f"{p}: not inspected yet (this listing spent its "
                                                           f"{SCAN_SECONDS:.0f} s budget); list again"))
                continue
            cached = _inspect_row(p, name)
            with _rows_lock:
                if len(_rows) >= _CACHE_ROWS:
                    _rows.clear()
                _rows[key] = cached
        record, error = cached
        entries.append(LibraryEntry(name, p, record=record, error=error))
    return entries


def _stem(p: Path) -> str:
    return p.name if _is_dir_path(p) else p.stem


def _is_dir_path(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def find(name: str, adapter_dirs=None, data_dir=None) -> LibraryEntry | None:
    for entry in scan(adapter_dirs, data_dir):
        if entry.name == name:
            return entry
    return None


def denoiser_skeletons(model_id: str, data_dir=None):
    """(pipeline class, {component: module on the meta device}) from the model's configs only."""
    import diffusers

    from ..models import resolve_model

    resolved = resolve_model(model_id, data_dir)
    out = {}
    for comp in resolved.denoisers:
        config_file = Path(resolved.path) / comp / "config.json"
        if not config_file.is_file():
            continue
        cls = getattr(diffusers, json.loads(config_file.read_text())["_class_name"])
        with torch.device("meta"):
            out[comp] = cls.from_config(cls.load_config(config_file.parent))
    return getattr(diffusers, resolved.class_name), out


_encoder_skeletons: dict[tuple, dict] = {}  # (model dir, model_index.json stamp) -> {component: meta module}


def encoder_skeletons(model_id: str, data_dir=None) -> dict:
    """{component: module on the meta device} of the model's text encoders a LoRA may change (the family's
    ``LoraRouting.text_encoders`` its ``model_index.json`` lists as transformers classes), from their configs
    only; built once per model folder."""
    import transformers

    from ..models import resolve_model

    resolved = resolve_model(model_id, data_dir)
    index_file = Path(resolved.path) / "model_index.json"
    try:
        st = index_file.stat()
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        return {}
    key = (str(index_file), st.st_mtime_ns, st.st_size)
    if key in _encoder_skeletons:
        return _encoder_skeletons[key]
    out = {}
    for comp in resolved.family.lora.text_encoders:
        entry = index.get(comp)
        folder = Path(resolved.path) / comp
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "transformers"
                and (folder / "config.json").is_file()):
            continue
        cls = getattr(transformers, entry[1], None)
        if cls is None:
            continue
        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            out[comp] = cls._from_config(config)
    if len(_encoder_skeletons) > 8:
        _encoder_skeletons.clear()
    _encoder_skeletons[key] = out
    return out


def library_rows(model: str | None = None, adapter_dirs=None, data_dir=None) -> list[dict]:
    """Printable rows: name, format, rank, alpha, size, sha256, base model hint, fit, path.

    With ``model``, each adapter is fitted against that model's denoisers (``fit`` is the
    report's summary, ``fits`` a bool). For a demo model the demo adapters are written first and
    listed too, each with ``demo: true`` (they live in ``<data-dir>/demo/adapters``, not the library);
    without a model nothing is built and only the library roots are listed.
    """
    demo_root = None
    if model and model.startswith("demo:"):
        from . import demo_adapters

        demo_root = demo_adapters.ensure(data_dir).resolve()
    skeleton = skeletons(model, data_dir) if model else None
    rows = []
    for entry in scan(adapter_dirs, data_dir, model):
        rec = entry.record
        row = {"name": entry.name, "path": str(entry.path), "format": rec.format if rec else "-",
               "rank": rec.rank if rec else "-", "alpha": _num(rec.alpha) if rec else "-",
               "size": _size(rec.size_bytes) if rec else "-", "size_bytes": rec.size_bytes if rec else 0,
               "sha256": rec.sha256 if rec else "", "base_model": (rec.base_model or "") if rec else "",
               "targets": target_kinds(rec.target_modules) if rec else [],
               "usable": entry.error is None, "error": entry.error,
               "demo": demo_root is not None and Path(entry.path).is_relative_to(demo_root),
               **sidecar.read(entry.path)}  # A1111's <name>.json: preferred weight, activation and negative text
        if entry.error:
            row.update(fit=f"refused: {entry.error}", fits=False, fit_reason="cannot be read as an adapter")
        elif skeleton is not None:
            row.update(_fit_row(model, entry, skeleton))
        rows.append(row)
    return rows


# (model, name, stamp) -> {"fit", "fits", "fit_reason", "fitted"}: a file is fitted once per model
_fits: dict[tuple, dict] = {}


def skeletons(model: str, data_dir=None) -> tuple:
    """(pipeline class, {denoiser: meta module}, {text encoder: meta module}): what adapters are fitted to."""
    return (*denoiser_skeletons(model, data_dir), encoder_skeletons(model, data_dir))


def _fit_row(model: str, entry: LibraryEntry, skeleton) -> dict:
    """The fit of one file against ``model``, cached by (model, name, stamp). ``skeleton``: ``skeletons``'
    answer, or a callable giving it (built only when the cache misses). ``fitted`` says a fit report
    decided (not an error reading or converting the file); ``fit_reason`` is the plain line of a misfit."""
    from .adapter import fit_adapter

    try:
        key = (model, entry.name, *_stamp(entry.path))
    except OSError:
        return {"fit": f"refused: {entry.path}: cannot be read", "fits": False, "fitted": False,
                "fit_reason": "cannot be read"}
    with _rows_lock:
        cached = _fits.get(key)
    if cached is None:
        try:
            pipeline, denoisers, encoders = skeleton() if callable(skeleton) else skeleton
            report = fit_adapter(entry.path, pipeline, denoisers, name=entry.name, encoders=encoders)
            cached = {"fit": report.summary(), "fits": report.ok, "fitted": True, "fit_reason": report.reason(model)}
        except StudioError as exc:
            cached = {"fit": f"refused: {exc.message}", "fits": False, "fitted": False,
                      "fit_reason": f"could not be checked against {model}"}
        except Exception as exc:  # noqa: BLE001 - one bad file must not break the listing for everyone
            cached = {"fit": f"refused: {entry.path}: cannot be fitted ({type(exc).__name__})", "fits": False,
                      "fitted": False, "fit_reason": f"could not be checked against {model}"}
        with _rows_lock:
            if len(_fits) >= _CACHE_ROWS:
                _fits.clear()
            _fits[key] = cached
    return dict(cached)


def check_fits(model: str, adapters, data_dir=None) -> None:
    """Refuse, before a job is queued, an adapter whose fit report against ``model`` says it does not fit
    (AdapterError: its name and file, why in one plain line, then the report's summary, which names at most
    a few keys): the worker would refuse it only mid-job. ``adapters``: (name, path) pairs. The listing's cache answers; a miss fits the file
    once (its header and factors, against meta-device skeletons). An adapter that could not be fitted here
    (an error, not a report) is left to the worker's own checks."""
    for name, path in adapters:
        row = _fit_row(model, LibraryEntry(name, Path(path)), lambda: skeletons(model, data_dir))
        if row["fitted"] and not row["fits"]:
            raise AdapterError(f"adapter {name!r} ({Path(path).name}) does not fit {model}: {row['fit_reason']}. "
                               f"Its fit report: {row['fit']}", param="lora_path")


def format_rows(rows: list[dict]) -> str:
    """A plain-text table of ``library_rows`` for the terminal."""
    # without a model only refused rows carry a fit (their reason): the column is there if any row has one
    cols = ["name", "format", "rank", "alpha", "size", "sha256"] + (["fit"] if any("fit" in r for r in rows) else [])
    cells = [[(r[c][:12] if c == "sha256" else str(r.get(c, "-"))) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])  # the last column runs free
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols)] + [line(c) for c in cells])


_INDEX = re.compile(r"(?:^|[._])\d+(?:[._]|$)")


def target_kinds(modules) -> list[str]:
    """The kinds of layer an adapter targets, in file order, the block index folded (what follows the first
    number): ``transformer_blocks.0.attn.to_q`` and ``...1.attn.to_q`` are ``attn.to_q``, ``...0.ff.net.2`` is
    ``ff.net.2``; kohya's ``lora_unet_transformer_blocks_0_attn_to_q`` is ``attn_to_q``; a module outside
    numbered blocks keeps its whole path."""
    kinds: list[str] = []
    for module in map(str, modules):
        m = _INDEX.search(module)
        kind = module[m.end():] if m and m.end() < len(module) else module
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def _num(x) -> str:
    return "-" if x is None else (str(int(x)) if float(x).is_integer() else f"{x:g}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024

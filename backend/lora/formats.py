"""Reading adapters from disk: typed records from headers, and full loads with validation.

Two entry points, both naming the file at fault in every error:

- ``inspect(path)`` -> ``AdapterRecord`` from the safetensors header, ``__metadata__`` and
  (for PEFT folders) ``adapter_config.json``, without reading any weight; only the scalar
  ``.alpha`` tensors of kohya/ComfyUI files are read (a few bytes each).
- ``read_tensors(path)`` -> ``RawAdapter``: every tensor, checked for truncation and NaN/inf,
  from one read of the file (the same bytes give the sha256).

Pickle formats (``.bin``, ``.pt``, ``.ckpt``, ``.pth``) are refused: loading one runs
arbitrary code from the file.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AdapterError, AdapterNotFound

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Formats, by where the file came from (what users recognise), not by how we bind it.
FORMATS = ("peft", "peft-dump", "diffusers", "kohya", "lightx2v")
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec's own limit


@dataclass(frozen=True)
class AdapterRecord:
    """What a listing needs to know about one adapter, read from headers only."""

    name: str
    path: Path  # what the user named: a PEFT folder or a .safetensors file
    file: Path  # the safetensors file holding the weights
    format: str
    ranks: tuple[int, ...]
    alpha: float | None  # None: no alpha stored (diffusers convention: alpha == rank)
    target_modules: tuple[str, ...]  # module paths as written in the file
    num_tensors: int
    size_bytes: int
    sha256: str
    base_model: str | None = None  # a hint from the metadata, if the publisher left one
    metadata: dict = field(default_factory=dict, compare=False, repr=False)
    peft_config: dict | None = field(default=None, compare=False, repr=False)

    @property
    def rank(self) -> str:
        return "/".join(str(r) for r in self.ranks) if self.ranks else "?"


@dataclass
class RawAdapter:
    """An adapter's tensors as stored, with the header metadata and PEFT config."""

    record: AdapterRecord
    tensors: dict  # name -> torch.Tensor (CPU)
    stamp: tuple[int, int]  # (mtime_ns, size) of the bytes the tensors were read from


# -- locating the weights file -------------------------------------------------------------
def weights_file(path: str | os.PathLike) -> Path:
    """The safetensors file behind a user-given path (file or PEFT folder)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise AdapterNotFound(f"adapter path {p} does not exist", param="lora_path")
    if p.is_dir():
        if not (p / PEFT_CONFIG).is_file():
            raise AdapterError(f"{p} is a directory without {PEFT_CONFIG}: not a PEFT adapter folder "
                               "(give the folder saved by peft's save_pretrained, or a .safetensors file)",
                               param="lora_path")
        for name in PEFT_WEIGHTS:
            if (p / name).is_file():
                return p / name
        pickled = [n for n in ("adapter_model.bin",) if (p / n).is_file()]
        if pickled:
            raise AdapterError(f"{p / pickled[0]}: pickle checkpoints are refused (loading one can run code); "
                               "re-save the adapter with safe_serialization=True", param="lora_path")
        raise AdapterError(f"{p} has {PEFT_CONFIG} but no adapter_model.safetensors", param="lora_path")
    if p.suffix.lower() in PICKLE_SUFFIXES:
        raise AdapterError(f"{p}: pickle checkpoints ({p.suffix}) are refused (loading one can run arbitrary "
                           "code); convert it to .safetensors", param="lora_path")
    if p.suffix.lower() != ".safetensors":
        raise AdapterError(f"{p}: not a .safetensors file or PEFT folder", param="lora_path")
    return p


# -- sha256, cached by (path, mtime, size) ---------------------------------------------------
_sha_cache: dict[tuple[str, int, int], str] = {}
_sha_lock = threading.Lock()


def _sha_key(path: Path, st: os.stat_result) -> tuple[str, int, int]:
    return str(path.resolve()), st.st_mtime_ns, st.st_size


def _cached_sha256(key) -> str | None:
    with _sha_lock:
        return _sha_cache.get(key)


def _remember_sha256(key, digest: str) -> None:
    with _sha_lock:
        _sha_cache[key] = digest


def forget_sha256(path=None) -> None:
    """Drop cached digests (of one file, or all), so the next read hashes the bytes again."""
    with _sha_lock:
        if path is None:
            _sha_cache.clear()
            return
        resolved = str(Path(path).expanduser().resolve())
        for key in [k for k in _sha_cache if k[0] == resolved]:
            del _sha_cache[key]


def file_sha256(path: Path) -> str:
    key = _sha_key(path, path.stat())
    cached = _cached_sha256(key)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    _remember_sha256(key, digest)
    return digest


def file_stamp(path: Path) -> tuple[int, int]:
    """(mtime_ns, size): changes when the file is rewritten, so cached loads can go stale."""
    st = path.stat()
    return st.st_mtime_ns, st.st_size


# -- header parsing -----------------------------------------------------------------------
def read_header(file: Path) -> tuple[dict, dict]:
    """(tensor entries, __metadata__) of a safetensors file, checked against the file size."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        n = _header_length(head, size, file)
        head += fh.read(n)
    header, metadata, _ = _parse_header(head, size, file)
    return header, metadata


def _header_length(head, size: int, file: Path) -> int:
    try:
        if len(head) < 8:
            raise ValueError("file is shorter than a safetensors header")
        (n,) = struct.unpack_from("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"header length {n} does not fit a {size}-byte file")
    except ValueError as exc:
        raise AdapterError(f"{file}: not a valid safetensors file ({exc})", param="lora_path") from None
    return n


def _parse_header(data, size: int, file: Path) -> tuple[dict, dict, int]:
    """(entries, __metadata__, where the data section starts) from the file's first bytes (``data``)."""
    n = _header_length(data, size, file)
    try:
        header = json.loads(bytes(data[8: 8 + n]))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        metadata = header.pop("__metadata__", None) or {}
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (ValueError, UnicodeDecodeError, KeyError, IndexError, TypeError) as exc:
        raise AdapterError(f"{file}: not a valid safetensors file ({exc})", param="lora_path") from None
    if 8 + n + end > size:
        raise AdapterError(f"{file}: truncated ({size} bytes, the header describes {8 + n + end})",
                           param="lora_path")
    return header, metadata, 8 + n


def detect_format(keys, is_peft_folder: bool) -> str:
    if is_peft_folder:
        return "peft"
    keys = list(keys)
    if any(k.startswith("lora_unet_") for k in keys):
        return "kohya"
    if any(k.startswith("diffusion_model.") for k in keys):
        return "lightx2v"
    if any(k.startswith("base_model.model.") for k in keys):
        return "peft-dump"
    if any(k.endswith((".lora_down.weight", ".alpha")) for k in keys):
        return "kohya"
    return "diffusers"


_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight", ".lora_B.bias",
             ".alpha", ".diff_b", ".diff", ".dora_scale", ".lora_magnitude_vector")


def module_of(key: str) -> str:
    for s in _SUFFIXES:
        if key.endswith(s):
            return key[: -len(s)]
    return key.rsplit(".", 1)[0]


def inspect(path: str | os.PathLike, name: str | None = None) -> AdapterRecord:
    """The typed record of an adapter, from its headers only."""
    p = Path(path).expanduser()
    file = weights_file(p)
    header, metadata = read_header(file)
    return _record(p, file, header, metadata, name, sha256=lambda: file_sha256(file),
                   scalar=lambda key: _read_scalar(file, key))


def _record(p: Path, file: Path, header: dict, metadata: dict, name: str | None, *, sha256, scalar) -> AdapterRecord:
    """The record from a parsed header; ``sha256()`` gives the digest, ``scalar(key)`` one stored value."""
    peft_config = None
    if p.is_dir():
        try:
            peft_config = json.loads((p / PEFT_CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise AdapterError(f"{p / PEFT_CONFIG}: unreadable ({exc})", param="lora_path") from None
    fmt = detect_format(header, peft_config is not None)
    ranks = sorted({int(v["shape"][0]) for k, v in header.items()
                    if k.endswith((".lora_down.weight", ".lora_A.weight")) and v.get("shape")})
    alpha = _alpha(header, metadata, peft_config, scalar)
    modules = tuple(sorted({module_of(k) for k in header if not k.endswith(".alpha")}))
    size = sum(f.stat().st_size for f in ([file, p / PEFT_CONFIG] if peft_config is not None else [file]))
    return AdapterRecord(
        name=name or (p.name if p.is_dir() else p.stem), path=p, file=file, format=fmt, ranks=tuple(ranks),
        alpha=alpha, target_modules=modules, num_tensors=len(header), size_bytes=size,
        sha256=sha256(), base_model=_base_model_hint(metadata, peft_config),
        metadata=dict(metadata), peft_config=peft_config)


def _read_scalar(file: Path, key: str) -> float:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as fh:
            return float(fh.get_tensor(key).item())
    except Exception as exc:  # noqa: BLE001 - any read failure is the file's fault
        raise AdapterError(f"{file}: cannot read {key} ({exc})", param="lora_path") from None


def _alpha(header: dict, metadata: dict, peft_config: dict | None, scalar) -> float | None:
    if peft_config is not None:
        return float(peft_config.get("lora_alpha", peft_config.get("r", 8)))
    if "lora_adapter_metadata" in metadata:  # written by diffusers' save_lora_weights
        try:
            meta = json.loads(metadata["lora_adapter_metadata"])
            alphas = [v for k, v in meta.items() if k.endswith("lora_alpha")]
            if alphas:
                return float(alphas[0])
        except ValueError:
            pass
    if "ss_network_alpha" in metadata:  # kohya sd-scripts / musubi
        try:
            return float(metadata["ss_network_alpha"])
        except ValueError:
            pass
    alpha_keys = [k for k in header if k.endswith(".alpha")]
    if alpha_keys:
        return scalar(alpha_keys[0])
    return None


def _base_model_hint(metadata: dict, peft_config: dict | None) -> str | None:
    if peft_config and peft_config.get("base_model_name_or_path"):
        return str(peft_config["base_model_name_or_path"])
    for key in ("modelspec.architecture", "ss_base_model_version", "base_model", "ss_sd_model_name"):
        if metadata.get(key):
            return str(metadata[key])
    return None


# -- full read ------------------------------------------------------------------------------
def read_tensors(path: str | os.PathLike, name: str | None = None) -> RawAdapter:
    """Every tensor of an adapter on CPU, refusing truncated, corrupt or non-finite files.

    The file is read once: the same bytes give the sha256 (unless cached for this path,
    mtime and size) and, through safetensors' own ``load``, the tensors.
    """
    from safetensors.torch import load  # torch only here: listing a library must not import it

    p = Path(path).expanduser()
    file = weights_file(p)
    data, st = _read_whole(file)
    header, metadata, _ = _parse_header(data, len(data), file)
    _check_entries(header, file)
    try:
        loaded = load(data)
    except Exception as exc:  # noqa: BLE001 - SafetensorError and friends: name the file
        raise AdapterError(f"{file}: not a valid safetensors file ({exc})", param="lora_path") from None
    tensors = {k: loaded[k] for k in header}  # the file's order (load's varies), so reports are stable
    key = _sha_key(file, st)

    def sha256() -> str:
        digest = _cached_sha256(key)
        if digest is None:
            digest = hashlib.sha256(data).hexdigest()
            _remember_sha256(key, digest)
        return digest

    record = _record(p, file, header, metadata, name, sha256=sha256,
                     scalar=lambda k: float(tensors[k].float().item()))
    for k, t in tensors.items():
        if t.is_floating_point() and t.numel() and not _finite(t):
            raise AdapterError(f"{file}: tensor {k!r} contains NaN or inf values", param="lora_path")
    return RawAdapter(record=record, tensors=tensors, stamp=(st.st_mtime_ns, st.st_size))


def _read_whole(file: Path) -> tuple[bytes, os.stat_result]:
    """The file's bytes, with the stat they belong to (refused if it changed meanwhile)."""
    with open(file, "rb") as fh:
        before = os.fstat(fh.fileno())
        data = fh.read()
        after = os.fstat(fh.fileno())
    if len(data) != before.st_size or (after.st_mtime_ns, after.st_size) != (before.st_mtime_ns, before.st_size):
        raise AdapterError(f"{file}: the file changed while it was being read; try again", param="lora_path")
    return data, before


def _check_entries(header: dict, file: Path) -> None:
    """Each entry's shape and dtype against its byte range, naming the tensor at fault
    (safetensors refuses the same files, but without saying which tensor)."""
    for key, entry in header.items():
        try:
            if entry.get("dtype") not in _ITEMSIZE:
                raise ValueError(f"unsupported dtype {entry.get('dtype')!r}")
            itemsize = _ITEMSIZE[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
            if min(shape, default=0) < 0 or begin < 0 or end - begin != math.prod(shape) * itemsize:
                raise ValueError(f"shape {shape} and {entry['dtype']} do not match data_offsets [{begin}, {end}]")
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(f"{file}: not a valid safetensors file (tensor {key!r}: {exc})",
                               param="lora_path") from None


# bytes per element of the safetensors dtypes torch can hold
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _finite(t) -> bool:
    """All values finite: min and max are (NaN propagates through both), without a full-size mask."""
    import torch

    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))

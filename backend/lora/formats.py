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

from ..digest import file_sha256 as digest_file
from ..errors import AdapterError, AdapterNotFound

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Formats, by where the file came from (what users recognise), not by how we bind it.
FORMATS = ("peft", "peft-dump", "diffusers", "kohya", "lightx2v", "lycoris")
# Bounds on what one file may ask of a reader (a listing reads every file's header):
MAX_HEADER = 8 * 1024 * 1024  # header bytes (the spec allows 100 MB; real LoRA headers are < 1 MB)
MAX_KEY_LEN = 256  # characters in one tensor key (real keys are < 150)
# Factors must be floating point. fp8 is refused, not upcast: an fp8 LoRA is stored with
# per-tensor scales this reader does not apply, so upcasting the raw values would be wrong.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# an ``.alpha`` is one number; kohya/ComfyUI store it as a float, some tools as an integer
ALPHA_DTYPES = FLOAT_DTYPES + ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")


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
    digest = digest_file(path)
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
    # the messages never quote the file's bytes (the length field is 8 of them)
    if len(head) < 8:
        raise AdapterError(f"{file}: not a valid safetensors file (shorter than a safetensors header)",
                           param="lora_path")
    (n,) = struct.unpack_from("<Q", head)
    if 8 + n > size:
        raise AdapterError(f"{file}: not a valid safetensors file (its header length does not fit the file)",
                           param="lora_path")
    if n > MAX_HEADER:
        raise AdapterError(f"{file}: header larger than {MAX_HEADER // (1024 * 1024)} MiB refused (an adapter's "
                           "header is well under 1 MiB)", param="lora_path")
    return n


def _parse_header(data, size: int, file: Path) -> tuple[dict, dict, int]:
    """(entries, __metadata__, where the data section starts) from the file's first bytes (``data``),
    every entry checked: key length, dtype (floating point factors, scalar alphas), shape vs offsets."""
    n = _header_length(data, size, file)
    try:
        header = json.loads(bytes(data[8: 8 + n]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise AdapterError(f"{file}: not a valid safetensors file (its header is not JSON)",
                           param="lora_path") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file}: not a valid safetensors file (its header is not a JSON object)",
                           param="lora_path")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AdapterError(f"{file}: not a valid safetensors file (__metadata__ must be an object of strings)",
                           param="lora_path")
    _check_entries(header, file)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise AdapterError(f"{file}: truncated ({size} bytes, the header describes {8 + n + end})",
                           param="lora_path")
    return header, metadata, 8 + n


# LyCORIS parts (backend/lora/lycoris.py reads them): LoHa, LoKr, full diffs, and Tucker cores (refused)
LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
FULL = ("diff", "diff_b")
TUCKER = ("hada_t1", "hada_t2", "lokr_t1", "lokr_t2")
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight")


def is_lycoris(keys) -> bool:
    """A LyCORIS file: any LoHa / LoKr / Tucker part, or full diffs with no LoRA factors beside them
    (lightx2v's distill files carry ``.diff`` keys beside their LoRA factors: those are not LyCORIS)."""
    keys = list(keys)
    parts = {k.rpartition(".")[2] for k in keys}
    if parts & set(LOHA + LOKR + TUCKER):
        return True
    return "diff" in parts and not any(k.endswith(_LORA_SUFFIXES) for k in keys)


def detect_format(keys, is_peft_folder: bool) -> str:
    if is_peft_folder:
        return "peft"
    keys = list(keys)
    if is_lycoris(keys):  # LoHa / LoKr / full diffs, whatever their module names look like
        return "lycoris"
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
    """The typed record of an adapter, from its headers only (and its few-byte ``.alpha`` values)."""
    p = Path(path).expanduser()
    file = weights_file(p)
    header, metadata = read_header(file)
    return _record(p, file, header, metadata, name, sha256=lambda: file_sha256(file),
                   scalars=lambda keys: _read_scalars(file, keys))


def check(path: str | os.PathLike, param: str = "lora_path") -> None:
    """Refuse a file ``inspect`` would refuse, without hashing it (a request's check at submission);
    the error's ``param`` is the request field that named the file."""
    p = Path(path).expanduser()
    try:
        file = weights_file(p)
        header, metadata = read_header(file)
        _record(p, file, header, metadata, None, sha256=lambda: "", scalars=lambda keys: _read_scalars(file, keys))
    except AdapterError as exc:
        exc.param = param
        raise


def _record(p: Path, file: Path, header: dict, metadata: dict, name: str | None, *, sha256,
            scalars) -> AdapterRecord:
    """The record from a parsed header; ``sha256()`` gives the digest, ``scalars(keys)`` stored values.

    Configs and alphas are checked here, so every reader (listing, request, worker) refuses
    the same files: configs through ``patterns.check_config``, every ``.alpha`` finite."""
    from .patterns import check_config

    peft_config = None
    if p.is_dir():
        where = p / PEFT_CONFIG
        try:
            peft_config = json.loads(where.read_bytes())
        except OSError as exc:
            raise AdapterError(f"{where}: unreadable ({exc.strerror or type(exc).__name__})",
                               param="lora_path") from None
        except (ValueError, RecursionError):
            raise AdapterError(f"{where}: not valid JSON", param="lora_path") from None
        check_config(peft_config, str(where))
    for comp, config in _metadata_configs(metadata, file).items():
        check_config(config, f"{file}: __metadata__ lora_adapter_metadata [{comp}]")
    fmt = detect_format(header, peft_config is not None)
    ranks = sorted({int(v["shape"][0]) for k, v in header.items()
                    if k.endswith((".lora_down.weight", ".lora_A.weight", ".hada_w1_b", ".lokr_w1_b", ".lokr_w2_b"))
                    and v.get("shape")})
    alpha_keys = [k for k in header if k.endswith(".alpha")]
    stored = scalars(alpha_keys) if alpha_keys else {}
    for key, value in stored.items():
        if not math.isfinite(value):
            raise AdapterError(f"{file}: tensor {key!r} is {value}: an alpha must be a finite number",
                               param="lora_path")
    alpha = _alpha(metadata, peft_config, [stored[k] for k in alpha_keys], file)
    modules = tuple(sorted({module_of(k) for k in header if not k.endswith(".alpha")}))
    size = sum(f.stat().st_size for f in ([file, p / PEFT_CONFIG] if peft_config is not None else [file]))
    return AdapterRecord(
        name=name or (p.name if p.is_dir() else p.stem), path=p, file=file, format=fmt, ranks=tuple(ranks),
        alpha=alpha, target_modules=modules, num_tensors=len(header), size_bytes=size,
        sha256=sha256(), base_model=_base_model_hint(metadata, peft_config),
        metadata=dict(metadata), peft_config=peft_config)


def _metadata_configs(metadata: dict, file: Path) -> dict[str, dict]:
    """diffusers' save_lora_weights stores each component's LoraConfig flat as ``comp.field``."""
    raw = metadata.get("lora_adapter_metadata")
    if raw is None:
        return {}
    try:
        flat = json.loads(raw)
    except (ValueError, RecursionError):
        raise AdapterError(f"{file}: __metadata__ lora_adapter_metadata is not valid JSON",
                           param="lora_path") from None
    if not isinstance(flat, dict):
        raise AdapterError(f"{file}: __metadata__ lora_adapter_metadata is not a JSON object", param="lora_path")
    out: dict[str, dict] = {}
    for key, value in flat.items():
        if "." in key:
            comp, field_name = key.split(".", 1)
            out.setdefault(comp, {})[field_name] = value
    return out


def _read_scalars(file: Path, keys: list[str]) -> dict[str, float]:
    """The values of one-element tensors (shapes and dtypes were checked with the header)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as fh:
            return {k: float(fh.get_tensor(k).double().reshape(()).item()) for k in keys}
    except Exception as exc:  # noqa: BLE001 - any read failure is the file's fault; never quote its bytes
        raise AdapterError(f"{file}: cannot read its alpha tensors ({type(exc).__name__})",
                           param="lora_path") from None


def _alpha(metadata: dict, peft_config: dict | None, stored: list[float], file: Path) -> float | None:
    if peft_config is not None:
        return float(peft_config.get("lora_alpha", peft_config.get("alpha", peft_config.get("r", 8))))
    if "lora_adapter_metadata" in metadata:  # written by diffusers' save_lora_weights (checked above)
        meta = json.loads(metadata["lora_adapter_metadata"])
        alphas = [v for k, v in meta.items() if k.endswith("lora_alpha")]
        if alphas:
            return float(alphas[0])
    if "ss_network_alpha" in metadata:  # kohya sd-scripts / musubi
        try:
            value = float(metadata["ss_network_alpha"])
        except ValueError:
            value = None
        if value is not None and not math.isfinite(value):
            raise AdapterError(f"{file}: __metadata__ ss_network_alpha is {value}: an alpha must be a finite "
                               "number", param="lora_path")
        if value is not None:
            return value
    if stored:
        return stored[0]
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
    try:
        loaded = load(data)
    except Exception as exc:  # noqa: BLE001 - SafetensorError and friends: name the file, not its bytes
        raise AdapterError(f"{file}: not a valid safetensors file ({type(exc).__name__})",
                           param="lora_path") from None
    tensors = {k: loaded[k] for k in header}  # the file's order (load's varies), so reports are stable
    key = _sha_key(file, st)

    def sha256() -> str:
        digest = _cached_sha256(key)
        if digest is None:
            digest = hashlib.sha256(data).hexdigest()
            _remember_sha256(key, digest)
        return digest

    record = _record(p, file, header, metadata, name, sha256=sha256,
                     scalars=lambda keys: {k: float(tensors[k].double().reshape(()).item()) for k in keys})
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
    """Each entry's key, dtype and shape against its byte range, naming the tensor at fault
    (safetensors refuses malformed files too, but without saying which tensor)."""
    for key, entry in header.items():
        shown = repr(key[:80]) + ("..." if len(key) > 80 else "")
        if len(key) > MAX_KEY_LEN:
            raise AdapterError(f"{file}: tensor key {shown} is longer than {MAX_KEY_LEN} characters",
                               param="lora_path")
        try:
            if not isinstance(entry, dict):
                raise ValueError("entry is not an object")
            dtype = entry.get("dtype")
            if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
                raise ValueError(f"unsupported dtype {str(dtype)[:20]!r}")
            itemsize = _ITEMSIZE[dtype]
            if not isinstance(entry.get("shape"), list) or not isinstance(entry.get("data_offsets"), list):
                raise ValueError("shape and data_offsets must be lists")
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
            if min(shape, default=0) < 0 or begin < 0 or end - begin != math.prod(shape) * itemsize:
                raise ValueError(f"shape {shape[:8]} and {dtype} do not match data_offsets [{begin}, {end}]")
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise AdapterError(f"{file}: not a valid safetensors file (tensor {shown}: {exc})",
                               param="lora_path") from None
        if key.endswith(".alpha"):
            if dtype not in ALPHA_DTYPES:
                raise AdapterError(f"{file}: tensor {shown} is {dtype}; an alpha must be a number (float or "
                                   "integer)", param="lora_path")
            if math.prod(shape) != 1:
                raise AdapterError(f"{file}: tensor {shown} has shape {shape[:8]}; an alpha must be one number "
                                   "(shape [] or [1])", param="lora_path")
        elif dtype.startswith("F8_"):
            raise AdapterError(f"{file}: tensor {shown} is {dtype}: fp8 factors are refused (they need the "
                               "scales they were quantized with); re-save the adapter in bf16, fp16 or fp32",
                               param="lora_path")
        elif dtype not in FLOAT_DTYPES:
            raise AdapterError(f"{file}: tensor {shown} is {dtype}: LoRA factors must be floating point "
                               f"({', '.join(FLOAT_DTYPES)})", param="lora_path")
        elif not shape or 0 in shape:
            raise AdapterError(f"{file}: tensor {shown} has shape {shape[:8]}: a factor must have at least one "
                               "dimension and no empty one", param="lora_path")


# bytes per element of the safetensors dtypes torch can hold
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _finite(t) -> bool:
    """All values finite: min and max are (NaN propagates through both), without a full-size mask."""
    import torch

    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))

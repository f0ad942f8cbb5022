"""Distill presets: ``presets/*.toml`` loaded, validated, and their files resolved.

A preset is data only: the base models it fits, the LoRA files (source repo, filename
pattern, target component, the demo stand-in's name), sampling defaults, sampling
requirements, and the scheduler the publisher's recipe samples with (``[scheduler]``:
a class and its config, set while the preset is fused and put back with the base). Validation happens on load, and every error names the file
and the key. Files are looked up in the adapter directories, then in the local
Hugging Face cache; nothing is downloaded. For ``demo:`` models the stand-in files
are generated (seeded), like the demo models themselves.
"""
from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import settings
from .errors import AdapterNotFound, ContractViolation, InvalidParameter, PresetError

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"


@dataclass(frozen=True)
class PresetFile:
    component: str
    repo: str
    pattern: str
    demo: str | None  # file name of the demo stand-in (required only when ``models`` names a demo model)
    scale: float = 1.0


@dataclass(frozen=True)
class Preset:
    id: str
    title: str
    pipeline: str
    models: tuple[str, ...]
    files: tuple[PresetFile, ...]
    defaults: dict
    requirements: dict
    description: str = ""
    source: Path | None = None
    scheduler: dict | None = None  # {"class": name, **config}: the recipe's scheduler, None = the base's

    def build_scheduler(self):
        """A fresh instance of the recipe's scheduler (None when the preset keeps the base's)."""
        if self.scheduler is None:
            return None
        from .distill.schedulers import scheduler_class

        config = {k: v for k, v in self.scheduler.items() if k != "class"}
        return scheduler_class(self.scheduler["class"])(**config)

    @property
    def demo_models(self) -> list[str]:
        return [m for m in self.models if m.startswith("demo:")]

    def check(self, params: dict) -> None:
        """Reject a request that breaks a requirement, naming the field (HTTP 422)."""
        for name, required in self.requirements.items():
            if name in params and params[name] != required:
                raise ContractViolation(
                    f"{name}={params[name]!r} breaks preset {self.id!r}, which requires {name}={required!r} "
                    f"(its distilled LoRA is trained for that); use {required!r} or go back to the base model",
                    param=name)

    def fits(self, model_id: str, class_name: str) -> None:
        if class_name != self.pipeline:
            raise InvalidParameter(f"preset {self.id!r} is for {self.pipeline}; {model_id} is a {class_name}",
                                   param="preset")
        if model_id not in self.models and not Path(model_id).expanduser().exists():
            raise InvalidParameter(f"preset {self.id!r} fits {', '.join(self.models)}; not {model_id}",
                                   param="preset")


# -- loading and validation -------------------------------------------------------------
_TOP = {"id": str, "title": str, "pipeline": str, "models": list, "files": list, "defaults": dict,
        "requirements": dict, "description": str, "scheduler": dict}
_REQUIRED_TOP = ("id", "title", "pipeline", "models", "files", "defaults", "requirements")
_FILE = {"component": str, "repo": str, "pattern": str, "demo": str, "scale": (int, float)}
_REQUIRED_FILE = ("component", "repo", "pattern")


def load_preset(path: Path) -> Preset:
    path = Path(path)
    where = path.name
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(f"{where}: not valid TOML ({exc})", param="preset") from None
    _keys(where, data, _TOP, _REQUIRED_TOP, "")
    if data["id"] != path.stem:
        raise PresetError(f"{where}: key 'id' is {data['id']!r} but must match the file name {path.stem!r}",
                          param="id")
    from . import families

    if data["pipeline"] not in families.FAMILIES:
        raise PresetError(f"{where}: key 'pipeline' {data['pipeline']!r} is not a supported pipeline "
                          f"({', '.join(families.supported())})", param="pipeline")
    spec = families.spec_for(data["pipeline"])
    models = data["models"]
    if not models or not all(isinstance(m, str) and m for m in models):
        raise PresetError(f"{where}: key 'models' must be a non-empty list of model ids", param="models")
    files = []
    for i, entry in enumerate(data["files"]):
        ctx = f"files[{i}]."
        if not isinstance(entry, dict):
            raise PresetError(f"{where}: key 'files[{i}]' must be a table", param="files")
        _keys(where, entry, _FILE, _REQUIRED_FILE, ctx)
        if entry["component"] not in spec.denoisers:
            raise PresetError(f"{where}: key '{ctx}component' {entry['component']!r} is not a denoiser of "
                              f"{spec.class_name} ({', '.join(spec.denoisers)})", param="component")
        if "/" not in entry["repo"]:
            raise PresetError(f"{where}: key '{ctx}repo' {entry['repo']!r} is not a Hugging Face repo id "
                              f"(owner/name)", param="repo")
        demos = [m for m in models if m.startswith("demo:")]
        if "demo" not in entry and demos:
            raise PresetError(f"{where}: key '{ctx}demo' is required: 'models' names the demo model "
                              f"{demos[0]} (the stand-in file generated for it)", param="demo")
        for name in ("pattern", "demo"):
            if name in entry and (not entry[name].endswith(".safetensors") or "/" in entry[name]):
                raise PresetError(f"{where}: key '{ctx}{name}' {entry[name]!r} must be a .safetensors file name",
                                  param=name)
        if "demo" in entry and not fnmatch.fnmatchcase(entry["demo"], entry["pattern"]):
            raise PresetError(f"{where}: key '{ctx}demo' {entry['demo']!r} does not match its pattern "
                              f"{entry['pattern']!r} (a stand-in is named like the real file)", param="demo")
        files.append(PresetFile(entry["component"], entry["repo"], entry["pattern"], entry.get("demo"),
                                float(entry.get("scale", 1.0))))
    if not files:
        raise PresetError(f"{where}: key 'files' must list at least one file", param="files")
    order = [f.component for f in files]
    if order != list(spec.denoisers[:len(order)]) or len(set(order)) != len(order):
        raise PresetError(f"{where}: key 'files' must list one file per component in the order "
                          f"{', '.join(spec.denoisers)}; got {', '.join(order)}", param="files")
    defaults = _fields(where, "defaults", data["defaults"], spec)
    requirements = _fields(where, "requirements", data["requirements"], spec)
    scheduler = _scheduler(where, data["scheduler"], spec) if "scheduler" in data else None
    if scheduler is not None:
        # the request fields that would swap or reshape the scheduler are pinned to the recipe's
        for name, value in _scheduler_requirements(scheduler, spec).items():
            if name in requirements and requirements[name] != value:
                raise PresetError(f"{where}: key 'requirements.{name}' = {requirements[name]!r} contradicts the "
                                  f"[scheduler] table, which means {name}={value!r}", param=name)
            requirements[name] = value
    for name, value in requirements.items():
        if name in defaults and defaults[name] != value:
            raise PresetError(f"{where}: key 'defaults.{name}' = {defaults[name]!r} breaks "
                              f"'requirements.{name}' = {value!r}", param=name)
    steps = (scheduler or {}).get("denoising_step_list")
    if steps is not None and requirements.get("num_inference_steps") != len(steps):
        raise PresetError(f"{where}: key 'scheduler.denoising_step_list' has {len(steps)} timesteps, so "
                          f"'requirements.num_inference_steps' must be {len(steps)}", param="num_inference_steps")
    return Preset(data["id"], data["title"], data["pipeline"], tuple(models), tuple(files), defaults,
                  requirements, data.get("description", ""), path, scheduler)


# Request fields that pick the scheduler (Wan's flow_shift / sample_solver), by scheduler family.
_SOLVER_OF = {"FlowMatchEulerDiscreteScheduler": "euler", "StepListFlowMatchScheduler": "euler",
              "UniPCMultistepScheduler": "unipc"}


def _scheduler(where: str, table: dict, spec) -> dict:
    """``[scheduler]``: ``class`` (ours or diffusers') and config fields that class takes; it must build."""
    import inspect

    from .distill.schedulers import scheduler_class

    name = table.get("class")
    if not isinstance(name, str):
        raise PresetError(f"{where}: missing key 'scheduler.class' (a diffusers scheduler class name)",
                          param="class")
    cls = scheduler_class(name)
    if cls is None or name not in _SOLVER_OF:
        raise PresetError(f"{where}: key 'scheduler.class' {name!r} is not a scheduler a preset can set "
                          f"({', '.join(sorted(_SOLVER_OF))})", param="class")
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]
    for key in table:
        if key != "class" and key not in allowed:
            raise PresetError(f"{where}: unknown key 'scheduler.{key}' for {name} (allowed: {', '.join(allowed)})",
                              param=key)
    try:
        cls(**{k: v for k, v in table.items() if k != "class"})
    except Exception as exc:  # noqa: BLE001 - the scheduler's own validation, in one line
        raise PresetError(f"{where}: [scheduler] does not build a {name}: {str(exc).strip().splitlines()[0]}",
                          param="scheduler") from None
    return dict(table)


def _scheduler_requirements(scheduler: dict, spec) -> dict:
    out = {}
    if "sample_solver" in spec.fields:
        out["sample_solver"] = _SOLVER_OF[scheduler["class"]]
    if "flow_shift" in spec.fields:
        from .distill.schedulers import scheduler_class

        cls = scheduler_class(scheduler["class"])
        key = "flow_shift" if out.get("sample_solver") == "unipc" else "shift"
        default = cls().config.get(key)
        out["flow_shift"] = float(scheduler.get(key, default if default is not None else 1.0))
    return out


def _keys(where: str, data: dict, allowed: dict, required, ctx: str) -> None:
    for key in data:
        if key not in allowed:
            raise PresetError(f"{where}: unknown key '{ctx}{key}' (allowed: {', '.join(allowed)})", param=key)
    for key in required:
        if key not in data:
            raise PresetError(f"{where}: missing key '{ctx}{key}'", param=key)
    for key, value in data.items():
        kind = allowed[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            raise PresetError(f"{where}: key '{ctx}{key}' must be {' or '.join(k.__name__ for k in kinds)}, "
                              f"got {value!r}", param=key)


def _fields(where: str, table: str, values: dict, spec) -> dict:
    """Sampling fields, checked by the same rules a request is checked by."""
    from . import params as param_rules

    out = {}
    for name, value in values.items():
        if name not in spec.fields or name in ("prompt", "image", "seed"):
            raise PresetError(f"{where}: unknown key '{table}.{name}' for {spec.class_name}", param=name)
        try:
            out[name] = param_rules.check_field(name, value)
        except InvalidParameter as exc:
            raise PresetError(f"{where}: bad value for '{table}.{name}': {exc.message}", param=name) from None
    return out


def load_presets(directory: Path | None = None) -> list[Preset]:
    directory = Path(directory) if directory else PRESETS_DIR
    presets = [load_preset(p) for p in sorted(directory.glob("*.toml"))]
    return presets


def get_preset(preset_id: str, directory: Path | None = None) -> Preset:
    directory = Path(directory) if directory else PRESETS_DIR
    path = directory / f"{preset_id}.toml"
    if not path.is_file():
        known = ", ".join(p.stem for p in sorted(directory.glob("*.toml")))
        raise InvalidParameter(f"unknown preset {preset_id!r}; available: {known}", param="preset")
    return load_preset(path)


def match_files(class_name: str, paths) -> Preset | None:
    """The preset whose files these are (by name, in order), so a plain ``--lora-path`` fuse
    gets the same sampling defaults and requirements as ``--preset``."""
    names = [Path(p).name for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    for preset in load_presets():
        if preset.pipeline != class_name or len(preset.files) != len(names):
            continue
        if all(fnmatch.fnmatchcase(n, f.pattern) for n, f in zip(names, preset.files)):
            return preset
    return None


# -- file resolution --------------------------------------------------------------------
@dataclass(frozen=True)
class Located:
    file: PresetFile
    path: Path | None
    where: str  # "adapter-dir" | "hf-cache" | "demo" | "missing"
    candidates: tuple[Path, ...] = ()  # every file that matched, when there were several
    choice: str | None = None  # why ``path`` among the candidates (CHOICE_RULE)


def _roots(data_dir, adapter_dirs) -> list[Path]:
    """The adapter roots in the one search order every lookup uses (``settings.adapter_roots``: the
    library, then each ``--adapter-dir``); a preset's files are never demo adapters."""
    return [r for r in settings.adapter_roots(adapter_dirs, data_dir) if r.is_dir()]


def _is_demo_standin(path: Path) -> bool:
    """Generated stand-ins carry a marker in their header; they never stand in for a real model."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return "lora_studio_demo" in (f.metadata() or {})
    except Exception:  # unreadable: let the fuse report it, naming the file
        return False


def _in_roots(name_pattern: str, roots: list[Path]) -> list[Path]:
    """Every matching file under the first root that has any (several versions or dtypes can)."""
    for root in roots:
        hits = sorted(p for p in root.rglob("*.safetensors") if fnmatch.fnmatchcase(p.name, name_pattern)
                      and not _is_demo_standin(p))
        if hits:
            return hits
    return []


# -- which file, when several match -------------------------------------------------------
_DTYPE_TAGS = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32", "float16": "fp16",
               "fp16": "fp16"}
_TAG = re.compile(r"(?<![a-z0-9])(bf16|fp32|fp16)(?![a-z0-9])")
CHOICE_RULE = ("several files match: the one whose name carries the run's dtype (bf16 / fp32 / fp16), "
               "then the highest name (the newest version)")


def dtype_tag(dtype) -> str | None:
    """``bf16`` / ``fp32`` / ``fp16`` for a run dtype (a torch dtype or its name); None if unknown."""
    if dtype is None:
        return None
    return _DTYPE_TAGS.get(str(dtype).replace("torch.", ""))


def choose(paths: list[Path], dtype=None) -> tuple[Path | None, str | None]:
    """The file a run in ``dtype`` uses among ``paths`` (all matching one pattern), and why (None
    when there was no choice): the run's dtype tag first, then the highest name."""
    paths = sorted(paths, key=lambda p: p.name)
    if not paths:
        return None, None
    if len(paths) == 1:
        return paths[0], None
    tag = dtype_tag(dtype)
    same = [p for p in paths if tag and tag in _TAG.findall(p.name.lower())]
    pick = (same or paths)[-1]
    names = ", ".join(p.name for p in paths)
    why = (f"{len(paths)} files match ({names}); picked {pick.name}: "
           + (f"its dtype tag is the run's ({tag})" if same else
              f"the highest name (no file tagged {tag})" if tag else "the highest name (no run dtype given)"))
    return pick, why


def _in_hf_cache(repo: str, pattern: str, cache_dir=None, all_hits: bool = False):
    """The cached file matching ``pattern`` in ``repo`` (newest revision; ``all_hits``: every
    matching file of it); never touches the network."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache
    from huggingface_hub.errors import CacheNotFound

    if not any(ch in pattern for ch in "*?["):
        hit = try_to_load_from_cache(repo, pattern, cache_dir=cache_dir)
        hit = Path(hit) if isinstance(hit, str) else None
        return ([hit] if hit else []) if all_hits else hit
    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return [] if all_hits else None
    for cached in info.repos:
        if cached.repo_id != repo or cached.repo_type != "model":
            continue
        for rev in sorted(cached.revisions, key=lambda r: r.last_modified, reverse=True):
            hits = sorted(Path(f.file_path) for f in rev.files if fnmatch.fnmatchcase(f.file_name, pattern))
            if hits:
                return hits if all_hits else choose(hits)[0]
    return [] if all_hits else None


def locate(preset: Preset, model_id: str, data_dir=None, adapter_dirs=None, hf_cache_dir=None,
           create_demo: bool = False, dtype=None) -> list[Located]:
    """Where each of the preset's files is (or that it is missing), for ``model_id``; when several
    files match a pattern, the one a ``dtype`` run uses (``choose``)."""
    roots = _roots(data_dir, adapter_dirs)
    found = []
    for f in preset.files:
        if model_id.startswith("demo:"):
            if create_demo:  # (re)written when missing or from an older generator, else reused
                from .distill.demo_files import write_demo_file

                path = write_demo_file(model_id, f.demo, f.component, data_dir)
            else:
                path = settings.demo_dir(data_dir) / "distill" / f.demo
                path = path if path.is_file() else None
            found.append(Located(f, path, "demo" if path else "missing"))
            continue
        where, hits = "adapter-dir", _in_roots(f.pattern, roots)
        if not hits:
            where, hits = "hf-cache", _in_hf_cache(f.repo, f.pattern, hf_cache_dir, all_hits=True)
        path, why = choose(hits, dtype)
        found.append(Located(f, path, where if path else "missing", tuple(hits) if len(hits) > 1 else (), why))
    return found


def resolve_files(preset: Preset, model_id: str, data_dir=None, adapter_dirs=None, hf_cache_dir=None,
                  dtype=None) -> list[Path]:
    """The preset's files for ``model_id``, in component order (for a run in ``dtype``: see
    ``choose``); a missing one names repo and filename."""
    located = locate(preset, model_id, data_dir, adapter_dirs, hf_cache_dir, create_demo=True, dtype=dtype)
    for loc in located:
        if loc.path is None:
            raise AdapterNotFound(
                f"preset {preset.id!r}: no file matching {loc.file.pattern!r} for {loc.file.component} in the "
                f"adapter dirs or the Hugging Face cache; fetch it with `huggingface-cli download "
                f"{loc.file.repo} --include '{loc.file.pattern}'` or put it in an --adapter-dir",
                param="preset")
    return [loc.path for loc in located]


def list_presets(data_dir=None, adapter_dirs=None, hf_cache_dir=None) -> list[dict]:
    """Rows for ``app.py presets`` and the UI: each preset, and per file whether it is present.

    For the demo model the files are reported as written on use (they always are), each a trained
    distill or a seeded stand-in (``demo_kind``).
    """
    rows = []
    for preset in load_presets():
        real = [m for m in preset.models if not m.startswith("demo:")]
        located = locate(preset, real[0], data_dir, adapter_dirs, hf_cache_dir) if real else []
        rows.append({
            "id": preset.id, "title": preset.title, "pipeline": preset.pipeline, "models": list(preset.models),
            "defaults": dict(preset.defaults), "requirements": dict(preset.requirements),
            "scheduler": dict(preset.scheduler) if preset.scheduler else None,
            "files": [{"component": loc.file.component, "repo": loc.file.repo, "pattern": loc.file.pattern,
                       "present": loc.path is not None, "path": str(loc.path) if loc.path else None,
                       "where": loc.where, "demo": loc.file.demo,
                       "demo_kind": _demo_kind(preset, loc.file.demo),
                       "candidates": [str(c) for c in loc.candidates],
                       "choice": _choices(loc) if loc.candidates else None} for loc in located],
            "ready": bool(located) and all(loc.path is not None for loc in located),
        })
    return rows


def _demo_kind(preset: Preset, filename: str | None) -> str | None:
    """What a demo model is served under this name: a distill trained here, or a seeded stand-in."""
    if not filename or not preset.demo_models:
        return None
    from .demo import DISTILL_DIRS

    trained = any((DISTILL_DIRS[m] / filename).is_file() for m in preset.demo_models if m in DISTILL_DIRS)
    return "trained distill" if trained else "seeded stand-in"


def _choices(loc: Located) -> str:
    """Which candidate a bf16 and an fp32 run would use (``app.py presets`` has no run dtype)."""
    picks = {tag: choose(list(loc.candidates), tag)[0].name for tag in ("bf16", "fp32")}
    return (f"{len(loc.candidates)} files match; a bfloat16 run uses {picks['bf16']}, a float32 run "
            f"{picks['fp32']} (rule: {CHOICE_RULE})")


def format_rows(rows: list[dict]) -> str:
    """The text ``python app.py presets`` prints."""
    lines = []
    for row in rows:
        state = "ready" if row["ready"] else "files missing"
        lines.append(f"{row['id']}  ({row['pipeline']}; {state})")
        lines.append(f"  {row['title']}")
        lines.append(f"  models: {', '.join(row['models'])}")
        lines.append(f"  defaults: {_kv(row['defaults'])}")
        lines.append(f"  requires: {_kv(row['requirements'])}")
        if row.get("scheduler"):
            sched = dict(row["scheduler"])
            lines.append(f"  scheduler (while fused): {sched.pop('class')}({_kv(sched)})")
        for f in row["files"]:
            mark = f"present ({f['where']}): {f['path']}" if f["present"] else \
                f"MISSING: huggingface-cli download {f['repo']} --include '{f['pattern']}'"
            lines.append(f"  {f['component']}: {f['repo']} {f['pattern']}  {mark}")
            if f.get("choice"):
                lines.append(f"    {f['choice']}")
        if any(f["demo"] for f in row["files"]):
            files = ", ".join(f"{f['demo']} ({f.get('demo_kind') or 'seeded stand-in'})" for f in row["files"])
            lines.append(f"  demo file(s), written on use: {files}")
    return "\n".join(lines)


def _kv(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "-"

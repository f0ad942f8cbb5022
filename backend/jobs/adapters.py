"""Which adapter file a request means, and whether it may use it.

A request names an adapter by ``name`` (one registered with /v1/load_lora_adapter, or
one in the library) and/or by ``path``. A path must resolve, symlinks followed, inside
one of the adapter roots (``<data-dir>/adapters`` and every ``--adapter-dir``), else
PathNotAllowed (403): ``..``, absolute paths elsewhere and links pointing out are all
refused the same way, and nothing is said about whether the file exists out there.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import settings
from ..digest import lora_int_id
from ..errors import AdapterNotFound, InvalidParameter, PathNotAllowed


@dataclass(frozen=True)
class ResolvedAdapter:
    name: str
    path: str
    scale: float | list | dict  # backend/lora/schedule.py
    int_id: int

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "scale": self.scale, "int_id": self.int_id}


class AdapterResolver:
    """``model``: the model served (an id, or a callable giving the one loaded now): while it is a
    demo model, the demo adapters (``<data-dir>/demo/adapters``) are a root too."""

    def __init__(self, adapter_dirs=(), data_dir=None, model=None):
        self.data_dir = data_dir
        self._model = model if callable(model) else (lambda: model)
        self.adapter_dirs: list[Path] = settings.adapter_roots(adapter_dirs, data_dir)[1:]  # the --adapter-dirs
        self._registered: dict[str, str] = {}  # name -> resolved path (vLLM's load_lora_adapter)
        self._lock = threading.Lock()

    # -- paths -----------------------------------------------------------------------------------
    def check_path(self, raw: str, param: str = "lora.path") -> Path:
        if not isinstance(raw, str) or not raw.strip():
            raise InvalidParameter(f"{param} must be a non-empty string", param=param)
        # "~/x" is the server's home (the roots rule applies as to any path); "~name/x" is not expanded: a
        # client must not make the server look users up (an unknown one raised, a 500)
        given = Path(raw).expanduser() if raw == "~" or raw.startswith("~/") else Path(raw)
        candidates = [given] if given.is_absolute() else [root / given for root in self.roots]
        for cand in candidates:
            if not os.path.lexists(cand):
                continue
            real = Path(os.path.realpath(cand))  # every symlink on the way, the last one included (loops end)
            if not self._inside(real):
                break  # it exists, but out there: refused below, whatever it is
            if real.exists():
                return real
        else:
            if any(self._inside(Path(os.path.realpath(c))) for c in candidates):
                raise AdapterNotFound(f"adapter path {raw!r} does not exist under the adapter roots", param=param)
        raise PathNotAllowed(f"adapter path {raw!r} resolves outside the adapter roots "
                             f"({', '.join(map(str, self.roots))})", param=param)

    @property
    def roots(self) -> list[Path]:
        """The library first, then each --adapter-dir, then the demo adapters while a demo model is served."""
        model = self._model()
        return settings.adapter_roots(self.adapter_dirs, self.data_dir,
                                      demo=isinstance(model, str) and model.startswith("demo:"))

    def _demo_served(self) -> bool:
        model = self._model()
        return isinstance(model, str) and model.startswith("demo:")

    def _inside(self, real: Path) -> bool:
        return any(real == root or real.is_relative_to(root) for root in self.roots)

    def int_id(self, path: Path) -> int:
        return lora_int_id(str(path))

    # -- names -----------------------------------------------------------------------------------
    def register(self, name: str, path: str) -> ResolvedAdapter:
        if not isinstance(name, str) or not name.strip():
            raise InvalidParameter("lora_name must be a non-empty string", param="lora_name")
        real = self.check_path(path, "lora_path")
        _inspect(real, name)
        with self._lock:
            self._registered[name] = str(real)
        return ResolvedAdapter(name, str(real), 1.0, self.int_id(real))

    def register_start_file(self, path) -> ResolvedAdapter:
        """A ``--lora-path`` adapter of a PEFT server, registered under its file (or folder) name
        so requests can name it. The operator chose the file at start, so it need not sit under
        an adapter root; a request's own ``path`` still must."""
        given = Path(path).expanduser()
        if not given.exists():
            raise AdapterNotFound(f"--lora-path {path}: no such file or folder", param="lora_path")
        real = given.resolve()
        name = given.name if given.is_dir() else given.stem
        _inspect(real, name)
        with self._lock:
            self._registered[name] = str(real)
        return ResolvedAdapter(name, str(real), 1.0, self.int_id(real))

    def unregister(self, name: str) -> None:
        with self._lock:
            if self._registered.pop(name, None) is None:
                raise AdapterNotFound(f"no adapter named {name!r} was loaded with /v1/load_lora_adapter",
                                      param="lora_name")

    def registered(self) -> dict[str, str]:
        with self._lock:
            return dict(self._registered)

    def by_name(self, name: str) -> Path:
        with self._lock:
            if name in self._registered:
                return Path(self._registered[name])
        from ..lora.library import find

        entry = find(name, self.roots[1:], self.data_dir)
        if entry is None and self._demo_served():
            # the demo adapters are written the first time something lists them; a request that names one
            # before (a script that starts the server and asks at once) writes them now instead of a 404
            from ..lora import demo_adapters

            demo_adapters.ensure(self.data_dir)
            entry = find(name, self.roots[1:], self.data_dir)
        if entry is None:
            raise AdapterNotFound(f"no adapter named {name!r} in the library or loaded with "
                                  "/v1/load_lora_adapter", param="lora.name")
        real = self.check_path(str(entry.path), "lora.name")  # the root rule, by name as by path
        if entry.error:
            raise InvalidParameter(f"adapter {name!r} cannot be used: {entry.error}", param="lora.name")
        return real

    # -- a request's adapters ---------------------------------------------------------------------
    def resolve(self, specs: list[dict] | None) -> list[ResolvedAdapter]:
        """[{"name", "path", "scale", "int_id"}] (any of name/path) -> checked, resolved adapters."""
        out = []
        for i, spec in enumerate(specs or []):
            where = f"lora[{i}]" if len(specs) > 1 else "lora"
            if not isinstance(spec, dict):
                raise InvalidParameter(f"{where} must be an object with a name and/or path", param=where)
            given = spec.get("scale")
            scale = None if given is None else _scale(given, f"{where}.scale")  # pure, before any file is looked at
            name, path = spec.get("name"), spec.get("path")
            if not name and not path:
                raise InvalidParameter(f"{where} needs a name or a path", param=f"{where}.name")
            real = self.check_path(path, f"{where}.path") if path else self.by_name(name)
            if not name:
                name = real.name if real.is_dir() else real.stem
            _check_file(real, f"{where}.path" if path else f"{where}.name")
            if scale is None:  # no weight named: the adapter's preferred one (A1111's sidecar), else 1.0
                from ..lora.sidecar import preferred_weight

                scale = preferred_weight(real)
            int_id = spec.get("int_id")
            if int_id is None:
                int_id = self.int_id(real)
            elif isinstance(int_id, bool) or not isinstance(int_id, int) or int_id < 1:
                raise InvalidParameter(f"{where}.int_id must be a positive integer, got {int_id!r}",
                                       param=f"{where}.int_id")
            out.append(ResolvedAdapter(str(name), str(real), scale, int_id))
        return out




def _scale(value, param: str):
    """A number, a step schedule, per expert or per-block weights (backend/lora/schedule.py), as JSON."""
    from ..lora.schedule import to_json

    return to_json(value, param)


def _check_file(path: Path, param: str) -> None:
    """The adapter's header, configs and alphas, checked now (a 400 naming the file and key) rather
    than by the worker mid-job; cheap: no weight is read and nothing is hashed."""
    from ..lora.formats import check

    check(path, param)


def _inspect(path: Path, name: str) -> None:
    """Read the adapter's header now, so a broken file is refused at load time, not mid-job."""
    from ..lora.formats import inspect

    inspect(path, name)

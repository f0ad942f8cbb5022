"""The PEFT backend's engine: per-request adapter activation by exact merge.

Strategy: the active set is merged into the denoisers' Linear weights,
``W = W0 + sum_i s_i * (B_i * scaling_i) @ A_i`` in one fp32 GEMM per layer (stacked
factors are concatenated), so a generation with an adapter costs the same per step as
the base model. Every weight is written from its pristine copy ``W0`` (kept by
``backend.weights.WeightSnapshot`` the first time a layer is touched), never from the
previous merged value, so nothing accumulates: base -> A -> B -> base gives the base
bits back in any dtype, after any number of switches.

Work is skipped where nothing changed: a request with the same active set writes no
layer (``stats()["noop_activations"]`` counts it), and a switch writes only the layers
whose contributions differ.

Adapter factors live in a two-tier LRU (``max_loras`` on the device, ready to merge;
``max_cpu_loras`` on CPU, read and converted). Reading and fitting happen before the
model is touched; a failure while writing rolls every touched layer back to pristine.
On CPU the layers of a switch are written by single-threaded workers
(``backend.cpu_tasks``), which keeps switching fast on a busy machine.
"""
from __future__ import annotations

import contextlib

import dataclasses
import math
import threading
import time
from dataclasses import dataclass

import torch

from ..cpu_tasks import run_tasks
from ..errors import AdapterError, AdapterNotFound, InvalidParameter
from ..weights import WeightSnapshot
from .adapter import LoadedAdapter, load_adapter
from .cache import TwoTierCache
from .request import LoRARequest


@dataclass(frozen=True)
class _DeviceFactors:
    """Factors ready to merge: fp32 on the weight's device, with the adapter's own scaling."""

    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None
    scaling: float


class _LayerWriteFailed(Exception):
    def __init__(self, layer: str, cause: Exception):
        super().__init__(layer)
        self.layer, self.cause = layer, cause


class LoRAEngine:
    def __init__(self, pipeline, denoisers: dict[str, torch.nn.Module], *, model: str = "model",
                 max_loras: int = 4, max_cpu_loras: int = 16, lora_mode: str | None = None):
        if max_cpu_loras < max_loras:
            raise InvalidParameter(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})",
                                   param="max_cpu_loras")
        # the pipeline (or its class) picks diffusers' converters for non-diffusers layouts
        self.pipeline_cls = pipeline if isinstance(pipeline, type) else type(pipeline)
        self.denoisers = dict(denoisers)
        self.model = model
        self.cache = TwoTierCache(max_loras, max_cpu_loras)
        self._snapshots = {c: WeightSnapshot(m) for c, m in self.denoisers.items()}
        self._params = {c: dict(m.named_parameters()) for c, m in self.denoisers.items()}
        # (component, module) -> contribution key currently merged there
        self._merged: dict[tuple[str, str], tuple] = {}
        self._active_key: tuple = ()
        self._active_meta: list[dict] = []
        self._scratch_buf: dict = {}
        self.preloaded: list[LoRARequest] = []  # pinned at start (Omni(lora_path=...))
        self._lock = threading.RLock()
        self.counters = {"activations": 0, "noop_activations": 0, "switches": 0, "layers_written": 0,
                         "loads_from_disk": 0, "aliases": 0, "reloads_stale": 0, "rollbacks": 0}
        # merge or unfused by cost (backend/lora/unfused.py, backend/lora/policy.py)
        from .unfused import UnfusedServing
        self.unfused = UnfusedServing(self, lora_mode)

    # -- loading (CPU; never touches the model) -------------------------------------------------
    def load(self, request: LoRARequest, *, pin: bool = False) -> LoadedAdapter:
        """Make sure an adapter is in the CPU tier (reading it from disk if needed)."""
        key = request.lora_int_id
        with self._lock:
            cached = self.cache.cpu.get(key)
            if cached is not None:
                self._check_same(cached, request)
                if not cached.is_stale():
                    if pin:
                        self.cache.pinned.add(key)
                    return cached
                self.counters["reloads_stale"] += 1
                self.cache.device.pop(key)
            alias = self._same_content(request) if cached is None else None
            if alias is not None:  # the same file under another id/name: share its factors, no disk read
                loaded = dataclasses.replace(alias, name=request.lora_name, int_id=key)
                self.counters["aliases"] += 1
                return self._insert(loaded, pin)
        path = request.lora_path or (cached.record.path if cached is not None else "")
        if not path:
            raise AdapterNotFound(f"adapter {request.lora_name!r} (id {key}) is not loaded and the request "
                                  "gives no lora_path", param="lora_path")
        # read + convert + fit outside the lock: disk and CPU work only
        loaded = load_adapter(path, self.pipeline_cls, self.denoisers, name=request.lora_name, int_id=key,
                              model=self.model)
        with self._lock:
            self.counters["loads_from_disk"] += 1
            return self._insert(loaded, pin)

    def _insert(self, loaded: LoadedAdapter, pin: bool) -> LoadedAdapter:
        if pin:
            self.cache.pinned.add(loaded.int_id)
        self.cache.cpu.put(loaded.int_id, loaded, loaded.nbytes, keep=self.cache.keep())
        return loaded

    def _same_content(self, request: LoRARequest) -> LoadedAdapter | None:
        """A cached, fresh entry for the same file (by path), or by name when no path is given."""
        for entry in self.loaded():
            if entry.is_stale():
                continue
            if request.lora_path and _same_path(request.lora_path, entry.record.path):
                return entry
            if not request.lora_path and entry.name == request.lora_name:
                return entry
        return None

    def prepare(self, adapters) -> None:
        """Read and fit the adapters of a coming request, so activation later is a short device step.

        Safe to call without the manager's lock (it never touches the model): a server worker
        calls it before ``PipelineManager.generate``.
        """
        for request, _ in adapters or []:
            self.load(request)

    def unload(self, name_or_id) -> None:
        """Forget an adapter (both tiers, pin included). Its merged weights stay until the next switch."""
        with self._lock:
            key = self._key_of(name_or_id)
            self.cache.drop(key)

    def find(self, name: str) -> LoadedAdapter | None:
        with self._lock:
            for key in self.cache.cpu.keys():
                entry = self.cache.cpu._entries[key].value
                if entry.name == name:
                    return entry
        return None

    def loaded(self) -> list[LoadedAdapter]:
        with self._lock:
            return [self.cache.cpu._entries[k].value for k in self.cache.cpu.keys()]

    # -- activation -------------------------------------------------------------------------------
    def activate(self, adapters, *, steps=None, mode=None, queued_same: int = 0) -> list[dict]:
        """Make exactly ``adapters`` (list of (LoRARequest, scale)) active; [] is the base model.

        Returns the metadata of what is active: name, id, path, sha256, format, scale.
        ``steps``, ``mode`` ("auto" | "merge" | "unfused") and ``queued_same`` feed the
        merge-or-unfused policy (``self.unfused.last_decision`` says what it chose).
        """
        adapters = list(adapters or [])
        with self._lock:
            self.counters["activations"] += 1
            loaded = []
            for request, scale in adapters:
                if not isinstance(request, LoRARequest):
                    raise InvalidParameter(f"expected a LoRARequest, got {type(request).__name__}",
                                           param="lora_request")
                entry = self.load(request)
                scales = self._component_scales(entry, scale)
                if any(s != 0.0 for s in scales.values()):
                    loaded.append((entry, scales))
            key = tuple((e.int_id, e.stamp, tuple(sorted(s.items()))) for e, s in loaded)
            # -- merge or unfused (backend/lora/unfused.py): served unfused = hooks, no weight write --
            if self.unfused.serve(loaded, key, steps=steps, mode=mode, queued_same=queued_same):
                return [dict(m) for m in self._active_meta]
            # -- end merge or unfused --
            if key == self._active_key:
                self.counters["noop_activations"] += 1
                return [dict(m) for m in self._active_meta]
            plan = self._plan(loaded)
            started, written = time.perf_counter(), self.counters["layers_written"]  # -- unfused: timing
            self._apply(plan)
            if self.counters["layers_written"] != written:  # -- unfused: the policy's measured bandwidth
                self.unfused.observe_merge(time.perf_counter() - started)
            self._active_key = key
            self._active_meta = [self._meta(e, s) for e, s in loaded]
            self.counters["switches"] += 1
            return [dict(m) for m in self._active_meta]

    def deactivate(self) -> None:
        self.activate([])

    @contextlib.contextmanager
    def rebase(self):
        """Adopt the current weights as the new base, e.g. around a distill fuse or restore.

        Adapters come off first (so whoever writes the base sees pristine weights), and the
        pristine copies are dropped afterwards, so the next activation captures the new base
        instead of writing the old one back.
        """
        with self._lock:
            self.deactivate()
            try:
                yield
            finally:
                for snap in self._snapshots.values():
                    snap.clear()
                self._merged.clear()

    @property
    def active(self) -> list[dict]:
        return [dict(m) for m in self._active_meta]

    def _component_scales(self, entry: LoadedAdapter, scale) -> dict[str, float]:
        bound = list(entry.bindings)
        if isinstance(scale, dict):
            out = {}
            for comp, value in scale.items():
                if comp not in self.denoisers:
                    raise InvalidParameter(f"lora_scale names component {comp!r}; {self.model} has "
                                           f"{', '.join(self.denoisers)}", param="lora_scale")
                value = _finite(value)
                if value != 0.0 and comp not in bound:
                    raise InvalidParameter(f"adapter {entry.name!r} does not bind to {comp!r} "
                                           f"(it binds to {', '.join(bound)})", param="lora_scale")
                out[comp] = value
            return {c: out.get(c, 0.0) for c in bound}
        value = 1.0 if scale is None else _finite(scale)
        return {c: value for c in bound}

    def _plan(self, loaded) -> dict[tuple[str, str], list]:
        """(component, module) -> [(adapter entry, scale)] for every layer the new set touches."""
        plan: dict[tuple[str, str], list] = {}
        for entry, scales in loaded:
            for comp, s in scales.items():
                if s == 0.0:
                    continue
                for module in entry.bindings[comp].layers:
                    plan.setdefault((comp, module), []).append((entry, s))
        return plan

    def _apply(self, plan) -> None:
        def contribution(items):
            return tuple((e.int_id, e.stamp, s) for e, s in items)

        targets = set(plan) | set(self._merged)
        changed = [t for t in sorted(targets)
                   if contribution(plan.get(t, [])) != self._merged.get(t, ())]
        device_factors = self._device_factors({e.int_id: e for items in plan.values() for e, _ in items})
        work = []
        for comp, module in changed:
            contributions = [(device_factors[e.int_id][(comp, module)], s) for e, s in plan.get((comp, module), [])]
            work.append((comp, module, contributions))
        self._capture_pristine(work)
        try:
            if all(self._params[c][f"{m}.weight"].device.type == "cpu" for c, m, _ in work):
                run_tasks(self._write_layer, work)  # independent layers: no barrier per GEMM
            else:
                for item in work:
                    self._write_layer(item)
        except _LayerWriteFailed as failed:
            self._rollback(set(self._merged) | {(c, m) for c, m, _ in work})
            raise AdapterError(f"activating adapters failed at {failed.layer} ({failed.cause}); every touched "
                               "layer was restored and the base model is active",
                               param="lora_request") from failed.cause
        for t in changed:
            if t in plan:
                self._merged[t] = contribution(plan[t])
            else:
                self._merged.pop(t, None)
        self.counters["layers_written"] += len(changed)

    def _write_layer(self, item) -> None:
        comp, module, contributions = item
        try:
            self._write(comp, module, contributions)
        except Exception as exc:
            raise _LayerWriteFailed(f"{comp}.{module}", exc) from exc

    def _write(self, comp: str, module: str, contributions) -> None:
        """Write one layer as pristine + the given contributions (fp32 math, one rounding)."""
        params = self._params[comp]
        snap = self._snapshots[comp]
        w_name, b_name = f"{module}.weight", f"{module}.bias"
        weight = params[w_name]
        with torch.no_grad():
            w0 = snap.saved[w_name].to(weight.device, non_blocking=True)
            if not contributions:
                weight.data.copy_(w0)
            elif weight.dtype == torch.float32:
                (first, s0), rest = contributions[0], contributions[1:]
                torch.addmm(w0, first.b, first.a, alpha=s0 * first.scaling, out=weight.data)
                for f, s in rest:
                    weight.data.addmm_(f.b, f.a, alpha=s * f.scaling)
            else:  # low precision: sum in an fp32 scratch buffer, round once
                acc = self._scratch(weight)
                acc.copy_(w0)
                for f, s in contributions:
                    acc.addmm_(f.b, f.a, alpha=s * f.scaling)
                weight.data.copy_(acc)
            if b_name in snap.saved:
                bias = params[b_name]
                b0 = snap.saved[b_name].to(bias.device, non_blocking=True)
                acc = b0.float()
                for f, s in contributions:
                    if f.bias is not None:
                        acc = acc + f.bias * (s * f.scaling)
                bias.data.copy_(acc)

    def _scratch(self, weight: torch.Tensor) -> torch.Tensor:
        """A reused fp32 buffer per writing thread (no per-switch allocations, so RSS stays flat)."""
        key = (weight.device, threading.get_ident())
        buf = self._scratch_buf.get(key)
        if buf is None or buf.numel() < weight.numel():
            buf = torch.empty(weight.numel(), dtype=torch.float32, device=weight.device)
            self._scratch_buf[key] = buf
        return buf[: weight.numel()].view(weight.shape)

    def _capture_pristine(self, work) -> None:
        """Copy, before their first write, exactly the tensors this switch will write."""
        names: dict[str, list[str]] = {}
        for comp, module, contributions in work:
            names.setdefault(comp, []).append(f"{module}.weight")
            if any(f.bias is not None for f, _ in contributions):
                names[comp].append(f"{module}.bias")
        for comp, todo in names.items():
            self._snapshots[comp].capture(todo)

    def _rollback(self, layers) -> None:
        with torch.no_grad():
            for comp, module in layers:
                snap, params = self._snapshots[comp], self._params[comp]
                for name in (f"{module}.weight", f"{module}.bias"):
                    if name in snap.saved:
                        params[name].data.copy_(snap.saved[name].to(params[name].device))
        self._merged.clear()
        self._active_key, self._active_meta = (), []
        self.counters["rollbacks"] += 1

    def _device_factors(self, entries: dict[int, LoadedAdapter]) -> dict[int, dict]:
        """Device-tier factors for the adapters of one activation (moving them there if needed)."""
        out = {}
        keep = self.cache.keep(entries)
        for key, entry in entries.items():
            factors = self.cache.device.get(key)
            if factors is None:
                factors = {}
                for comp, binding in entry.bindings.items():
                    for module, f in binding.layers.items():
                        device = self._params[comp][f"{module}.weight"].device
                        bias = f.tensors.get("lora_B.bias")
                        factors[(comp, module)] = _DeviceFactors(
                            a=f.tensors["lora_A.weight"].to(device, torch.float32).contiguous(),
                            b=f.tensors["lora_B.weight"].to(device, torch.float32).contiguous(),
                            bias=None if bias is None else bias.to(device, torch.float32),
                            scaling=f.scaling)
                nbytes = sum(t.numel() * t.element_size() for d in factors.values()
                             for t in (d.a, d.b, d.bias) if t is not None)
                self.cache.device.put(key, factors, nbytes, keep=keep)
            out[key] = factors
        return out

    # -- helpers ------------------------------------------------------------------------------------
    def _check_same(self, entry: LoadedAdapter, request: LoRARequest) -> None:
        if request.lora_path and _same_path(request.lora_path, entry.record.path) is False:
            raise AdapterError(f"lora_int_id {request.lora_int_id} is already adapter {entry.name!r} at "
                               f"{entry.record.path}; use another id for {request.lora_path}",
                               param="lora_int_id")

    def _key_of(self, name_or_id):
        if isinstance(name_or_id, int):
            if name_or_id not in self.cache.cpu and name_or_id not in self.cache.device:
                raise AdapterNotFound(f"no loaded adapter with id {name_or_id}", param="lora_int_id")
            return name_or_id
        entry = self.find(name_or_id)
        if entry is None:
            raise AdapterNotFound(f"no loaded adapter named {name_or_id!r}", param="lora_name")
        return entry.int_id

    def _meta(self, entry: LoadedAdapter, scales: dict[str, float]) -> dict:
        values = set(scales.values())
        scale = values.pop() if len(values) == 1 else dict(scales)
        return {"name": entry.name, "int_id": entry.int_id, "path": str(entry.record.path),
                "sha256": entry.record.sha256, "format": entry.record.format, "scale": scale}

    def pristine_bytes(self) -> int:
        return sum(s.nbytes() for s in self._snapshots.values())

    def stats(self) -> dict:
        """Cache tiers, counters and bytes, for the UI and the benchmark."""
        with self._lock:
            tiers = self.cache.stats()
            names = {k: self.cache.cpu._entries[k].value.name for k in self.cache.cpu.keys()}
            tiers["device"]["adapters"] = [names.get(k, str(k)) for k in self.cache.device.keys()]
            tiers["cpu"]["adapters"] = [names[k] for k in self.cache.cpu.keys()]
            return {"tiers": tiers, "pinned": sorted(names.get(k, str(k)) for k in self.cache.pinned),
                    "active": self.active, "counters": dict(self.counters),
                    "merged_layers": len(self._merged), "pristine_bytes": self.pristine_bytes(),
                    "unfused": self.unfused.stats()}


def _finite(value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InvalidParameter(f"lora_scale must be a number, got {value!r}", param="lora_scale") from None
    if not math.isfinite(v):
        raise InvalidParameter(f"lora_scale must be finite, got {value!r}", param="lora_scale")
    return v


def _same_path(a, b) -> bool:
    from pathlib import Path

    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False

"""The PEFT backend's engine: per-request adapter activation by exact merge.

Strategy: the active set is merged into the denoisers' Linear weights with one GEMM per
layer, ``W = addmm(W0, B_cat, A_cat, alpha)``: the factors of every adapter on that layer are
concatenated along the rank (``B_cat = [B_1 c_1 | B_2 c_2 ...]``, ``c_i = s_i * scaling_i``;
with a single adapter its ``c`` is addmm's ``alpha`` and ``B`` is used as stored). The GEMM
accumulates in fp32 and rounds once into the weight: in fp32 the result is within fp32's
accumulation error of the float64 value; in bf16 on CPU (oneDNN / PyTorch's fp32-accumulating
bf16 gemm) and on CUDA (cuBLAS, fp32 compute) within 1 ulp of it, correctly rounded for all
but a few elements in a million (tests/test_lora_engine.py measures it). Factors are stored in
the model's dtype on the device, as peft's own layers keep them; with stacked adapters of
different scales ``B_i c_i`` is rounded once to that dtype (a relative 2^-9 on the delta in
bf16, far below one ulp of the weight). No fp32 copy of a weight is ever made.

Every weight is written from its pristine copy ``W0`` (``backend.lora.pristine``: on the device
or in pinned host memory, ``--pristine``), never from the previous merged value, so nothing
accumulates: base -> A -> B -> base gives the base bits back in any dtype, after any number
of switches. A merge whose result is not finite (an Infinity alpha, factors of 1e30) is
refused: every touched layer goes back to its original and the error names the adapter and
the layer.

The active set is canonical: adapters are identified by their file (resolved path + sha256),
not by ``lora_int_id`` or name, duplicates' scales are summed and the set is sorted by
identity, so ``[A, B]`` then ``[B, A]`` with the same scales is a no-op (0 layers written;
``stats()["noop_activations"]`` counts it), and a switch writes only the layers whose
contributions differ. One adapter is one cache entry whatever the ids and names it is
requested by: a pre-loaded (pinned) adapter requested by path or by its registered name
uses its pinned entry.

Adapter factors live in a two-tier LRU (``max_loras`` on the device, ready to merge;
``max_cpu_loras`` on CPU, read and converted). Reading and fitting happen before the
model is touched; a failure while writing rolls every touched layer back to pristine.
On CPU the layers of a switch are written by single-threaded workers
(``backend.cpu_tasks``), which keeps switching fast on a busy machine.
"""
from __future__ import annotations

import contextlib

import math
import threading
import time
from dataclasses import dataclass

import torch

from ..cpu_tasks import run_tasks
from ..errors import AdapterError, AdapterNotFound, InvalidParameter
from ..errors import LayerWriteFailed as _LayerWriteFailed, NonFinite as _NonFinite
from . import lycoris
from . import pristine as pristine_mod
from . import schedule
from .adapter import LoadedAdapter, load_adapter
from .cache import TwoTierCache
from .request import LoRARequest


Identity = tuple  # (resolved weights file, sha256): one adapter, whatever it is requested as


@dataclass(frozen=True)
class _DeviceFactors:
    """Factors ready to merge: in the weight's dtype on its device, with the adapter's own scaling.
    A LyCORIS layer (LoHa, LoKr, full diff: ``lycoris.py``) keeps its compact ``parts`` instead of
    ``a``/``b``, a DoRA layer its ``magnitude`` beside them; their deltas are built at merge time (``delta``)."""

    a: torch.Tensor | None
    b: torch.Tensor | None
    bias: torch.Tensor | None
    scaling: float
    bound: float = math.inf  # r * max|B| * max|A| (+ max|bias|): no element of B @ A is larger
    kind: str = "lora"
    parts: dict | None = None  # a LyCORIS layer's parts (no ``a``/``b``), a DoRA layer's ``magnitude``

    def delta(self, w0: torch.Tensor | None = None) -> torch.Tensor:
        """A merge-only layer's delta in fp32 on the device, before the request's weight: LyCORIS's before its
        scaling too; DoRA's from the pristine weight ``w0`` (fp32), as peft merges it: the magnitude times
        ``W0 + scaling * B @ A`` normalised per output row (a ``magnitude`` of (out, 1)) or per input column
        ((1, in): kohya / LyCORIS), minus ``W0``. A weight s gives ``W0 + s * delta`` (ComfyUI's strength:
        1 is peft's merge, 0 the base)."""
        if self.kind != "dora":
            return lycoris.delta(self.kind, self.parts)
        m = self.parts["magnitude"].float()
        w = torch.addmm(w0, self.b.float(), self.a.float(), alpha=self.scaling)
        norm = torch.linalg.vector_norm(w, dim=1 if m.shape[1] == 1 else 0, keepdim=True)
        return w * (m / norm) - w0

    @property
    def nbytes(self) -> int:
        tensors = [self.a, self.b, self.bias, *(self.parts or {}).values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def identity_of(entry: LoadedAdapter) -> Identity:
    if entry.identity is None:
        entry.identity = (str(_resolved(entry.record.file)), entry.record.sha256)
    return entry.identity


class LoRAEngine:
    def __init__(self, pipeline, denoisers: dict[str, torch.nn.Module], *, model: str = "model",
                 encoders: dict[str, torch.nn.Module] | None = None,
                 max_loras: int = 4, max_cpu_loras: int = 16, pristine: str = "auto",
                 lora_mode: str | None = None, family=None, factor_device=None,
                 mode_fixed_by: str | None = None):
        if max_cpu_loras < max_loras:
            raise InvalidParameter(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})",
                                   param="max_cpu_loras")
        # the pipeline (or its class) picks diffusers' converters for non-diffusers layouts
        self.pipeline_cls = pipeline if isinstance(pipeline, type) else type(pipeline)
        # the family's hooks: how its files become per-component factors, its request rules (backend/lora/family.py)
        from .family import hooks_for

        self.family = family if family is not None else hooks_for(self.pipeline_cls)
        # where device-tier factors live when not with their weight (offload: the compute device, unfused only)
        self.factor_device = None if factor_device is None else torch.device(factor_device)
        # why lora_mode is fixed for this engine, or None (offload: weights are not where a merge could write them)
        self.mode_fixed_by = mode_fixed_by
        if mode_fixed_by is not None and lora_mode not in ("merge", "unfused"):
            raise InvalidParameter("a fixed lora_mode must be merge or unfused", param="lora_mode")
        self.denoisers = dict(denoisers)
        # text encoders a LoRA's ``lora_te*`` / ``text_encoder*.`` layers change: merged always (they run
        # once per request, before the first step), whatever mode the denoisers' layers are served in
        self.encoders = {c: m for c, m in (encoders or {}).items() if c not in self.denoisers}
        self.model = model
        self.cache = TwoTierCache(max_loras, max_cpu_loras)  # keyed by adapter identity
        self.pristine_mode = pristine
        placement, why = pristine_mod.choose(pristine, self.targets)
        pristine_mod.check_host_memory(placement, self.targets)
        self.pristine = pristine_mod.PristineStore(placement)
        self.pristine_reason = why
        self.targetable_bytes = pristine_mod.targetable_bytes(self.targets)
        self._params = {c: dict(m.named_parameters()) for c, m in self.targets.items()}
        # quantized bases (backend/quant.py): factors in each layer's compute dtype, served unfused only
        from .. import quant
        self._compute = quant.compute_dtypes(self.denoisers)
        self.quantized = quant.quantized_kind(self.denoisers)
        # (component, module) -> contribution key currently merged there
        self._w0_amax: dict[tuple[str, str], float] = {}  # largest |element| of each original (and bias)
        self._merged: dict[tuple[str, str], tuple] = {}
        self._active_key: tuple = ()
        self._active_meta: list[dict] = []
        self._ids: dict[int, Identity] = {}  # lora_int_id -> identity
        self._names: dict[str, Identity] = {}  # lora_name -> identity
        self._paths: dict[Identity, set[str]] = {}  # identity -> resolved paths it was named by
        self._pinned_as: dict[Identity, set] = {}  # identity -> the ids and names it was pinned under
        self.preloaded: list[LoRARequest] = []  # pinned at start (Omni(lora_path=...))
        self._lock = threading.RLock()
        self.counters = {"activations": 0, "noop_activations": 0, "switches": 0, "layers_written": 0,
                         "bytes_written": 0, "loads_from_disk": 0, "aliases": 0, "reloads_stale": 0,
                         "rollbacks": 0, "nonfinite_refused": 0}
        # merge or unfused by cost (backend/lora/unfused.py, backend/lora/policy.py)
        from .unfused import UnfusedServing
        self.unfused = UnfusedServing(self, lora_mode)

    @property
    def targets(self) -> dict[str, torch.nn.Module]:
        """Every component an adapter may change: the denoisers, then the text encoders."""
        return {**self.denoisers, **self.encoders}

    # -- loading (CPU; never touches the model) -------------------------------------------------
    def load(self, request: LoRARequest, *, pin: bool = False) -> LoadedAdapter:
        """Make sure an adapter is in the CPU tier (reading it from disk if needed)."""
        with self._lock:
            key = self._lookup(request)
            cached = self.cache.cpu.get(key) if key is not None else None
            if cached is not None:
                if not cached.is_stale():
                    if request.lora_int_id not in self._ids or request.lora_name not in self._names:
                        self.counters["aliases"] += 1
                    self._register(request, key, pin)
                    return cached
                self.counters["reloads_stale"] += 1
        path = request.lora_path or (cached.record.path if cached is not None else "")
        if not path:
            raise AdapterNotFound(f"adapter {request.lora_name!r} (id {request.lora_int_id}) is not loaded and "
                                  "the request gives no lora_path", param="lora_path")
        # read + convert + fit outside the lock: disk and CPU work only
        loaded = load_adapter(path, self.pipeline_cls, self.denoisers, name=request.lora_name,
                              int_id=request.lora_int_id, model=self.model, family=self.family,
                              encoders=self.encoders)
        with self._lock:
            self.counters["loads_from_disk"] += 1
            new = identity_of(loaded)
            if cached is not None and key != new:  # rewritten: the old content goes, its pin moves over
                if key in self.cache.pinned:
                    pin = True
                    self._pinned_as.setdefault(new, set()).update(self._pinned_as.pop(key, ()))
                self.cache.drop(key)
                self._forget(key)
            existing = self.cache.cpu.get(new)
            if existing is not None and not existing.is_stale():
                loaded = existing  # read concurrently by someone else
            else:
                self.cache.device.pop(new)  # never merge factors of an older read
                self.cache.cpu.put(new, loaded, loaded.nbytes, keep=self.cache.keep([new]))
            self._register(request, new, pin)
            return loaded

    def _lookup(self, request: LoRARequest) -> Identity | None:
        """The identity a request names: by path when it gives one, else by id, then by name."""
        by_id = self._ids.get(request.lora_int_id)
        if by_id is not None and by_id not in self.cache.cpu:
            by_id = None
        if request.lora_path:
            wanted = self._resolve(request.lora_path)
            for key in self.cache.cpu.keys():
                if wanted in self._paths.get(key, ()):
                    if by_id is not None and by_id != key:
                        self._refuse_id(request, by_id)
                    return key
            if by_id is not None:
                self._refuse_id(request, by_id)
            return None
        if by_id is not None:
            return by_id
        by_name = self._names.get(request.lora_name)
        return by_name if by_name is not None and by_name in self.cache.cpu else None

    def _refuse_id(self, request: LoRARequest, key: Identity) -> None:
        entry = self.cache.cpu.peek(key)
        raise AdapterError(f"lora_int_id {request.lora_int_id} is already adapter {entry.name!r} at "
                           f"{entry.record.path}; use another id for {request.lora_path}", param="lora_int_id")

    @staticmethod
    def _resolve(path) -> str:
        return str(_resolved(path))  # once per request (symlinks may change between requests)

    def _register(self, request: LoRARequest, key: Identity, pin: bool) -> None:
        entry = self.cache.cpu.peek(key)
        if entry is not None and key not in self._paths:
            if len(self._paths) > 2 * self.cache.cpu.capacity:  # drop what the CPU tier evicted
                self._paths = {k: v for k, v in self._paths.items() if k in self.cache.cpu}
            self._paths[key] = {key[0], str(_resolved(entry.record.path))}
        self._ids[request.lora_int_id] = key
        self._names[request.lora_name] = key
        if pin:
            self.cache.pinned.add(key)
            self._pinned_as.setdefault(key, set()).update((request.lora_int_id, request.lora_name))

    def _forget(self, key: Identity) -> None:
        self._paths.pop(key, None)
        for table in (self._ids, self._names):
            for k in [k for k, v in table.items() if v == key]:
                del table[k]

    def add_denoiser(self, name: str, module: torch.nn.Module) -> None:
        """A denoiser loaded after the engine was built (MiniMax-H3's ref2va partition): targetable from now on."""
        with self._lock:
            if self.denoisers.get(name) is module:
                return
            self.denoisers[name] = module
            self._params[name] = dict(module.named_parameters())
            self.targetable_bytes = pristine_mod.targetable_bytes(self.targets)
            self.unfused.add_denoiser(name, module)

    def unload(self, name_or_id) -> None:
        """Forget an adapter (both tiers, pin included). Its merged weights stay until the next switch.

        A pinned adapter unloaded by another id or name than it was pinned under (a request's alias
        for a pre-loaded file) only loses that alias: the pin and its entry stay."""
        with self._lock:
            key = self._key_of(name_or_id)
            if key in self.cache.pinned and name_or_id not in self._pinned_as.get(key, ()):
                table = self._ids if isinstance(name_or_id, int) else self._names
                table.pop(name_or_id, None)
                return
            self.cache.drop(key)
            self._forget(key)
            self._pinned_as.pop(key, None)

    def unpin(self, name_or_id) -> None:
        """Let an adapter be evicted again (it stays cached until then)."""
        with self._lock:
            key = self._key_of(name_or_id)
            self.cache.pinned.discard(key)
            self._pinned_as.pop(key, None)

    def cached_identity(self, request_or_id) -> Identity | None:
        """The identity of the fresh CPU-tier entry a request (or a lora_int_id) names; None when it
        is not cached, stale on disk, or the request would be refused. Touches no LRU order."""
        with self._lock:
            try:
                key = self._ids.get(request_or_id) if isinstance(request_or_id, int) else self._lookup(request_or_id)
            except AdapterError:
                return None
            if key is None or key not in self.cache.cpu or self.cache.cpu.peek(key).is_stale():
                return None
            return key

    def active_identities(self) -> set:
        """The adapters in use now (merged or served unfused): never to be evicted by a prefetch."""
        with self._lock:
            # an activation key's items are (identity, scales) pairs; an unfused or batch key starts with a word
            return {item[0] for item in self._active_key if isinstance(item, tuple) and len(item) == 2
                    and isinstance(item[0], tuple)} | \
                {ident for items in self._merged.values() for ident, _ in items}

    def exclusive(self):
        """Hold the engine's state (cache, ids, active set) across several calls. Re-entrant."""
        return self._lock

    def find(self, name: str) -> LoadedAdapter | None:
        with self._lock:
            key = self._names.get(name)
            if key is not None and key in self.cache.cpu:
                return self.cache.cpu.peek(key)
        return None

    def by_name(self) -> dict[str, LoadedAdapter]:
        """Every name a cached adapter was requested or pinned under, with its entry."""
        with self._lock:
            return {name: self.cache.cpu.peek(key) for name, key in self._names.items()
                    if key in self.cache.cpu}

    def loaded(self) -> list[LoadedAdapter]:
        with self._lock:
            return [self.cache.cpu.peek(k) for k in self.cache.cpu.keys()]

    # -- activation -------------------------------------------------------------------------------
    def activate(self, adapters, *, steps=None, mode=None, queued_same: int = 0) -> list[dict]:
        """Make exactly ``adapters`` (list of (LoRARequest, scale)) active; [] is the base model.

        Returns the metadata of what is active (in request order, one row per adapter; an
        adapter named twice appears once with its scales summed): name, id, path, sha256,
        format, scale, mode ("merged" or "unfused").
        ``steps``, ``mode`` ("auto" | "merge" | "unfused") and ``queued_same`` feed the
        merge-or-unfused policy (``self.unfused.last_decision`` says what it chose).
        """
        if self.mode_fixed_by is not None and mode not in (None, "auto", self.unfused.mode):
            raise InvalidParameter(f"lora_mode {mode!r} is not available: adapters are served {self.unfused.mode} "
                                   f"here ({self.mode_fixed_by})", param="lora_mode")
        if self.mode_fixed_by is not None:
            mode = None  # the engine's own (fixed) mode
        with self._lock:
            self.counters["activations"] += 1
            loaded, key, meta = self.canonical(adapters, steps)
            self.merge_encoders(loaded)  # text encoders: merged in every mode
            # -- merge or unfused (backend/lora/unfused.py): served unfused = hooks, no weight write --
            if self.unfused.serve(loaded, key, meta, steps=steps, mode=mode, queued_same=queued_same):
                return [dict(m) for m in self._active_meta]
            meta = [{**m, "mode": "merged"} for m in meta]
            # -- end merge or unfused --
            if key == self._active_key:
                self.counters["noop_activations"] += 1
                self._active_meta = meta
                return [dict(m) for m in meta]
            plan = self._plan(loaded)
            started, written = time.perf_counter(), self.counters["layers_written"]  # -- unfused: timing
            self._apply(plan, {ident: e for ident, e, _ in loaded})
            if self.counters["layers_written"] != written:  # -- unfused: the policy's measured bandwidth
                self.unfused.observe_merge(time.perf_counter() - started)
            self._active_key = key
            self._active_meta = meta
            self.counters["switches"] += 1
            return [dict(m) for m in self._active_meta]

    def canonical(self, adapters, steps=None) -> tuple[list, tuple, list[dict]]:
        """``(loaded, key, meta)`` of a request's adapters (list of (LoRARequest, scale)), loaded and
        checked: ``loaded`` is [(identity, entry, {component: scale})] sorted by identity (duplicates
        summed, zero scales dropped), ``key`` the activation key, ``meta`` the rows in request order."""
        adapters = list(adapters or [])
        with self._lock:
            combined: dict[Identity, list] = {}  # identity -> [entry, {component: scale}, request]
            for request, scale in adapters:
                if not isinstance(request, LoRARequest):
                    raise InvalidParameter(f"expected a LoRARequest, got {type(request).__name__}",
                                           param="lora_request")
                entry = self.load(request)
                scales = self._component_scales(entry, scale, steps)
                slot = combined.setdefault(identity_of(entry), [entry, {}, request])
                for comp, value in scales.items():
                    slot[1][comp] = _summed(slot[1].get(comp, 0.0), value, entry.name)
            meta = [self._meta(e, s, r, steps) for e, s, r in combined.values() if any(v != 0.0 for v in s.values())]
            loaded = sorted(((ident, e, {c: v for c, v in s.items() if v != 0.0})
                             for ident, (e, s, _) in combined.items() if any(v != 0.0 for v in s.values())),
                            key=lambda item: item[0])
            key = tuple((ident, tuple(sorted(s.items()))) for ident, _, s in loaded)
            return loaded, key, meta

    def deactivate(self) -> None:
        self.activate([])

    def merge_encoders(self, loaded) -> None:
        """Merge the text-encoder layers of a canonical set (``canonical``'s ``loaded``), and put back those
        it no longer touches; denoiser layers are left as they are. The encoder runs once per request, so
        its layers are merged whichever way the denoisers' are served (merged, unfused hooks, a mixed
        batch). A refusal (a non-finite merge) leaves the base model active everywhere: hooks off too."""
        if not self.encoders:
            return
        plan = self._plan(loaded, self.encoders)
        if not plan and not any(c in self.encoders for c, _ in self._merged):
            return
        try:
            self._apply(plan, {ident: e for ident, e, _ in loaded}, only=self.encoders)
        except AdapterError:
            self.unfused.clear()
            raise

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
                self.pristine.clear()
                self._w0_amax.clear()
                self._merged.clear()

    @property
    def active(self) -> list[dict]:
        return [dict(m) for m in self._active_meta]

    def _component_scales(self, entry: LoadedAdapter, scale, steps=None) -> dict:
        """{component: float} for a plain scale; a component with a step schedule or block weights
        keeps its ``schedule.ComponentScale`` (``backend/lora/schedule.py``: the grammar, checked
        here against this model: its components, its blocks and the request's steps)."""
        bound = list(entry.bindings)
        if isinstance(scale, (dict, list, tuple, schedule.LoraScale)):
            parsed = schedule.parse(scale, "lora_scale")
        else:
            parsed = schedule.parse(1.0 if scale is None else _finite(scale), "lora_scale")
        if parsed.default is None:
            for comp, value in parsed.components:
                if comp == schedule.DENOISERS or comp == "text_encoder" and self.encoders:
                    continue  # groups: every denoiser / text encoder the adapter binds to, unless named alone
                if comp not in self.targets:
                    encoders = f"; text encoders: {', '.join(self.encoders)}" if self.encoders else ""
                    raise InvalidParameter(f"lora_scale names component {comp!r}; {self.model} has "
                                           f"{', '.join(self.denoisers)}{encoders}", param="lora_scale")
                if not (value.plain and value.steps.constant == 0.0) and comp not in bound:
                    raise InvalidParameter(f"adapter {entry.name!r} does not bind to {comp!r} "
                                           f"(it binds to {', '.join(bound)})", param="lora_scale")
        per = parsed.per_component(bound)
        if parsed.default is None:  # the groups fill the components not named alone
            given = dict(parsed.components)
            per = schedule.fill_groups(given, bound, self.encoders)
            nonzero = [c for c, v in given.items() if not (v.plain and v.steps.constant == 0.0)]
            if nonzero and not per:  # a group for what the adapter has none of: say so rather than run the base
                raise InvalidParameter(f"adapter {entry.name!r} binds to {', '.join(bound)}; lora_scale gives "
                                       f"weights to {', '.join(nonzero)} only", param="lora_scale")
        out = {}
        for comp in bound:
            value = per.get(comp)
            if value is None:
                out[comp] = 0.0
                continue
            where = "lora_scale" if parsed.default is not None else f"lora_scale.{comp}"
            if comp in self.encoders and not value.plain:
                raise InvalidParameter(f"{where}: {comp} is a text encoder, which runs once per request: give it "
                                       "one number (a schedule over steps or block weights apply to the "
                                       f"denoisers: {', '.join(self.denoisers)})", param="lora_scale")
            if value.scheduled:
                if not steps:
                    raise InvalidParameter(f"{where}: a schedule over steps needs the request's steps",
                                           param="lora_scale")
                value.steps.check_steps(int(steps), where)
            if value.blocks is not None:
                value.blocks.check_count(sum(n for _, n in self._block_lists(comp)), comp, where)
            out[comp] = value.steps.constant if value.plain else value
        return out

    def _block_lists(self, comp: str) -> list:
        lists = getattr(self, "_blocks_cache", None)
        if lists is None:
            lists = self._blocks_cache = {c: schedule.block_lists(d) for c, d in self.denoisers.items()}
        return lists.get(comp, [])

    def _plan(self, loaded, only=None) -> dict[tuple[str, str], list]:
        """(component, module) -> [(identity, scale)] (canonical order) for every layer the set touches
        (of the components in ``only``, when given: the denoisers, or the text encoders).

        A scale with block weights gives each layer its own (scale x its block's weight; a layer
        whose weight is 0 is left out); a step schedule's layers carry the block weight alone and
        its per-step value is applied by the unfused path (``UnfusedServing``) at each step."""
        plan: dict[tuple[str, str], list] = {}
        for ident, entry, scales in loaded:
            for comp, s in scales.items():
                if only is not None and comp not in only:
                    continue
                for module in entry.bindings[comp].layers:
                    if isinstance(s, schedule.ComponentScale):
                        w = s.blocks.weight(schedule.block_of(module, self._block_lists(comp))) \
                            if s.blocks is not None else 1.0
                        value = w if s.scheduled else s.steps.constant * w
                        if value == 0.0:
                            continue
                        plan.setdefault((comp, module), []).append((ident, value))
                        continue
                    plan.setdefault((comp, module), []).append((ident, s))
        return plan

    def _changed(self, plan, only=None) -> list[tuple[str, str]]:
        """The layers (sorted) whose planned contributions differ from what is merged there now (of the
        components in ``only``, when given)."""
        return [t for t in sorted(set(plan) | set(self._merged)) if (only is None or t[0] in only)
                and tuple(plan.get(t, ())) != self._merged.get(t, ())]

    @staticmethod
    def _contributions(plan, target, entries, device_factors) -> list:
        """One layer's contributions ``(factors, scale, name)`` in the plan's canonical order."""
        return [(device_factors[ident][target], s, entries[ident].name) for ident, s in plan.get(target, [])]

    def _apply(self, plan, entries: dict[Identity, LoadedAdapter], only=None) -> None:
        changed = self._changed(plan, only)
        if not changed:
            return
        device_factors = self._device_factors(entries)
        work = [(comp, module, self._contributions(plan, (comp, module), entries, device_factors))
                for comp, module in changed]
        self._capture_pristine(work)
        try:
            self._write_all(work)
        except _LayerWriteFailed as failed:
            self._rollback(set(self._merged) | {(c, m) for c, m, _ in work})
            raise self._refusal(failed) from (None if isinstance(failed.cause, _NonFinite) else failed.cause)
        for t in changed:
            if t in plan:
                self._merged[t] = tuple(plan[t])
            else:
                self._merged.pop(t, None)
        self.counters["layers_written"] += len(changed)
        self.counters["bytes_written"] += sum(self._params[c][f"{m}.weight"].numel() *
                                              self._params[c][f"{m}.weight"].element_size() for c, m in changed)

    def restore_base(self, only=None) -> None:
        """Put every merged layer (of the components in ``only``, when given) back to its pristine original
        (the merge path's own restore)."""
        self._apply({}, {}, only)

    def _refusal(self, failed: _LayerWriteFailed) -> AdapterError:
        """The error for an activation refused at one layer (the base model is active again)."""
        if isinstance(failed.cause, _NonFinite):
            self.counters["nonfinite_refused"] += 1
            return AdapterError(f"{failed.cause} at {failed.layer}: the merged weight is not finite (inf/nan); "
                                "refused, every touched layer was restored and the base model is active",
                                param="lora_request")
        return AdapterError(f"activating adapters failed at {failed.layer} ({failed.cause}); every touched "
                            "layer was restored and the base model is active", param="lora_request")

    def _unfused_factors(self, comp: str, module: str, contributions) -> tuple:
        """``(b, a, alpha, bias)`` for serving one layer unfused (``y += alpha * B'(A'x) + bias'``): the
        merge's own stacked factors (``_stacked``) and bias terms. Raises ``_LayerWriteFailed`` when
        the delta ``alpha * B'A'`` (+ bias) is not finite; by the factors' bounds that is known
        without any device work except for absurd factors or scales."""
        weight = self._params[comp][f"{module}.weight"]
        dtype = self._compute.get((comp, module), weight.dtype)
        b, a, alpha = _stacked(contributions, dtype)
        terms = list(_bias_terms(contributions))
        bias = None if not terms else sum(terms[1:], terms[0]).to(dtype)
        if not self._delta_bound(contributions) < 0.5 * torch.finfo(dtype).max:
            with torch.no_grad():
                delta = (torch.mm(b.float(), a.float()) * alpha).to(dtype)
                ok = bool(torch.isfinite(delta.sum(dtype=torch.float64)))
                ok = ok and (bias is None or bool(torch.isfinite(bias.sum(dtype=torch.float64))))
            if not ok:
                raise _LayerWriteFailed(f"{comp}.{module}", _NonFinite(self._blame(contributions)))
        return b, a, alpha, bias

    @staticmethod
    def _delta_bound(contributions) -> float:
        """No element of the stacked delta (and bias) exceeds sum_i |c_i| r_i max|B_i| max|A_i| (+ max|bias_i|)."""
        return sum(abs(s * f.scaling) * f.bound for f, s, _ in contributions)

    def _write_all(self, work) -> None:
        """Write every layer of a switch; on CPU spread over single-threaded workers, on a GPU in one
        stream with the host originals' copies overlapped (``PristineStore.stream_originals``)."""
        if all(self._params[c][f"{m}.weight"].device.type == "cpu" for c, m, _ in work):
            def one(item):
                comp, module, contributions = item
                self._write_layer(comp, module, contributions, self.pristine.saved[(comp, f"{module}.weight")])
                self._check_finite(comp, module, contributions, sync=True)

            run_tasks(one, work)  # independent layers: no barrier per GEMM
            return
        keys = [((c, f"{m}.weight"), self._params[c][f"{m}.weight"]) for c, m, _ in work]
        flags = []
        for i, w0 in self.pristine.stream_originals(keys):
            comp, module, contributions = work[i]
            self._write_layer(comp, module, contributions, w0)
            flags.append(self._finite_flag(comp, module, contributions))
        bad = [i for i, f in enumerate(flags) if f is not None and not bool(f)]  # one sync, at the end
        if bad:
            comp, module, contributions = work[bad[0]]
            raise _LayerWriteFailed(f"{comp}.{module}", _NonFinite(self._blame(contributions)))

    def _write_layer(self, comp: str, module: str, contributions, w0) -> None:
        try:
            self._write(comp, module, contributions, w0)
        except Exception as exc:
            raise _LayerWriteFailed(f"{comp}.{module}", exc) from exc

    def _write(self, comp: str, module: str, contributions, w0: torch.Tensor) -> None:
        """Write one layer as pristine + the contributions: one GEMM, fp32 accumulation, one rounding."""
        params = self._params[comp]
        w_name, b_name = f"{module}.weight", f"{module}.bias"
        weight = params[w_name]
        with torch.no_grad():
            if not contributions:
                weight.data.copy_(w0)
            elif all(f.parts is None for f, _, _ in contributions):
                b, a, alpha = _stacked(contributions, weight.dtype)
                torch.addmm(w0, b, a, alpha=alpha, out=weight.data)
            else:  # a LyCORIS or DoRA layer among them: built in the fp32 buffer that sums everything
                weight.data.copy_(_dense_merge(w0, contributions))
            key = (comp, b_name)
            if key in self.pristine:
                bias = params[b_name]
                b0 = self.pristine.saved[key].to(bias.device, non_blocking=True)
                acc = b0.float()
                for term in _bias_terms(contributions):
                    acc = acc + term
                bias.data.copy_(acc)

    def _finite_flag(self, comp: str, module: str, contributions):
        """None when the result is finite by construction, else a device bool to read.

        |W| <= max|W0| + sum_i |c_i| r_i max|B_i| max|A_i| elementwise; when that bound (with a
        factor 2 for rounding) stays below the dtype's largest value, no element can be inf or
        nan and nothing is read. Otherwise (an Infinity alpha, factors of 1e30...) the written
        weight is checked."""
        if not contributions:
            return None
        weight = self._params[comp][f"{module}.weight"]
        w0 = self._w0_amax.get((comp, module))
        if w0 is not None:
            bound = w0 + self._delta_bound(contributions)
            if bound < 0.5 * torch.finfo(weight.dtype).max:
                return None
        # one read pass, no temporary: a float64 sum is finite iff every element is (an inf or nan
        # anywhere makes it inf/nan; finite bf16/fp32 values cannot overflow a float64 sum)
        flag = torch.isfinite(self._params[comp][f"{module}.weight"].sum(dtype=torch.float64))
        bias = self._params[comp].get(f"{module}.bias")
        if bias is not None and (comp, f"{module}.bias") in self.pristine:
            flag = flag & torch.isfinite(bias.sum(dtype=torch.float64))
        return flag

    def _check_finite(self, comp: str, module: str, contributions, sync: bool) -> None:
        flag = self._finite_flag(comp, module, contributions)
        if flag is not None and not bool(flag):
            raise _LayerWriteFailed(f"{comp}.{module}", _NonFinite(self._blame(contributions)))

    @staticmethod
    def _blame(contributions) -> str:
        """The adapter(s) whose own delta on this layer is not finite (all of them if none alone is)."""
        bad = []
        for f, s, name in contributions:
            c = s * f.scaling
            if f.parts is not None:
                tensors = [t for t in (f.a, f.b, *f.parts.values()) if t is not None]
                ok = math.isfinite(c) and all(bool(torch.isfinite(t).all()) for t in tensors)
                if not ok or f.kind != "dora" and not bool(torch.isfinite(f.delta() * c).all()):
                    bad.append(name)
                continue
            delta_ok = math.isfinite(c) and bool(torch.isfinite(f.b.float() * c).all()) and \
                bool(torch.isfinite(f.a).all())
            if not delta_ok or not bool(torch.isfinite((f.b.float() * c) @ f.a.float()).all()):
                bad.append(name)
        names = bad or [name for _, _, name in contributions]
        return "adapter " + ", ".join(repr(n) for n in names)

    def _capture_pristine(self, work) -> None:
        """Copy, before their first write, exactly the tensors this switch will write."""
        for comp, module, contributions in work:
            params = self._params[comp]
            if (comp, f"{module}.weight") not in self.pristine:
                self.pristine.capture((comp, f"{module}.weight"), params[f"{module}.weight"])
                self._w0_amax[(comp, module)] = _amax(params[f"{module}.weight"])
            if any(f.bias is not None for f, _, _ in contributions) and f"{module}.bias" in params:
                if (comp, f"{module}.bias") not in self.pristine:
                    self.pristine.capture((comp, f"{module}.bias"), params[f"{module}.bias"])
                    self._w0_amax[(comp, module)] = max(self._w0_amax[(comp, module)],
                                                        _amax(params[f"{module}.bias"]))

    def _rollback(self, layers) -> None:
        for comp, module in layers:
            for name in (f"{module}.weight", f"{module}.bias"):
                if (comp, name) in self.pristine:
                    self.pristine.put_back((comp, name), self._params[comp][name])
        self._merged.clear()
        self._active_key, self._active_meta = (), []
        self.counters["rollbacks"] += 1

    def _device_factors(self, entries: dict[Identity, LoadedAdapter]) -> dict[Identity, dict]:
        """Device-tier factors for the adapters of one activation (moving them there if needed)."""
        out = {}
        keep = self.cache.keep(entries)
        for key, entry in entries.items():
            factors = self.cache.device.get(key)
            if factors is None:
                factors = {}
                for comp, binding in entry.bindings.items():
                    for module, f in binding.layers.items():
                        weight = self._params[comp][f"{module}.weight"]
                        device = self.factor_device or weight.device
                        dtype = self._compute.get((comp, module), weight.dtype)  # never fp8/GGUF storage
                        bias = f.tensors.get(f.bias_part)
                        if f.kind == "dora":  # the factors and the magnitude: merged through the pristine weight
                            factors[(comp, module)] = _DeviceFactors(
                                a=f.tensors["lora_A.weight"].to(device, dtype).contiguous(),
                                b=f.tensors["lora_B.weight"].to(device, dtype).contiguous(),
                                bias=None if bias is None else bias.to(device, dtype), scaling=f.scaling,
                                kind="dora", parts={"magnitude": f.tensors["magnitude"].to(device, dtype)})
                            continue
                        if f.kind != "lora":  # LyCORIS: the compact parts, the delta built when merged
                            factors[(comp, module)] = _DeviceFactors(
                                a=None, b=None, bias=None if bias is None else bias.to(device, dtype),
                                scaling=f.scaling, kind=f.kind,
                                bound=lycoris.bound(f.kind, f.tensors) + (0.0 if bias is None else _amax(bias)),
                                parts={p: t.to(device, dtype).contiguous() for p, t in f.tensors.items()
                                       if p != f.bias_part})
                            continue
                        fa, fb = f.tensors["lora_A.weight"], f.tensors["lora_B.weight"]
                        bound = fa.shape[0] * _amax(fa) * _amax(fb) + (0.0 if bias is None else _amax(bias))
                        factors[(comp, module)] = _DeviceFactors(
                            a=f.tensors["lora_A.weight"].to(device, dtype).contiguous(),
                            b=f.tensors["lora_B.weight"].to(device, dtype).contiguous(),
                            bias=None if bias is None else bias.to(device, dtype),
                            scaling=f.scaling, bound=bound)
                nbytes = sum(d.nbytes for d in factors.values())
                self.cache.device.put(key, factors, nbytes, keep=keep)
            out[key] = factors
        return out

    # -- helpers ------------------------------------------------------------------------------------
    def _key_of(self, name_or_id) -> Identity:
        if isinstance(name_or_id, int):
            key = self._ids.get(name_or_id)
            if key is None or (key not in self.cache.cpu and key not in self.cache.device):
                raise AdapterNotFound(f"no loaded adapter with id {name_or_id}", param="lora_int_id")
            return key
        key = self._names.get(name_or_id)
        if key is None or key not in self.cache.cpu:
            raise AdapterNotFound(f"no loaded adapter named {name_or_id!r}", param="lora_name")
        return key

    def _meta(self, entry: LoadedAdapter, scales: dict, request: LoRARequest, steps=None) -> dict:
        row = {"name": request.lora_name, "int_id": request.lora_int_id, "path": str(entry.record.path),
               "sha256": entry.record.sha256, "format": entry.record.format}
        if any(isinstance(v, schedule.ComponentScale) for v in scales.values()):
            return {**row, **schedule.metadata(scales, steps, {c: sum(n for _, n in self._block_lists(c))
                                                              for c in scales})}
        values = set(scales.values())
        scale = values.pop() if len(values) == 1 else dict(scales)
        return {**row, "scale": scale}

    def pristine_bytes(self) -> int:
        return self.pristine.nbytes()

    def pristine_info(self) -> dict:
        """Where the originals live and how much they take (for /metrics, the System tab, ``adapters``)."""
        return {"mode": self.pristine_mode, "placement": self.pristine.placement, "where": self.pristine.where(),
                "reason": self.pristine_reason, "bytes": self.pristine.nbytes(),
                "targetable_bytes": self.targetable_bytes}

    def stats(self) -> dict:
        """Cache tiers, counters and bytes, for the UI and the benchmark."""
        with self._lock:
            tiers = self.cache.stats()
            names = {k: self.cache.cpu.peek(k).name for k in self.cache.cpu.keys()}
            tiers["device"]["adapters"] = [names.get(k, k[0]) for k in self.cache.device.keys()]
            tiers["cpu"]["adapters"] = [names[k] for k in self.cache.cpu.keys()]
            return {"tiers": tiers, "pinned": sorted(names.get(k, k[0]) for k in self.cache.pinned),
                    "family": self.family.name,
                    "active": self.active, "counters": dict(self.counters),
                    "merged_layers": len(self._merged), "pristine_bytes": self.pristine_bytes(),
                    "pristine": self.pristine_info(), "unfused": self.unfused.stats()}


def _summed(a, b, name: str):
    """One adapter named twice: plain scales add; a schedule or block weights cannot be summed."""
    if isinstance(a, schedule.ComponentScale) or isinstance(b, schedule.ComponentScale):
        if a == 0.0 or b == 0.0:
            return b if a == 0.0 else a
        raise InvalidParameter(f"adapter {name!r} is named twice and one has a schedule or block weights; "
                               "name it once", param="lora_scale")
    return a + b


def _stacked(contributions, dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(B, A, alpha) for one addmm: a single adapter as stored with its scale as alpha; several
    concatenated along the rank, each B_i scaled by c_i in fp32 and rounded once to ``dtype``
    (or as stored, with a common alpha, when all share one scale)."""
    if any(f.parts is not None for f, _, _ in contributions):  # never: the policy keeps these sets merged
        raise AdapterError("a LyCORIS or DoRA layer has no low-rank form: it is applied by merge only",
                           param="lora_mode")
    coeffs = [s * f.scaling for f, s, _ in contributions]
    if len(contributions) == 1:
        f = contributions[0][0]
        return f.b, f.a, coeffs[0]
    a = torch.cat([f.a for f, _, _ in contributions], dim=0)
    if all(c == coeffs[0] for c in coeffs):
        return torch.cat([f.b for f, _, _ in contributions], dim=1), a, coeffs[0]
    b = torch.cat([(f.b.float() * c).to(dtype) for (f, _, _), c in zip(contributions, coeffs)], dim=1)
    return b, a, 1.0


def _dense_merge(w0: torch.Tensor, contributions) -> torch.Tensor:
    """pristine + every contribution in one fp32 buffer, for a layer with a merge-only delta among them (LyCORIS,
    DoRA: built here from their parts on the device); the caller rounds it once into the weight's dtype."""
    w0 = w0.to(torch.float32)
    acc = w0.clone()
    lora = [c for c in contributions if c[0].parts is None]
    if lora:
        b, a, alpha = _stacked(lora, torch.float32)
        acc.addmm_(b.float(), a.float(), alpha=alpha)
    for f, s, _ in contributions:
        if f.parts is not None:  # a DoRA delta carries its own scaling (inside its norm)
            acc.add_(f.delta(w0), alpha=s if f.kind == "dora" else s * f.scaling)
    return acc


def _bias_terms(contributions):
    """Each adapter's bias contribution ``bias_i * c_i`` in fp32 (adapters without a bias give none)."""
    for f, s, _ in contributions:
        if f.bias is not None:
            yield f.bias.float() * (s * f.scaling)


def _amax(t: torch.Tensor) -> float:
    """Largest |element| as a Python float (inf when any element is not finite)."""
    if t.numel() == 0:
        return 0.0
    v = float(torch.linalg.vector_norm(t.detach(), ord=math.inf))  # exact in any dtype: a max, no sum
    return v if math.isfinite(v) else math.inf


def _finite(value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InvalidParameter(f"lora_scale must be a number, got {value!r}", param="lora_scale") from None
    if not math.isfinite(v):
        raise InvalidParameter(f"lora_scale must be finite, got {value!r}", param="lora_scale")
    return v


def _resolved(p):
    from pathlib import Path

    try:
        return Path(p).expanduser().resolve()
    except OSError:
        return Path(p)

"""Serving adapters unfused: forward hooks on the targeted Linear layers, no weight write.

For a layer ``y = W0 x + b0`` with active contributions ``(A_i, B_i, s_i * scaling_i)`` the
hook adds ``B' (A' x) + bias'`` to the layer's output, where ``A' = cat(A_i)`` and
``B' = cat(s_i * scaling_i * B_i)`` (a stack costs two GEMMs per layer, not two per
adapter). The factors are the engine's own device-tier entries (one cache for both modes, already in
the layer's dtype), stacked by the engine's own ``_stacked`` (one adapter: as stored with its
``c`` as alpha, no copy; several: ``B_i c_i`` rounded once to the dtype), in the engine's
canonical order (by adapter identity). Base weights are never written, so a request served
unfused leaves every weight bit-exact; layers an earlier request left merged are put back
from their pristine copies by the engine's own restore path first. A stack whose delta is
not finite is refused exactly as the merge refuses it (same error, base model active).

Why hooks and not peft layers: peft's ``inject_adapter_in_model`` replaces every targeted
module with a wrapper (a second copy of the factors in peft's own format, a model-wide
module swap per switch, and the merge path would then have to write through the wrappers).
A hook is added and removed per layer in microseconds, reads the factors the merge path
already keeps on the device, and leaves the module tree untouched.

Which mode a request gets is ``backend.lora.policy.decide`` (merge or unfused by predicted
cost); ``UnfusedServing.serve`` is called by ``LoRAEngine.activate`` after the fit checks,
so both modes refuse exactly the same adapters.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from ..errors import InvalidParameter
from ..errors import LayerWriteFailed as _LayerWriteFailed
from .convert import MERGE_ONLY
from .policy import (DEVICE_DEFAULTS, BatchInputs, Decision, PolicyInputs, check_mode, decide,
                     decide_batch)


def _frozen(plan: dict) -> tuple:
    """A plan ((component, module) -> [(identity, scale)]) as a hashable value, to compare sets' plans."""
    return tuple(sorted((target, tuple(items)) for target, items in plan.items()))


class _Hook:
    """Adds the low-rank path of one Linear layer: ``out + alpha * B(A x) + bias``."""

    __slots__ = ("a", "b", "alpha", "bias")

    def __init__(self, b: torch.Tensor, a: torch.Tensor, alpha: float, bias: torch.Tensor | None):
        self.a, self.b, self.alpha, self.bias = a, b, float(alpha), bias

    def __call__(self, module, args, kwargs, output):
        x = args[0] if args else kwargs["input"]
        a, b, bias = self.a, self.b, self.bias
        if x.dtype != a.dtype:
            a, b = a.to(x.dtype), b.to(x.dtype)
            bias = None if bias is None else bias.to(x.dtype)
        out = output.add(F.linear(F.linear(x, a), b), alpha=self.alpha)
        return out if bias is None else out.add_(bias)


class _ScheduledHook:
    """A layer of a set with a step schedule: ``out + B'((A'x) * coef) + bias'``. The per-rank
    ``coef = table[slot] * weight`` reads the step's scales from a tensor set in place each step
    (``UnfusedServing.set_step``), so every step runs the same code on the same tensors: nothing
    is re-merged and a compiled denoiser sees one graph for the whole run. ``weight`` is each
    rank's adapter scaling x block weight (x the constant scale of an unscheduled adapter, whose
    slot is 0, always 1.0)."""

    __slots__ = ("a", "b", "table", "slot", "weight", "bias", "bias_slot", "bias_weight")

    def __init__(self, a, b, table, slot, weight, bias=None, bias_slot=None, bias_weight=None):
        self.a, self.b, self.table, self.slot, self.weight = a, b, table, slot, weight
        self.bias, self.bias_slot, self.bias_weight = bias, bias_slot, bias_weight

    def __call__(self, module, args, kwargs, output):
        x = args[0] if args else kwargs["input"]
        a, b = self.a.to(x.dtype), self.b.to(x.dtype)
        coef = self.table.index_select(0, self.slot).mul(self.weight)
        out = output + F.linear(F.linear(x, a) * coef.to(x.dtype), b)
        if self.bias is not None:
            bc = self.table.index_select(0, self.bias_slot).mul(self.bias_weight)
            out = out + (bc @ self.bias).to(out.dtype)
        return out
class _BatchHook:
    """Mixed-adapter batches (BGMV with torch ops): sample ``i`` of the batch gets its own set's low-rank
    path, ``out_i + alpha_k B_k (A_k x_i) + bias_k`` with ``k = sets[i]``.

    ``factors`` holds one ``(b, a, alpha, bias)`` per distinct adapter set on this layer (``None``: the set
    does not touch it, the sample gets the base output). They are stacked once, zero-padded to the largest
    rank (``A`` (S, R, in), ``B`` (S, out, R)); a forward gathers each row's factors by its set index and
    runs two batched GEMMs. A padded rank column is an exact zero, so each sample's delta is its own set's
    ``alpha B(Ax)`` (as the single-request hook computes it, up to summation order). Rows map to samples
    by ``row % n``: the pipeline's batch is the n prompts, or 2n with classifier-free guidance stacked as
    [negative..., positive...] (diffusers' order); two separate CFG forwards of n rows each map the same."""

    __slots__ = ("a", "b", "alpha", "bias", "sets", "n", "any_bias", "_rows")

    def __init__(self, factors: list, sets: list[int]):
        live = [f for f in factors if f is not None]
        ref = live[0][1]
        rank = max(f[1].shape[0] for f in live)
        in_f, out_f = ref.shape[1], live[0][0].shape[0]
        count = len(factors) + 1  # the last slot: all zeros (samples whose set does not touch this layer)
        self.a = ref.new_zeros((count, rank, in_f))
        self.b = ref.new_zeros((count, out_f, rank))
        self.alpha = torch.zeros(count, dtype=torch.float32, device=ref.device)  # never rounded to bf16
        self.bias = ref.new_zeros((count, out_f))
        self.any_bias = False
        for k, f in enumerate(factors):
            if f is None:
                continue
            b, a, alpha, bias = f
            self.a[k, :a.shape[0]] = a
            self.b[k, :, :b.shape[1]] = b
            self.alpha[k] = alpha
            if bias is not None:
                self.bias[k] = bias
                self.any_bias = True
        empty = count - 1
        self.sets = torch.tensor([empty if factors[k] is None else k for k in sets], device=ref.device)
        self.n = len(sets)
        self._rows: dict[int, torch.Tensor] = {}

    def __call__(self, module, args, kwargs, output):
        x = args[0] if args else kwargs["input"]
        rows = x.shape[0]
        if rows % self.n:
            raise RuntimeError(f"mixed-adapter batch: a layer got {rows} rows for a batch of {self.n} samples")
        idx = self._rows.get(rows)
        if idx is None:  # row r belongs to sample r % n
            idx = self._rows[rows] = self.sets[torch.arange(rows, device=self.sets.device) % self.n]
        a, b, alpha, bias = self.a[idx], self.b[idx], self.alpha[idx], self.bias[idx]  # the gather
        if x.dtype != a.dtype:
            a, b, bias = a.to(x.dtype), b.to(x.dtype), bias.to(x.dtype)
        flat = x.reshape(rows, -1, x.shape[-1])
        delta = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2))
        delta = (delta.float() * alpha.view(rows, 1, 1)).to(x.dtype)
        if self.any_bias:
            delta = delta + bias.view(rows, 1, -1)
        return output + delta.reshape(output.shape)


class _ForwardCounter:
    """A forward pre-hook kept on the module itself (no reference to any engine)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, args):
        self.calls += 1


class UnfusedServing:
    """The unfused half of a LoRAEngine: the mode policy's inputs, hooks on and off, step timing."""

    def __init__(self, engine, mode: str | None = None, config: dict | None = None):
        self.engine = engine
        params = [p for ps in engine._params.values() for p in ps.values()]
        kind = params[0].device.type if params else "cpu"
        # default: the cost policy on CUDA; on a CPU the exact merge is the faster path per request;
        # a quantized base (backend/quant.py): unfused only, --lora-mode merge refused
        self.quantized = getattr(engine, "quantized", None) or ""
        if self.quantized and mode == "merge":
            decide(PolicyInputs(steps=1, merge_bytes=0, quantized=self.quantized), "merge")  # raises, by name
        self.mode = check_mode(mode) if mode is not None else \
            ("unfused" if self.quantized else "auto" if kind == "cuda" else "merge")
        self.config = {**DEVICE_DEFAULTS.get(kind, DEVICE_DEFAULTS["cpu"]), **(config or {})}
        self._handles: list = []
        self._key = None  # the set served unfused now (the engine's activation key)
        self._tables: dict = {}  # step schedules: component -> (scale table tensor, [Steps per slot 1..])
        self._last_key = None
        self._repeats = 0
        self.last_decision: Decision | None = None
        self.step_s: float | None = None
        self.forwards: float = 1.0
        self._linear_elems: dict[str, int] = {}
        for c, d in engine.denoisers.items():
            self.add_denoiser(c, d)
        self.counters = {"merged": 0, "unfused": 0, "hooks_installed": 0, "batches": 0}
        self.batch_step_s: dict[int, float] = {}  # batch size -> measured seconds per step (mixed-adapter batches)
        self.last_merge: dict | None = None

    def add_denoiser(self, comp: str, d: torch.nn.Module) -> None:
        """Count a denoiser's Linear elements and forwards (at start, or when it is loaded later)."""
        self._linear_elems[comp] = sum(m.in_features * m.out_features for m in d.modules()
                                       if isinstance(m, torch.nn.Linear))
        for m in d.modules():  # hooks an earlier engine on these modules left on: never two at once
            for hid, hook in list(m._forward_hooks.items()):
                if isinstance(hook, (_Hook, _ScheduledHook)):
                    m._forward_hooks.pop(hid, None)
        if not isinstance(getattr(d, "_lora_studio_forwards", None), _ForwardCounter):
            d._lora_studio_forwards = _ForwardCounter()  # counts denoiser forwards (2 per step with CFG)
            d.register_forward_pre_hook(d._lora_studio_forwards)

    def _refuse(self, failed) -> Exception:
        """A layer's factors were refused (not finite) before any hook went on: nothing served, the base
        back, no active set; the engine's refusal (naming adapter and layer) to raise."""
        engine = self.engine
        self._remove()
        engine.restore_base()
        engine._active_key, engine._active_meta = (), []
        return engine._refusal(failed)

    # -- the policy -----------------------------------------------------------------------------------
    def serve(self, loaded, key, meta, *, steps=None, mode=None, queued_same: int = 0) -> bool:
        """Decide this activation's mode; serve it unfused (and return True) or leave it to the merge.

        ``loaded``, ``key`` and ``meta`` are ``LoRAEngine.activate``'s canonical set
        ((identity, entry, scales) sorted by identity), activation key and metadata rows."""
        engine = self.engine
        requested = self.mode if mode is None else check_mode(mode)
        self._repeats = self._repeats + 1 if key == self._last_key and key else 0
        self._last_key = key
        plan = engine._plan(loaded, engine.denoisers)  # the text encoders' layers are merged (merge_encoders)
        if not plan:  # the base model: hooks off, merged layers restored by the merge path
            self._remove()
            self.last_decision = None
            return False
        entries = {ident: e for ident, e, _ in loaded}
        scheduled = {(ident, comp): s.steps for ident, _, scales in loaded for comp, s in scales.items()
                     if getattr(s, "scheduled", False)}  # step schedules (backend/lora/schedule.py)
        inputs = self.inputs(plan, entries, steps=steps, queued_same=queued_same, scheduled=bool(scheduled))
        decision = decide(inputs, requested)
        self.last_decision = decision
        if decision.mode == "merged":
            self._remove()
            self.counters["merged"] += 1
            return False
        self.counters["unfused"] += 1
        meta = [{**m, "mode": "unfused"} for m in meta]
        if self._key == key and self._handles:
            engine.counters["noop_activations"] += 1
            engine._active_meta = meta
            return True
        factors = engine._device_factors(entries)
        try:  # every hook's factors first (and the finite check): nothing is touched if one is refused
            if scheduled:
                hooks, tables = self._scheduled_hooks(plan, entries, factors, scheduled)
            else:
                hooks, tables = [((comp, module), _Hook(*engine._unfused_factors(
                    comp, module, engine._contributions(plan, (comp, module), entries, factors))))
                    for comp, module in sorted(plan)], {}
        except _LayerWriteFailed as failed:
            raise self._refuse(failed) from None
        self._remove()
        engine.restore_base(engine.denoisers)  # layers left merged go back to pristine (none: no write)
        self._install(hooks)
        self._tables = tables
        engine._active_key = ("unfused",) + tuple(key)
        engine._active_meta = meta
        engine.counters["switches"] += 1
        self._key = key
        return True

    def _scheduled_hooks(self, plan, entries, factors, scheduled):
        """Hooks reading per-step scales from one table per component (slot 0: 1.0, for the
        unscheduled adapters of the set), and those tables. The finite check runs on each layer's
        stack at its largest scale over the steps."""
        engine = self.engine
        slots: dict = {}
        for ident, comp in sorted(scheduled):
            slots.setdefault(comp, []).append((ident, scheduled[(ident, comp)]))
        tables = {}
        for comp, items in slots.items():
            device = next(iter(engine._params[comp].values())).device
            with torch.no_grad():
                tables[comp] = (torch.ones(len(items) + 1, dtype=torch.float32, device=device),
                                [st for _, st in items])
        slot_of = {(ident, comp): i + 1 for comp, items in slots.items() for i, (ident, _) in enumerate(items)}
        hooks = []
        for comp, module in sorted(plan):
            contributions = engine._contributions(plan, (comp, module), entries, factors)
            peak = [(f, s * max((abs(v) for v in scheduled[(ident, comp)].values), default=1.0)
                     if (ident, comp) in scheduled else s, name)
                    for (f, s, name), (ident, _) in zip(contributions, plan[(comp, module)])]
            engine._unfused_factors(comp, module, peak)  # raises _LayerWriteFailed when not finite
            slot, weight, bias, bias_slot, bias_weight = [], [], [], [], []
            for (f, s, _), (ident, _) in zip(contributions, plan[(comp, module)]):
                k = slot_of.get((ident, comp), 0)
                slot += [k] * f.a.shape[0]
                weight += [s * f.scaling] * f.a.shape[0]
                if f.bias is not None:
                    bias.append(f.bias.float())
                    bias_slot.append(k)
                    bias_weight.append(s * f.scaling)
            table = tables[comp][0] if comp in tables else \
                torch.ones(1, dtype=torch.float32, device=contributions[0][0].a.device)
            dev = table.device
            a = torch.cat([f.a for f, _, _ in contributions], dim=0)
            b = torch.cat([f.b for f, _, _ in contributions], dim=1)
            hooks.append(((comp, module), _ScheduledHook(
                a, b, table, torch.tensor(slot, device=dev), torch.tensor(weight, dtype=torch.float32, device=dev),
                torch.stack(bias) if bias else None,
                torch.tensor(bias_slot, device=dev) if bias else None,
                torch.tensor(bias_weight, dtype=torch.float32, device=dev) if bias else None)))
        return hooks, tables

    def set_step(self, step: int, steps: int) -> None:
        """The scales of step ``step`` (0-based) of ``steps``, written in place into the tables."""
        for table, items in self._tables.values():
            values = torch.tensor([1.0] + [st.at(step, steps) for st in items], dtype=torch.float32)
            table.copy_(values)

    def stepper(self, steps, on_step):
        """``on_step`` for a run of ``steps``: with a step schedule active, the scales of step 0 are
        set now and each step's callback sets the next step's; otherwise ``on_step`` itself."""
        if not self._tables or not self._handles or not steps:
            return on_step
        total = int(steps)
        self.set_step(0, total)

        def step_end(done: int, of: int) -> None:
            if done < total:
                self.set_step(done, total)
            if on_step is not None:
                on_step(done, of)

        return step_end

    def inputs(self, plan, entries, *, steps=None, queued_same: int = 0, scheduled: bool = False) -> PolicyInputs:
        """The policy's inputs for the engine's plan ((component, module) -> [(identity, scale)])
        and its entries (identity -> LoadedAdapter)."""
        engine, cfg = self.engine, self.config
        merge_bytes = sum(self._weight_bytes(t) for t in engine._changed(plan))
        restore_bytes = sum(self._weight_bytes(t) for t in engine._merged if t[0] in engine.denoisers)
        lowrank = 0
        per_comp: dict[str, int] = {}
        merge_only: dict[str, str] = {}  # adapter -> its kind without a low-rank form (LyCORIS, DoRA): merged only
        for (comp, module), items in plan.items():
            w = engine._params[comp][f"{module}.weight"]
            rank = 0
            for ident, _ in items:
                f = entries[ident].bindings[comp].layers[module]
                if f.kind != "lora":
                    merge_only.setdefault(entries[ident].name, f.kind)
                    continue
                rank += f.tensors["lora_A.weight"].shape[0]
            lowrank += rank * (w.shape[0] + w.shape[1])
            per_comp[comp] = per_comp.get(comp, 0) + 1
        base = sum(self._linear_elems[c] for c in per_comp) or 1
        return PolicyInputs(steps=int(steps or 1), merge_bytes=merge_bytes, restore_bytes=restore_bytes,
                            bandwidth=float(cfg["bandwidth"]), fixed_s=float(cfg["fixed_s"]), step_s=self.step_s,
                            ratio=lowrank / base, hooked_layers=max(per_comp.values()),
                            hook_s=float(cfg["hook_s"]), forwards=self.forwards,
                            queued_same=int(queued_same or 0), repeats=self._repeats, scheduled=scheduled,
                            quantized=self.quantized,
                            merge_only=", ".join(f"adapter {n!r} ({MERGE_ONLY[k]})" for n, k in merge_only.items()))

    def _weight_bytes(self, target) -> int:
        comp, module = target
        w = self.engine._params[comp][f"{module}.weight"]
        return w.numel() * w.element_size()

    # -- measurements -----------------------------------------------------------------------------------
    def forward_calls(self) -> int:
        return sum(d._lora_studio_forwards.calls for d in self.engine.denoisers.values())

    def observe_run(self, seconds: float, steps, forward_calls: int) -> None:
        """A generation took ``seconds`` for ``steps``: keep the base step time (runs without hooks)."""
        if not steps or steps <= 0 or seconds <= 0:
            return
        if forward_calls > 0:
            self.forwards = forward_calls / steps
        if self._handles:  # an unfused run is not a base step
            return
        per_step = seconds / steps
        self.step_s = per_step if self.step_s is None else 0.5 * self.step_s + 0.5 * per_step

    def observe_merge(self, seconds: float) -> None:
        """The merge the last decision chose took ``seconds``; large ones update the bandwidth estimate."""
        d = self.last_decision
        nbytes = d.inputs.merge_bytes if d is not None and d.inputs is not None else 0
        self.last_merge = {"bytes": nbytes, "seconds": round(seconds, 6)}
        net = seconds - self.config["fixed_s"]
        if nbytes >= 64 << 20 and net > 0:
            self.config["bandwidth"] = 0.5 * self.config["bandwidth"] + 0.5 * nbytes / net

    # -- hooks ----------------------------------------------------------------------------------------------
    def _install(self, hooks) -> None:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:  # a compiled denoiser: guard on hooks, else those added after compile are ignored
            dynamo.config.skip_nnmodule_hook_guards = False
        for (comp, module), hook in hooks:
            layer = self.engine.denoisers[comp].get_submodule(module)
            self._handles.append(layer.register_forward_hook(hook, with_kwargs=True))
        self.counters["hooks_installed"] += len(self._handles)

    def clear(self) -> None:
        """Hooks off and no set served: after a refusal that put the base model back."""
        self._remove()
        self._key = None
        self.engine._active_key, self.engine._active_meta = (), []

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._tables = {}
        if self._key is not None:
            self.engine._active_key, self.engine._active_meta = (), []
        self._key = None

    # -- mixed-adapter batches -------------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self, adapter_sets: list):
        """Serve one batched pipeline call whose sample ``i`` uses ``adapter_sets[i]`` (list of
        (LoRARequest, scale), [] for the base model): per-sample hooks (``_BatchHook``) on every layer
        any set touches, no weight written (layers an earlier request left merged are restored first).
        Yields each sample's metadata rows (``mode": "unfused"``); the hooks come off on exit.
        Every set goes through the same load, fit, scale and finite checks as ``activate``."""
        engine = self.engine
        with engine.exclusive():
            canon = [engine.canonical(s) for s in adapter_sets]
            distinct: dict[tuple, int] = {}
            for _, key, _ in canon:
                distinct.setdefault(key, len(distinct))
            loaded_of = {key: loaded for loaded, key, _ in canon}
            sets = [distinct[key] for _, key, _ in canon]
            entries = {ident: e for loaded, _, _ in canon for ident, e, _ in loaded}
            encoder_plans = {key: engine._plan(loaded_of[key], engine.encoders) for key in distinct}
            if len({_frozen(p) for p in encoder_plans.values()}) > 1:
                raise InvalidParameter("the batch's adapters change the text encoders differently (the encoder "
                                       "runs once for the whole batch): run these requests one by one",
                                       param="lora_request")
            plans = {key: engine._plan(loaded_of[key], engine.denoisers) for key in distinct}
            factors = engine._device_factors(entries)
            targets = sorted({t for plan in plans.values() for t in plan})
            try:  # every layer's factors first (and the finite checks): nothing is touched if one is refused
                hooks = []
                for comp, module in targets:
                    per_set = [engine._unfused_factors(comp, module, engine._contributions(
                                   plans[key], (comp, module), entries, factors))
                               if (comp, module) in plans[key] else None for key in distinct]
                    hooks.append(((comp, module), _BatchHook(per_set, sets)))
            except _LayerWriteFailed as failed:
                raise self._refuse(failed) from None
            self._remove()
            engine.merge_encoders(next(iter(loaded_of.values())))  # the same for every set (checked above)
            engine.restore_base(engine.denoisers)
            self._install(hooks)
            self.counters["batches"] += 1
            engine._active_key, engine._active_meta = ("batch",) + tuple(distinct), []
            self._key = self._last_key = None
            self.last_decision = None
            try:
                yield [[{**m, "mode": "unfused"} for m in meta] for _, _, meta in canon]
            finally:
                for handle in self._handles:
                    handle.remove()
                self._handles = []
                # encoder layers the batch merged stay merged: a key no set has makes the next activation look
                encoders_merged = any(c in engine.encoders for c, _ in engine._merged)
                engine._active_key, engine._active_meta = ("after a batch",) if encoders_merged else (), []

    def decide_batch(self, adapter_sets: list, *, steps) -> dict:
        """Batch these jobs' sets in one call, or run them one by one? (``policy.decide_batch``: each job's
        own single-request inputs, the measured lone step time and the measured batch efficiency)."""
        engine = self.engine
        with engine.exclusive():
            jobs, union, encoder_plans = [], {}, set()
            for adapters in adapter_sets:
                loaded, _, _ = engine.canonical(adapters)
                encoder_plans.add(_frozen(engine._plan(loaded, engine.encoders)))
                plan = engine._plan(loaded, engine.denoisers)
                jobs.append(self.inputs(plan, {i: e for i, e, _ in loaded}, steps=steps) if plan else None)
                for comp, module in plan:
                    union.setdefault(comp, set()).add(module)
        if len(encoder_plans) > 1:  # the encoder runs once for the whole batch
            return {"mode": "sequential", "reason": "the jobs' adapters change the text encoders differently"}
        n = len(adapter_sets)
        eff = self.batch_step_s.get(n)  # None until a batch of n has run: policy.decide_batch runs one to measure
        eff = eff / (n * self.step_s) if eff is not None and self.step_s else None
        return decide_batch(BatchInputs(jobs=jobs, steps=int(steps or 1), step_s=self.step_s, batch_eff=eff,
                                        forwards=self.forwards, hook_s=float(self.config["hook_s"]),
                                        hooked_layers=max((len(v) for v in union.values()), default=0)))

    def observe_batch(self, seconds: float, steps, n: int) -> None:
        """A batch of ``n`` took ``seconds`` for ``steps``: its step time (halved EMA) gives ``batch_eff``."""
        if not steps or steps <= 0 or seconds <= 0 or n < 2:
            return
        per_step = seconds / steps
        old = self.batch_step_s.get(n)
        self.batch_step_s[n] = per_step if old is None else 0.5 * old + 0.5 * per_step

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def stats(self) -> dict:
        return {"mode": self.mode, "serving": "unfused" if self._handles else "merged",
                "hooked_layers": len(self._handles), "counters": dict(self.counters),
                "step_s": self.step_s, "forwards_per_step": self.forwards,
                "bandwidth": self.config["bandwidth"], "fixed_s": self.config["fixed_s"],
                "hook_s": self.config["hook_s"], "last_merge": self.last_merge,
                "batch_step_s": {str(n): v for n, v in sorted(self.batch_step_s.items())},
                "last_decision": self.last_decision.as_dict() if self.last_decision else None}

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

import torch
import torch.nn.functional as F

from ..errors import LayerWriteFailed as _LayerWriteFailed
from .policy import DEVICE_DEFAULTS, Decision, PolicyInputs, check_mode, decide


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
        # default: the cost policy on CUDA; on a CPU the exact merge is the faster path per request
        self.mode = check_mode(mode) if mode is not None else ("auto" if kind == "cuda" else "merge")
        self.config = {**DEVICE_DEFAULTS.get(kind, DEVICE_DEFAULTS["cpu"]), **(config or {})}
        self._handles: list = []
        self._key = None  # the set served unfused now (the engine's activation key)
        self._last_key = None
        self._repeats = 0
        self.last_decision: Decision | None = None
        self.step_s: float | None = None
        self.forwards: float = 1.0
        self._linear_elems = {c: sum(m.in_features * m.out_features for m in d.modules()
                                     if isinstance(m, torch.nn.Linear))
                              for c, d in engine.denoisers.items()}
        for d in engine.denoisers.values():
            for m in d.modules():  # hooks an earlier engine on these modules left on: never two at once
                for hid, hook in list(m._forward_hooks.items()):
                    if isinstance(hook, _Hook):
                        m._forward_hooks.pop(hid, None)
            if not isinstance(getattr(d, "_lora_studio_forwards", None), _ForwardCounter):
                d._lora_studio_forwards = _ForwardCounter()  # counts denoiser forwards (2 per step with CFG)
                d.register_forward_pre_hook(d._lora_studio_forwards)
        self.counters = {"merged": 0, "unfused": 0, "hooks_installed": 0}
        self.last_merge: dict | None = None

    # -- the policy -----------------------------------------------------------------------------------
    def serve(self, loaded, key, meta, *, steps=None, mode=None, queued_same: int = 0) -> bool:
        """Decide this activation's mode; serve it unfused (and return True) or leave it to the merge.

        ``loaded``, ``key`` and ``meta`` are ``LoRAEngine.activate``'s canonical set
        ((identity, entry, scales) sorted by identity), activation key and metadata rows."""
        engine = self.engine
        requested = self.mode if mode is None else check_mode(mode)
        self._repeats = self._repeats + 1 if key == self._last_key and key else 0
        self._last_key = key
        plan = engine._plan(loaded)
        if not plan:  # the base model: hooks off, merged layers restored by the merge path
            self._remove()
            self.last_decision = None
            return False
        entries = {ident: e for ident, e, _ in loaded}
        inputs = self.inputs(plan, entries, steps=steps, queued_same=queued_same)
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
            hooks = [((comp, module), _Hook(*engine._unfused_factors(
                         comp, module, engine._contributions(plan, (comp, module), entries, factors))))
                     for comp, module in sorted(plan)]
        except _LayerWriteFailed as failed:
            self._remove()
            engine.restore_base()
            engine._active_key, engine._active_meta = (), []
            raise engine._refusal(failed) from None
        self._remove()
        engine.restore_base()  # layers left merged go back to pristine (no write when nothing is merged)
        self._install(hooks)
        engine._active_key = ("unfused",) + tuple(key)
        engine._active_meta = meta
        engine.counters["switches"] += 1
        self._key = key
        return True

    def inputs(self, plan, entries, *, steps=None, queued_same: int = 0) -> PolicyInputs:
        """The policy's inputs for the engine's plan ((component, module) -> [(identity, scale)])
        and its entries (identity -> LoadedAdapter)."""
        engine, cfg = self.engine, self.config
        merge_bytes = sum(self._weight_bytes(t) for t in engine._changed(plan))
        restore_bytes = sum(self._weight_bytes(t) for t in engine._merged)
        lowrank = 0
        per_comp: dict[str, int] = {}
        for (comp, module), items in plan.items():
            w = engine._params[comp][f"{module}.weight"]
            rank = sum(entries[ident].bindings[comp].layers[module].tensors["lora_A.weight"].shape[0]
                       for ident, _ in items)
            lowrank += rank * (w.shape[0] + w.shape[1])
            per_comp[comp] = per_comp.get(comp, 0) + 1
        base = sum(self._linear_elems[c] for c in per_comp) or 1
        return PolicyInputs(steps=int(steps or 1), merge_bytes=merge_bytes, restore_bytes=restore_bytes,
                            bandwidth=float(cfg["bandwidth"]), fixed_s=float(cfg["fixed_s"]), step_s=self.step_s,
                            ratio=lowrank / base, hooked_layers=max(per_comp.values()),
                            hook_s=float(cfg["hook_s"]), forwards=self.forwards,
                            queued_same=int(queued_same or 0), repeats=self._repeats)

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
        for (comp, module), hook in hooks:
            layer = self.engine.denoisers[comp].get_submodule(module)
            self._handles.append(layer.register_forward_hook(hook, with_kwargs=True))
        self.counters["hooks_installed"] += len(self._handles)

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._key is not None:
            self.engine._active_key, self.engine._active_meta = (), []
        self._key = None

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def stats(self) -> dict:
        return {"mode": self.mode, "serving": "unfused" if self._handles else "merged",
                "hooked_layers": len(self._handles), "counters": dict(self.counters),
                "step_s": self.step_s, "forwards_per_step": self.forwards,
                "bandwidth": self.config["bandwidth"], "fixed_s": self.config["fixed_s"],
                "hook_s": self.config["hook_s"], "last_merge": self.last_merge,
                "last_decision": self.last_decision.as_dict() if self.last_decision else None}

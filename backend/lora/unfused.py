"""Serving adapters unfused: forward hooks on the targeted Linear layers, no weight write.

For a layer ``y = W0 x + b0`` with active contributions ``(A_i, B_i, s_i * scaling_i)`` the
hook adds ``B' (A' x) + bias'`` to the layer's output, where ``A' = cat(A_i)`` and
``B' = cat(s_i * scaling_i * B_i)`` (a stack costs two GEMMs per layer, not two per
adapter). The factors are the engine's own device-tier entries (one cache for both modes),
cast once to the layer's dtype when hooks go on. Base weights are never written, so a
request served unfused leaves every weight bit-exact.

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

from .policy import DEVICE_DEFAULTS, Decision, PolicyInputs, check_mode, decide


def _contribution(items) -> tuple:
    # the engine's own key for what a layer holds (LoRAEngine._apply)
    return tuple((e.int_id, e.stamp, s) for e, s in items)


class _Hook:
    """Adds the low-rank path of one Linear layer: ``out + F.linear(F.linear(x, a), b, bias)``."""

    __slots__ = ("a", "b", "bias")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None):
        self.a, self.b, self.bias = a, b, bias

    def __call__(self, module, args, kwargs, output):
        x = args[0] if args else kwargs["input"]
        a, b, bias = self.a, self.b, self.bias
        if x.dtype != a.dtype:
            a, b = a.to(x.dtype), b.to(x.dtype)
            bias = None if bias is None else bias.to(x.dtype)
        return output + F.linear(F.linear(x, a), b, bias)


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
    def serve(self, loaded, key, *, steps=None, mode=None, queued_same: int = 0) -> bool:
        """Decide this activation's mode; serve it unfused (and return True) or leave it to the merge."""
        engine = self.engine
        requested = self.mode if mode is None else check_mode(mode)
        self._repeats = self._repeats + 1 if key == self._last_key and key else 0
        self._last_key = key
        plan = engine._plan(loaded)
        if not plan:  # the base model: hooks off, merged layers restored by the merge path
            self._remove()
            self.last_decision = None
            return False
        inputs = self.inputs(plan, steps=steps, queued_same=queued_same)
        decision = decide(inputs, requested)
        self.last_decision = decision
        if decision.mode == "merged":
            self._remove()
            self.counters["merged"] += 1
            return False
        self.counters["unfused"] += 1
        if self._key == key and self._handles:
            engine.counters["noop_activations"] += 1
            return True
        self._remove()
        if engine._merged:  # put merged layers back to base first (no write when nothing is merged)
            engine._apply({})
        factors = engine._device_factors({e.int_id: e for items in plan.values() for e, _ in items})
        self._install(plan, factors)
        engine._active_key = ("unfused",) + tuple(key)
        engine._active_meta = [engine._meta(e, s) for e, s in loaded]
        engine.counters["switches"] += 1
        self._key = key
        return True

    def inputs(self, plan, *, steps=None, queued_same: int = 0) -> PolicyInputs:
        """The policy's inputs for a plan ((component, module) -> [(entry, scale)])."""
        engine, cfg = self.engine, self.config
        merge_bytes = restore_bytes = 0
        for t in set(plan) | set(engine._merged):
            nbytes = self._weight_bytes(t)
            if _contribution(plan.get(t, [])) != engine._merged.get(t, ()):
                merge_bytes += nbytes
            if t in engine._merged:
                restore_bytes += nbytes
        lowrank = 0
        per_comp: dict[str, int] = {}
        for (comp, module), items in plan.items():
            w = engine._params[comp][f"{module}.weight"]
            rank = sum(e.bindings[comp].layers[module].tensors["lora_A.weight"].shape[0] for e, _ in items)
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
    def _install(self, plan, factors) -> None:
        engine = self.engine
        with torch.no_grad():
            for (comp, module), items in sorted(plan.items()):
                weight = engine._params[comp][f"{module}.weight"]
                dtype = weight.dtype
                fs = [(factors[e.int_id][(comp, module)], s) for e, s in items]
                a = torch.cat([f.a for f, _ in fs], 0) if len(fs) > 1 else fs[0][0].a
                b = torch.cat([f.b.float() * (s * f.scaling) for f, s in fs], 1)
                biases = [f.bias.float() * (s * f.scaling) for f, s in fs if f.bias is not None]
                bias = torch.stack(biases).sum(0).to(dtype) if biases else None
                hook = _Hook(a.to(dtype).contiguous(), b.to(dtype).contiguous(), bias)
                layer = engine.denoisers[comp].get_submodule(module)
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

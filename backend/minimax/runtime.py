"""MiniMaxRuntime: a loaded MiniMax-H3 repository, its adapters and the contract check of every request.

The PipelineManager owns one of these when the model is MiniMax-H3 (a modular pipeline, which has neither
`__call__(callback_on_step_end=...)` nor one denoiser per task), and hands `generate` to it.

Adapters run on the shared LoRA engine (``backend.lora.engine.LoRAEngine``), the one every pipeline uses; MiniMax-H3
only adds its family hooks (``adapters.MiniMaxLoRAFamily``: contracts, layouts, grouped-QKV reorder, partition
routing). docs/ARCHITECTURE.md, "MiniMax-H3 and the LoRA engine", says why and how.
- peft: every adapter of a request is read and fitted by the engine (the shared fit report; refused by key before
  the model is touched), the request is checked against the contracts (the family's ``check``), the partition the
  task needs is loaded, and the engine makes exactly the active set live: an exact merge from pristine copies
  without offload, forward hooks (no weight written) with offload. No adapter, or only adapters at scale 0, = the
  base model, bit for bit, with no contract. The engine is the one ``backend.lora.attach(manager)`` builds (the
  server's worker, Omni), or the runtime's own, built on first use, when none was attached.
- distill: `fuse(paths)` once at start: each file fitted and added into its partition's weights (W += s B A).

Offload (`offload.py`): checked at construction, applied by `ready()` after start-time fusing (`start()` ends with
it; the server's worker, which never calls `start()`, reaches it on its first generation).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import AdapterError, AdapterNotFound, InvalidParameter
from ..lora.request import LoRARequest
from . import contracts, offload as offload_policy, pipeline as mp
from .adapters import MiniMaxAdapter, MiniMaxLoRAFamily

#: lora_int_ids of adapters named by (name, path, scale) triples (the runtime's own API), clear of request ids
TRIPLE_ID_BASE = 1 << 29


@dataclass
class Generated:
    frames: list
    fps: int
    audio: tuple
    metadata: dict = field(default_factory=dict)


class MiniMaxRuntime:
    def __init__(self, path, *, device, dtype, lora_backend: str = "peft", offload=None, task_type: str = "t2va"):
        self.device, self.dtype, self.lora_backend = torch.device(device), dtype, lora_backend
        plan = offload_policy.check(offload)
        offload_policy.check_device(plan, self.device)
        self.offloader = offload_policy.Offloader(plan, self.device)
        self.path = Path(path)
        self.index = contracts.read_index(self.path)
        self.checkpoint_contract = contracts.checkpoint_contract(self.path, self.index)
        # With offload the weights stay in CPU memory until `ready()` applies it (after any distill fusing).
        self.pipe = mp.load(self.path, device=None if plan.active else self.device, dtype=dtype, task_type=task_type)
        self.family = MiniMaxLoRAFamily(type(self.pipe))  # the engine's hooks for this repository
        self.family.checkpoint = self.checkpoint_contract
        self.fused: list[MiniMaxAdapter] = self.family.fused
        self.engine = None  # backend.lora.engine.LoRAEngine: attached (attach_engine) or built on first use
        self._requests: dict[str, LoRARequest] = {}  # (name, path, scale) triples: name -> its request
        self._lock = threading.RLock()

    @property
    def offload(self) -> offload_policy.OffloadPlan:
        return self.offloader.plan

    def start(self, lora_backend: str, lora_path=None) -> None:
        """Start-time adapters (Omni(lora_path=...)): distill fuses them, peft pre-loads and pins them (inactive);
        then offload. A start path that attaches the engine itself (``backend.lora.attach(manager, preload=...)``)
        passes ``lora_path`` only for distill."""
        self.lora_backend = lora_backend
        paths = [lora_path] if isinstance(lora_path, (str, Path)) else list(lora_path or [])
        if lora_backend == "distill":
            self.fuse(paths)
        elif paths:
            from ..lora import PRELOAD_ID_BASE

            engine = self.lora_engine()
            for i, path in enumerate(paths):
                request = LoRARequest(Path(path).stem, PRELOAD_ID_BASE + i, str(path))
                engine.load(request, pin=True)
                engine.preloaded.append(request)
        self.ready()

    def ready(self) -> None:
        """Apply the offload plan, once: after start-time fusing, before the first generation."""
        with self._lock:
            self.offloader.apply(self.pipe)

    def _ensure_partition(self, task_type: str) -> str:
        partition = mp.ensure_partition(self.pipe, task_type, dtype=self.dtype, place=self.offloader.place)
        if self.engine is not None:
            self.engine.add_denoiser(partition, getattr(self.pipe, partition))
        return partition

    # -- adapters: the shared engine ---------------------------------------------------------------------
    def denoisers(self) -> dict[str, torch.nn.Module]:
        return {p: getattr(self.pipe, p) for p in ("transformer", "transformer_ref") if p in
                mp.loaded_partitions(self.pipe)}

    def attach_engine(self, engine) -> None:
        """Serve this runtime's adapters with ``engine`` (built by ``backend.lora.attach``): its family hooks become
        this repository's (checkpoint schedule, fused files)."""
        with self._lock:
            engine.family = self.family
            self.engine = engine

    def lora_engine(self):
        """The attached engine, or one built here with the defaults (a runtime used on its own, as in tests)."""
        with self._lock:
            if self.engine is None:
                from ..lora.engine import LoRAEngine

                options = self.family.engine_options(SimpleNamespace(minimax=self, device=self.device))
                self.attach_engine(LoRAEngine(self.pipe, self.denoisers(), model=self.path.name, family=self.family,
                                              **options))
            return self.engine

    def _request(self, name: str, path) -> LoRARequest:
        """The request for a (name, path) of the runtime's own API; a name given a new path drops the old one."""
        request = self._requests.get(name)
        if request is not None and Path(request.lora_path).expanduser() != Path(path).expanduser():
            self.unload_adapter(name)
            request = None
        if request is None:
            used = {r.lora_int_id for r in self._requests.values()}
            int_id = next(i for i in range(TRIPLE_ID_BASE, TRIPLE_ID_BASE + len(used) + 1) if i not in used)
            request = self._requests[name] = LoRARequest(name, int_id, str(path))
        return request

    @property
    def adapters(self) -> dict[str, MiniMaxAdapter]:
        """The adapters the engine holds, by the names they were requested under (contract, partition, report)."""
        if self.engine is None:
            return {}
        return {name: entry.data for name, entry in self.engine.by_name().items()}

    def read(self, path, name: str | None = None) -> MiniMaxAdapter:
        """Read and fit one file as the engine does; refused (AdapterError naming the keys) before anything touches
        the model."""
        from ..lora.adapter import load_adapter

        entry = load_adapter(path, type(self.pipe), self.denoisers(), name=name or Path(path).stem, int_id=0,
                             model=self.path.name, family=self.family)
        return entry.data

    def load_adapter(self, name: str, path) -> MiniMaxAdapter:
        """Read, fit and cache one adapter in the engine (nothing is activated)."""
        if self.lora_backend != "peft":
            raise AdapterError("per-request adapters need --lora-backend peft", param="lora_request")
        with self._lock:
            return self.lora_engine().load(self._request(name, path)).data

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            self._requests.pop(name, None)
            if self.engine is not None:
                try:
                    self.engine.unload(name)
                except AdapterNotFound:
                    pass

    def fuse(self, paths) -> list[MiniMaxAdapter]:
        """Distill: add each file into its partition's weights once (scale 1: W += scaling * B A, one rounding)."""
        if self.offloader.applied and self.offload.active:
            # The policy's consistency argument for offload rests on fusing before its hooks exist.
            raise AdapterError(f"distill files are fused at start, before {self.offload.flags()} is applied; "
                               "fusing later is not supported", param="lora_path")
        for i, path in enumerate(paths):
            adapter = self.read(path, f"distill_{i}")
            self._ensure_partition(adapter.tasks[0])
            module = getattr(self.pipe, adapter.partition)
            with self.engine.rebase() if self.engine is not None else contextlib.nullcontext():
                _fuse(module, adapter)
            self.fused.append(adapter)
        return self.fused

    def _activate(self, active: list[tuple[MiniMaxAdapter, str, float]], partition: str) -> None:
        """Make exactly these (adapter, name, scale) of `partition` active (no generation)."""
        chosen = [(self._requests[name], scale) for adapter, name, scale in active if adapter.partition == partition]
        self.lora_engine().activate(chosen)

    def _disable_all(self) -> None:
        if self.engine is not None:
            self.engine.deactivate()

    # -- generation --------------------------------------------------------------------------------------
    def plan(self, params: dict, active: list[MiniMaxAdapter], *, default_steps: int | None = None):
        return self.family.check(params, active, default_steps=default_steps)

    def generate(self, params: dict, *, adapters=(), on_step=None, cancel=None, default_steps=None,
                 lora_mode: str | None = None) -> Generated:
        """`adapters`: (name, path, scale) triples or (LoRARequest, scale) pairs; `params`: validated fields.

        Every adapter is read and fitted (a file that does not fit is refused whatever its scale); one at scale 0
        is then left out: it neither changes a weight nor imposes its sampling contract (the base model, bit for
        bit, as with every other pipeline)."""
        with self._lock:
            self.ready()  # a runtime built without start() (the server's worker) offloads here
            pairs = []
            for item in adapters:
                request, scale = (item[0], item[1]) if isinstance(item[0], LoRARequest) else \
                    (self._request(item[0], item[1]), item[2])
                if not isinstance(scale, (int, float)) or isinstance(scale, bool):
                    raise InvalidParameter("MiniMax-H3 adapters take one scale (they bind to one partition)",
                                           param="lora_scale")
                pairs.append((request, float(scale)))
            if pairs and self.lora_backend != "peft":
                raise AdapterError("per-request adapters need --lora-backend peft", param="lora_request")
            engine = self.lora_engine() if pairs else self.engine
            entries = [engine.load(request) for request, _ in pairs]  # read + fit: refusals touch nothing
            active = [(entry, request, scale) for entry, (request, scale) in zip(entries, pairs) if scale != 0.0]
            plan = self.family.check(params, [e for e, _, _ in active], default_steps=default_steps)
            self._ensure_partition(plan.task_type)
            applied, calls = [], 0
            if engine is not None:  # exactly the active set (none: every written layer back to its original)
                applied = engine.activate([(request, scale) for _, request, scale in active], steps=plan.steps,
                                          mode=lora_mode)
                calls = engine.unfused.forward_calls()
            generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
            started = time.perf_counter()
            out = mp.run(self.pipe, plan, params, on_step=on_step, cancel=cancel, generator=generator)
            if engine is not None:  # the merge-or-unfused policy's measured step time
                engine.unfused.observe_run(time.perf_counter() - started, plan.steps,
                                           engine.unfused.forward_calls() - calls)
            meta = {
                "task_type": plan.task_type, "num_inference_steps": plan.steps,
                "sigmas": list(plan.sigmas) if plan.sigmas else None,
                "flow_shift": None if plan.sigmas else plan.flow_shift,
                "audio_flow_shift": None if plan.sigmas else plan.audio_flow_shift,
                "contract": plan.contract.describe() if plan.contract else None,
                "height": out.height, "width": out.width, "num_frames": out.num_frames,
                "sample_rate": out.audio[1], "fused": [a.path.name for a in self.fused],
                "applied": applied,
            }
            if applied:
                decision = engine.unfused.last_decision
                meta["lora_mode"] = decision.as_dict() if decision is not None else \
                    {"mode": "unfused" if engine.unfused.active else "merged"}
            return Generated(frames=out.frames, fps=out.fps, audio=out.audio, metadata=meta)


def _fuse(module: torch.nn.Module, adapter: MiniMaxAdapter) -> None:
    """W += scaling * B A (and the bias term) for every fitted layer, in fp32, one rounding; refused untouched
    when a result is not finite."""
    written = []
    with torch.no_grad():
        for name, f in adapter.report.bindings[adapter.partition].layers.items():
            layer = module.get_submodule(name)
            w = layer.weight
            new = torch.addmm(w.float(), f.tensors["lora_B.weight"].float().to(w.device),
                              f.tensors["lora_A.weight"].float().to(w.device), alpha=f.scaling).to(w.dtype)
            bias = f.tensors.get("lora_B.bias")
            new_bias = None if bias is None else (layer.bias.float() + bias.float().to(w.device) * f.scaling
                                                  ).to(layer.bias.dtype)
            if not bool(torch.isfinite(new).all()) or (new_bias is not None and not bool(torch.isfinite(new_bias).all())):
                for lyr, w0, b0 in written:
                    lyr.weight.copy_(w0)
                    if b0 is not None:
                        lyr.bias.copy_(b0)
                raise AdapterError(f"{adapter.path.name}: fusing makes {adapter.partition}.{name} not finite "
                                   "(inf/nan); refused, the base weights are unchanged", param="lora_path")
            written.append((layer, w.detach().clone(), None if new_bias is None else layer.bias.detach().clone()))
            w.copy_(new)
            if new_bias is not None:
                layer.bias.copy_(new_bias)


#: Fields whose default must wait for the contract: an artifact may pin them, and a default filled in
#: before the check would read as a request that breaks the contract.
CONTRACT_FIELDS = ("num_inference_steps", "flow_shift", "audio_flow_shift")


def generate_for_manager(manager, request: dict, *, adapters=None, defaults=None, on_step=None, cancel=None,
                         lora_mode: str | None = None):
    """PipelineManager.generate for MiniMax-H3: validate, check the contract, run, and wrap the result."""
    from ..result import GenerationResult

    started = time.time()
    if "lora_mode" in request:  # a request field (HTTP): merge or unfused, not a pipeline argument
        request = dict(request)
        field_mode = request.pop("lora_mode")
        lora_mode = field_mode if lora_mode is None else lora_mode
    params = manager.validate(request, defaults)
    merged_defaults = {**manager.spec.defaults, **manager.defaults, **(defaults or {})}
    for name in CONTRACT_FIELDS:
        params[name] = request.get(name)
    out = manager.minimax.generate(params, adapters=list(adapters or []), on_step=on_step, cancel=cancel,
                                   default_steps=merged_defaults.get("num_inference_steps"), lora_mode=lora_mode)
    applied = out.metadata.pop("applied")
    lora_mode_meta = out.metadata.pop("lora_mode", None)
    shown = {k: v for k, v in params.items() if k not in ("image", "last_image", "references") and v is not None}
    shown.update(out.metadata)
    metadata = manager.run_metadata(shown, applied, time.time() - started)
    if lora_mode_meta is not None:  # which way the adapters ran, as for every other pipeline
        metadata["lora_mode"] = lora_mode_meta
    return GenerationResult(frames=out.frames, fps=out.fps, audio=out.audio, metadata=metadata)

"""MiniMaxRuntime: a loaded MiniMax-H3 repository, its adapters and the contract check of every request.

The PipelineManager owns one of these when the model is MiniMax-H3 (a modular pipeline, which has neither
`__call__(callback_on_step_end=...)` nor one denoiser per task), and hands `generate` to it.

Adapters:
- peft: `load_adapter(name, path)` reads the file once (contract, native reorder, alpha), fits it against a
  meta-device skeleton of its partition with the shared fit check (`backend.lora.fit`: unmatched keys, wrong
  shapes and nothing bound are refused, naming the keys, before the model is touched), then binds it to its
  partition under an internal peft name; a request activates a list of (name, scale) with `set_adapters` on that
  partition and every other adapter off; no adapter, or only adapters at scale 0, = base model (LoRA layers
  disabled, no contract).
- distill: `fuse(paths)` once at start: each file fitted, fused into its partition, then the LoRA layers dropped.

Offload (`offload.py`): checked at construction, applied by `ready()` after start-time fusing (`start()` ends with
it; the server's worker, which never calls `start()`, reaches it on its first generation).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import AdapterError, ContractViolation, InvalidParameter
from . import contracts, offload as offload_policy, pipeline as mp
from .adapters import MiniMaxAdapter, fit_partition, read_adapter


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
        self.adapters: dict[str, MiniMaxAdapter] = {}
        self._peft_names: dict[str, str] = {}  # request name -> peft adapter name (peft refuses dots in names)
        self._skeletons: dict[str, torch.nn.Module] = {}  # partition -> meta-device copy, for fit reports
        self.fused: list[MiniMaxAdapter] = []
        self._lock = threading.RLock()

    @property
    def offload(self) -> offload_policy.OffloadPlan:
        return self.offloader.plan

    def start(self, lora_backend: str, lora_path=None) -> None:
        """Start-time adapters (Omni(lora_path=...)): distill fuses them, peft binds them (inactive); then offload."""
        self.lora_backend = lora_backend
        paths = [lora_path] if isinstance(lora_path, (str, Path)) else list(lora_path or [])
        if lora_backend == "distill":
            self.fuse(paths)
        else:
            for path in paths:
                self.load_adapter(Path(path).stem, path)
        self.ready()

    def ready(self) -> None:
        """Apply the offload plan, once: after start-time fusing, before the first generation."""
        with self._lock:
            self.offloader.apply(self.pipe)

    def _ensure_partition(self, task_type: str) -> str:
        return mp.ensure_partition(self.pipe, task_type, dtype=self.dtype, place=self.offloader.place)

    # -- adapters ----------------------------------------------------------------------------------------
    def _heads(self, partition: str) -> tuple[int, int]:
        config = self._partition_config(partition)
        return int(config["num_attention_heads"]), int(config["attention_head_dim"])

    def _partition_config(self, partition: str) -> dict:
        module = getattr(self.pipe, partition, None)
        if module is not None:
            return dict(module.config)
        import json

        return json.loads((self.path / partition / "config.json").read_text())

    def skeleton(self, partition: str) -> torch.nn.Module:
        """The partition's architecture on the meta device (from its config): what fit reports are made
        against, never the loaded module (whose bound peft layers are no longer plain Linear layers)."""
        if partition not in self._skeletons:
            from diffusers import MiniMaxH3Transformer3DModel

            with torch.device("meta"):
                self._skeletons[partition] = MiniMaxH3Transformer3DModel.from_config(
                    self._partition_config(partition))
        return self._skeletons[partition]

    def read(self, path, name: str | None = None) -> MiniMaxAdapter:
        """Read and fit one file; refused (AdapterError naming the keys) before anything touches the model."""
        # Both partitions share one architecture config in every released repository; read the one on disk.
        heads, head_dim = self._heads("transformer")
        adapter = read_adapter(path, num_heads=heads, head_dim=head_dim)
        return fit_partition(adapter, self.skeleton(adapter.partition),
                             model=f"{self.path.name} ({adapter.partition})", name=name or Path(path).stem)

    def _bind(self, adapter: MiniMaxAdapter, peft_name: str) -> None:
        self._ensure_partition(adapter.tasks[0])
        self.pipe.load_lora_weights(adapter.state_dict, adapter_name=peft_name,
                                    load_into_transformer_ref=adapter.partition == "transformer_ref")

    def load_adapter(self, name: str, path) -> MiniMaxAdapter:
        if self.lora_backend != "peft":
            raise AdapterError("per-request adapters need --lora-backend peft", param="lora_request")
        with self._lock:
            cached = self.adapters.get(name)
            if cached is not None and cached.path == Path(path).expanduser():
                return cached
            if cached is not None:
                self.unload_adapter(name)
            adapter = self.read(path, name)
            peft_name = f"adapter_{len(self._peft_names)}"
            while peft_name in self._peft_names.values():
                peft_name += "_"
            self._bind(adapter, peft_name)
            self.adapters[name], self._peft_names[name] = adapter, peft_name
            self._disable_all()
            return adapter

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            adapter = self.adapters.pop(name, None)
            if adapter is not None:
                getattr(self.pipe, adapter.partition).delete_adapters([self._peft_names.pop(name)])

    def fuse(self, paths) -> list[MiniMaxAdapter]:
        """Distill: fuse each file into its partition once (scale 1), then drop the LoRA layers."""
        if self.offloader.applied and self.offload.active:
            # The policy's consistency argument for offload rests on fusing before its hooks exist.
            raise AdapterError(f"distill files are fused at start, before {self.offload.flags()} is applied; "
                               "fusing later is not supported", param="lora_path")
        for i, path in enumerate(paths):
            name = f"distill_{i}"
            adapter = self.read(path, name)
            self._bind(adapter, name)
            module = getattr(self.pipe, adapter.partition)
            module.set_adapters([name], [1.0])
            module.fuse_lora(lora_scale=1.0, adapter_names=[name])
            module.unload_lora()
            self.fused.append(adapter)
        return self.fused

    def _disable_all(self) -> None:
        for partition in mp.loaded_partitions(self.pipe):
            module = getattr(self.pipe, partition)
            if getattr(module, "peft_config", None):
                module.disable_lora()

    def _activate(self, active: list[tuple[MiniMaxAdapter, str, float]], partition: str) -> None:
        self._disable_all()
        chosen = [(self._peft_names[name], scale) for adapter, name, scale in active
                  if adapter.partition == partition]
        if chosen:
            module = getattr(self.pipe, partition)
            module.enable_lora()
            module.set_adapters([n for n, _ in chosen], [s for _, s in chosen])

    # -- generation --------------------------------------------------------------------------------------
    def plan(self, params: dict, active: list[MiniMaxAdapter], *, default_steps: int | None = None):
        contract = contracts.active_contract(self.checkpoint_contract,
                                             [a.contract for a in [*self.fused, *active]])
        return contracts.plan(params, contract, default_steps=default_steps)

    def generate(self, params: dict, *, adapters=(), on_step=None, cancel=None, default_steps=None) -> Generated:
        """`adapters`: (name, path, scale) triples; `params`: validated generation fields.

        Every adapter is read and fitted (a file that does not fit is refused whatever its scale); one at scale 0
        is then left out: it neither changes a weight nor imposes its sampling contract (the base model, bit for
        bit, as with the merging engine of the other pipelines)."""
        with self._lock:
            self.ready()  # a runtime built without start() (the server's worker) offloads here
            active = []
            for name, path, scale in adapters:
                if not isinstance(scale, (int, float)) or isinstance(scale, bool):
                    raise InvalidParameter("MiniMax-H3 adapters take one scale (they bind to one partition)",
                                           param="lora_scale")
                adapter = self.load_adapter(name, path)
                if float(scale) != 0.0:
                    active.append((adapter, name, float(scale)))
            plan = self.plan(params, [a for a, _, _ in active], default_steps=default_steps)
            partition = contracts.PARTITION[plan.task_type]
            for adapter, name, _ in active:
                if adapter.partition != partition:
                    raise ContractViolation(
                        f"{adapter.path.name} binds to {adapter.partition} (task_type {' or '.join(adapter.tasks)});"
                        f" the request's task_type {plan.task_type!r} denoises with {partition}",
                        param="task_type")
            for adapter in self.fused:
                if adapter.partition != partition:
                    raise ContractViolation(
                        f"{adapter.path.name} is fused into {adapter.partition}; task_type {plan.task_type!r} "
                        f"denoises with {partition}", param="task_type")
            self._ensure_partition(plan.task_type)
            self._activate(active, partition)
            generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
            try:
                out = mp.run(self.pipe, plan, params, on_step=on_step, cancel=cancel, generator=generator)
            finally:
                self._disable_all()
            meta = {
                "task_type": plan.task_type, "num_inference_steps": plan.steps,
                "sigmas": list(plan.sigmas) if plan.sigmas else None,
                "flow_shift": None if plan.sigmas else plan.flow_shift,
                "audio_flow_shift": None if plan.sigmas else plan.audio_flow_shift,
                "contract": plan.contract.describe() if plan.contract else None,
                "height": out.height, "width": out.width, "num_frames": out.num_frames,
                "sample_rate": out.audio[1], "fused": [a.path.name for a in self.fused],
                "active": [name for _, name, _ in active],
            }
            return Generated(frames=out.frames, fps=out.fps, audio=out.audio, metadata=meta)


#: Fields whose default must wait for the contract: an artifact may pin them, and a default filled in
#: before the check would read as a request that breaks the contract.
CONTRACT_FIELDS = ("num_inference_steps", "flow_shift", "audio_flow_shift")


def generate_for_manager(manager, request: dict, *, adapters=None, defaults=None, on_step=None, cancel=None):
    """PipelineManager.generate for MiniMax-H3: validate, check the contract, run, and wrap the result."""
    import time

    from ..digest import file_sha256
    from ..result import GenerationResult

    started = time.time()
    params = manager.validate(request, defaults)
    merged_defaults = {**manager.spec.defaults, **manager.defaults, **(defaults or {})}
    for name in CONTRACT_FIELDS:
        params[name] = request.get(name)
    triples = [(req.lora_name, req.lora_path, scale) for req, scale in (adapters or [])]
    out = manager.minimax.generate(params, adapters=triples, on_step=on_step, cancel=cancel,
                                   default_steps=merged_defaults.get("num_inference_steps"))
    active = out.metadata.pop("active")
    applied = [{"name": name, "path": str(path), "scale": scale,
                "sha256": file_sha256(path)} for name, path, scale in triples if name in active]
    shown = {k: v for k, v in params.items() if k not in ("image", "last_image", "references") and v is not None}
    shown.update(out.metadata)
    metadata = manager.run_metadata(shown, applied, time.time() - started)
    return GenerationResult(frames=out.frames, fps=out.fps, audio=out.audio, metadata=metadata)

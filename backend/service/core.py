"""What every part of the service shares (``Core``): the start config, the persistent job queue,
the worker process (or Ray dispatcher) that owns the device, the adapter resolver and the request
limits; and the facts every part reads: the model loaded now, the preset fused now, the loaded
model's spec, a model's spec from its files. Importing it does not import torch."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from .. import settings
from ..config import RuntimeConfig
from ..errors import InvalidParameter, StudioError
from ..jobs.adapters import AdapterResolver
from ..jobs.queue import JobQueue, not_found
from ..jobs.supervisor import Supervisor
from ..limits import Limits
from ..users import User, sees


class Core:
    """Built once by ``Studio`` (``Core.build``); the parts hold it and read these attributes."""

    def __init__(self, *, data_dir: Path, model: str, preset: str | None, lora_backend: str, engine: str,
                 limits: Limits):
        self.data_dir, self.model, self.preset = data_dir, model, preset
        self.lora_backend, self.engine, self.limits = lora_backend, engine, limits
        self.supervisor = None  # set by build(): the constructor's reads of the model see the start one
        self.started_at = time.time()

    @classmethod
    def build(cls, model: str, *, data_dir=None, adapter_dirs=(), lora_backend: str = "peft", lora_paths=None,
              lora_scale: float = 1.0, preset: str | None = None, max_loras: int = 4, max_cpu_loras: int = 16,
              max_queue: int = 256, max_overtake: int = 4, device: str | None = None, dtype: str | None = None,
              worker_threads: int | None = None, db_path=None, engine: str = "local",
              ray_address: str | None = None, replicas: int = 1, gpus_per_replica: float = 0.0,
              offload: str = "none", offload_stream: bool = False, limits: Limits | None = None,
              pristine: str = "auto", lora_mode: str | None = None, lora_prefetch: int = 2, max_batch: int = 1,
              quantize: str | None = None, gguf=None) -> "Core":
        if engine == "ray" and (replicas < 1 or gpus_per_replica < 0):
            raise InvalidParameter(f"--replicas must be >= 1 and --gpus-per-replica >= 0, got {replicas} and "
                                   f"{gpus_per_replica}", param="replicas" if replicas < 1 else "gpus_per_replica")
        data_dir = settings.data_dir(data_dir)
        settings.retire_old_demo_layout(data_dir)  # an older version's demo files in the user's library
        core = cls(data_dir=data_dir, model=model, preset=preset, lora_backend=lora_backend, engine=engine,
                   limits=limits or Limits())
        core.resolver = AdapterResolver(adapter_dirs, data_dir, model=core.current_model)
        # the one start config (backend/config.py: every rule across its fields is checked there, once)
        core.config = RuntimeConfig(
            model=model, data_dir=str(data_dir), device=device, dtype=dtype, lora_backend=lora_backend,
            lora_paths=lora_paths, lora_scale=lora_scale, preset=preset, max_loras=max_loras,
            max_cpu_loras=max_cpu_loras, threads=worker_threads,
            adapter_dirs=[str(r) for r in core.resolver.adapter_dirs], offload=offload, offload_stream=offload_stream,
            env={settings.ENV_VAR: str(data_dir)}, pristine=pristine, lora_mode=lora_mode,
            lora_prefetch=lora_prefetch, engine=engine, max_batch=max_batch, quantize=quantize, gguf=gguf)
        if lora_backend == "peft":  # pre-loaded and pinned by the worker; requests name them
            for path in core.config.lora_paths:
                core.resolver.register_start_file(path)
        core.queue = JobQueue(db_path or settings.jobs_db(data_dir), max_queue=max_queue, max_overtake=max_overtake)
        core.recovered = core.queue.recover()
        if engine == "ray":
            from ..engines.ray_engine import RayEngineConfig  # imports ray: only for --engine ray
            from ..jobs.ray_dispatch import RayDispatcher

            ray_cfg = RayEngineConfig(address=ray_address, replicas=replicas, gpus_per_replica=gpus_per_replica,
                                      device=device, dtype=dtype, data_dir=str(data_dir), max_loras=max_loras,
                                      max_cpu_loras=max_cpu_loras, runtime=core.config)
            core.supervisor = RayDispatcher(core.queue, core.config, ray_cfg, job_timeout=core.limits.job_timeout)
        else:
            core.supervisor = Supervisor(core.queue, core.config, job_timeout=core.limits.job_timeout)
        return core

    @property
    def info(self) -> dict:
        """The worker's last report (model, spec, preset, cache, memory), {} before its first."""
        return (self.supervisor.info if self.supervisor is not None else None) or {}

    def current_model(self) -> str:
        return self.info.get("model") or self.model

    def current_preset(self) -> str | None:
        info = self.info
        return info.get("preset") if "preset" in info else self.preset

    def spec(self) -> dict | None:
        """The loaded model's spec (fields, defaults, pipeline), as the worker reported it."""
        return self.info.get("spec")

    def static_spec(self, model_id: str) -> dict | None:
        """A model's spec from its directory's model_index.json (no weights loaded)."""
        return static_spec(model_id, self.data_dir)

    def job_for(self, job_id: str, user: User | None) -> dict:
        """A job's row as ``user`` may see it: another user's job is refused exactly as an unknown id is
        (no way to tell them apart, so ids cannot be probed)."""
        job = self.queue.get(job_id)
        if not sees(user, job.get("owner")):
            raise not_found(job_id)
        return job

    def queue_job(self, kind: str, params: dict, model: str | None = None) -> dict:
        """A job the server makes itself (a model switch, a preset), queued and the worker woken."""
        job = self.queue.submit(kind, model=model or self.current_model(), params=params, preset=None)
        self.supervisor.wake()
        return job


_SPECS: dict[str, dict] = {}
_SPECS_LOCK = threading.Lock()


def static_spec(model_id: str, data_dir) -> dict | None:
    """A model's spec from its directory's model_index.json (no weights loaded), cached per model."""
    from .. import demo

    if demo.is_demo(model_id) and not (settings.models_dir(data_dir) / model_id.replace(":", "-")
                                       / ".demo-build").exists():
        return None  # not built yet: the worker builds it when someone switches to it
    with _SPECS_LOCK:
        if model_id not in _SPECS:
            from ..models import resolve_model

            try:
                _SPECS[model_id] = resolve_model(model_id, data_dir).spec_info()
            except StudioError:
                return None
        return _SPECS[model_id]

"""The models part of the service: which models can be served, the switch between them, the
distill presets fused into the loaded one, and the system view (worker, queue, cache, versions)."""
from __future__ import annotations

import platform
import time
from pathlib import Path

from ..errors import Cancelled, InvalidParameter, ModelNotFound, StudioError
from .core import Core


class ModelService:
    def __init__(self, core: Core):
        self.core = core

    def models(self) -> list[dict]:
        from ..demo import DEMO_MODELS

        from ..models.resolve import baked_models

        loaded = self.core.current_model()
        out = []
        for model_id in dict.fromkeys([loaded, self.core.model, *DEMO_MODELS, *baked_models(self.core.data_dir)]):
            entry = {"id": model_id, "loaded": model_id == loaded}
            spec = self.core.spec() if model_id == loaded else self.core.static_spec(model_id)
            if spec:
                entry.update(spec)
            out.append(entry)
        return out

    def check_model(self, model_id) -> str:
        """The one rule for every ``model`` a client names (UI, gradio_client, /v1, switch): the
        demo ids, the model the server started with, the one loaded now, the models baked here
        (``baked:NAME``), and Hugging Face repo ids already in the local cache. Anything else, local paths included, gets the same error,
        which says nothing about the file system."""
        from ..demo import DEMO_MODELS

        current = self.core.current_model()
        if isinstance(model_id, str):
            model_id = model_id.strip()
            if model_id in DEMO_MODELS or model_id in (self.core.model, current) or _cached_repo(model_id) \
                    or self._baked(model_id):
                return model_id
        shown = repr(model_id[:100]) if isinstance(model_id, str) else type(model_id).__name__
        raise ModelNotFound(f"model {shown} is not served here; choose one of: "
                            f"{', '.join(dict.fromkeys([current, self.core.model, *DEMO_MODELS]))} "
                            "(or a Hugging Face repo id in this server's cache)", param="model")

    def _baked(self, model_id: str) -> bool:
        """``baked:NAME`` of a model baked here (its folder exists; a name that is not plain is not one)."""
        from ..models.resolve import BAKED, baked_models

        return model_id.startswith(BAKED) and model_id in baked_models(self.core.data_dir)

    def switch_model(self, model_id: str) -> dict:
        """Queue a load of another model (a job, so it never lands mid-generation)."""
        return self.core.queue_job("load_model", {}, model=self.check_model(model_id))

    def seconds_per_step(self) -> float | None:
        """The worker's recent pace (what an ETA is computed from before a job's first step)."""
        return self.core.info.get("seconds_per_step")

    # -- presets (distill) -----------------------------------------------------------------------
    def presets(self) -> list[dict]:
        from .. import presets as preset_mod

        return preset_mod.list_presets(data_dir=self.core.data_dir, adapter_dirs=self.core.resolver.adapter_dirs)

    def apply_preset(self, preset_id: str, timeout: float | None = 600.0) -> dict:
        """Fuse a preset into the loaded model (a queued job, so it never lands mid-generation)."""
        if not isinstance(preset_id, str) or not preset_id.strip():
            raise InvalidParameter("preset must be a preset id (see presets())", param="preset")
        return self._state_job("apply_preset", {"preset": preset_id}, timeout)

    def restore_base(self, timeout: float | None = 600.0) -> dict:
        """Back to the exact base weights (no reload)."""
        return self._state_job("restore_base", {}, timeout)

    def _state_job(self, kind: str, params: dict, timeout) -> dict:
        job = self.core.queue.wait(self.core.queue_job(kind, params)["id"], timeout)
        if job["status"] in ("failed", "cancelled"):
            raise job_error(job)
        return job["result"] or {}

    # -- observability ---------------------------------------------------------------------------
    def system(self) -> dict:
        core, sup = self.core, self.core.supervisor
        info, counts = dict(core.info), core.queue.counts()
        cache = info.get("lora_cache")
        return {
            "model": info.get("model") or core.model, "pipeline": info.get("pipeline"),
            "device": info.get("device"), "dtype": info.get("dtype"), "lora_backend": core.lora_backend,
            "preset": core.preset, "fused": info.get("fused"), "memory": info.get("memory") or {},
            "quantization": info.get("quantization"),
            "cache": _cache_summary(cache), "lora_cache": cache, "pristine": (cache or {}).get("pristine"),
            "queue_depth": counts["queued"], "jobs": counts, "max_queue": core.queue.max_queue,
            "scheduler": core.queue.scheduler_stats(), "seconds_per_step": info.get("seconds_per_step"),
            "worker": {"pid": sup.pid, "ready": sup.ready, "restarts": sup.restarts, "deaths": sup.deaths[-10:],
                       "running": sup.current["id"] if sup.current else None},
            "recovered_at_start": core.recovered, "uptime_s": round(time.time() - core.started_at, 1),
            "versions": _versions(), "data_dir": str(core.data_dir),
            "adapter_roots": [str(r) for r in core.resolver.roots],
        }


def job_error(job: dict) -> StudioError:
    """The StudioError a failed or cancelled job stands for (same status, type and param)."""
    if job["status"] == "cancelled":
        return Cancelled(f"job {job['id']} was cancelled", param="job_id")
    detail = {"status": 500, "type": "server_error", **(job.get("error_detail") or {})}  # a row with none: 500
    return StudioError.from_wire(detail, message=job.get("error") or "the job failed")


def _cached_repo(model_id: str) -> bool:
    """A Hugging Face repo id ("org/name") whose snapshot is in the local cache (never a path)."""
    if model_id.count("/") != 1 or model_id.startswith((".", "/", "~")) or ".." in model_id \
            or "\\" in model_id or Path(model_id).exists():
        return False
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(model_id)
        snapshot_download(model_id, local_files_only=True)
        return True
    except Exception:  # not a valid id, not cached, no huggingface_hub: not servable
        return False


def _cache_summary(stats: dict | None) -> dict:
    if not stats:
        return {}
    out = {}
    for tier, t in (stats.get("tiers") or {}).items():
        for k in ("hits", "misses", "evictions"):
            if k in t:
                out[f"{tier}_{k}"] = t[k]
    out.update({k: v for k, v in (stats.get("counters") or {}).items()})
    pristine = stats.get("pristine") or {}
    if pristine:  # the peft engine's originals: how much, and where (--pristine)
        out["pristine_bytes"] = pristine.get("bytes")
        out["pristine_where"] = pristine.get("where")
    return out


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "diffusers", "peft", "transformers", "gradio", "fastapi"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out

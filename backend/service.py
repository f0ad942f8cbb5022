"""The Studio facade: what the UI (ui/) and the HTTP API (backend/api/) talk to.

It holds the persistent job queue, the supervised worker process and the adapter
rules; it never imports Gradio, and importing it does not import torch (the worker
process is where the pipeline lives). Every method returns plain JSON-able dicts.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

from . import settings
from .config import RuntimeConfig
from .errors import AdapterNotFound, InvalidParameter, ModelNotFound, PathNotAllowed, StudioError
from .families import DEFAULT_MODEL
from .jobs.adapters import AdapterResolver
from .jobs.queue import FINISHED, JobQueue
from .jobs.supervisor import Supervisor
from .limits import Limits, check_request, check_text
from .limits import MAX_PLOT_PIXELS, MAX_PLOT_SIDE, check_plot_cells, check_plot_size  # noqa: F401 (the UI's plot budget)
from .lora.schedule import parse_text as parse_scale_text  # noqa: F401 - the UI's scale fields (torch-free)
from .pnginfo import infotext  # noqa: F401 - the UI's result line (torch-free)

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
log = logging.getLogger("lora_studio.service")


class Studio:
    def __init__(self, model: str = DEFAULT_MODEL, *, data_dir=None, adapter_dirs=(), lora_backend: str = "peft",
                 lora_paths=None, lora_scale: float = 1.0, preset: str | None = None, max_loras: int = 4,
                 max_cpu_loras: int = 16, max_queue: int = 256, max_overtake: int = 4, device: str | None = None,
                 dtype: str | None = None, worker_threads: int | None = None, db_path=None,
                 engine: str = "local", ray_address: str | None = None, replicas: int = 1,
                 gpus_per_replica: float = 0.0, offload: str = "none", offload_stream: bool = False,
                 limits: Limits | None = None, pristine: str = "auto",
                 lora_mode: str | None = None, lora_prefetch: int = 2, max_batch: int = 1,
                 quantize: str | None = None, gguf=None):
        if engine == "ray" and (replicas < 1 or gpus_per_replica < 0):
            raise InvalidParameter(f"--replicas must be >= 1 and --gpus-per-replica >= 0, got {replicas} and "
                                   f"{gpus_per_replica}", param="replicas" if replicas < 1 else "gpus_per_replica")
        self.data_dir = settings.data_dir(data_dir)
        settings.retire_old_demo_layout(self.data_dir)  # an older version's demo files in the user's library
        self.resolver = AdapterResolver(adapter_dirs, self.data_dir, model=self.current_model)
        # the one start config (backend/config.py: every rule across its fields is checked there, once)
        self.config = RuntimeConfig(
            model=model, data_dir=str(self.data_dir), device=device, dtype=dtype, lora_backend=lora_backend,
            lora_paths=lora_paths, lora_scale=lora_scale, preset=preset, max_loras=max_loras,
            max_cpu_loras=max_cpu_loras, threads=worker_threads,
            adapter_dirs=[str(r) for r in self.resolver.adapter_dirs], offload=offload, offload_stream=offload_stream,
            env={settings.ENV_VAR: str(self.data_dir)}, pristine=pristine, lora_mode=lora_mode,
            lora_prefetch=lora_prefetch, engine=engine, max_batch=max_batch, quantize=quantize, gguf=gguf)
        self.model = model
        self.limits = limits or Limits()
        self.lora_backend = lora_backend
        self.preset = preset
        if lora_backend == "peft":  # pre-loaded and pinned by the worker; requests name them
            for path in self.config.lora_paths:
                self.resolver.register_start_file(path)
        self.queue = JobQueue(db_path or settings.jobs_db(self.data_dir), max_queue=max_queue, max_overtake=max_overtake)
        self.recovered = self.queue.recover()
        self.engine = engine
        if engine == "ray":
            from .engines.ray_engine import RayEngineConfig  # imports ray: only for --engine ray
            from .jobs.ray_dispatch import RayDispatcher

            ray_cfg = RayEngineConfig(address=ray_address, replicas=replicas, gpus_per_replica=gpus_per_replica,
                                      device=device, dtype=dtype, data_dir=str(self.data_dir), max_loras=max_loras,
                                      max_cpu_loras=max_cpu_loras, runtime=self.config)
            self.supervisor = RayDispatcher(self.queue, self.config, ray_cfg, job_timeout=self.limits.job_timeout)
        else:
            self.supervisor = Supervisor(self.queue, self.config, job_timeout=self.limits.job_timeout)
        self.started_at = time.time()
        self._closed = False
        # the LoRA browser's generated previews: pending job id -> adapter sha256, and every preview
        # job id this server made (not counted as uses); the PNGs live in <data-dir>/previews
        self._previews: dict[str, str] = {}
        self._preview_jobs: set[str] = set()
        self._preview_urls: dict[str, tuple] = {}
        self._preview_lock = threading.Lock()
        self._load_preview_jobs()  # a restart keeps both: a queued preview job is recovered with the queue

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, *, timeout: float = 600.0) -> "Studio":
        """Start the worker and wait until it has loaded the model (raises if it cannot)."""
        self.supervisor.start(wait_ready=True, timeout=timeout)
        return self

    def stopping(self) -> None:
        """Shutdown has begun (Ctrl-C, SIGTERM): end every wait for a job now (503), so the HTTP
        server's graceful close does not have to cancel those requests."""
        self.queue.interrupt()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stopping()
            self.supervisor.stop()
            self.queue.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- jobs ------------------------------------------------------------------------------------
    def submit(self, kind: str, params: dict, adapters: list[dict] | None = None, preset: str | None = None,
               model: str | None = None) -> dict:
        """Queue a job; the returned dict is already a committed row. Raises StudioError subclasses."""
        job = self.queue.submit_many([self._checked(kind, params, adapters, preset, model)])[0]
        self.supervisor.wake()
        return job

    def submit_many(self, requests: list[dict]) -> list[dict]:
        """Queue several jobs (each {"kind", "params", "adapters", "preset", "model"}, as ``submit`` takes
        them) all or none: every one is checked first, then all are queued in one transaction, so a plot
        or a grid never sits half in the queue (a bad cell, or too little room, queues nothing)."""
        checked = [self._checked(r.get("kind", "generate"), r.get("params"), r.get("adapters"), r.get("preset"),
                                 r.get("model")) for r in requests]
        jobs = self.queue.submit_many(checked)
        self.supervisor.wake()
        return jobs

    def _checked(self, kind: str, params: dict, adapters: list[dict] | None, preset: str | None,
                 model: str | None) -> dict:
        """One request checked and resolved into the queue's row fields; raises what ``submit`` raises."""
        if not isinstance(params, dict):
            raise InvalidParameter("params must be an object of generation fields", param="params")
        if adapters is not None and not isinstance(adapters, list):
            raise InvalidParameter("'lora' must be an adapter object or a list of them", param="lora")
        if adapters and len(adapters) > self.limits.max_adapters:  # before resolving any of them
            check_request(self.limits, None, {}, {}, adapters)
        for key, value in params.items():
            check_text(key, "params")
            check_text(value, str(key))
        check_text(adapters, "lora")
        check_text(preset, "preset")
        if model is not None:
            model = self.check_model(model)
        if adapters and self.lora_backend == "distill":
            raise InvalidParameter(
                "this server runs --lora-backend distill: its LoRA is fused into the base at start, so "
                "per-request 'lora' is refused; start a peft server for per-request adapters", param="lora")
        if isinstance(params.get("prompt"), str) and "<lora:" in params["prompt"].lower():
            from .lora import prompt_tags  # <lora:NAME:WEIGHT> (A1111): into the stack, out of the text

            # the bounds first, on the text as sent: its length, then its tags with the request's adapters
            # against --max-adapters, before any tag is parsed or looked up (20,000 tags took a minute)
            check_request(self.limits, None, {}, {"prompt": params["prompt"]}, None)
            tags, listed = prompt_tags.count(params["prompt"]), len(adapters or [])
            if tags + listed > self.limits.max_adapters:
                raise InvalidParameter(
                    f"'prompt' has {tags} <lora:> tags" + (f" and 'lora' lists {listed} adapters" if listed else "")
                    + f"; this server takes at most {self.limits.max_adapters} adapters per request "
                      "(--max-adapters)", param="prompt")
            text, tagged = prompt_tags.split(params["prompt"])
            for a in tagged:  # unknown names refused by name, before anything is queued
                self.resolver.by_name(a["name"])
            params = {**params, "prompt": text}
            adapters = prompt_tags.merge(adapters, tagged)
        if preset is not None and preset != self.current_preset():
            raise InvalidParameter(f"preset {preset!r} is not the one applied now "
                                   f"({self.current_preset() or 'none'}); apply it first", param="preset")
        params = self._check_params(params, model, adapters)
        resolved = [a.as_dict() for a in self.resolver.resolve(adapters)]
        return {"kind": kind, "model": model or self.current_model(), "params": params, "adapters": resolved,
                "preset": self.current_preset()}

    def _check_params(self, params: dict, model: str | None, adapters: list | None = None) -> dict:
        """Reject what the loaded model's spec refuses now (an HTTP 400), before the job is queued."""
        from .params import FIELDS, IMAGE_FIELDS, check_field

        params = {k: v for k, v in params.items() if v is not None}
        if "lora_mode" in params:  # per request: merge or unfused (backend/lora/policy.py; the worker pops it)
            from .lora.policy import check_mode

            check_mode(params["lora_mode"])
        current = model is None or model == self.current_model()
        spec = (self.supervisor.info or {}).get("spec") if current else _static_spec(model, self.data_dir)
        if spec and current:
            unknown = sorted(k for k in params if k not in spec["fields"] and k != "lora_mode")
            if unknown:
                raise InvalidParameter(
                    f"unknown field {unknown[0]!r} for {spec['pipeline']}; accepted fields: "
                    f"{', '.join(spec['fields'])}", param=unknown[0])
        if "image" in params and not isinstance(params["image"], str):
            raise InvalidParameter("'image' must be a path to an image file", param="image")
        for name, value in params.items():  # types and ranges now (400), not in the worker (a failed job)
            if name in FIELDS and name not in IMAGE_FIELDS and name != "references":
                check_field(name, value)
        preset = self.current_preset() if current else None
        if preset:  # the fused preset's sampling contract (steps, CFG) by name, before the job is queued
            from .presets import get_preset

            try:
                contract = get_preset(preset)
            except StudioError:  # a preset fused from files no longer listed: the worker's check stands
                contract = None
            if contract is not None:
                contract.check(params)
        if spec:  # the pipeline's size multiple and frame rule too (a 100-pixel height failed in the worker)
            from .families import spec_for
            from .params import check_shape

            try:
                shape = spec_for(spec["pipeline"])
            except StudioError:  # a pipeline no family lists: the worker's own checks stand
                shape = None
            if shape is not None:
                check_shape(shape, params)
        check_request(self.limits, (spec or {}).get("pipeline"), (spec or {}).get("defaults") or {}, params,
                      adapters)
        return params

    def job(self, job_id: str) -> dict:
        return self.queue.get(job_id)

    def job_preview(self, job_id: str) -> dict | None:
        """The latest live preview of a running job: {"step", "png"} (PNG bytes, at most 128 px a side),
        or None (not running, not yet a second into its run, or a model without previews)."""
        self.queue.get(job_id)  # an unknown id is refused (404) like every other job route
        return self.supervisor.preview(job_id)

    def jobs(self, limit: int = 100, status: str | None = None) -> list[dict]:
        return self.queue.list(limit=limit, status=status)

    def active_jobs(self, kinds: tuple[str, ...] | None = ("generate",)) -> list[dict]:
        """Running and queued jobs (running first, then by queue position), optionally of some kinds:
        what a page opened mid-job (a reload, a second tab, another device) re-attaches to."""
        jobs = self.queue.list(limit=1000, status="running") + \
            sorted(self.queue.list(limit=1000, status="queued"), key=lambda j: j.get("queue_position") or 0)
        return [j for j in jobs if kinds is None or j.get("kind") in kinds]

    def library_signature(self) -> str:
        """A cheap fingerprint of the adapter library (names, sizes and times of the files in its roots,
        the names registered by API): it changes when an adapter is imported, deleted or registered,
        so a page can refresh its lists without reading every file."""
        import hashlib

        h = hashlib.sha1()
        for root in self.resolver.roots:
            try:
                entries = sorted(root.iterdir())
            except OSError:
                continue
            for p in entries:
                try:
                    st = p.stat()
                except OSError:
                    continue
                h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        h.update(repr(sorted(self.resolver.registered().items())).encode())
        h.update(str(self.current_model()).encode())
        self._collect_previews()  # a finished preview job's PNG is written now, so the cards redraw
        with self._preview_lock:
            h.update(repr(sorted(self._previews.values())).encode())
        try:
            h.update(repr(sorted((p.name, p.stat().st_mtime_ns) for p in settings.previews_dir(self.data_dir)
                                 .glob("*.png"))).encode())
        except OSError:
            pass
        return h.hexdigest()

    def cancel(self, job_id: str) -> dict:
        job, running = self.queue.cancel(job_id)
        if running:
            self.supervisor.cancel_running(job_id)
        return job

    def wait(self, job_id: str, timeout: float | None = None) -> dict:
        return self.queue.wait(job_id, timeout)

    async def wait_async(self, job_id: str, timeout: float | None = None) -> dict:
        """``wait`` from an event loop (HTTP handlers, Gradio events): no thread held while it waits."""
        return await self.queue.wait_async(job_id, timeout)

    def run(self, kind: str, params: dict, adapters=None, preset=None, model=None,
            timeout: float | None = None) -> dict:
        """submit + wait: the finished job dict (or the unfinished one after ``timeout``)."""
        return self.wait(self.submit(kind, params, adapters, preset, model)["id"], timeout)

    # -- models ----------------------------------------------------------------------------------
    def current_model(self) -> str:
        supervisor = getattr(self, "supervisor", None)  # None while the constructor runs
        return ((supervisor.info if supervisor is not None else None) or {}).get("model") or self.model

    def seconds_per_step(self) -> float | None:
        """The worker's recent pace (what an ETA is computed from before a job's first step)."""
        return (self.supervisor.info or {}).get("seconds_per_step")

    def current_preset(self) -> str | None:
        info = self.supervisor.info or {}
        return info.get("preset") if "preset" in info else self.preset

    def models(self) -> list[dict]:
        from .demo import DEMO_MODELS

        info = self.supervisor.info or {}
        loaded = self.current_model()
        ids = list(dict.fromkeys([loaded, self.model, *DEMO_MODELS]))
        out = []
        for model_id in ids:
            entry = {"id": model_id, "loaded": model_id == loaded}
            spec = info.get("spec") if model_id == loaded else _static_spec(model_id, self.data_dir)
            if spec:
                entry.update(spec)
            out.append(entry)
        return out

    def check_model(self, model_id) -> str:
        """The one rule for every ``model`` a client names (UI, gradio_client, /v1, switch): the
        demo ids, the model the server started with, the one loaded now, and Hugging Face repo ids
        already in the local cache. Anything else, local paths included, gets the same error,
        which says nothing about the file system."""
        from .demo import DEMO_MODELS

        if isinstance(model_id, str):
            model_id = model_id.strip()
            if model_id in DEMO_MODELS or model_id in (self.model, self.current_model()) or _cached_repo(model_id):
                return model_id
        shown = repr(model_id[:100]) if isinstance(model_id, str) else type(model_id).__name__
        raise ModelNotFound(f"model {shown} is not served here; choose one of: "
                            f"{', '.join(dict.fromkeys([self.current_model(), self.model, *DEMO_MODELS]))} "
                            "(or a Hugging Face repo id in this server's cache)", param="model")

    def switch_model(self, model_id: str) -> dict:
        model_id = self.check_model(model_id)
        job = self.queue.submit("load_model", model=model_id, params={}, preset=None)
        self.supervisor.wake()
        return job

    # -- adapters --------------------------------------------------------------------------------
    def adapters(self) -> list[dict]:
        """The library, each with its fit for the loaded model; adapters loaded by API name are marked."""
        rows = _library_rows(self.current_model(), self.resolver.adapter_dirs, self.data_dir)
        registered = self.resolver.registered()
        by_path = {v: k for k, v in registered.items()}
        cache = (self.supervisor.info or {}).get("lora_cache") or {}
        pinned = set(cache.get("pinned") or [])
        for row in rows:
            row["fit"] = {"ok": bool(row.get("fits")), "summary": row.get("fit", "")}
            row["registered_as"] = by_path.get(os.path.realpath(row["path"]))
            row["pinned"] = row["name"] in pinned
        return rows

    def adapter_cards(self) -> list[dict]:
        """The LoRA browser's cards: one plain dict per library row, with what its safetensors header
        says (title, trigger words, a description, an embedded thumbnail, all bounded: backend/lora/cards.py), the
        base-model family (the publisher's hint, else the loaded model's when the adapter fits it, else
        one its name says: ``family_source`` is metadata, fit or name),
        and whether it can be used here and why not. Headers only, cached by (path, mtime, size)."""
        from .lora import cards

        model = self.current_model()
        model_family = cards.family_of(model)
        self._collect_previews()
        with self._preview_lock:
            pending = set(self._previews.values())
        out = []
        for row in self.adapters():
            card = cards.header_card(row["path"]) if row.get("usable") else {**cards.card_info({}), "mtime": 0.0}
            sha = row.get("sha256") or ""
            thumb, made = card["thumbnail"], None
            if not thumb and row.get("usable"):
                thumb = self._preview_url(sha)
                made = "generated" if thumb else None
            fits = bool(row["fit"]["ok"])
            hint = row.get("base_model") or card["base_model"]
            # the family: the publisher's hint, else the loaded model's when it fits, else the file's name
            family, source = cards.family_of(hint), "metadata"
            if family is None and fits:
                family, source = cards.family_of(model), "fit"
            if family is None:
                family, source = cards.family_of(row["name"]), "name"
            out.append({"name": row["name"], "format": row["format"], "rank": row["rank"], "alpha": row["alpha"],
                        "size": row["size"], "size_bytes": row["size_bytes"], "mtime": card["mtime"],
                        "usable": bool(row.get("usable")), "error": row.get("error"), "fits": fits,
                        "fit": row["fit"]["summary"], "model": model, "model_family": model_family,
                        "family": family,
                        "family_source": source if family else None,
                        "base_model": cards.clean_text(hint or ""), "title": card["title"],
                        "description": card["description"], "triggers": card["triggers"], "thumbnail": thumb, "thumbnail_source": made or
                        ("file" if thumb else None), "preview_pending": bool(sha) and sha in pending,
                        "thumbnail_note": card["thumbnail_note"], "pinned": row.get("pinned", False),
                        "demo": bool(row.get("demo"))})
        return out

    def adapter_use_counts(self) -> dict[str, int]:
        """How many succeeded jobs used each adapter (by name, from the job rows' adapters): the LoRA
        browser's "most used" sort. Preview jobs (``make_preview``) made by this server are not uses."""
        counts: dict[str, int] = {}
        with self._preview_lock:
            previews = set(self._preview_jobs)
        for job in self.queue.list(limit=1_000_000, status="succeeded"):
            if job["id"] in previews:
                continue
            for name in {a.get("name") for a in job.get("adapters") or [] if isinstance(a, dict)}:
                if isinstance(name, str) and name:
                    counts[name] = counts.get(name, 0) + 1
        return counts

    def make_preview(self, name: str) -> dict:
        """Queue one small job that previews an adapter for the LoRA browser: the adapter at scale
        1.0, 4 steps, seed 0, the loaded model's smallest sensible size (its default, the short side
        at most ``PREVIEW_SIDE``), the prompt its first trigger word (else its name). When it has
        succeeded its image is written (as a 256 px thumbnail) to ``<data-dir>/previews/<sha256>.png``
        and shown on the adapter's card (``adapter_cards``). Returns the job (an adapter whose
        preview is already being made returns that job)."""
        from .lora import cards

        row = next((r for r in self.adapters() if r["name"] == name), None) if isinstance(name, str) else None
        if row is None:
            raise AdapterNotFound(f"no adapter named {str(name)[:100]!r} in the library", param="name")
        if not row.get("usable") or not row["fit"]["ok"]:
            raise InvalidParameter(f"{name} does not fit the loaded model ({self.current_model()}); previews "
                                   "are made with the loaded model", param="name")
        sha = row.get("sha256") or ""
        if not _SHA256.fullmatch(sha):
            raise InvalidParameter(f"{name}: no checksum to name its preview by", param="name")
        with self._preview_lock:
            for job_id, pending in self._previews.items():
                if pending == sha:
                    return self.job(job_id)
        triggers = cards.header_card(row["path"])["triggers"]
        prompt = next((t for t in triggers if "<lora:" not in t.lower()), "")
        if not prompt.strip():
            prompt = name if "<lora:" not in name.lower() else "a picture"
        spec = (self.supervisor.info or {}).get("spec") or _static_spec(self.current_model(), self.data_dir) or {}
        job = self.submit("generate", _preview_params(spec, prompt), [{"name": name, "scale": 1.0}])
        with self._preview_lock:
            self._previews[job["id"]] = sha
            self._preview_jobs.add(job["id"])
            self._save_preview_jobs()
        return job

    def _preview_jobs_file(self) -> Path:
        return settings.previews_dir(self.data_dir) / "jobs.json"

    def _load_preview_jobs(self) -> None:
        """The preview jobs an earlier run of this server made (``<data-dir>/previews/jobs.json``)."""
        try:
            saved = json.loads(self._preview_jobs_file().read_text())
            pending, made = dict(saved.get("pending") or {}), list(saved.get("made") or [])
        except (OSError, ValueError, TypeError, AttributeError):
            return  # none yet, or unreadable: previews are a convenience, the server starts anyway
        self._previews = {str(k): str(v) for k, v in pending.items() if _SHA256.fullmatch(str(v))}
        self._preview_jobs = {str(j) for j in made}

    def _save_preview_jobs(self) -> None:
        """Written under ``_preview_lock`` whenever the pending set changes (atomic)."""
        from .outputs import _atomic_write

        data = json.dumps({"pending": self._previews, "made": sorted(self._preview_jobs)})
        try:
            _atomic_write(self._preview_jobs_file(), lambda tmp: Path(tmp).write_text(data))
        except OSError as exc:  # a full disk: the preview is still made while this server runs
            log.warning("could not record preview jobs in %s: %s", self._preview_jobs_file(), exc)

    def _collect_previews(self) -> None:
        """Write the thumbnails of preview jobs that have succeeded; forget those that ended otherwise."""
        with self._preview_lock:
            pending = dict(self._previews)
        for job_id, sha in pending.items():
            try:
                job = self.job(job_id)
            except StudioError:
                job = {"status": "failed"}
            if job["status"] not in FINISHED:
                continue
            if job["status"] == "succeeded":
                try:
                    self._write_preview(job_id, sha)
                except Exception:  # noqa: BLE001 - the card keeps its "make preview" button
                    pass
            with self._preview_lock:
                self._previews.pop(job_id, None)
                self._save_preview_jobs()

    def _write_preview(self, job_id: str, sha: str) -> None:
        from PIL import Image

        from .outputs import _atomic_write

        src = self.result_image(job_id)["path"]
        with Image.open(src) as im:
            thumb = im.convert("RGB")
        thumb.thumbnail((PREVIEW_THUMB, PREVIEW_THUMB))
        _atomic_write(settings.previews_dir(self.data_dir) / f"{sha}.png",
                      lambda tmp: thumb.save(tmp, format="PNG"))

    def _preview_url(self, sha: str) -> str | None:
        """The generated preview of the adapter with this sha256 as a PNG data URL (None if none)."""
        import base64

        if not _SHA256.fullmatch(sha or ""):
            return None
        path = settings.previews_dir(self.data_dir) / f"{sha}.png"
        try:
            st = path.stat()
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        hit = self._preview_urls.get(sha)
        if hit and hit[0] == stamp:
            return hit[1]
        if st.st_size > 4 << 20:
            return None
        url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
        if len(self._preview_urls) > 4000:
            self._preview_urls.clear()
        self._preview_urls[sha] = (stamp, url)
        return url

    def adapter_detail(self, name: str) -> dict:
        for row in self.adapters():
            if row["name"] == name:
                return row
        raise AdapterNotFound(f"no adapter named {name!r} in the library", param="name")

    def import_adapter(self, src, name: str | None = None) -> dict:
        """Copy an adapter into <data-dir>/adapters (the library root we own).

        ``src`` is one file (a .safetensors) or a list of files: one file imports as itself, a PEFT
        folder's ``adapter_config.json`` + ``adapter_model.safetensors`` as a folder named ``name``.
        The name is checked first (``check_adapter_name``: a plain file name), then the files are
        staged in ``<root>/.staging/``, checked like any library file, and moved into place; the
        staging folder is removed whatever happens. Nothing is written anywhere else."""
        from .jobs.adapters import check_adapter_name

        srcs = [Path(src)] if isinstance(src, (str, os.PathLike)) else [Path(p) for p in src]
        if not srcs:
            raise InvalidParameter("choose a file to import", param="path")
        if name is None or not str(name).strip():
            name = (srcs[0].name if srcs[0].is_dir() else srcs[0].stem) if len(srcs) == 1 else srcs[0].parent.name
        name = check_adapter_name(name, "name")
        for p in srcs:
            if not p.is_file() and not (len(srcs) == 1 and p.is_dir()):
                raise AdapterNotFound(f"{p.name}: no such file to import", param="path")
        if len(srcs) == 1 and srcs[0].is_dir():  # a PEFT folder given as one path (not from the UI)
            srcs = sorted(srcs[0].iterdir())
            folder = True
        else:
            folder = len(srcs) > 1
        allowed = {PEFT_FILES[0], PEFT_FILES[1]}
        if folder and sorted(p.name for p in srcs) != sorted(allowed):
            raise InvalidParameter(f"a PEFT folder imports as exactly {' + '.join(PEFT_FILES)}; got "
                                   f"{', '.join(sorted(p.name for p in srcs))[:200]}", param="path")
        root = self.resolver.roots[0]
        target = root / name if folder else root / f"{name}{srcs[0].suffix.lower()}"
        if os.path.lexists(target):
            raise InvalidParameter(f"an adapter named {name!r} already exists in the library", param="name")
        root.mkdir(parents=True, exist_ok=True)
        (root / ".staging").mkdir(exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix="import-", dir=root / ".staging"))
        try:
            staged = stage / target.name
            if folder:
                staged.mkdir()
                for p in srcs:
                    shutil.copyfile(p, staged / p.name)
            else:
                shutil.copyfile(srcs[0], staged)
            from .lora.formats import inspect

            try:
                inspect(staged, name)
            except StudioError as exc:  # named by the file the user chose, not the staging copy's path
                raise exc.replacing(str(staged), name if folder else srcs[0].name) from None
            if os.path.lexists(target):
                raise InvalidParameter(f"an adapter named {name!r} already exists in the library", param="name")
            os.rename(staged, target)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return self.adapter_detail(name)

    def delete_adapter(self, name: str) -> dict:
        row = self.adapter_detail(name)
        path = Path(os.path.realpath(row["path"]))
        if not path.is_relative_to(self.resolver.roots[0]):
            raise PathNotAllowed(f"{path} is not in {self.resolver.roots[0]}; only adapters imported into the "
                                 "library can be deleted here", param="name")
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.supervisor.control({"op": "unload_adapter", "name": name})
        return {"name": name, "deleted": str(path)}

    def pin(self, name: str, pinned: bool = True) -> dict:
        """Keep an adapter in the worker's CPU cache (never evicted) or let it go again.
        Pins live as long as the worker process (a restarted worker starts unpinned)."""
        path = self.resolver.by_name(name)
        self.supervisor.control({"op": "pin", "name": name, "path": str(path),
                                 "int_id": self.resolver.int_id(path), "pinned": bool(pinned)})
        return {"name": name, "pinned": bool(pinned)}

    def load_adapter(self, name: str, path: str) -> dict:
        """vLLM's /v1/load_lora_adapter: register ``name`` for ``path`` (path rules apply)."""
        return self.resolver.register(name, path).as_dict()

    def unload_adapter(self, name: str) -> dict:
        self.resolver.unregister(name)
        self.supervisor.control({"op": "unload_adapter", "name": name})
        return {"name": name, "unloaded": True}

    def loaded_adapters(self) -> list[dict]:
        cache = (self.supervisor.info or {}).get("lora_cache") or {}
        tiers = cache.get("tiers") or {}
        resident = set((tiers.get("cpu") or {}).get("adapters") or [])
        return [{"name": n, "path": p, "int_id": self.resolver.int_id(Path(p)), "resident": n in resident}
                for n, p in sorted(self.resolver.registered().items())]

    # -- observability ---------------------------------------------------------------------------
    def system(self) -> dict:
        info = dict(self.supervisor.info or {})
        counts = self.queue.counts()
        sup = self.supervisor
        return {
            "model": info.get("model") or self.model, "pipeline": info.get("pipeline"),
            "device": info.get("device"), "dtype": info.get("dtype"), "lora_backend": self.lora_backend,
            "preset": self.preset, "fused": info.get("fused"), "memory": info.get("memory") or {},
            "quantization": info.get("quantization"),
            "cache": _cache_summary(info.get("lora_cache")), "lora_cache": info.get("lora_cache"),
            "pristine": (info.get("lora_cache") or {}).get("pristine"),
            "queue_depth": counts["queued"], "jobs": counts, "max_queue": self.queue.max_queue,
            "scheduler": self.queue.scheduler_stats(), "seconds_per_step": info.get("seconds_per_step"),
            "worker": {"pid": sup.pid, "ready": sup.ready, "restarts": sup.restarts, "deaths": sup.deaths[-10:],
                       "running": sup.current["id"] if sup.current else None},
            "recovered_at_start": self.recovered, "uptime_s": round(time.time() - self.started_at, 1),
            "versions": _versions(), "data_dir": str(self.data_dir),
            "adapter_roots": [str(r) for r in self.resolver.roots],
        }

    def outputs_dir(self) -> str:
        """Where result files are written (the UI lets Gradio serve files from here only)."""
        return str(settings.outputs_dir(self.data_dir))

    def outputs(self, limit: int = 50, offset: int = 0, *, model: str | None = None,
                adapter: str | None = None) -> list[dict]:
        """Finished results, newest first (path, metadata, prompt, model, adapter names), from the job
        rows whose file still exists; ``offset``/``limit`` page through them, ``model`` and ``adapter``
        keep those made with that model / with that adapter in the stack."""
        if limit < 0 or offset < 0:
            raise InvalidParameter(f"limit and offset must be >= 0, got {limit} and {offset}", param="offset")
        out = []
        for item in self._outputs():
            if model and item["model"] != model or adapter and adapter not in item["adapters"]:
                continue
            out.append(item)
            if len(out) >= offset + limit:
                break
        return out[offset:offset + limit]

    def output_facets(self) -> dict:
        """What the gallery can filter on: the models and adapters its results were made with, and
        how many results there are."""
        models, adapters, total = {}, {}, 0
        for item in self._outputs():
            total += 1
            models[item["model"]] = None
            for name in item["adapters"]:
                adapters[name] = None
        return {"models": sorted(m for m in models if m), "adapters": sorted(adapters), "total": total}

    def _outputs(self):
        for job in self.queue.list(limit=1_000_000, status="succeeded"):
            result = job.get("result") or {}
            path = result.get("path")
            if not path or not Path(path).exists():
                continue
            meta = result.get("metadata") or {}
            adapters = [a.get("name") for a in (meta.get("adapters") or job.get("adapters") or [])
                        if isinstance(a, dict) and a.get("name")]
            yield {"path": path, "metadata": meta, "job": job["id"], "model": meta.get("model") or job.get("model"),
                   "prompt": (meta.get("params") or {}).get("prompt") or (job.get("params") or {}).get("prompt") or "",
                   "seed": meta.get("seed"), "adapters": adapters}

    def delete_output(self, path: str) -> dict:
        """Remove a result file and its JSON sidecar (only files in the outputs folder)."""
        from .outputs import SUFFIXES

        root = Path(os.path.realpath(settings.outputs_dir(self.data_dir)))
        target = Path(os.path.realpath(str(path)))
        if not target.is_relative_to(root) or target.suffix.lower() not in SUFFIXES:
            raise PathNotAllowed(f"{Path(str(path)).name} is not a result in the outputs folder; only those can "
                                 "be deleted here", param="path")
        if not target.is_file():
            raise InvalidParameter(f"{target.name}: no such output (deleted already?)", param="path")
        removed = [str(target)]
        target.unlink()
        sidecar = target.with_suffix(target.suffix + ".json")
        if sidecar.is_file():
            sidecar.unlink()
            removed.append(str(sidecar))
        return {"deleted": removed}

    def result_image(self, job_id: str) -> dict:
        """A finished job's result as one image file (what "send to image-to-video" takes): the image
        itself, or a video's last frame, written once as ``<outputs>/frames/<name>-last.png``.
        Returns {"path", "seed", "video"}."""
        job = self.job(job_id)
        result = job.get("result") or {}
        path = result.get("path")
        if job.get("status") != "succeeded" or not path or not Path(path).exists():
            raise InvalidParameter(f"job {job_id} has no result to send (status {job.get('status')})",
                                   param="job_id")
        seed = (result.get("metadata") or {}).get("seed", (job.get("params") or {}).get("seed"))
        if Path(path).suffix.lower() != ".mp4":
            return {"path": str(path), "seed": seed, "video": False}
        frame = settings.outputs_dir(self.data_dir) / "frames" / f"{Path(path).stem}-last.png"
        if not frame.exists():
            import imageio.v3 as iio
            from PIL import Image

            from .outputs import _atomic_write

            last = None
            for last in iio.imiter(path, plugin="FFMPEG"):
                pass
            if last is None:
                raise InvalidParameter(f"{Path(path).name} has no frames", param="job_id")
            _atomic_write(frame, lambda tmp: Image.fromarray(last).convert("RGB").save(tmp, format="PNG"))
        return {"path": str(frame), "seed": seed, "video": True}

    def png_info(self, path) -> dict | None:
        """The generation settings an image carries: ours, A1111's ``parameters`` or ComfyUI's
        ``prompt``/``workflow`` (backend/pnginfo.py); None when it carries none."""
        from .pnginfo import read_info

        return read_info(path)

    def save_plot(self, image, sidecar: dict) -> dict:
        """An X/Y/Z plot (a PIL image, assembled by the UI) as ``<outputs>/plots/xyz-<time>-<id>.png``
        with the cells in a PNG text chunk and a JSON sidecar beside it; returns both paths."""
        import json
        import uuid

        from .outputs import _atomic_write

        folder = settings.outputs_dir(self.data_dir) / "plots"
        path = folder / f"xyz-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.png"
        text = json.dumps(sidecar, indent=2, default=str)

        def write_png(tmp):
            from PIL.PngImagePlugin import PngInfo

            info = PngInfo()
            info.add_text("lora_studio_plot", text)
            image.save(tmp, format="PNG", pnginfo=info)

        _atomic_write(path, write_png)
        side = path.with_suffix(".png.json")
        _atomic_write(side, lambda tmp: Path(tmp).write_text(text))
        return {"path": str(path), "sidecar": str(side)}

    # -- presets (distill) -----------------------------------------------------------------------
    def presets(self) -> list[dict]:
        from . import presets as preset_mod

        return preset_mod.list_presets(data_dir=self.data_dir, adapter_dirs=self.resolver.adapter_dirs)

    def apply_preset(self, preset_id: str, timeout: float | None = 600.0) -> dict:
        """Fuse a preset into the loaded model (a queued job, so it never lands mid-generation)."""
        if not isinstance(preset_id, str) or not preset_id.strip():
            raise InvalidParameter("preset must be a preset id (see presets())", param="preset")
        return self._state_job("apply_preset", {"preset": preset_id}, timeout)

    def restore_base(self, timeout: float | None = 600.0) -> dict:
        """Back to the exact base weights (no reload)."""
        return self._state_job("restore_base", {}, timeout)

    def _state_job(self, kind: str, params: dict, timeout) -> dict:
        job = self.queue.submit(kind, model=self.current_model(), params=params, preset=None)
        self.supervisor.wake()
        job = self.wait(job["id"], timeout)
        if job["status"] in ("failed", "cancelled"):
            raise job_error(job)
        return job["result"] or {}


def job_error(job: dict) -> StudioError:
    """The StudioError a failed or cancelled job stands for (same status, type and param)."""
    from .errors import Cancelled

    if job["status"] == "cancelled":
        return Cancelled(f"job {job['id']} was cancelled", param="job_id")
    detail = {"status": 500, "type": "server_error", **(job.get("error_detail") or {})}  # a row with none: 500
    return StudioError.from_wire(detail, message=job.get("error") or "the job failed")


PREVIEW_SIDE = 512  # a generated preview's short side at most (the model's default if smaller)
PREVIEW_THUMB = 256  # the cached preview PNG's longest side at most
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _preview_params(spec: dict, prompt: str) -> dict:
    """A preview job's fields for a model spec: 4 steps, seed 0, the smallest sensible size (and
    one frame where the spec has a 4k+1 frame rule). Refused for a model that needs an input image."""
    from .families import spec_for

    fields, defaults = set(spec.get("fields") or ()), spec.get("defaults") or {}
    try:
        shape = spec_for(spec["pipeline"])
    except Exception:  # noqa: BLE001 - an unknown pipeline: the usual multiple, no frame rule
        shape = None
    if shape is not None and "image" in shape.required:
        raise InvalidParameter(f"{spec.get('pipeline')} needs an input image; previews are made with "
                               "text-to-image or text-to-video models", param="name")
    m = shape.size_multiple if shape is not None else 16
    params = {"prompt": prompt, "seed": 0, "num_inference_steps": 4}
    h, w = defaults.get("height"), defaults.get("width")
    if isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0:
        k = min(1.0, PREVIEW_SIDE / min(h, w))
        params["height"], params["width"] = (max(m, int(v * k) // m * m) for v in (h, w))
    if "num_frames" in fields and shape is not None and shape.frame_multiple:
        params["num_frames"] = 1  # k * frame_multiple + 1 with k = 0 (Wan); others keep their default
    return {k: v for k, v in params.items() if k == "prompt" or k in fields}


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


def _library_rows(model, adapter_dirs, data_dir) -> list[dict]:
    from .lora import list_adapters

    return list_adapters(model, adapter_dirs, data_dir)


_SPECS: dict[str, dict] = {}
_SPECS_LOCK = threading.Lock()


def _static_spec(model_id: str, data_dir) -> dict | None:
    """A model's spec from its directory's model_index.json (no weights loaded)."""
    from . import demo

    if demo.is_demo(model_id) and not (settings.models_dir(data_dir) / model_id.replace(":", "-")
                                       / ".demo-build").exists():
        return None  # not built yet: the worker builds it when someone switches to it
    with _SPECS_LOCK:
        if model_id not in _SPECS:
            from .models import resolve_model

            try:
                _SPECS[model_id] = resolve_model(model_id, data_dir).spec_info()
            except StudioError:
                return None
        return _SPECS[model_id]


def _cache_summary(stats: dict | None) -> dict:
    if not stats:
        return {}
    tiers = stats.get("tiers") or {}
    out = {}
    for tier, t in tiers.items():
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


__all__ = ["Studio", "FINISHED", "DEFAULT_MODEL", "job_error"]

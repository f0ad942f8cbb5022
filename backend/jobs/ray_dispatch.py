"""The Ray dispatcher: the Supervisor's counterpart for ``--engine ray``.

It feeds jobs from the same JobQueue (``claim`` decides the order, exactly as for the local
worker) to a ``backend.engines.ray_engine.RayEngine`` and records what comes back in the job
row. Up to one job per replica is in flight; each in-flight job has a thread that reads its
events (progress -> the row, the outcome -> the result file and the row). The result file is
written here, on the head, with ``backend.outputs.save_result`` (atomic) before the row is
marked succeeded, as the local worker does.

State-changing jobs (BARRIER_KINDS) wait until every in-flight job has finished. ``load_model``
only changes the model new jobs are tagged with: replicas load it on demand (Ray Serve routes a
job by its model + adapters). Distill presets are per deployment: ``--preset`` /
``--lora-backend distill --lora-path`` are resolved here, on the head, into a ``DistillPlan``
that every replica fuses at start; ``apply_preset`` / ``restore_base`` at run time succeed only
when they ask for what the deployment already runs, and otherwise name the flag to restart with
(docs/scaling.md says why). ``--lora-path`` under the PEFT backend becomes a ``PreloadPlan``: every
replica pins those adapters for the start model, as the local worker does.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

from ..errors import InvalidParameter, ServerError, StudioError, Timeout, WorkerStartError
from .queue import BARRIER_KINDS, JobQueue, group_key
from .worker import WorkerConfig

log = logging.getLogger("lora_studio.jobs")


class RayDispatcher:
    """Same surface as Supervisor (what backend.service.Studio uses)."""

    def __init__(self, queue: JobQueue, config: WorkerConfig, engine_config, *, job_timeout: float = 0.0):
        self.queue, self.config, self.engine_config = queue, config, engine_config
        self.job_timeout = job_timeout  # --job-timeout: a job running longer is cancelled on its replica, failed
        self._started: dict[str, float] = {}  # job id -> when it was handed to a replica (monotonic)
        self._timed_out: set[str] = set()
        self.previews: dict[str, dict] = {}  # job id -> its latest live preview, while it runs
        self.engine = None
        self.plan = None  # the deployment's DistillPlan (None: replicas serve the plain base)
        self.preload = None  # the deployment's PreloadPlan: --lora-path adapters every replica pins
        self.info: dict = {}
        self.fatal: str | None = None
        self.restarts = 0  # nothing to restart here: Ray Serve replaces dead replicas itself
        self.deaths: list[dict] = []
        self._runs: dict[str, object] = {}  # job id -> RayJob, the in-flight jobs
        self._jobs: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._group: str | None = None
        self._step_times: list[float] = []
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, *, wait_ready: bool = True, timeout: float = 600.0) -> None:
        """Start the Ray engine here, in the caller's thread: Ray ties its driver state (signal
        handlers, shutdown) to the thread that called ``ray.init``. ``wait_ready`` and ``timeout``
        are accepted for Supervisor's signature; Ray's own start-up timeouts bound this call."""
        from ..engines.ray_engine import DistillPlan, PreloadPlan, RayEngine

        cfg = self.config
        try:
            if cfg.preset or (cfg.lora_backend == "distill" and cfg.lora_paths):
                self.plan = DistillPlan.resolve(cfg.model, preset=cfg.preset, lora_paths=cfg.lora_paths,
                                                lora_scale=cfg.lora_scale, data_dir=cfg.data_dir,
                                                adapter_dirs=cfg.adapter_dirs)
            if cfg.lora_backend == "peft" and cfg.lora_paths:
                self.preload = PreloadPlan.resolve(cfg.model, cfg.lora_paths)
            self.engine_config = dataclasses.replace(self.engine_config, lora_backend=cfg.lora_backend,
                                                     distill=self.plan, preload=self.preload)
            self._set_model(cfg.model)
            self.engine = RayEngine(self.engine_config).start()
        except Exception as exc:
            self.fatal = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            self.stop()
            raise WorkerStartError(f"the Ray engine could not start: {self.fatal}", param="engine") from exc
        self.info["replicas"] = self.engine_config.replicas
        self._ready.set()
        self._thread = threading.Thread(target=self._loop, name="lora-studio-ray-dispatcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake()
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def pid(self) -> None:
        return None  # no local worker process: the replicas are Ray actors

    @property
    def current(self) -> dict | None:
        """One running job (the oldest in flight), as Supervisor.current."""
        with self._lock:
            return next(iter(self._jobs.values()), None)

    def wake(self) -> None:
        self._wake.set()

    def preview(self, job_id: str) -> dict | None:
        """The latest live preview a replica sent for a running job ({"step", "png"}), or None."""
        return self.previews.get(str(job_id))

    def cancel_running(self, job_id: str) -> None:
        with self._lock:
            run = self._runs.get(job_id)
        if run is not None:
            run.cancel()

    def control(self, msg: dict) -> None:
        # Replicas load an adapter per job from its path (checked by sha256) and free it when their
        # slot is evicted; a deleted or unregistered adapter is simply never asked for again.
        log.info("ray engine: control %r ignored: replicas manage adapter residency per job",
                 msg.get("op"))

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._dispatch()
                self._enforce_timeout()
            except Exception:  # never let the dispatcher die: log and go on
                log.exception("ray dispatcher error")
                time.sleep(0.5)
            self._wake.wait(1.0)
            self._wake.clear()

    def _enforce_timeout(self) -> None:
        """--job-timeout, as the local supervisor enforces it: a job that has run longer is cancelled on
        its replica (Serve cancels the request; the replica stops at its next step) and failed (504)."""
        if not self.job_timeout:
            return
        now = time.monotonic()
        with self._lock:
            over = [(job_id, run) for job_id, run in self._runs.items()
                    if job_id not in self._timed_out and now - self._started.get(job_id, now) > self.job_timeout]
            self._timed_out.update(job_id for job_id, _ in over)
        for job_id, run in over:
            log.warning("job %s ran over --job-timeout %g s on a replica: stopping it", job_id, self.job_timeout)
            run.cancel()

    def _timeout_reason(self, job_id: str) -> str:
        ran = time.monotonic() - self._started.get(job_id, time.monotonic())
        return f"stopped after running {ran:.0f} s, over this server's --job-timeout of {self.job_timeout:g} s"

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if len(self._runs) >= max(1, self.engine_config.replicas):
                    return
            job = self.queue.claim(self._group)
            if job is None:
                return
            if job["kind"] in BARRIER_KINDS:
                self._drain()
                self._barrier(job)
                continue
            self._group = group_key(job["model"], job["adapters"], job["preset"])
            self._submit(job)

    def _submit(self, job: dict) -> None:
        try:
            run = self.engine.submit({"id": job["id"], "model": job["model"] or self.info["model"],
                                      "params": job["params"], "adapters": job["adapters"]})
        except StudioError as exc:
            self._fail(job["id"], exc)
            return
        with self._lock:
            self._runs[job["id"]], self._jobs[job["id"]] = run, job
            self._started[job["id"]] = time.monotonic()
        if self.queue.cancel_requested(job["id"]):  # cancelled between claim and submit
            run.cancel()
        threading.Thread(target=self._follow, args=(job, run), name=f"ray-job-{job['id']}", daemon=True).start()

    def _follow(self, job: dict, run) -> None:
        from ..engines.ray_engine import Outcome, Preview

        job_id = job["id"]
        last = time.perf_counter()
        try:
            for event in run.events():
                if isinstance(event, Preview):
                    self.previews[job_id] = {"step": event.step, "png": event.png}
                elif not isinstance(event, Outcome):
                    now = time.perf_counter()
                    self._step_times = (self._step_times + [now - last])[-200:]
                    last = now
                    self.queue.progress(job_id, event.step, event.total)
                elif event.status == "succeeded":
                    self._succeed(job_id, event.result)
                elif event.status == "cancelled" and job_id in self._timed_out \
                        and not self.queue.cancel_requested(job_id):
                    self.queue.fail(job_id, Timeout(self._timeout_reason(job_id), param="job_timeout"))
                elif event.status == "cancelled" and self._stop.is_set() and not self.queue.cancel_requested(job_id):
                    pass  # stopped by the shutdown, not a user: the row stays 'running', re-queued at the next start
                elif event.status == "cancelled":
                    self.queue.finish(job_id, "cancelled", error="cancelled while running")
                else:
                    self._fail(job_id, event.error)
        except Exception as exc:  # e.g. the result file could not be written
            log.exception("ray job %s", job_id)
            self._fail(job_id, exc)
        finally:
            with self._lock:
                self._runs.pop(job_id, None)
                self._jobs.pop(job_id, None)
                self._started.pop(job_id, None)
                self._timed_out.discard(job_id)
                self.previews.pop(job_id, None)
            if self._step_times:
                self.info["seconds_per_step"] = sum(self._step_times) / len(self._step_times)
            self.wake()

    def _succeed(self, job_id: str, result) -> None:
        from ..outputs import save_result

        result.metadata["job_id"] = job_id  # metadata["engine"] names the replica that ran it
        result.metadata["job_number"] = self.queue.get(job_id).get("number")  # the output's name may use it
        self.info.update(device=result.metadata.get("device") or self.info.get("device"),  # what replicas run
                         dtype=result.metadata.get("dtype") or self.info.get("dtype"))
        fused, distill = self.info.get("fused") or {}, result.metadata.get("distill")
        if distill and fused.get("state") == "fused":  # what the replicas computed after fusing
            self.info["fused"] = {**fused, "checksums": distill["checksums"],
                                  "base_checksums": distill["base_checksums"]}
        path = save_result(result, data_dir=self.config.data_dir)
        self.queue.finish(job_id, "succeeded", result={"path": str(path), "metadata": result.metadata})

    def _fail(self, job_id: str, exc: BaseException) -> None:
        self.queue.fail(job_id, exc if isinstance(exc, StudioError) else ServerError(f"{type(exc).__name__}: {exc}"))

    def _drain(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self._runs:
                    return
            self._wake.wait(0.2)
            self._wake.clear()

    def _barrier(self, job: dict) -> None:
        try:
            if job["kind"] == "load_model":
                self._set_model(job["model"])
                result = {"model": job["model"]}
            elif job["kind"] in ("apply_preset", "restore_base"):
                result = self._preset_state(job["params"].get("preset") if job["kind"] == "apply_preset" else None)
            else:
                raise InvalidParameter(f"job kind {job['kind']!r} is not supported by the Ray engine", param="kind")
        except StudioError as exc:
            self._fail(job["id"], exc)
            return
        self._group = None
        self.queue.finish(job["id"], "succeeded", result=result)

    def _preset_state(self, wanted: str | None) -> dict:
        """apply_preset(wanted) / restore_base() (wanted None). Presets are per deployment: every
        replica fused the same files in its constructor, and one replica switching alone would
        make a job's output depend on where it ran; so a run-time switch is refused, naming the
        flag to restart with, and asking for what the deployment already runs answers like the
        local worker does."""
        from ..presets import get_preset

        fused = self.info["fused"]
        running = fused.get("preset") if fused.get("state") == "fused" else None
        if wanted is None and fused.get("state") != "fused":
            return {"preset": None, "defaults": {}, "fused": fused}
        if wanted is not None and wanted == running:
            return {"preset": wanted, "defaults": dict(get_preset(wanted).defaults), "fused": fused}
        now = (f"preset {running}" if running else "distill files " +
               ", ".join(f["path"] for f in fused["files"])) if fused.get("state") == "fused" else "the base weights"
        if wanted is None:
            raise InvalidParameter(f"restore_base is not available with --engine ray: distill presets are per "
                                   f"deployment and every replica runs {now}; restart the server without --preset "
                                   f"/ --lora-backend distill to serve the base", param="preset")
        raise InvalidParameter(f"apply_preset is not available with --engine ray: distill presets are per "
                               f"deployment (every replica fuses the same files at start) and this one runs "
                               f"{now}; restart the server with --preset {wanted}", param="preset")

    def _set_model(self, model_id: str) -> None:
        """What the local worker reports about its model, read from the model's directory (on the
        head, which also builds a demo model once here rather than in every replica)."""
        from ..models import resolve_model

        resolved = resolve_model(model_id, self.config.data_dir)
        cfg = self.engine_config
        # replicas fuse the plan into its model only, as the local worker does for its start model
        plan = self.plan if self.plan is not None and self.plan.model == model_id else None
        self.info.update({
            "model": model_id, "preset": plan.preset if plan else None,
            "fused": plan.state() if plan else {"state": "base", "preset": None},
            # as the local worker's: the --lora-path adapters are pinned for the start model only
            "lora_cache": self.preload.state() if self.preload is not None and self.preload.model == model_id
            else None,
            "pipeline": resolved.class_name, "device": cfg.device or ("cuda" if cfg.gpus_per_replica else "cpu"),
            "dtype": cfg.dtype, "lora_backend": self.config.lora_backend, "engine": "ray",
            "spec": resolved.spec_info()})

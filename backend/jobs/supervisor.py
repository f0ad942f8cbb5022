"""The supervisor: starts the worker process, feeds it jobs from the queue, records
what comes back, and restarts it when it dies.

One thread does all of it, waiting on the worker's pipe, its process sentinel and a
wake-up pipe (poked on submit/cancel), so the order of events is never ambiguous.
If the worker dies mid-job (segfault, OOM kill, ``kill -9``) that job is marked failed
with the reason, a new worker is started and the queue continues.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import time
from multiprocessing.connection import wait

from ..errors import ServerError, StudioError, Timeout, WorkerStartError
from . import worker as worker_mod
from .prefetch import hints_for
from .queue import BARRIER_KINDS, JobQueue, group_key

log = logging.getLogger("lora_studio.jobs")

RESTART_BACKOFF_S = (0.2, 1.0, 2.0, 5.0, 10.0)
# --job-timeout: a job is stopped at its next step; one that does not stop this much later (a step
# or a model load that never ends) has its worker killed, and the worker is restarted
TIMEOUT_KILL_GRACE_S = 60.0


class Supervisor:
    def __init__(self, queue: JobQueue, config: worker_mod.RuntimeConfig, *, job_timeout: float = 0.0):
        self.queue, self.config = queue, config
        self.job_timeout = float(job_timeout or 0.0)  # seconds a job may run; 0: no limit
        self._job_started = 0.0  # monotonic time the current job was sent
        self._timed_out: str | None = None  # the job stopped for running past job_timeout
        self._start_config = config
        self._ctx = mp.get_context("spawn")
        self._cancel = self._ctx.Event()
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._controls: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.proc = None
        self.conn = None
        self._hints = None  # the prefetch hint pipe to the worker (backend/jobs/prefetch.py)
        self._hinted = None
        self.current: dict | None = None  # the job the worker is running (the first of a batch)
        self.running: dict[str, dict] = {}  # every job of the current dispatch (several: a mixed-adapter batch)
        self._batched = False  # the current dispatch is a batch ({"op": "batch"})
        # the latest live preview of each running job: {"step", "png"} (backend/preview.py), in memory only:
        # it is gone when the job ends (the result replaces it)
        self.previews: dict[str, dict] = {}
        self._member_cancels: list[str] = []  # jobs of the running batch to cancel one by one
        self.group: str | None = None  # what the worker has set up (queue.group_key)
        self.info: dict = {}  # the worker's last report (model, spec, cache, memory)
        self.fatal: str | None = None
        self.restarts = 0
        self.deaths: list[dict] = []
        self._failures_in_a_row = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, *, wait_ready: bool = True, timeout: float = 600.0) -> None:
        self._spawn()
        self._thread = threading.Thread(target=self._loop, name="lora-studio-supervisor", daemon=True)
        self._thread.start()
        if wait_ready:
            deadline = time.monotonic() + timeout
            while not self._ready.wait(0.1):
                if self.fatal:
                    self.stop()
                    raise WorkerStartError(f"the worker could not start: {self.fatal}", param="model")
                if time.monotonic() > deadline:
                    self.stop()
                    raise WorkerStartError(f"the worker did not become ready within {timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        proc, conn = self.proc, self.conn
        if proc is not None and proc.is_alive():
            if self.current is not None:
                # No one records its outcome now: stop it at the next step so the worker exits
                # cleanly; its row stays 'running' and recover() re-queues it at the next start.
                self._cancel.set()
            try:
                conn.send({"op": "stop"})
            except (OSError, ValueError):
                pass
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"!")
        except (OSError, ValueError):
            pass

    def preview(self, job_id: str) -> dict | None:
        """The latest live preview of a running job ({"step", "png"}), or None."""
        return self.previews.get(str(job_id))

    def cancel_running(self, job_id: str) -> None:
        if self._batched:  # one job of a batch: the others go on (one already finished: nothing to stop)
            if job_id in self.running:
                with self._lock:
                    self._member_cancels.append(job_id)
                self.wake()
            return
        if self.current is not None and self.current["id"] == job_id:
            self._cancel.set()

    def control(self, msg: dict) -> None:
        """Send a message to the worker between jobs (e.g. drop an adapter from its cache)."""
        with self._lock:
            self._controls.append(msg)
        if msg.get("op") == "pin":  # reported at once, even while a job holds the worker
            cache = dict((self.info or {}).get("lora_cache") or {})
            pinned = set(cache.get("pinned") or [])
            (pinned.add if msg.get("pinned") else pinned.discard)(msg.get("name"))
            cache["pinned"] = sorted(pinned)
            self.info = {**(self.info or {}), "lora_cache": cache}
        self.wake()

    # -- the loop --------------------------------------------------------------------------------
    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        hints_r, hints_w = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=worker_mod.main, args=(child, self._cancel, self.config, hints_r),
                                 name="lora-studio-worker", daemon=True)
        proc.start()
        child.close()
        hints_r.close()
        if self._hints is not None:
            self._hints.close()
        self.proc, self.conn, self._hints, self._hinted = proc, parent, hints_w, None
        self._ready.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # never let the supervisor die: log and go on
                log.exception("supervisor error")
                time.sleep(0.5)

    def _tick(self) -> None:
        if not self.proc.is_alive():
            self._on_death()
            return
        if self._ready.is_set() and self.current is None:
            self._dispatch()
        if self.current is not None:
            self._send_hints()
            self._send_member_cancels()
        ready = wait([self.conn, self.proc.sentinel, self._wake_r], timeout=1.0)
        if self._wake_r in ready:
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
        if self.conn in ready:
            try:
                while self.conn.poll():
                    self._on_message(self.conn.recv())
            except (EOFError, OSError):
                pass  # the sentinel reports the death on the next tick
        self._enforce_timeout()

    def _enforce_timeout(self) -> None:
        job = self.current
        if job is None or not self.job_timeout:
            return
        ran = time.monotonic() - self._job_started
        if ran > self.job_timeout and self._timed_out != job["id"]:
            log.warning("job %s ran %.0f s, over --job-timeout %g s: stopping it", job["id"], ran, self.job_timeout)
            self._timed_out = job["id"]
            self._cancel.set()
        elif ran > self.job_timeout + TIMEOUT_KILL_GRACE_S and self._timed_out == job["id"] and self.proc.is_alive():
            log.warning("job %s did not stop within %.0f s of its timeout: killing the worker", job["id"],
                        TIMEOUT_KILL_GRACE_S)
            self.proc.kill()  # the sentinel reports it; _on_death fails the job with the timeout reason

    def _timeout_reason(self) -> str:
        return (f"stopped after running {time.monotonic() - self._job_started:.0f} s, over this server's "
                f"--job-timeout of {self.job_timeout:g} s")

    def _dispatch(self) -> None:
        with self._lock:
            controls, self._controls = self._controls, []
        for msg in controls:
            self.conn.send(msg)
        job = self.queue.claim(self.group)
        if job is None:
            return
        jobs = [job] + self._batch_with(job)
        self._cancel.clear()
        self.current, self.running, self._batched = job, {j["id"]: j for j in jobs}, len(jobs) > 1
        self._job_started, self._timed_out = time.monotonic(), None
        # the merge-or-unfused policy shares a merge among the queued jobs with the same setup
        for j in jobs:
            j["queued_same"] = self.queue.count_queued(group_key(j["model"], j["adapters"], j["preset"]))
        if self._batched:
            self.conn.send({"op": "batch", "jobs": jobs})
            for j in jobs:  # cancelled between claim and send
                if self.queue.cancel_requested(j["id"]):
                    self.cancel_running(j["id"])
            return
        self.conn.send({"op": "job", "job": job})
        if self.queue.cancel_requested(job["id"]):  # cancelled between claim and send
            self._cancel.set()

    def _batch_with(self, job: dict) -> list[dict]:
        """--max-batch N (or the job's own ``batch_size``, the larger): up to N-1 more queued jobs that may
        share one batched call with ``job`` (backend/batch.py: same model, preset and request but prompt, seed
        and adapters; a ``batch_size`` is part of the request, so only jobs asking the same join it)."""
        asked = (job.get("params") or {}).get("batch_size") or 1
        size = max(int(getattr(self.config, "max_batch", 1) or 1), int(asked))
        if size < 2 or job["kind"] != "generate":
            return []
        from ..batch import compatible_key

        key = compatible_key(job["model"], job["preset"], job["params"])
        return [] if key is None else self.queue.claim_compatible(compatible_key, key, size - 1)

    def _send_member_cancels(self) -> None:
        with self._lock:
            ids, self._member_cancels = self._member_cancels, []
        for job_id in ids:
            try:
                self.conn.send({"op": "cancel", "id": job_id})
            except (OSError, ValueError):
                pass

    def _send_hints(self) -> None:
        """Tell the worker's prefetch thread the adapters of the next queued jobs, when that list changed."""
        if self._hints is None or self.config.lora_prefetch <= 0 or self.config.lora_backend != "peft":
            return
        upcoming = hints_for(self.queue, self.config.lora_prefetch, (self.info or {}).get("model"))
        if not upcoming or upcoming == self._hinted:
            return
        try:
            self._hints.send({"upcoming": upcoming})
            self._hinted = upcoming
        except (OSError, ValueError):
            pass

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            self.info = msg[1]
            self.group = group_key(self.info.get("model"), [], self.info.get("preset"))
            self.fatal = None
            self._ready.set()
        elif kind == "info":  # the worker's state changed between jobs (a pin, an unload)
            self.info = msg[1]
        elif kind == "fatal":
            self.fatal = msg[1]
        elif kind == "progress":
            self.queue.progress(msg[1], msg[2], msg[3])
        elif kind == "preview":
            if msg[1] in self.running:
                self.previews[msg[1]] = {"step": msg[2], "png": msg[3]}
        elif kind in ("done", "failed", "cancelled"):
            job_id, info = msg[1], msg[-1]
            self.previews.pop(job_id, None)
            self.info = info
            if kind == "done":
                self.queue.finish(job_id, "succeeded", result=msg[2])
            elif kind == "failed":
                self.queue.fail(job_id, StudioError.from_wire(msg[2]))
            elif self._timed_out is not None and self._timed_out == (self.current or {}).get("id") \
                    and not self.queue.cancel_requested(job_id):
                self.queue.fail(job_id, Timeout(self._timeout_reason(), param="job_timeout"))
            else:
                self.queue.finish(job_id, "cancelled", error="cancelled while running")
            finished = self.running.pop(job_id, None) or self.current
            if not self.running:  # the dispatch (one job, or every job of a batch) is over
                job = self.current
                if job is not None and finished is not None:
                    batched = ((msg[2] or {}).get("metadata") or {}).get("batch", {}).get("size", 1) > 1 \
                        if kind == "done" else self._batched
                    # a batched call leaves nothing merged (its hooks are off); one by one, the last set is
                    self.group = group_key(info.get("model"), [] if batched else finished["adapters"],
                                           info.get("preset"))
                    if job["kind"] in BARRIER_KINDS:
                        self._remember_state(info)
                self.current, self._batched = None, False
            self._failures_in_a_row = 0

    def _on_death(self) -> None:
        # messages sent just before the death are still in the pipe: record them first
        try:
            while self.conn.poll():
                self._on_message(self.conn.recv())
        except (EOFError, OSError):
            pass
        code = self.proc.exitcode
        reason = _exit_reason(code)
        self.deaths.append({"at": time.time(), "exitcode": code, "reason": reason,
                            "job": self.current["id"] if self.current else None,
                            **({"batch": list(self.running)} if self._batched else {})})
        unfinished = list(self.running) or ([self.current["id"]] if self.current is not None else [])
        for job_id in unfinished:  # every job of the dispatch (a batch fails as one)
            if self.current is not None and self._timed_out == self.current["id"]:
                self.queue.fail(job_id, Timeout(f"{self._timeout_reason()}; it did not stop, so the worker "
                                                "was restarted", param="job_timeout"))
            else:
                self.queue.fail(job_id, ServerError(f"the worker process died ({reason}) while running "
                                                    "this job; it was restarted"))
        self.current, self.running, self._batched = None, {}, False
        self.previews.clear()
        self.group = None
        self.conn.close()
        if self._stop.is_set():
            return
        if self.fatal and not self._ready.is_set() and self.restarts == 0:
            self._stop.set()  # it never came up: start() reports self.fatal
            return
        delay = RESTART_BACKOFF_S[min(self._failures_in_a_row, len(RESTART_BACKOFF_S) - 1)]
        self._failures_in_a_row += 1
        log.warning("worker died (%s); restarting in %.1f s", reason, delay)
        self._stop.wait(delay)
        if not self._stop.is_set():
            self.restarts += 1
            self._spawn()


    def _remember_state(self, info: dict) -> None:
        """A restarted worker comes back with the model and preset the last one had switched to."""
        start = self._start_config
        model = info.get("model") or start.model
        self.config = start.model_copy(update={"model": model, "preset": info.get("preset"),
                                               "lora_paths": start.lora_paths if model == start.model else ()})


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "unknown exit"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

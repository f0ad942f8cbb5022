"""The worker process: the only holder of the PipelineManager (and so of the device).

It is started with multiprocessing's ``spawn`` (a fresh interpreter: no CUDA state or
locks inherited from the server) and talks to the supervisor over one Pipe:

    supervisor -> worker   {"op": "job", "job": {...}} | {"op": "unload_adapter", "name"}
                           | {"op": "pin", "name", "path", "int_id", "pinned"} | {"op": "stop"}
                           | {"op": "batch", "jobs": [...]} | {"op": "cancel", "id"} (one job of a batch)
    worker -> supervisor   ("ready", info) | ("progress", id, step, total) | ("preview", id, step, png)
                           | ("done", id, result, info) | ("failed", id, error, info)
                           | ("cancelled", id, info) | ("fatal", message)

A result file is written (atomically, fsynced) by ``backend.outputs`` before "done"
is sent, so the row is only marked succeeded once its file is durable. Cancel is a
shared Event the manager checks after every denoising step.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback

from backend.config import RuntimeConfig


#: What the worker is started with: the one start config (backend/config.py), pickled across ``spawn``.
WorkerConfig = RuntimeConfig


class _Worker:
    def __init__(self, conn, cancel, config: RuntimeConfig):
        from backend.manager import PipelineManager

        self.conn, self.cancel, self.config = conn, cancel, config
        self.manager = PipelineManager.from_config(config)
        self.engine = None
        self.preset: str | None = None
        self.step_times: list[float] = []
        self.prefetcher = None  # backend/jobs/prefetch.py: started by main() when the supervisor sends hints
        self._pending: list[dict] = []  # messages read while a batch ran (polled for its members' cancels)
        self._cancelled: set[str] = set()  # members of the running batch cancelled one by one

    # -- model state -----------------------------------------------------------------------------
    def load(self, model_id: str) -> None:
        """Load a model through the one start sequence; the server's start model also gets its
        start-time files / preset there (PipelineManager.start)."""
        self.engine, self.preset = None, None
        self.manager.start(self.config, model_id)
        self.engine = self.manager.lora_engine
        if self.config.for_model(model_id):
            self.preset = self.config.preset

    def set_preset(self, preset_id: str | None) -> dict:
        """Fuse a preset (or go back to base). The manager takes PEFT adapters off around it and
        the engine adopts the new weights as base, so later adapters merge on top of them."""
        manager = self.manager
        manager.restore_base()
        defaults = manager.apply_preset(preset_id, list(self.config.adapter_dirs)) if preset_id else {}
        self.preset = preset_id
        return {"preset": preset_id, "defaults": defaults, "fused": manager.fused_state()}

    def info(self) -> dict:
        import torch

        m = self.manager
        out = {"pid": os.getpid(), "model": m.model_id, "preset": self.preset,
               "fused": {**(m.fused_state() if hasattr(m, "fused_state") else {"state": "base"}),
                         "preset": self.preset}, "device": str(m.device),
               "dtype": str(m.dtype).replace("torch.", ""), "lora_backend": self.config.lora_backend,
               "quantization": m.quantized,
               "pipeline": m.spec.class_name if m.spec else None,
               "seconds_per_step": (sum(self.step_times) / len(self.step_times)) if self.step_times else None}
        if m.spec is not None:
            from backend.families import describe

            out["spec"] = describe(m.spec, m.defaults, m.denoisers())
        if self.engine is not None:
            out["lora_cache"] = self.engine.stats()
            if self.prefetcher is not None:
                out["lora_cache"]["prefetch"] = dict(self.prefetcher.stats)
        if m.device.type == "cuda":
            out["memory"] = {"allocated": torch.cuda.memory_allocated(m.device),
                             "reserved": torch.cuda.memory_reserved(m.device),
                             "max_allocated": torch.cuda.max_memory_allocated(m.device)}
        else:
            import psutil

            out["memory"] = {"rss": psutil.Process().memory_info().rss}
        return out

    # -- jobs ------------------------------------------------------------------------------------
    def run_job(self, job: dict, cancel=None) -> None:
        from backend.errors import Cancelled

        job_id = job["id"]
        try:
            result = self._execute(job, cancel)
        except Cancelled:
            self.conn.send(("cancelled", job_id, self.info()))
        except Exception as exc:  # the user's error, or a bug / library error: the job fails, the worker lives on
            self.conn.send(("failed", job_id, self._failure(exc), self.info()))
        else:
            self.conn.send(("done", job_id, result, self.info()))

    def _execute(self, job: dict, cancel=None) -> dict | None:
        kind = job["kind"]
        if job.get("model") and job["model"] != self.manager.model_id:
            self.load(job["model"])
        if kind == "load_model":
            return {"model": self.manager.model_id}
        if kind == "apply_preset":
            return self.set_preset(job["params"]["preset"])
        if kind == "restore_base":
            return self.set_preset(None)
        if kind != "generate":
            from backend.errors import StudioError

            raise StudioError(f"job kind {kind!r} is not supported by this worker", param="kind")
        return self._generate(job, cancel)

    def _generate(self, job: dict, cancel=None) -> dict:
        from backend.lora.request import LoRARequest
        from backend.outputs import save_result

        adapters = [(LoRARequest(a["name"], int(a["int_id"]), a["path"]), a.get("scale", 1.0))
                    for a in job.get("adapters") or []]
        started = time.perf_counter()
        last = [started]
        first_step: list[float] = []

        def on_step(step: int, total: int) -> None:
            now = time.perf_counter()
            if not first_step:
                first_step.append(now - started)
            self.step_times = (self.step_times + [now - last[0]])[-200:]
            last[0] = now
            self.conn.send(("progress", job["id"], step, total))

        reads = self._disk_reads({a[0].lora_int_id for a in adapters})  # waits for a read in flight
        result = self.manager.generate(dict(job["params"]), adapters=adapters, on_step=on_step,
                                       cancel=self.cancel if cancel is None else cancel,
                                       queued_same=int(job.get("queued_same") or 0),
                                       on_preview=self._previews([job["id"]]))
        result.metadata["job_id"], result.metadata["job_number"] = job["id"], job.get("number")
        if job.get("batch_decision"):  # formed as a batch, run alone by the cost model's choice
            result.metadata["batch"] = {"size": 1, "index": 0, "decision": job["batch_decision"]}
        if self.engine is not None:  # this job's own adapter reads from disk (0 when prefetch had them)
            result.metadata["lora_disk_reads"] = self._disk_reads(None) - reads
        if first_step:
            result.metadata["first_step_s"] = round(first_step[0], 4)
        path = save_result(result, data_dir=self.config.data_dir)
        return {"path": str(path), "metadata": result.metadata}

    # -- mixed-adapter batches (backend/batch.py) --------------------------------------------------
    def run_batch(self, jobs: list[dict]) -> None:
        """Compatible generate jobs (same model, preset and request but prompt, seed and adapters): one
        batched pipeline call when the cost model predicts it is faster, else one by one. Each job gets its
        own progress, result file, metadata (``batch``) and outcome message; a job cancelled mid-batch is
        reported cancelled at the next step and its sample dropped from the outputs (the others go on);
        when the batched call fails, each member runs again alone (a bad member fails only itself)."""
        from backend.errors import Cancelled

        self._cancelled = set()
        ids = [j["id"] for j in jobs]
        decision = self._batch_decision(jobs)
        if decision["mode"] != "batched":
            for job in jobs:
                if self._take_cancels(ids) and job["id"] in self._cancelled:
                    self.conn.send(("cancelled", job["id"], self.info()))
                    continue
                self.run_job({**job, "batch_decision": decision}, cancel=_MemberCancel(self, [job["id"]]))
            return
        reported: set[str] = set()

        def live() -> list[str]:
            return [i for i in ids if i not in self._cancelled]

        def cancel() -> bool:
            self._take_cancels(ids)
            for job_id in ids:  # each member cancelled is reported at once; its sample is dropped at the end
                if job_id in self._cancelled and job_id not in reported:
                    reported.add(job_id)
                    self.conn.send(("cancelled", job_id, self.info()))
            return self.cancel.is_set() or not live()

        try:
            results = self._batched(jobs, decision, cancel)
        except Cancelled:
            for job_id in ids:
                if job_id not in reported:
                    self.conn.send(("cancelled", job_id, self.info()))
            return
        except Exception as exc:
            # The batched call failed: which member caused it is unknown, and one client's request must not
            # fail another's (nor its error name another client's adapter). Each live member runs again
            # alone and gets its own outcome; the reason recorded says nothing of the others.
            print(f"lora-studio worker: a mixed-adapter batch of {len(ids)} jobs failed "
                  f"({getattr(exc, 'message', exc)}); each runs again alone", file=sys.stderr)
            alone = {"mode": "sequential", "reason": f"the batched call of {len(ids)} jobs failed; each job ran "
                                                     "alone"}
            for job in jobs:
                if job["id"] in reported:
                    continue
                if self._take_cancels(ids) and job["id"] in self._cancelled:
                    self.conn.send(("cancelled", job["id"], self.info()))
                    continue
                self.run_job({**job, "batch_decision": alone}, cancel=_MemberCancel(self, [job["id"]]))
            return
        cancel()
        for job, result in zip(jobs, results):
            if job["id"] in reported:
                continue
            try:
                path = self._save(result)
            except Exception as exc:
                self.conn.send(("failed", job["id"], self._failure(exc), self.info()))
            else:
                self.conn.send(("done", job["id"], {"path": str(path), "metadata": result.metadata}, self.info()))

    def _batch_decision(self, jobs: list[dict]) -> dict:
        if self.manager.minimax is not None:
            return {"mode": "sequential", "reason": f"{self.manager.model_id} has its own runtime"}
        if any(j.get("model") and j["model"] != self.manager.model_id for j in jobs):
            return {"mode": "sequential", "reason": "a model switch comes first"}
        if any(not isinstance(a.get("scale", 1.0), (int, float)) for j in jobs for a in j.get("adapters") or []):
            # a step schedule / block weights (backend/lora/schedule.py) runs on its own hooks, one request each
            return {"mode": "sequential", "reason": "a scheduled or per-block scale runs alone"}
        if self.engine is None:
            if any(j.get("adapters") for j in jobs):
                return {"mode": "sequential", "reason": "no LoRA engine (distill backend)"}
            return {"mode": "batched", "reason": "base model only"}
        try:
            sets = [self._adapters(j) for j in jobs]
            steps = self.manager.validate(dict(jobs[0]["params"])).get("num_inference_steps")
            return self.engine.unfused.decide_batch(sets, steps=steps)
        except Exception as exc:  # an adapter or a field is refused: each job alone reports its own error
            return {"mode": "sequential", "reason": f"checked one by one ({getattr(exc, 'message', exc)})"}

    @staticmethod
    def _adapters(job: dict) -> list:
        from backend.lora.request import LoRARequest

        return [(LoRARequest(a["name"], int(a["int_id"]), a["path"]), a.get("scale", 1.0))
                for a in job.get("adapters") or []]

    def _batched(self, jobs: list[dict], decision: dict, cancel) -> list:
        from backend.batch import generate_batch

        started = time.perf_counter()
        last, first_step = [started], []

        def on_step(step: int, total: int) -> None:
            now = time.perf_counter()
            if not first_step:
                first_step.append(now - started)
            last[0] = now
            for job in jobs:
                if job["id"] not in self._cancelled:
                    self.conn.send(("progress", job["id"], step, total))

        self._disk_reads({a[0].lora_int_id for j in jobs for a in self._adapters(j)})
        results = generate_batch(self.manager, [dict(j["params"]) for j in jobs], [self._adapters(j) for j in jobs],
                                 on_step=on_step, cancel=cancel,
                                 on_preview=self._previews([j["id"] for j in jobs],
                                                           skip=lambda job_id: job_id in self._cancelled))
        for job, result in zip(jobs, results):
            result.metadata["job_id"], result.metadata["job_number"] = job["id"], job.get("number")
            result.metadata["batch"] = {**result.metadata["batch"], "decision": decision}
            if first_step:
                result.metadata["first_step_s"] = round(first_step[0], 4)
        return results

    def _previews(self, job_ids: list[str], skip=lambda job_id: False):
        """Live previews of the running job(s) to the supervisor: ("preview", id, step, png); none when the
        Settings tab's "live previews" is off (read at the job's start: a stat while the file is unchanged)."""
        from backend import preferences
        from backend.preview import sender

        if not preferences.load(self.config.data_dir).live_previews:
            return None
        return sender(lambda job_id, step, data: self.conn.send(("preview", job_id, step, data)), job_ids, skip)

    def _save(self, result):
        from backend.outputs import save_result

        return save_result(result, data_dir=self.config.data_dir)

    def _failure(self, exc: Exception) -> dict:
        """The wire form of a job failure (``StudioError.to_wire``): the error itself, a full disk as 507
        (the operator's to fix, no traceback), anything else a ServerError naming the exception."""
        from backend.errors import ServerError, StorageFull, StudioError, storage_full

        if isinstance(exc, StudioError):
            return exc.to_wire()
        if storage_full(exc):
            return StorageFull(f"no room to write the output under {self.config.data_dir or 'the data dir'}"
                               f" ({exc.strerror})").to_wire()
        traceback.print_exc(file=sys.stderr)
        text = str(exc).strip().splitlines()
        return ServerError(f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")).to_wire()

    def _take_cancels(self, ids) -> bool:
        """Read the messages the supervisor sent while a batch runs: a member's cancel is noted; anything
        else waits for the serve loop. True when some member of ``ids`` is cancelled."""
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if msg.get("op") == "cancel":
                    self._cancelled.add(msg.get("id"))
                else:
                    self._pending.append(msg)
        except (EOFError, OSError):
            pass
        return any(i in self._cancelled for i in ids)

    def _disk_reads(self, protect) -> int:
        """Adapter files read from disk by jobs (not by prefetch) so far; ``protect``: the ids the
        coming job needs, which prefetch must not evict while it runs."""
        if self.engine is None:
            return 0
        pf = self.prefetcher
        if pf is None:
            return self.engine.counters["loads_from_disk"]
        with pf.busy:
            if protect is not None:
                pf.protect = frozenset(protect)
            return self.engine.counters["loads_from_disk"] - pf.disk_reads()

    def serve(self) -> None:
        while True:
            try:
                msg = self._pending.pop(0) if self._pending else self.conn.recv()
            except (EOFError, OSError):  # the supervisor is gone: nothing left to do
                return
            op = msg.get("op")
            if op == "stop":
                return
            if op == "job":
                self.run_job(msg["job"])
            elif op == "batch":
                self.run_batch(msg["jobs"])
            elif op in ("unload_adapter", "pin") and self.engine is not None:
                try:
                    self._cache_op(msg)
                except Exception as exc:  # not loaded / unreadable: nothing to change, say why in the log
                    print(f"lora-studio worker: {op} {msg.get('name')!r}: {exc}", file=sys.stderr)
                self.conn.send(("info", self.info()))  # the cache's new state (pins), reported at once

    def _cache_op(self, msg: dict) -> None:
        from backend.lora.request import LoRARequest

        if msg["op"] == "unload_adapter":
            self.engine.unload(msg["name"])
        elif msg["pinned"]:  # read it into the CPU tier now and keep it there
            self.engine.load(LoRARequest(msg["name"], int(msg["int_id"]), msg["path"]), pin=True)
        else:
            self.engine.unpin(int(msg["int_id"]))


class _MemberCancel:
    """``cancel`` for one job of a batch run one by one: the shared Event (timeout, stop) or its own cancel."""

    def __init__(self, worker: _Worker, ids: list[str]):
        self.worker, self.ids = worker, ids

    def is_set(self) -> bool:
        self.worker._take_cancels(self.ids)
        return self.worker.cancel.is_set() or all(i in self.worker._cancelled for i in self.ids)


def main(conn, cancel, config: RuntimeConfig, hints=None) -> None:
    """Process entry point (must be importable for ``spawn``)."""
    # A terminal's Ctrl-C reaches the whole process group. The server stops this worker itself
    # (Supervisor.stop); dying here mid-job would fail that job instead of leaving it queued.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(config.env)
    try:
        import torch

        if config.threads:
            torch.set_num_threads(config.threads)
        worker = _Worker(conn, cancel, config)
        worker.load(config.model)
        if hints is not None and config.lora_prefetch > 0 and config.lora_backend == "peft":
            from backend.jobs.prefetch import Prefetcher

            worker.prefetcher = Prefetcher(hints, lambda: worker.engine).start()
    except Exception as exc:
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        try:
            conn.send(("fatal", message))
        finally:
            sys.exit(3)
    conn.send(("ready", worker.info()))
    worker.serve()

"""The worker process: the only holder of the PipelineManager (and so of the device).

It is started with multiprocessing's ``spawn`` (a fresh interpreter: no CUDA state or
locks inherited from the server) and talks to the supervisor over one Pipe:

    supervisor -> worker   {"op": "job", "job": {...}} | {"op": "unload_adapter", "name"}
                           | {"op": "pin", "name", "path", "int_id", "pinned"} | {"op": "stop"}
    worker -> supervisor   ("ready", info) | ("progress", id, step, total)
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
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    data_dir: str | None = None
    device: str | None = None
    dtype: str | None = None
    lora_backend: str = "peft"
    lora_paths: tuple = ()
    lora_scale: float = 1.0
    preset: str | None = None
    max_loras: int = 4
    max_cpu_loras: int = 16
    adapter_dirs: tuple = ()
    offload: str = "none"  # MiniMax-H3: none | model | group (backend/minimax/offload.py)
    offload_stream: bool = False
    pristine: str = "auto"  # peft: where the originals of merged layers live (backend/lora/pristine.py)
    threads: int | None = None  # torch CPU threads (None: torch's default)
    env: dict = field(default_factory=dict)
    lora_mode: str | None = None  # auto | merge | unfused (None: auto on CUDA, merge on CPU)
    lora_prefetch: int = 2  # upcoming queued jobs whose adapters are read while a job runs (0: off)


class _Worker:
    def __init__(self, conn, cancel, config: WorkerConfig):
        from backend.manager import PipelineManager

        self.conn, self.cancel, self.config = conn, cancel, config
        self.manager = PipelineManager(device=config.device, dtype=config.dtype, data_dir=config.data_dir,
                                       offload=config.offload, offload_stream=config.offload_stream)
        self.engine = None
        self.preset: str | None = None
        self.step_times: list[float] = []
        self.prefetcher = None  # backend/jobs/prefetch.py: started by main() when the supervisor sends hints

    # -- model state -----------------------------------------------------------------------------
    def load(self, model_id: str) -> None:
        """Load a model; the server's start model also gets its fused files / preset."""
        self.manager.load(model_id)
        self.engine = None
        self.preset = None
        if model_id == self.config.model:
            if self.config.lora_backend == "distill" and self.config.lora_paths:
                self.manager.fuse(list(self.config.lora_paths), self.config.lora_scale)
            if self.config.preset:
                self.manager.apply_preset(self.config.preset, list(self.config.adapter_dirs))
                self.preset = self.config.preset
        self._attach_peft()

    def set_preset(self, preset_id: str | None) -> dict:
        """Fuse a preset (or go back to base). The manager takes PEFT adapters off around it and
        the engine adopts the new weights as base, so later adapters merge on top of them."""
        manager = self.manager
        manager.restore_base()
        defaults = manager.apply_preset(preset_id, list(self.config.adapter_dirs)) if preset_id else {}
        self.preset = preset_id
        return {"preset": preset_id, "defaults": defaults, "fused": manager.fused_state()}

    def _attach_peft(self) -> None:
        if self.config.lora_backend != "peft":
            return
        preload = self.config.lora_paths if self.manager.model_id == self.config.model else ()
        from backend.lora import attach

        self.engine = attach(self.manager, max_loras=self.config.max_loras,
                             max_cpu_loras=self.config.max_cpu_loras, preload=list(preload),
                             pristine=self.config.pristine, lora_mode=self.config.lora_mode)

    def info(self) -> dict:
        import torch

        m = self.manager
        out = {"pid": os.getpid(), "model": m.model_id, "preset": self.preset,
               "fused": {**(m.fused_state() if hasattr(m, "fused_state") else {"state": "base"}),
                         "preset": self.preset}, "device": str(m.device),
               "dtype": str(m.dtype).replace("torch.", ""), "lora_backend": self.config.lora_backend,
               "pipeline": m.spec.class_name if m.spec else None,
               "seconds_per_step": (sum(self.step_times) / len(self.step_times)) if self.step_times else None}
        if m.spec is not None:
            out["spec"] = {"pipeline": m.spec.class_name, "output": m.spec.output, "mode": m.spec.mode,
                           "fields": sorted(m.spec.fields), "denoisers": list(m.denoisers()),
                           "defaults": {**m.spec.defaults, **m.defaults}}
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
    def run_job(self, job: dict) -> None:
        from backend.errors import Cancelled, ServerError, StorageFull, StudioError, storage_full

        job_id = job["id"]
        try:
            result = self._execute(job)
        except Cancelled:
            self.conn.send(("cancelled", job_id, self.info()))
        except StudioError as exc:
            self.conn.send(("failed", job_id, exc.to_wire(), self.info()))
        except Exception as exc:  # a bug or a library error: the job fails, the worker lives on
            if storage_full(exc):  # a full disk is the operator's to fix, not a bug: 507, no traceback
                error = StorageFull(f"no room to write the output under {self.config.data_dir or 'the data dir'}"
                                    f" ({exc.strerror})")
            else:
                traceback.print_exc(file=sys.stderr)
                text = str(exc).strip().splitlines()
                error = ServerError(f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": "))
            self.conn.send(("failed", job_id, error.to_wire(), self.info()))
        else:
            self.conn.send(("done", job_id, result, self.info()))

    def _execute(self, job: dict) -> dict | None:
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
        return self._generate(job)

    def _generate(self, job: dict) -> dict:
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
        result = self.manager.generate(dict(job["params"]), adapters=adapters, on_step=on_step, cancel=self.cancel,
                                       queued_same=int(job.get("queued_same") or 0))
        result.metadata["job_id"] = job["id"]
        if self.engine is not None:  # this job's own adapter reads from disk (0 when prefetch had them)
            result.metadata["lora_disk_reads"] = self._disk_reads(None) - reads
        if first_step:
            result.metadata["first_step_s"] = round(first_step[0], 4)
        path = save_result(result, data_dir=self.config.data_dir)
        return {"path": str(path), "metadata": result.metadata}

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
                msg = self.conn.recv()
            except (EOFError, OSError):  # the supervisor is gone: nothing left to do
                return
            op = msg.get("op")
            if op == "stop":
                return
            if op == "job":
                self.run_job(msg["job"])
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


def main(conn, cancel, config: WorkerConfig, hints=None) -> None:
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

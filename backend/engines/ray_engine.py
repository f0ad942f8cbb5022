"""Ray Serve engine: the job queue's work carried by a pool of replicas, each owning one
``backend.manager.PipelineManager`` on its own device (the same code the local worker runs).

Routing is Ray Serve model multiplexing. A job's *slot key* names what must be resident to
run it (the model and its adapter set); the ingress forwards each job through a handle with
``multiplexed_model_id=<slot key>``, so Serve sends it to a replica that already holds that
slot. Each replica keeps ``slots_per_replica`` slots (``@serve.multiplexed`` LRU); when Serve
evicts one, the slot's adapters are freed on the device.

The driver-side API (what the server's dispatcher calls), a drop-in for the local worker::

    engine = RayEngine(RayEngineConfig(replicas=2)); engine.start()
    run = engine.submit({"id": "j1", "model": "demo:sd3.5", "params": {...}, "adapters": [...]})
    for event in run.events():       # Progress(step, total, replica) / Preview(step, png, replica) ..., then one Outcome
        ...
    run.cancel()                     # from any thread; the replica stops at the next step
    engine.stop()
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import ray
from ray import serve

from .. import digest, errors
from ..errors import AdapterError, AdapterNotFound, Cancelled, InvalidParameter, StudioError
from ..lora.request import LoRARequest

from ..lora import PRELOAD_ID_BASE

APP_NAME = "lora-studio"
REPO_ROOT = Path(__file__).resolve().parents[2]


# -- jobs and their slot keys --------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterRef:
    """One adapter a job names, with the sha256 every node checks its own copy against."""

    name: str
    path: str
    sha256: str
    scale: Any = 1.0  # float, or {"transformer": s, "transformer_2": s2}
    int_id: int = 1

    def request(self) -> LoRARequest:
        return LoRARequest(lora_name=self.name, lora_int_id=self.int_id, lora_path=self.path)


@dataclass(frozen=True)
class Job:
    id: str
    model: str
    params: dict
    adapters: tuple[AdapterRef, ...] = ()

    @property
    def slot_key(self) -> str:
        """The multiplex key: model + the set of adapters (by content) that must be resident.
        Scales are not part of it: they apply per request to an already resident adapter."""
        names = ",".join(f"{a.name}@{a.sha256[:16]}" for a in sorted(self.adapters, key=lambda a: a.name))
        return f"{self.model}|{names}"

    @classmethod
    def from_dict(cls, job: dict) -> "Job":
        """A job row (as the queue stores it) -> Job; hashes adapter files that carry no sha256."""
        for name in ("id", "model"):
            if not job.get(name):
                raise InvalidParameter(f"job is missing {name!r}", param=name)
        refs = []
        for i, a in enumerate(job.get("adapters") or []):
            if not a.get("name") or not a.get("path"):
                raise InvalidParameter(f"adapters[{i}] needs 'name' and 'path'", param=f"adapters[{i}]")
            sha = a.get("sha256") or adapter_sha256(a["path"])
            # No int_id given: derive it from the content, so one adapter has one id on every replica.
            refs.append(AdapterRef(name=a["name"], path=str(a["path"]), sha256=sha, scale=a.get("scale", 1.0),
                                   int_id=int(a.get("int_id") or digest.lora_int_id(sha))))
        return cls(id=str(job["id"]), model=job["model"], params=dict(job.get("params") or {}),
                   adapters=tuple(refs))

    def to_dict(self) -> dict:
        """What travels to the replica: adapters carry the head's sha256, never recomputed there."""
        return {"id": self.id, "model": self.model, "params": self.params,
                "adapters": [dataclasses.asdict(a) for a in self.adapters]}


@dataclass(frozen=True)
class DistillPlan:
    """What every replica of a deployment fuses into ``model`` before it serves (``--preset`` or
    ``--lora-backend distill --lora-path``). Resolved and hashed once, on the head; each replica
    checks its node's copy of each file against that sha256 (as it does for per-request
    adapters), then fuses through the manager, the same code the local worker runs."""

    model: str
    files: tuple[AdapterRef, ...]  # in denoiser order (high noise first on Wan2.2), each with its scale
    preset: str | None = None  # None: plain --lora-path files (a preset still applies if they match by name)
    components: tuple[str, ...] = ()  # the denoiser each file goes into

    @classmethod
    def resolve(cls, model: str, *, preset: str | None = None, lora_paths=(), lora_scale: float = 1.0,
                data_dir=None, adapter_dirs=()) -> "DistillPlan":
        """Find and check the files as the local worker would (a preset wins over plain paths,
        as there), so a wrong preset, count, order or missing file stops the server at start."""
        from .. import presets
        from ..distill.support import plan as route
        from ..models import resolve_model

        resolved = resolve_model(model, data_dir)
        spec = resolved.family.spec(resolved.class_name)
        if preset:
            found = presets.get_preset(preset)
            found.fits(model, spec.class_name)
            paths = presets.resolve_files(found, model, data_dir, list(adapter_dirs))
            scales = [f.scale for f in found.files]
        else:
            paths, scales = [Path(p).expanduser() for p in lora_paths], lora_scale
        if spec.class_name == "MiniMaxH3ModularPipeline":  # its runtime binds each file by its keys, at start
            files = tuple(AdapterRef(name=p.name, path=str(p.absolute()), sha256=adapter_sha256(p), scale=scales)
                          for p in paths)
            return cls(model=model, files=files, preset=None, components=tuple("" for _ in files))
        # a denoiser the checkpoint leaves out (Wan2.1 has no transformer_2) takes no file
        routed = route(spec.class_name, list(resolved.denoisers), paths, scales)
        # absolute (replicas run in another cwd), but not resolved: a Hugging Face cache link's
        # name is what routes it (high/low noise) and what metadata shows
        files = tuple(AdapterRef(name=a.path.name, path=str(a.path.absolute()), sha256=adapter_sha256(a.path),
                                 scale=a.scale) for a in routed)
        return cls(model=model, files=files, preset=preset or None,
                   components=tuple(a.component for a in routed))

    def to_dict(self) -> dict:
        return {"model": self.model, "preset": self.preset, "components": list(self.components),
                "files": [dataclasses.asdict(f) for f in self.files]}

    @classmethod
    def from_dict(cls, d: dict) -> "DistillPlan":
        return cls(model=d["model"], preset=d.get("preset"), components=tuple(d.get("components") or ()),
                   files=tuple(AdapterRef(**f) for f in d["files"]))

    def state(self) -> dict:
        """What the server reports before a replica has answered: the deployment's fused files."""
        return {"state": "fused", "scope": "deployment", "preset": self.preset,
                "files": [{"path": f.path, "component": c, "scale": f.scale, "sha256": f.sha256}
                          for f, c in zip(self.files, self.components)]}


@dataclass(frozen=True)
class PreloadPlan:
    """The ``--lora-path`` adapters (``--lora-backend peft``) every replica pre-loads and pins for
    ``model``, as the local worker does. Hashed once, on the head; each replica checks its node's
    copy against that sha256 (``AdapterHost.verify``) before the PEFT engine reads it."""

    model: str
    adapters: tuple[AdapterRef, ...]

    @classmethod
    def resolve(cls, model: str, lora_paths) -> "PreloadPlan":
        refs = []
        for i, raw in enumerate(lora_paths):
            p = Path(raw).expanduser()
            if not p.exists():  # stop the server here, before Ray starts
                raise AdapterNotFound(f"--lora-path {raw}: no such file or folder", param="lora_path")
            # the name and id backend.lora.attach gives a pre-loaded adapter, so requests and
            # system() see the same ones as with the local worker
            refs.append(AdapterRef(name=p.name if p.is_dir() else p.stem, path=str(p.absolute()),
                                   sha256=adapter_sha256(p), int_id=PRELOAD_ID_BASE + i))
        return cls(model=model, adapters=tuple(refs))

    def to_dict(self) -> dict:
        return {"model": self.model, "adapters": [dataclasses.asdict(a) for a in self.adapters]}

    @classmethod
    def from_dict(cls, d: dict) -> "PreloadPlan":
        return cls(model=d["model"], adapters=tuple(AdapterRef(**a) for a in d["adapters"]))

    def state(self) -> dict:
        """The server's ``lora_cache`` for this model: pinned on every replica (start fails otherwise)."""
        return {"scope": "deployment", "pinned": sorted(a.name for a in self.adapters),
                "preloaded": [{"name": a.name, "path": a.path, "sha256": a.sha256} for a in self.adapters]}


def adapter_sha256(path: str | os.PathLike) -> str:
    """sha256 of an adapter (``backend.digest.adapter_sha256``); a missing one is an AdapterError."""
    if not Path(path).exists():
        raise AdapterError(f"adapter path {path} does not exist", param="path")
    return digest.adapter_sha256(path)


# -- driver-side events ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Progress:
    step: int
    total: int
    replica: str


@dataclass
class Preview:
    """A live preview of the running job (backend/preview.py): a small PNG of its latents at ``step``."""
    step: int
    png: bytes
    replica: str


@dataclass
class Outcome:
    status: str  # "succeeded" | "failed" | "cancelled"
    result: Any = None  # backend.manager.GenerationResult when succeeded
    error: StudioError | None = None
    replica: str | None = None


# -- the replica: one PipelineManager, a multiplexed LRU of slots --------------------------------------
class _Slot:
    """What one slot key keeps resident on a replica. Serve calls ``__del__`` on eviction."""

    def __init__(self, host: "AdapterHost", model: str, adapters: tuple[AdapterRef, ...]):
        self.host, self.model, self.adapters = host, model, adapters
        self.released = False

    def __del__(self):
        if not self.released:
            self.released = True
            self.host.release(self.adapters)


class AdapterHost:
    """Makes adapters resident on a replica's manager and frees them again; the one place that
    talks to the PEFT engine. Verifies each node's copy of an adapter by sha256 before use.
    Slots can share an adapter, so residency is reference-counted per adapter id."""

    def __init__(self, manager, counts: dict):
        self.manager, self.counts = manager, counts
        self._hashes: dict[tuple, str] = {}
        self._refs: dict[int, int] = {}

    def model_loaded(self) -> None:
        """A (re)loaded model (``PipelineManager.start``) starts with a fresh PEFT engine (MiniMax-H3's too,
        through its family hooks), or none (distill): count what its pre-load read from disk."""
        self._refs.clear()
        engine = self.manager.lora_engine
        if engine is not None:
            self.counts["adapter_loads"] += engine.counters["loads_from_disk"]

    def verify(self, ref: AdapterRef, what: str = "adapter", wanted_by: str = "the job") -> None:
        p = Path(ref.path)
        node = ray.get_runtime_context().get_node_id()[:12]
        if not p.exists():
            raise AdapterError(f"{what} {ref.name!r}: {p} is missing on node {node} "
                               "(mount the adapter library on every node or copy it there)", param="path")
        stat = p.stat()
        key = (str(p), stat.st_mtime_ns, stat.st_size)
        if key not in self._hashes:
            self._hashes[key] = adapter_sha256(p)
        if self._hashes[key] != ref.sha256:
            raise AdapterError(f"{what} {ref.name!r}: {p} on node {node} has sha256 {self._hashes[key][:16]}..., "
                               f"{wanted_by} expects {ref.sha256[:16]}... (stale or partial copy)", param="path")

    def attach(self, adapters: tuple[AdapterRef, ...]) -> None:
        if adapters and self.manager.lora_engine is None:
            raise InvalidParameter("this deployment runs --lora-backend distill: its LoRA is fused into the base "
                                   "at start, so per-request 'lora' is refused", param="lora")
        for ref in adapters:
            self.verify(ref)
        with self.manager.exclusive():
            engine, done = self.manager.lora_engine, []
            try:
                for ref in adapters:
                    read = engine.counters["loads_from_disk"]
                    engine.load(ref.request())  # read + convert + fit check, into the CPU tier
                    self._refs[ref.int_id] = self._refs.get(ref.int_id, 0) + 1
                    # a load is a read from disk: a file already resident (a pinned --lora-path
                    # adapter under the id a request gives it) is shared by the PEFT engine
                    self.counts["adapter_loads"] += engine.counters["loads_from_disk"] - read
                    done.append(ref)
            except BaseException:
                self.release(tuple(done))  # a slot is resident whole or not at all
                raise

    def release(self, adapters: tuple[AdapterRef, ...]) -> None:
        with self.manager.exclusive():  # eviction runs in Serve's executor: never under a running generation
            engine = self.manager.lora_engine
            for ref in adapters:
                left = self._refs.get(ref.int_id, 0) - 1
                if left > 0:
                    self._refs[ref.int_id] = left
                    continue
                self._refs.pop(ref.int_id, None)
                if engine is not None and left == 0:
                    try:
                        engine.unload(ref.int_id)
                    except AdapterNotFound:  # the PEFT engine's own LRU dropped it already
                        pass
                    self.counts["adapter_unloads"] += 1


@serve.deployment
class GenerationReplica:
    def __init__(self, settings: dict):
        from ..config import RuntimeConfig
        from ..manager import PipelineManager

        # the one start config, as the head built it (lora_paths: the head's absolute, hashed files)
        self.config = RuntimeConfig(**settings["runtime"])
        self.manager = PipelineManager.from_config(self.config)
        context = ray.get_runtime_context()
        self.identity = {"replica": serve.get_replica_context().replica_id.unique_id,
                         "actor": context.get_actor_name(), "node": context.get_node_id(),
                         "device": str(self.manager.device)}
        self.counts = {"jobs": 0, "slot_loads": 0, "model_loads": 0, "adapter_loads": 0, "adapter_unloads": 0}
        self.host = AdapterHost(self.manager, self.counts)
        self.distill = DistillPlan.from_dict(settings["distill"]) if settings.get("distill") else None
        self.preload = PreloadPlan.from_dict(settings["preload"]) if settings.get("preload") else None
        self._wanted: dict[str, Job] = {}
        if self.distill or self.preload:
            # Load, fuse and pin now, in the constructor: Serve routes nothing to a replica before
            # it returns, so a replica Ray restarts after a crash is ready again before it serves.
            self._ensure(self.config.model)

        async def load_slot(key: str) -> _Slot:
            job = self._wanted[key]
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._ensure, job.model, job.adapters)
            self.counts["slot_loads"] += 1
            return _Slot(self.host, job.model, job.adapters)

        # Wired here (not as a class decorator) so the per-replica slot count is a deployment setting.
        self._slot = serve.multiplexed(max_num_models_per_replica=int(settings.get("slots_per_replica", 4)))(load_slot)

    def _ensure(self, model: str, adapters=()) -> None:
        """Start the model (``PipelineManager.start``, the one start sequence) if this replica holds
        another one (a slot of a different model was used since), then attach the adapters."""
        with self.manager.exclusive():
            if self.manager.model_id != model:
                preset_paths = self._check_start_files() if self.config.for_model(model) else None
                self.manager.start(self.config, model, preset_paths=preset_paths)
                self.host.model_loaded()
                self.counts["model_loads"] += 1
            self.host.attach(adapters)

    def _check_start_files(self) -> list[str] | None:
        """The start model's files, checked on this node against the head's sha256 before anything is
        fused or pinned; returns the preset's files (fused as the head found them)."""
        if self.distill is not None:
            for ref, component in zip(self.distill.files, self.distill.components):
                _standin_on_this_node(self.distill, ref, component, self.manager.data_dir)
                self.host.verify(ref, "distill file", "the head")  # never fuse a stale or half-copied file
        for ref in self.preload.adapters if self.preload is not None else ():
            self.host.verify(ref, "--lora-path adapter", "the head")  # never pin a stale or half-copied file
        if self.distill is not None and self.distill.preset:
            return [ref.path for ref in self.distill.files]
        return None

    async def run(self, job_dict: dict, key: str):
        """Stream {"type": "progress"} events, then one {"type": "result"} or {"type": "error"}."""
        job = Job.from_dict(job_dict)
        cancel = threading.Event()
        try:
            self._wanted[key] = job
            before = dict(self.counts)
            slot = await self._slot(key)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()

            def on_step(step: int, total: int) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, {"type": "progress", "step": step, "total": total,
                                                             "replica": self.identity["replica"]})

            def on_preview(job_id, step: int, data: bytes) -> None:  # backend/preview.py, about once a second
                loop.call_soon_threadsafe(queue.put_nowait, {"type": "preview", "step": step, "png": data,
                                                             "replica": self.identity["replica"]})

            from ..preview import sender

            previews = sender(on_preview, [job.id])
            work = loop.run_in_executor(None, self._generate, slot, job, on_step, cancel, before, previews)
            work.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
            while (event := await queue.get()) is not None:
                yield event
            result = work.result()
            yield {"type": "result", "images": result.images, "frames": result.frames, "fps": result.fps,
                   "audio": result.audio, "metadata": result.metadata}
        except StudioError as exc:
            yield {"type": "error", "error": exc.to_wire(), "replica": self.identity["replica"]}
        except Exception as exc:  # a library failure: report it as this job's, the replica lives on
            error = errors.ServerError(f"generation failed on replica {self.identity['replica']}: "
                                       f"{type(exc).__name__}: {_first_line(exc)}")
            yield {"type": "error", "error": error.to_wire(), "replica": self.identity["replica"]}
        finally:
            cancel.set()  # a cancelled or abandoned request stops its generation at the next step
            self._wanted.pop(key, None)

    def _generate(self, slot: _Slot, job: Job, on_step, cancel: threading.Event, before: dict, on_preview=None):
        with self.manager.exclusive():
            if self.manager.model_id != slot.model:  # another slot switched the model: bring this one back
                self._ensure(slot.model, slot.adapters)
            self.counts["jobs"] += 1
            adapters = [(ref.request(), ref.scale) for ref in job.adapters]
            result = self.manager.generate(job.params, adapters=adapters, on_step=on_step, cancel=cancel,
                                           on_preview=on_preview)
            engine = self.manager.lora_engine
            resident = {e.name for e in engine.loaded()} if engine else set()  # a pin and its alias share a name
            pinned = engine.stats()["pinned"] if engine else []
            pristine = engine.pristine_info() if engine else None  # --pristine, as the replica applied it
        # Cumulative counters for this replica, and what this job itself cost (loads it caused).
        result.metadata["engine"] = {"name": "ray", **self.identity, "slot_key": job.slot_key, **self.counts,
                                     "this_job": {k: self.counts[k] - before[k] for k in self.counts if k != "jobs"},
                                     "resident_adapters": sorted(resident), "pinned_adapters": pinned,
                                     "pristine": pristine}
        return result


def _standin_on_this_node(plan: DistillPlan, ref: AdapterRef, component: str, data_dir) -> None:
    """A demo model's preset stand-in is built on each node on first use, like the demo model
    itself (seeded by its name, so the same bytes everywhere; the sha256 check still follows)."""
    from .. import demo
    from ..distill.demo_files import demo_dir, write_demo_file

    path = Path(ref.path)
    if plan.preset and demo.is_demo(plan.model) and not path.exists() and path.parent == demo_dir(data_dir):
        write_demo_file(plan.model, path.name, component, data_dir)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
class JobRouter:
    """The app's ingress: forwards each job to the replica pool through a handle, multiplexed by
    slot key (Serve multiplexes on a downstream deployment called through a handle)."""

    def __init__(self, replicas, multiplex: bool = True):
        self.replicas, self.multiplex = replicas, multiplex

    async def __call__(self, job_dict: dict, key: str):
        options = {"stream": True}
        if self.multiplex:
            options["multiplexed_model_id"] = key
        async for event in self.replicas.options(**options).run.remote(job_dict, key):
            yield event


# -- the driver side ------------------------------------------------------------------------------
@dataclass
class RayEngineConfig:
    address: str | None = None  # None: start a private local cluster inside this process
    replicas: int = 1
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    slots_per_replica: int = 4  # model + adapter-set slots each replica keeps resident (LRU)
    max_loras: int = 4  # the PEFT engine's tiers on each replica (as --max-loras / --max-cpu-loras)
    max_cpu_loras: int = 16
    lora_backend: str = "peft"  # "distill": no per-request adapters, as with the local engine
    runtime: Any = None  # backend.config.RuntimeConfig the server started with (None: built from these fields)
    distill: DistillPlan | None = None  # fused by every replica at start (DistillPlan.resolve, on the head)
    preload: PreloadPlan | None = None  # pinned by every replica at start (PreloadPlan.resolve, on the head)
    multiplex: bool = True  # False routes without regard to slots (the benchmark's baseline)
    # Jobs a replica accepts at once (it runs one; the rest wait there). 1 keeps every waiting job
    # in the front queue; 2 lets a job wait for the busy replica that holds its slot instead of
    # spilling to another replica that must load it (fewer loads under concurrent load).
    jobs_per_replica: int = 1
    device: str | None = None
    dtype: str | None = None
    data_dir: str | None = None
    num_cpus: int | None = None  # local cluster only
    app_name: str = APP_NAME
    env: dict = field(default_factory=dict)  # extra environment for replicas


class RayJob:
    """One submitted job: iterate ``events()`` for progress and the outcome; ``cancel()`` anywhere."""

    def __init__(self, job: Job, stream):
        self.job, self._stream = job, stream
        self._cancelled = threading.Event()
        self.replica: str | None = None

    def cancel(self) -> None:
        self._cancelled.set()
        self._stream.cancel()

    def events(self) -> Iterator[Progress | Outcome]:
        try:
            for event in self._stream:
                if event["type"] == "progress":
                    self.replica = event["replica"]
                    yield Progress(event["step"], event["total"], event["replica"])
                elif event["type"] == "preview":
                    yield Preview(event["step"], event["png"], event["replica"])
                elif event["type"] == "result":
                    from ..manager import GenerationResult

                    result = GenerationResult(images=event["images"], frames=event["frames"], fps=event["fps"],
                                              audio=event["audio"], metadata=event["metadata"])
                    yield Outcome("succeeded", result=result, replica=event["metadata"]["engine"]["replica"])
                    return
                else:
                    yield self._error(event)
                    return
        except Exception as exc:  # the replica died, or the request was cancelled
            if self._cancelled.is_set():
                yield Outcome("cancelled", error=Cancelled("job cancelled"), replica=self.replica)
            elif isinstance(exc, ray.exceptions.RayActorError):
                where = f"replica {self.replica}" if self.replica else "the Ray replica"
                yield Outcome("failed", error=StudioError(f"{where} died mid-job: {_first_line(exc)}"),
                              replica=self.replica)
            else:
                yield Outcome("failed", error=StudioError(f"the Ray engine failed the job: "
                                                          f"{type(exc).__name__}: {_first_line(exc)}"),
                              replica=self.replica)
            return
        yield Outcome("failed", error=StudioError("the Ray replica closed the job's stream without a result"))

    def _error(self, event: dict) -> Outcome:
        error = StudioError.from_wire(event["error"])
        status = "cancelled" if isinstance(error, Cancelled) else "failed"
        return Outcome(status, error=error, replica=event.get("replica"))

    def wait(self, on_progress=None) -> Outcome:
        for event in self.events():
            if isinstance(event, Outcome):
                return event
            if on_progress is not None and isinstance(event, Progress):
                on_progress(event)
        raise AssertionError("events() always ends with an Outcome")


class RayEngine:
    def __init__(self, config: RayEngineConfig | None = None):
        self.config = config or RayEngineConfig()
        self._handle = None
        self._owns_ray = False

    def start(self) -> "RayEngine":
        cfg = self.config
        if not ray.is_initialized():
            if cfg.address:
                # `ray start` turns token auth on when a token exists, but a client does not; this is
                # what `ray start` itself calls (ray 2.60, not public API): RAY_AUTH_MODE still wins.
                from ray._private.authentication.authentication_token_setup import (
                    maybe_enable_token_auth_if_token_available)

                maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
                try:
                    ray.init(address=cfg.address, log_to_driver=False)
                except (ConnectionError, RuntimeError, ValueError) as exc:
                    raise StudioError(f"could not join the Ray cluster at {cfg.address}: {_first_line(exc)}",
                                      param="ray-address") from exc
            else:
                self._start_local_ray()
        serve.start(proxy_location="Disabled")  # jobs arrive through the handle, never over Serve's HTTP
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               **({"LORA_STUDIO_HOME": str(cfg.data_dir)} if cfg.data_dir else {}), **cfg.env}
        actor = {"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica,
                 "runtime_env": {"env_vars": env}}
        settings = {"runtime": self.runtime_config().model_dump(mode="json"),
                    "slots_per_replica": cfg.slots_per_replica,
                    "distill": cfg.distill.to_dict() if cfg.distill else None,
                    "preload": cfg.preload.to_dict() if cfg.preload else None}
        # one constructor try per replica: what fails there (a distill or --lora-path file that differs from
        # the head's, a model that will not load) fails again on retry, and Serve's default of 20 tries (each a
        # model load and a hash) held a failing start for minutes before DEPLOY_FAILED
        replicas = GenerationReplica.options(num_replicas=cfg.replicas, ray_actor_options=actor,
                                             max_ongoing_requests=cfg.jobs_per_replica,
                                             max_constructor_retry_count=cfg.replicas).bind(settings)
        router = JobRouter.options(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}})
        try:
            self._handle = serve.run(router.bind(replicas, cfg.multiplex), name=cfg.app_name, route_prefix=None)
        except RuntimeError as exc:  # replicas kept failing in their constructor (a distill or --lora-path file)
            reason = self._replica_failure() or _first_line(exc)
            self._teardown()
            raise StudioError(f"the Ray replicas could not start: {reason}", param="engine") from exc
        return self

    def runtime_config(self):
        """The start config every replica starts from: the server's (``runtime``), or one built from this
        config's fields; its start-time files are the plans' (resolved and hashed on the head)."""
        from ..config import RuntimeConfig

        cfg = self.config
        base = cfg.runtime or RuntimeConfig(device=cfg.device, dtype=cfg.dtype, data_dir=cfg.data_dir,
                                            max_loras=cfg.max_loras, max_cpu_loras=cfg.max_cpu_loras,
                                            lora_backend=cfg.lora_backend)
        start, scale = cfg.distill or cfg.preload, base.lora_scale
        if cfg.distill is not None and not cfg.distill.preset:
            paths = [f.path for f in cfg.distill.files]
            scale = cfg.distill.files[0].scale if cfg.distill.files else scale
        else:
            paths = [a.path for a in cfg.preload.adapters] if cfg.preload is not None else []
        return base.replace(model=start.model if start is not None else base.model, lora_backend=cfg.lora_backend,
                            lora_paths=paths, lora_scale=scale, engine="ray",
                            preset=cfg.distill.preset if cfg.distill is not None else None)

    def _replica_failure(self) -> str | None:
        """The last line of the error a replica's constructor raised, as Serve recorded it
        (serve.run itself only says that the deployment failed)."""
        try:
            app = serve.status().applications.get(self.config.app_name)
            message = app.deployments[GenerationReplica.name].message if app else ""
        except Exception:  # noqa: BLE001 - no status: the caller falls back to Serve's own line
            return None
        lines = [ln.strip() for ln in (message or "").splitlines() if ln.strip()]
        if not lines:
            return None
        last = lines[-1]
        return last.split(": ", 1)[1] if re.match(r"^[\w.]+(Error|Exception|Violation|NotFound): ", last) else last

    def _start_local_ray(self, attempts: int = 3) -> None:
        # Ray gives a new node's raylet a fixed 30 s to register; on an overloaded host that can
        # pass, so try again before giving up.
        for attempt in range(1, attempts + 1):
            try:
                # "local": always a new private instance, even when a `ray start` cluster runs here
                ray.init(address="local", num_cpus=self.config.num_cpus, include_dashboard=False,
                         log_to_driver=False)
                self._owns_ray = True
                return
            except Exception as exc:
                ray.shutdown()
                if attempt == attempts or "timed out during startup" not in str(exc):
                    raise StudioError(f"could not start a local Ray instance: {_first_line(exc)}",
                                      param="engine") from exc

    def submit(self, job: dict) -> RayJob:
        if self._handle is None:
            raise StudioError("the Ray engine is not started", param="engine")
        parsed = Job.from_dict(job)
        return RayJob(parsed, self._handle.options(stream=True).remote(parsed.to_dict(), parsed.slot_key))

    def replica_actor_name(self, replica: str) -> str:
        """The Ray actor behind a replica id (as Progress/metadata report it), for ops tools."""
        return f"SERVE_REPLICA::{self.config.app_name}#{GenerationReplica.name}#{replica}"

    def replica_ids(self) -> set[str]:
        """Ids of the pool's replicas whose actors are alive (running or still starting): a
        replica Ray replaced after a crash shows up here under a new id."""
        prefix = self.replica_actor_name("")
        return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(prefix)}

    def replica_count(self) -> int:
        """Replicas of the pool that are up now."""
        app = serve.status().applications.get(self.config.app_name)
        deployment = app.deployments.get(GenerationReplica.name) if app else None
        return deployment.replica_states.get("RUNNING", 0) if deployment else 0

    def stop(self) -> None:
        if self._handle is None:
            return
        self._handle = None
        self._teardown()

    def _teardown(self) -> None:
        serve.delete(self.config.app_name)
        if self._owns_ray:
            self._owns_ray = False
            serve.shutdown()
            ray.shutdown()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- `python app.py ray-up`: a one-machine cluster -------------------------------------------------------
def ray_up(*, port: int = 6379, num_cpus: int | None = None, num_gpus: int | None = None) -> str:
    """Start a Ray head node on this machine (``ray start --head``); returns the address to
    pass as ``--ray-address``. Other machines join with ``ray start --address=<it>``; ``ray stop``
    ends it."""
    cmd = [_ray_cli(), "start", "--head", f"--port={port}", "--disable-usage-stats", "--include-dashboard=false"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        raise StudioError(f"`{' '.join(cmd)}` failed: {lines[-1] if lines else done.returncode}", param="ray-up")
    joined = re.search(r"--address='([^']+)'", done.stdout + done.stderr)  # the address Ray tells nodes to join
    return joined.group(1) if joined else f"127.0.0.1:{port}"


def _ray_cli() -> str:
    local = Path(sys.executable).with_name("ray")  # the venv's own `ray`, even when not on PATH
    return str(local) if local.exists() else (shutil.which("ray") or "ray")

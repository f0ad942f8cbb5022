"""Prefetch: while a job renders, read the adapters of the next queued jobs into the cache.

The supervisor sends the worker a hint on a second pipe whenever the head of the queue
changes (``hints_for``): the adapters of the next ``--lora-prefetch`` queued generate jobs.
A thread in the worker (``Prefetcher``) reads, converts and fits each one into the CPU
tier and moves its factors to the device tier (``LoRAEngine.load`` and the device-tier
insert the activation itself uses), so the job that needs it next starts with no disk read.

Bounded by the cache: an adapter is only brought in when the entry it would evict is
neither pinned, nor active (merged or hooked), nor needed by the running job, nor brought
in by this same round; otherwise prefetch stops for that tier. Errors never reach the
running job: they are counted and logged, and the adapter's own job reports them when it
loads the file itself.
"""
from __future__ import annotations

import sys
import threading
import time

from ..lora.request import LoRARequest


def requests_of(adapters: list[dict]) -> list[LoRARequest]:
    return [LoRARequest(a["name"], int(a["int_id"]), a["path"]) for a in adapters or []]


def hints_for(queue, limit: int, model: str | None) -> list[list[dict]]:
    """The adapter lists of the next ``limit`` queued jobs that run on ``model`` and name adapters."""
    if limit <= 0:
        return []
    out = []
    for job in queue.upcoming(limit * 4):
        if job["adapters"] and (job["model"] in (None, model)) and job["adapters"] not in out:
            out.append(job["adapters"])
        if len(out) >= limit:
            break
    return out


def _victim(tier, key, keep) -> object | None:
    """The key ``tier.put(key, ..., keep)`` would evict (None: there is room or nothing evictable)."""
    if key in tier or len(tier) < tier.capacity:
        return None
    for old in tier.keys():
        if old != key and old not in keep:
            return old
    return None


def prefetch(engine, requests, protect=frozenset(), stats: dict | None = None) -> dict:
    """Bring ``requests`` into both cache tiers, in order, within the cache bound (module docstring).

    ``protect``: the running job's adapters (LoRARequests or lora_int_ids), which must stay.
    Cache keys are the engine's adapter identities (``LoRAEngine.cached_identity``).
    Returns counts for this round.
    """
    out = {"read": 0, "cached": 0, "device": 0, "bounded": 0, "errors": 0}
    cache = engine.cache
    kept = {engine.cached_identity(p) for p in protect} - {None}
    for request in requests:
        with engine.exclusive():
            kept |= set(cache.pinned) | engine.active_identities()
            key = engine.cached_identity(request)
            victim = None if key is not None else _victim(cache.cpu, key, cache.keep())
            if victim is not None and victim in kept:
                out["bounded"] += 1
                break
        try:
            reads = engine.counters["loads_from_disk"]
            entry = engine.load(request)
            out["read" if engine.counters["loads_from_disk"] != reads else "cached"] += 1
            with engine.exclusive():
                key = engine.cached_identity(request)
                if key is not None and key not in cache.device:
                    victim = _victim(cache.device, key, cache.keep([key]))
                    if victim is not None and victim in kept:
                        out["bounded"] += 1
                        kept.add(key)
                        continue
                    engine._device_factors({key: entry})
                    out["device"] += 1
        except Exception as exc:  # never the running job's problem: its own job reports it
            out["errors"] += 1
            print(f"lora-studio worker: prefetch {request.lora_name!r}: {exc}", file=sys.stderr)
            continue
        if key is not None:
            kept.add(key)
    if stats is not None:
        for k, v in out.items():
            stats[k] = stats.get(k, 0) + v
    return out


class Prefetcher:
    """The worker's prefetch thread: takes hints from ``conn`` and fills the engine's cache."""

    def __init__(self, conn, get_engine):
        self.conn, self.get_engine = conn, get_engine
        self.busy = threading.Lock()  # held while an adapter is read (a job start waits for it)
        self.stats = {"hints": 0, "rounds": 0, "read": 0, "cached": 0, "device": 0, "bounded": 0, "errors": 0,
                      "seconds": 0.0}
        self.protect: frozenset = frozenset()
        self._thread = threading.Thread(target=self._loop, name="lora-studio-prefetch", daemon=True)

    def start(self) -> "Prefetcher":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            try:
                hint = self.conn.recv()
                while self.conn.poll():  # only the newest view of the queue matters
                    hint = self.conn.recv()
            except (EOFError, OSError):
                return
            self.stats["hints"] += 1
            engine = self.get_engine()
            if engine is None:
                continue
            started, names = time.perf_counter(), []
            for adapters in hint.get("upcoming", []):
                with self.busy:
                    round_ = prefetch(engine, requests_of(adapters), self.protect, self.stats)
                if round_["read"]:
                    names += [a["name"] for a in adapters]
                if round_["bounded"]:
                    break
            self.stats["rounds"] += 1
            seconds = time.perf_counter() - started
            self.stats["seconds"] = round(self.stats["seconds"] + seconds, 4)
            if names:  # one line a round that read files (the log says what the queue's next jobs will find)
                print(f"lora-studio worker: prefetched {', '.join(map(repr, names))} for queued jobs "
                      f"in {seconds:.2f} s", file=sys.stderr, flush=True)

    def disk_reads(self) -> int:
        """Adapter files prefetch has read (taken with ``busy`` held, so the engine's count agrees)."""
        return self.stats["read"]

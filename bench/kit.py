"""The benchmarks' shared harness: rotated rounds, medians with min-max, the load average (a leaf:
``bench/__main__.py``, ``bench/quant.py`` and ``scripts/bench_preview.py`` use it)."""
from __future__ import annotations

import statistics
import time


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def _loadavg() -> str:
    import os

    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _rotated(fns: dict, rounds: int) -> dict:
    """(median, min, max) seconds of each ``fn(i)`` over ``rounds`` rounds; round r calls the sides
    starting from side r mod k, so no side always runs first (caches, turbo) or last."""
    keys = list(fns)
    times = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            t = time.perf_counter()
            fns[k](r)
            times[k].append(time.perf_counter() - t)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def _stat(t) -> str:
    return f"{_ms(t[0])} [{_ms(t[1])}-{_ms(t[2])}]"


def _interleaved(fns: dict, rounds: int) -> dict:
    """Median seconds of each ``fn(i)``, called in turn round by round, so load that comes and
    goes on a shared machine hits every side alike (back-to-back blocks would not)."""
    times = {k: [] for k in fns}
    for i in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn(i)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}

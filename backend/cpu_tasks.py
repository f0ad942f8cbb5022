"""Many small CPU tensor ops that stay fast on a busy machine.

Each multi-threaded op is an OpenMP parallel region that ends at a barrier: when the machine
is oversubscribed, one descheduled thread holds up the others for a whole time slice, op after
op. Measured on the 2-core dev box at load average ~5: the 40 merge GEMMs of a 4-layer
Wan block stack took 18 ms quiet and 600 ms under load with 2 intra-op threads, but 80 ms as
single-threaded tasks shared by 2 workers (a stalled worker only delays its own task; the
other keeps taking tasks from the queue).

So work made of many independent ops runs here: ``run_tasks`` spreads it over one worker per
intra-op thread of the caller, each worker single-threaded, and ``single_threaded`` runs a
block of small ops in the calling thread without parallel regions. Both rely on the intra-op
thread count being per thread (OpenMP + MKL builds, which PyTorch's wheels are); elsewhere
they fall back to running in the calling thread unchanged.
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch

_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, workers): a forked child makes its own
_pools_lock = threading.Lock()


def per_thread_settings() -> bool:
    """True when ``torch.set_num_threads`` only affects the calling thread."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


_PER_THREAD = per_thread_settings()


@contextlib.contextmanager
def single_threaded():
    """Run the block's ops without intra-op parallel regions (this thread only)."""
    if not _PER_THREAD or torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pool(workers: int) -> ThreadPoolExecutor:
    key = (os.getpid(), workers)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = ThreadPoolExecutor(workers, thread_name_prefix="cpu-tasks",
                                      initializer=torch.set_num_threads, initargs=(1,))
            _pools[key] = pool
        return pool


def run_tasks(fn, items) -> None:
    """Call ``fn(item)`` for every item, on as many single-threaded workers as this thread's
    intra-op threads. Returns once every call has finished; then raises the first failure
    (in item order), so a caller's rollback never races a write still in flight."""
    items = list(items)
    workers = min(torch.get_num_threads(), len(items))
    if workers <= 1 or not _PER_THREAD:
        for item in items:
            fn(item)
        return
    futures = [_pool(workers).submit(fn, item) for item in items]
    wait(futures)
    for f in futures:
        if f.exception() is not None:
            raise f.exception()

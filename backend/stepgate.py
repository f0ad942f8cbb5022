"""A step gate for tests: hold a running job after a given step until the test lets it go on.

A test that must see a job *running* (its progress bar, the page title, a cancel, a live preview)
cannot rely on the job being slow enough: a 30-step 64x64 job can finish before a poll sees it. With
``LORA_STUDIO_STEP_GATE`` naming a file in the environment of the process that runs the pipeline (the
server passes its environment to its worker and to Ray replicas), every job reports each step and then,
while the file exists and holds a number ``N`` with ``step >= N``, waits: the file says how many steps
jobs may finish. The test writes ``1``, sees the job held at step 1, writes ``2`` to let one more step
through, and removes the file to let everything finish. A cancelled job leaves the gate at once and
stops at its next step as any cancelled job does, and a gate left closed opens by itself after
``HOLD_LIMIT_S`` with a warning, so a forgotten file slows a run but never hangs it.

The runners call ``wait`` at the end of each step's callback, after its progress and live preview are
out, so a held job shows both. Without the variable (every real deployment) ``wait`` returns at once
and ``wrap`` returns the callback unchanged: no file is read.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

ENV = "LORA_STUDIO_STEP_GATE"
HOLD_LIMIT_S = 300.0
POLL_S = 0.02

log = logging.getLogger(__name__)


def allowed_steps(path: Path) -> int | None:
    """How many steps the gate lets a job finish; None when it is open (no file)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return int(text or 0)
    except ValueError:  # being rewritten: closed for this poll
        return 0


def wait(step: int, cancelled: Callable[[], bool] | None = None) -> None:
    """Called at the end of each step (after its progress and preview are out): wait while the gate,
    if ``LORA_STUDIO_STEP_GATE`` is set, holds jobs at ``step``. Without the variable, returns at once."""
    name = os.environ.get(ENV)
    if not name:
        return
    path, deadline = Path(name), time.monotonic() + HOLD_LIMIT_S
    while (allowed := allowed_steps(path)) is not None and step >= allowed \
            and not (cancelled is not None and cancelled()):
        if time.monotonic() > deadline:
            log.warning("step gate %s held step %d for %.0f s: letting it go", path, step, HOLD_LIMIT_S)
            return
        time.sleep(POLL_S)


def wrap(on_step: Callable[[int, int], None] | None, cancelled: Callable[[], bool] | None = None):
    """``on_step`` followed by ``wait``, for a runner whose only per-step hook is ``on_step``."""
    if not os.environ.get(ENV):
        return on_step

    def gated(step: int, total: int) -> None:
        if on_step is not None:
            on_step(step, total)
        wait(step, cancelled)

    return gated

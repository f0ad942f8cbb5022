"""Following jobs from inside a Gradio event generator.

Gradio's progress only reaches the browser from the event's own generator, and a
``cancels=`` only stops that generator at a yield, so the event polls the Studio's
job and yields each change; when Gradio closes the generator (cancel, tab closed)
the job itself is cancelled too, so the worker stops rather than finish for nobody.
"""
from __future__ import annotations

import time
from typing import Iterator

from .views import FINISHED

POLL_S = 0.15


def follow(studio, job_ids: list, *, timeout: float | None = None) -> Iterator[list[dict]]:
    """Yield the jobs' dicts whenever one of them changes, until all are finished."""
    last, deadline = None, (time.monotonic() + timeout) if timeout else None
    done = False
    try:
        while True:
            jobs = [studio.job(j) for j in job_ids]
            key = [(j.get("status"), j.get("queue_position"), str(j.get("progress"))) for j in jobs]
            if key != last:
                last = key
                yield jobs
            if all(j.get("status") in FINISHED for j in jobs):
                done = True
                return
            if deadline and time.monotonic() > deadline:
                return
            time.sleep(POLL_S)
    finally:
        if not done:  # closed early (Gradio cancel, disconnect): stop the work too
            for j in job_ids:
                try:
                    studio.cancel(j)
                except Exception:  # already finished or gone: nothing left to stop
                    pass

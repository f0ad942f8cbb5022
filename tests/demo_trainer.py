"""Running a demo trainer's command in the test process (CI never trains for real: a few steps)."""
from __future__ import annotations

import torch


def run_trainer(capsys, args: list[str]) -> tuple[int, str]:
    """``python -m backend.demo.train ARGS`` as its ``main``: torch's random state forked and its thread count
    put back, so the test process is as it was. Returns the exit code and what it printed (progress-bar
    carriage returns as new lines)."""
    from backend.demo import train

    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        try:
            code = train.main(list(args))
        finally:
            torch.set_num_threads(threads)
    return code, capsys.readouterr().out.replace("\r", "\n")

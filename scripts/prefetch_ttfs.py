"""Time to first step of a job with a cold adapter, queued behind a running job, with and without
prefetch, through real `python app.py serve` processes (docs/lora.md, "Prefetch").

    .venv/bin/python scripts/prefetch_ttfs.py [--rounds 5] [--rank 1024] [--data-dir DIR]

Each round writes a new adapter file (diffusers format, every attention projection of
demo:qwen-image's transformer, rank --rank), starts a 40-step base job, and while it renders
queues a 2-step job naming the new file. ``first_step_s`` (the worker's time from taking the
job to its first step callback) and ``lora_disk_reads`` come from that job's metadata.
The servers run one after the other (prefetch on, then off, per round pair).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def post(url, steps, **body):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600,
                   json={"messages": [{"role": "user", "content": "a lighthouse"}],
                         "extra_body": {"num_inference_steps": steps, "seed": 7, "height": 64, "width": 64,
                                        "true_cfg_scale": 1.0, **body}})
    r.raise_for_status()
    return r.json()["metadata"][0]


def one_round(url, lora_rel):
    out = {}
    long_job = threading.Thread(target=lambda: out.setdefault("long", post(url, 40)))
    long_job.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = httpx.get(f"{url}/v1/jobs").json()["data"]
        if any(j["status"] == "running" and j["params"].get("num_inference_steps") == 40 for j in rows):
            break
        time.sleep(0.02)
    time.sleep(0.3)  # well inside the 40 steps
    cold = post(url, 2, lora={"path": lora_rel, "scale": 1.0})
    long_job.join(600)
    return cold


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=1024)
    ap.add_argument("--data-dir", default=os.environ.get("LORA_STUDIO_HOME") or tempfile.mkdtemp())
    args = ap.parse_args()
    from backend import demo
    from backend.api.server import free_port
    from ui_fixtures import make_lora

    data = Path(args.data_dir)
    model_dir = demo.ensure("demo:qwen-image", data)
    results = {}
    for prefetch in ("2", "0"):
        port = free_port()
        log = open(data / f"prefetch-{prefetch}.log", "w")
        proc = subprocess.Popen([sys.executable, "app.py", "serve", "demo:qwen-image", "--port", str(port),
                                 "--data-dir", str(data), "--device", "cpu", "--lora-prefetch", prefetch],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            post(url, 2)  # warm-up
            rows = []
            for i in range(args.rounds):
                rel = f"bench/ttfs-p{prefetch}-{i}-{time.time_ns()}.safetensors"
                make_lora(model_dir, data / "adapters" / rel, rank=args.rank, seed=i, strength=0.01)
                meta = one_round(url, rel)
                rows.append((meta["first_step_s"], meta["lora_disk_reads"]))
            results[prefetch] = rows
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
    size = (data / "adapters" / rel).stat().st_size
    print(f"adapter file: {size / 1e6:.1f} MB (rank {args.rank}); load average {os.getloadavg()}")
    for prefetch, rows in results.items():
        ttfs = [r[0] for r in rows]
        print(f"--lora-prefetch {prefetch}: time to first step median {statistics.median(ttfs) * 1e3:.1f} ms "
              f"(min {min(ttfs) * 1e3:.1f}, max {max(ttfs) * 1e3:.1f}), disk reads by the job "
              f"{[r[1] for r in rows]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

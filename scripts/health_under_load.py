#!/usr/bin/env python3
"""/health, /v1/jobs and cancel latency while N clients wait behind one long job (issue 14.8).

    python scripts/health_under_load.py http://127.0.0.1:7860 [N]

Against a running `app.py serve demo:qwen-image --max-queue 256`: starts one long generation
(2048x2048, 100 steps), then N waiting /v1 generations, then times /health (10 calls) and
/v1/jobs, and cancels every queued and running job. Prints the load average with the figures.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter

import httpx


def main(base: str, n: int) -> None:
    client = httpx.Client(timeout=30)
    long = threading.Thread(target=lambda: httpx.post(
        base + "/v1/images/generations", timeout=900,
        json={"prompt": "long", "height": 2048, "width": 2048, "num_inference_steps": 100}), daemon=True)
    long.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        running = client.get(base + "/v1/jobs", params={"status": "running"}).json()["data"]
        if running and running[0]["progress"]["step"] >= 1:
            break
        time.sleep(0.5)
    results: list = []

    def wait_one(i: int) -> None:
        try:
            r = httpx.post(base + "/v1/images/generations", timeout=900,
                           json={"prompt": f"wait {i}", "num_inference_steps": 1})
            results.append(r.status_code)
        except httpx.HTTPError as exc:
            results.append(type(exc).__name__)

    waiters = [threading.Thread(target=wait_one, args=(i,), daemon=True) for i in range(n)]
    for t in waiters:
        t.start()
    time.sleep(10)
    latencies = []
    for _ in range(10):
        t0 = time.monotonic()
        try:
            client.get(base + "/health", timeout=10)
            latencies.append(time.monotonic() - t0)
        except httpx.HTTPError:
            latencies.append(float("inf"))  # no answer within 10 s
    t0 = time.monotonic()
    try:
        jobs = client.get(base + "/v1/jobs", params={"limit": 1000}, timeout=10).json()["data"]
        jobs_s = f"{time.monotonic() - t0:.3f} s"
    except httpx.HTTPError:
        jobs, jobs_s = [], "no answer in 10 s"
    print(f"{n} waiting: /health median {sorted(latencies)[5]:.3f} s, max {max(latencies):.3f} s; "
          f"/v1/jobs {jobs_s}; queued {sum(j['status'] == 'queued' for j in jobs)}; "
          f"load average {os.getloadavg()}", flush=True)
    t0 = time.monotonic()
    try:
        for status in ("queued", "running"):
            for j in client.get(base + "/v1/jobs", params={"limit": 1000, "status": status},
                                timeout=30).json()["data"]:
                client.delete(base + f"/v1/jobs/{j['id']}", timeout=30)
    except httpx.HTTPError as exc:  # a wedged server: stop it yourself
        print(f"could not cancel the jobs: {type(exc).__name__} after {time.monotonic() - t0:.1f} s")
        return
    print(f"cancelled every job in {time.monotonic() - t0:.2f} s")
    for t in [long, *waiters]:
        t.join(120)
    print("waiting clients got:", dict(Counter(results)))


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"), int(sys.argv[2]) if len(sys.argv) > 2 else 60)

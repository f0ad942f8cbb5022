#!/usr/bin/env python3
"""A bounded loopback load test of the server: N requests from C concurrent clients over
a mix of adapters; every request is accounted for (succeeded or cleanly rejected with
429), cross-checked against the job table; reports throughput and the setup switches
the scheduler saved against plain FIFO on the same jobs.

    python scripts/load_test.py                        # 200 requests, 8 clients, demo:qwen-image
    python scripts/load_test.py --compare-fifo         # also run with --max-overtake 0 (plain FIFO)

It starts its own server on 127.0.0.1 (a free port) and talks to nothing else.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from backend.api import create_app  # noqa: E402
from backend.api.server import ThreadedServer  # noqa: E402
from backend.service import Studio  # noqa: E402


def adapter_mix(studio: Studio, model: str) -> list[dict | None]:
    """The base model plus every library adapter that fits ``model`` (none without PEFT)."""
    fitting = [a for a in studio.adapters() if a.get("fits")]
    return [None] + [{"name": a["name"], "scale": 1.0} for a in fitting[:3]]


def run(args, max_overtake: int) -> dict:
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="ls-load-"))
    db = Path(tempfile.mkdtemp(prefix="ls-load-db-")) / "jobs.sqlite"
    try:
        from backend.lora import demo_adapters

        demo_adapters.ensure(data_dir)
    except ImportError:
        pass
    studio = Studio(args.model, data_dir=data_dir, device=args.device, max_queue=args.max_queue,
                    max_overtake=max_overtake, db_path=db, worker_threads=args.threads).start()
    srv = ThreadedServer(create_app(studio)).start()
    mix = adapter_mix(studio, args.model)
    rng = random.Random(args.seed)
    plan = [rng.choice(mix) for _ in range(args.requests)]
    outcomes: list[tuple[int, str | None]] = []
    lock = threading.Lock()
    next_index = iter(range(args.requests))

    def client():
        with httpx.Client(base_url=srv.url, timeout=args.timeout) as http:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                body = {"prompt": f"request {i}", "size": "64x64", "num_inference_steps": args.steps, "seed": i}
                if plan[i]:
                    body["lora"] = plan[i]
                try:
                    r = http.post("/v1/images/generations", json=body)
                    job = r.json()["data"][0]["job_id"] if r.status_code == 200 else None
                    out = (r.status_code, job)
                except httpx.HTTPError as exc:
                    out = (-1, type(exc).__name__)
                with lock:
                    outcomes.append(out)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    codes = Counter(code for code, _ in outcomes)
    jobs = studio.jobs(limit=args.requests * 2)
    by_status = Counter(j["status"] for j in jobs)
    ok_ids = {job for code, job in outcomes if code == 200}
    succeeded_ids = {j["id"] for j in jobs if j["status"] == "succeeded"}
    report = {
        "max_overtake": max_overtake, "requests": args.requests, "clients": args.clients,
        "adapters_in_mix": [m["name"] if m else "base" for m in mix],
        "http": dict(codes), "jobs": dict(by_status), "wall_s": round(wall, 2),
        "throughput_rps": round(codes.get(200, 0) / wall, 2),
        "accounted": len(outcomes) == args.requests and set(codes) <= {200, 429},
        "none_lost": ok_ids == succeeded_ids and by_status.get("queued", 0) == 0 and by_status.get("running", 0) == 0,
        "scheduler": studio.queue.scheduler_stats(),
    }
    srv.stop()
    studio.close()
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:qwen-image")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--max-overtake", type=int, default=4)
    p.add_argument("--compare-fifo", action="store_true", help="also run with --max-overtake 0")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the worker")
    p.add_argument("--data-dir", help="reuse a data dir (demo models cached there)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.requests > 2000 or args.clients > 64:
        p.error("bounded by design: at most 2000 requests and 64 clients")
    reports = [run(args, args.max_overtake)] + ([run(args, 0)] if args.compare_fifo else [])
    for r in reports:
        s = r["scheduler"]
        print(f"max_overtake={r['max_overtake']}: {r['requests']} requests / {r['clients']} clients over "
              f"{r['adapters_in_mix']}: http {r['http']} jobs {r['jobs']} in {r['wall_s']} s = "
              f"{r['throughput_rps']} req/s; switches {s['switches']} vs FIFO {s['fifo_switches']} "
              f"(saved {s['switches_saved']}), max overtaken {s['max_overtaken_seen']}; "
              f"accounted={r['accounted']} none_lost={r['none_lost']}")
    if len(reports) == 2:
        print(f"throughput ratio affinity/FIFO: {reports[0]['throughput_rps'] / max(reports[1]['throughput_rps'], 1e-9):.2f}")
    return 0 if all(r["accounted"] and r["none_lost"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())

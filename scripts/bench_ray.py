"""Ray engine on this machine: throughput with 1 vs 2 replicas, and slot (model + adapter set)
loads with multiplexed routing vs routing that ignores what replicas hold. Prints ratios.

    .venv/bin/python scripts/bench_ray.py [--jobs 16] [--clients 4] [--steps 8]

One local Ray cluster for the whole run; each configuration is a fresh Serve deployment on it.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "demo:sd3.5"


def slot_keys(data_dir: str) -> list[tuple[str, list]]:
    """The mixed workload's slots: MODEL's base and each of its demo adapters."""
    from backend import demo
    from backend.lora import demo_adapters

    demo.ensure(MODEL, data_dir)
    paths = demo_adapters.for_model(MODEL, data_dir)
    return [(MODEL, [])] + [(MODEL, [{"name": p.stem, "path": str(p), "scale": 1.0}]) for p in paths]


def run_jobs(engine, jobs: list[dict], clients: int) -> tuple[float, list]:
    """Submit `jobs` from `clients` threads; returns (seconds, outcomes)."""
    outcomes, lock, it = [], threading.Lock(), iter(jobs)

    def client():
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            outcome = engine.submit(job).wait()
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    failed = [o for o in outcomes if o.status != "succeeded"]
    if failed:
        raise SystemExit(f"{len(failed)} job(s) failed: {failed[0].error}")
    return seconds, outcomes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mixed-jobs", type=int, default=24)
    ap.add_argument("--slots", type=int, default=2, help="slots per replica in the mixed run")
    args = ap.parse_args()

    import ray

    from backend import demo
    from backend.engines.ray_engine import RayEngine, RayEngineConfig

    data_dir = tempfile.mkdtemp(prefix="bench-ray-")
    demo.ensure(MODEL, data_dir)
    keys = slot_keys(data_dir)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    def engine(**kw):
        return RayEngine(RayEngineConfig(device="cpu", data_dir=data_dir, **kw))

    params = {"prompt": "a lighthouse at dusk", "num_inference_steps": args.steps}
    same = [{"id": f"t{i}", "model": MODEL, "params": {**params, "seed": i}} for i in range(args.jobs)]
    throughput = {}
    for replicas in (1, 2):
        with engine(replicas=replicas, cpus_per_replica=1.0) as eng:
            run_jobs(eng, same[:2 * replicas], args.clients)  # warm: every replica loads the model
            seconds, _ = run_jobs(eng, same, args.clients)
            throughput[replicas] = args.jobs / seconds
            print(f"{replicas} replica(s): {args.jobs} jobs in {seconds:.1f} s = {throughput[replicas]:.2f} jobs/s")

    rng = random.Random(0)
    order = [rng.randrange(len(keys)) for _ in range(args.mixed_jobs)]
    mixed = [{"id": f"m{i}", "model": keys[k][0], "adapters": keys[k][1],
              "params": {"prompt": "a fox", "seed": i, "num_inference_steps": 2}} for i, k in enumerate(order)]
    loads = {}
    runs = ((1, False, 1), (1, True, 1), (2, False, 1), (2, True, 1), (2, True, 2))
    for clients, multiplex, per_replica in runs:
        with engine(replicas=2, cpus_per_replica=1.0, slots_per_replica=args.slots, multiplex=multiplex,
                    jobs_per_replica=per_replica) as eng:
            seconds, outcomes = run_jobs(eng, mixed, clients=clients)
            costs = [o.result.metadata["engine"]["this_job"] for o in outcomes]
            # weights read from disk: adapter loads, plus model (re)loads
            loads[clients, multiplex, per_replica] = sum(c["adapter_loads"] + c["model_loads"] for c in costs)
            print(f"{clients} client(s), multiplex={multiplex}, jobs_per_replica={per_replica}: {len(mixed)} mixed "
                  f"jobs over {len(keys)} slots ({args.slots} per replica): "
                  f"{loads[clients, multiplex, per_replica]} loads, {seconds:.1f} s")

    print()
    print(f"throughput 2 vs 1 replicas:              {throughput[2] / throughput[1]:.2f}x")
    for clients, multiplex, per_replica in runs:
        if multiplex:
            base = loads[clients, False, 1]
            print(f"loads, {clients} client(s), multiplexed (jobs_per_replica={per_replica}) vs not: "
                  f"{loads[clients, True, per_replica]} / {base} = {loads[clients, True, per_replica] / max(base, 1):.2f}x")
    from ray import serve

    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()

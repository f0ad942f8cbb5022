"""The Ray Serve engine on a local Ray cluster on this machine: 2 CPU replicas, demo models.

Slow to start (~1 min on 2 cores), so one cluster serves the whole module. Run on its own:
    pytest tests/test_ray_engine.py -x -q
"""
from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import pytest

import ray  # noqa: E402

from backend.engines.ray_engine import Outcome, Progress, RayEngine, RayEngineConfig  # noqa: E402
from backend.errors import AdapterError, Cancelled  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)

MODEL = "demo:sd3.5"
FAST = {"prompt": "a red fox", "seed": 3, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def adapters(data_dir):
    """Two demo adapters for MODEL, as job adapter dicts."""
    from backend.lora import demo_adapters

    paths = demo_adapters.for_model(MODEL, data_dir)[:2]
    return {chr(ord("A") + i): {"name": p.stem, "path": str(p), "scale": 1.0} for i, p in enumerate(paths)}


@pytest.fixture(scope="module")
def engine(demo_path, data_dir):
    demo_path(MODEL)  # build once here, not concurrently in both replicas
    eng = RayEngine(RayEngineConfig(replicas=2, cpus_per_replica=0.5, num_cpus=2, device="cpu",
                                    data_dir=str(data_dir), slots_per_replica=1))
    eng.start()
    yield eng
    eng.stop()


def _run(engine, job_id, adapters=(), params=FAST):
    outcome = engine.submit({"id": job_id, "model": MODEL, "params": params, "adapters": list(adapters)}).wait()
    assert outcome.status == "succeeded", outcome.error
    return outcome


def _pixels(result):
    return np.stack([np.asarray(x) for x in (result.images or result.frames)])


def _round_robin_loads(keys, replicas: int, slots: int) -> int:
    """Slot loads the same replicas (LRU of `slots` each) would do if jobs went round-robin."""
    caches = [OrderedDict() for _ in range(replicas)]
    loads = 0
    for i, key in enumerate(keys):
        cache = caches[i % replicas]
        if key in cache:
            cache.move_to_end(key)
            continue
        loads += 1
        cache[key] = True
        if len(cache) > slots:
            cache.popitem(last=False)
    return loads


def test_mixed_load_needs_fewer_adapter_loads_than_round_robin(engine, adapters):
    order = ["A", "A", "B", "B"] * 3
    loads = 0
    for i, name in enumerate(order):  # on a cold pool: the first test of the module
        cost = _run(engine, f"mix-{i}", [adapters[name]]).result.metadata["engine"]["this_job"]
        loads += cost["adapter_loads"]
    baseline = _round_robin_loads(order, replicas=2, slots=1)
    assert loads < baseline, (loads, baseline)


def test_jobs_for_adapter_a_land_on_the_replica_that_holds_a(engine, adapters):
    first = {n: _run(engine, f"aff-{n}", [adapters[n]]).result.metadata["engine"] for n in "AB"}
    assert first["A"]["replica"] != first["B"]["replica"]  # one slot per replica: they split
    for n in "AB":  # the evicted slot's adapter is gone from the replica; only its own is resident
        assert first[n]["resident_adapters"] == [adapters[n]["name"]]
    for i in range(3):
        for n in "AB":
            meta = _run(engine, f"aff-{n}-{i}", [adapters[n]]).result.metadata["engine"]
            assert meta["replica"] == first[n]["replica"], f"job {i} for adapter {n} went to another replica"
            assert meta["this_job"]["adapter_loads"] == 0, "a resident adapter was loaded again"


def test_outputs_equal_the_local_engine_for_the_same_seed(engine, adapters, data_dir):
    from backend.lora import LoRARequest, attach
    from backend.manager import PipelineManager

    params = {"prompt": "a lighthouse at dusk", "seed": 11, "num_inference_steps": 3}
    local = PipelineManager(device="cpu", data_dir=data_dir)
    local.load(MODEL)
    attach(local)
    a = adapters["A"]
    expected = {
        "base": local.generate(dict(params)),
        "A": local.generate(dict(params), adapters=[(LoRARequest(a["name"], 1, a["path"]), 1.0)]),
    }
    assert not np.array_equal(_pixels(expected["base"]), _pixels(expected["A"]))  # the adapter does something
    for name, used in (("base", []), ("A", [a])):
        remote = _run(engine, f"same-seed-{name}", used, params).result
        assert np.array_equal(_pixels(remote), _pixels(expected[name])), name
        assert remote.metadata["params"] == expected[name].metadata["params"]


def _first_progress(run):
    events = run.events()
    for event in events:
        assert isinstance(event, Progress), event
        return event, events
    raise AssertionError("no progress event")


def test_cancel_stops_a_running_job_and_the_replica_serves_the_next(engine):
    run = engine.submit({"id": "cancel-me", "model": MODEL,
                         "params": {**FAST, "num_inference_steps": 1000}})
    progress, events = _first_progress(run)
    started = time.time()
    run.cancel()
    outcome = [e for e in events if isinstance(e, Outcome)][0]
    assert outcome.status == "cancelled" and isinstance(outcome.error, Cancelled)
    assert time.time() - started < 30
    _run(engine, "after-cancel")


def test_a_replica_killed_mid_job_fails_that_job_and_the_next_succeeds(engine):
    run = engine.submit({"id": "doomed", "model": MODEL, "params": {**FAST, "num_inference_steps": 1000}})
    progress, events = _first_progress(run)
    ray.kill(ray.get_actor(engine.replica_actor_name(progress.replica), namespace="serve"), no_restart=True)
    outcome = [e for e in events if isinstance(e, Outcome)][0]
    assert outcome.status == "failed"
    assert progress.replica in outcome.error.message and "died" in outcome.error.message
    after = _run(engine, "survivor")
    assert after.result.metadata["engine"]["replica"] != progress.replica
    # Serve replaces the dead replica (a new id, once its health check has noticed): back to two.
    deadline = time.time() + 120
    while not (engine.replica_ids() - {progress.replica, after.result.metadata["engine"]["replica"]}) \
            or engine.replica_count() < 2:
        assert time.time() < deadline, "Serve did not restart the killed replica"
        time.sleep(1)


def test_a_stale_adapter_copy_on_a_node_fails_the_job_by_name(engine, tmp_path):
    adapter = tmp_path / "style.safetensors"
    adapter.write_bytes(b"the copy on this node")
    run = engine.submit({"id": "stale", "model": MODEL, "params": FAST,
                         "adapters": [{"name": "style", "path": str(adapter), "sha256": "0" * 64}]})
    outcome = run.wait()
    assert outcome.status == "failed" and isinstance(outcome.error, AdapterError)
    assert str(adapter) in outcome.error.message and "sha256" in outcome.error.message
    _run(engine, "after-stale")

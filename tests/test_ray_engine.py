"""The Ray Serve engine on a local Ray cluster on this machine: 2 CPU replicas, demo models.

Slow to start (~1 min on 2 cores), so one cluster serves the whole module. Run on its own:
    pytest tests/test_ray_engine.py -x -q
"""
from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from backend.engines.ray_engine import Outcome, Progress, RayEngine, RayEngineConfig  # noqa: E402
from backend.errors import AdapterError, Cancelled  # noqa: E402

MODEL_A, MODEL_B = "demo:sd3.5", "demo:qwen-image"
FAST = {"prompt": "a red fox", "seed": 3, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def engine(demo_path, data_dir):
    for model in (MODEL_A, MODEL_B):
        demo_path(model)  # build once here, not concurrently in both replicas
    eng = RayEngine(RayEngineConfig(replicas=2, cpus_per_replica=0.5, num_cpus=2, device="cpu",
                                    data_dir=str(data_dir), slots_per_replica=1))
    eng.start()
    yield eng
    eng.stop()


def _run(engine, job_id, model, params=FAST, adapters=None):
    outcome = engine.submit({"id": job_id, "model": model, "params": params, "adapters": adapters}).wait()
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


def test_mixed_load_needs_fewer_slot_loads_than_round_robin(engine):
    keys = [MODEL_A, MODEL_A, MODEL_B, MODEL_B] * 3
    loads = 0
    for i, model in enumerate(keys):  # on a cold pool: the first test of the module
        cost = _run(engine, f"mix-{i}", model).result.metadata["engine"]["this_job"]
        loads += cost["slot_loads"]
    baseline = _round_robin_loads(keys, replicas=2, slots=1)
    assert loads < baseline, (loads, baseline)


def test_jobs_for_a_slot_land_on_the_replica_that_holds_it(engine):
    first = {m: _run(engine, f"aff-{m}", m).result.metadata["engine"] for m in (MODEL_A, MODEL_B)}
    assert first[MODEL_A]["replica"] != first[MODEL_B]["replica"]  # one slot per replica: they split
    for i in range(3):
        for m in (MODEL_A, MODEL_B):
            meta = _run(engine, f"aff-{m}-{i}", m).result.metadata["engine"]
            assert meta["replica"] == first[m]["replica"], f"job {i} for {m} went to another replica"
            assert meta["slot_loads"] == first[m]["slot_loads"], "a resident slot was loaded again"


def test_outputs_equal_the_local_engine_for_the_same_seed(engine, manager_for):
    params = {"prompt": "a lighthouse at dusk", "seed": 11, "num_inference_steps": 3}
    remote = _run(engine, "same-seed", MODEL_A, params).result
    local = manager_for(MODEL_A).generate(dict(params))
    assert np.array_equal(_pixels(remote), _pixels(local))
    assert remote.metadata["params"] == local.metadata["params"]


def _first_progress(run):
    events = run.events()
    for event in events:
        assert isinstance(event, Progress), event
        return event, events
    raise AssertionError("no progress event")


def test_cancel_stops_a_running_job_and_the_replica_serves_the_next(engine):
    run = engine.submit({"id": "cancel-me", "model": MODEL_A,
                         "params": {**FAST, "num_inference_steps": 1000}})
    progress, events = _first_progress(run)
    started = time.time()
    run.cancel()
    outcome = [e for e in events if isinstance(e, Outcome)][0]
    assert outcome.status == "cancelled" and isinstance(outcome.error, Cancelled)
    assert time.time() - started < 30
    _run(engine, "after-cancel", MODEL_A)


def test_a_replica_killed_mid_job_fails_that_job_and_the_next_succeeds(engine):
    run = engine.submit({"id": "doomed", "model": MODEL_A, "params": {**FAST, "num_inference_steps": 1000}})
    progress, events = _first_progress(run)
    ray.kill(ray.get_actor(engine.replica_actor_name(progress.replica), namespace="serve"), no_restart=True)
    outcome = [e for e in events if isinstance(e, Outcome)][0]
    assert outcome.status == "failed"
    assert progress.replica in outcome.error.message and "died" in outcome.error.message
    after = _run(engine, "survivor", MODEL_A)
    assert after.result.metadata["engine"]["replica"] != progress.replica
    # Serve replaces the dead replica: the pool is back to two.
    deadline = time.time() + 120
    while engine.replica_count() < 2:
        assert time.time() < deadline, "Serve did not restart the killed replica"
        time.sleep(1)


def test_a_stale_adapter_copy_on_a_node_fails_the_job_by_name(engine, tmp_path):
    adapter = tmp_path / "style.safetensors"
    adapter.write_bytes(b"the copy on this node")
    run = engine.submit({"id": "stale", "model": MODEL_A, "params": FAST,
                         "adapters": [{"name": "style", "path": str(adapter), "sha256": "0" * 64}]})
    outcome = run.wait()
    assert outcome.status == "failed" and isinstance(outcome.error, AdapterError)
    assert str(adapter) in outcome.error.message and "sha256" in outcome.error.message
    _run(engine, "after-stale", MODEL_A)

"""``--lora-backend peft --lora-path P`` with the Ray engine: every replica pre-loads and pins P in
its constructor (its node's copy checked by sha256 against the head's hash), and a request that
names the adapter runs as on the local engine.

One Studio on a private local Ray instance: 2 CPU replicas of demo:sd3.5. Slow to start; run alone:
    pytest tests/test_ray_preload.py -x -q
"""
from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest

pytest.importorskip("ray")

from PIL import Image  # noqa: E402

from backend.engines.ray_engine import PreloadPlan, RayEngine, RayEngineConfig, adapter_sha256  # noqa: E402
from backend.errors import StudioError  # noqa: E402

MODEL = "demo:sd3.5"
PARAMS = {"prompt": "a lighthouse at dusk", "num_inference_steps": 2}


@pytest.fixture(scope="module")
def pinned(demo_path, data_dir):
    """The --lora-path adapter: a demo file in the library, so a request can name it (as locally)."""
    from backend.lora import demo_adapters

    demo_path(MODEL)  # build once here, not concurrently in both replicas
    return demo_adapters.for_model(MODEL, data_dir)[1]


# -- the head's side: no cluster ------------------------------------------------------------------
def test_the_plan_names_each_adapter_as_the_local_worker_with_the_heads_sha256(pinned):
    from backend.lora import PRELOAD_ID_BASE

    plan = PreloadPlan.resolve(MODEL, [str(pinned)])
    (ref,) = plan.adapters
    assert (ref.name, ref.int_id, ref.sha256) == (pinned.stem, PRELOAD_ID_BASE, adapter_sha256(pinned))
    assert PreloadPlan.from_dict(plan.to_dict()) == plan  # what travels to the replicas


def test_a_missing_lora_path_stops_the_server_before_ray_starts(data_dir, tmp_path):
    import ray

    from backend.service import Studio

    missing = tmp_path / "gone.safetensors"
    with pytest.raises(StudioError) as err:  # refused while the server is built, before any Ray call
        Studio(MODEL, data_dir=data_dir, device="cpu", db_path=tmp_path / "jobs.sqlite", engine="ray",
               lora_paths=[str(missing)])
    assert f"--lora-path {missing}" in err.value.message and "\n" not in err.value.message
    assert not ray.is_initialized()


# -- the deployment ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def studio(pinned, data_dir, tmp_path_factory):
    from backend.service import Studio

    db = tmp_path_factory.mktemp("ray-preload") / "jobs.sqlite"
    s = Studio(MODEL, data_dir=data_dir, device="cpu", db_path=db, engine="ray", replicas=2,
               lora_paths=[str(pinned)])
    s.start(timeout=600)
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(pinned, data_dir):
    """The local worker's manager with the same --lora-path, on one torch thread like a 1-CPU
    replica (CPU matmuls reduce in a thread-count-dependent order)."""
    import torch

    from backend.lora import attach
    from backend.manager import PipelineManager

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = PipelineManager(device="cpu", data_dir=data_dir)
    m.load(MODEL)
    attach(m, preload=[str(pinned)])  # what backend/jobs/worker.py does with --lora-path
    yield m
    torch.set_num_threads(threads)


def _pixels(job):
    return np.asarray(Image.open(job["result"]["path"]).convert("RGB"))


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_both_replicas_pin_it_at_start_and_a_job_naming_it_loads_nothing(studio, local, pinned):
    from backend.lora import LoRARequest

    name = pinned.stem
    done, replicas = [], set()
    for _ in range(6):  # concurrent pairs naming the adapter, until both replicas have run one
        jobs = [studio.submit("generate", {**PARAMS, "seed": s}, [{"name": name}]) for s in (5, 6)]
        done += [studio.wait(j["id"], timeout=300) for j in jobs]
        replicas = {j["result"]["metadata"]["engine"]["replica"] for j in done if j["result"]}
        if len(replicas) == 2:
            break
    assert len(replicas) == 2, [j.get("error") for j in done]
    by_replica: dict[str, list] = {}
    for job in done:
        assert job["status"] == "succeeded", job.get("error")
        engine = job["result"]["metadata"]["engine"]
        by_replica.setdefault(engine["replica"], []).append(job)
        # pinned and read from disk once, in the constructor; no job loaded it again
        assert engine["pinned_adapters"] == [name] and name in engine["resident_adapters"]
        assert engine["adapter_loads"] == 1 and engine["this_job"]["adapter_loads"] == 0
        assert engine["model_loads"] == 1 and engine["this_job"]["model_loads"] == 0
    # each replica's very first job is among them (so the pin predates any request)
    firsts = [min(jobs, key=lambda j: j["result"]["metadata"]["engine"]["jobs"]) for jobs in by_replica.values()]
    assert [j["result"]["metadata"]["engine"]["jobs"] for j in firsts] == [1, 1]

    # the local engine runs the name as the server's resolver hands it over: the library path, its own id
    for job in firsts:
        seed = job["params"]["seed"]
        want = local.generate({**PARAMS, "seed": seed}, adapters=[(LoRARequest(name, 1, str(pinned)), 1.0)])
        assert np.array_equal(_pixels(job), np.asarray(want.images[0].convert("RGB"))), seed
        got = job["result"]["metadata"]["adapters"]
        assert [(a["name"], a["sha256"], a["scale"]) for a in got] == \
            [(a["name"], a["sha256"], a["scale"]) for a in want.metadata["adapters"]]
        plain = local.generate({**PARAMS, "seed": seed})
        assert not np.array_equal(np.asarray(plain.images[0]), np.asarray(want.images[0]))  # the adapter acts


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_system_and_v1_loras_report_the_pinned_adapter_as_locally(studio, local, pinned):
    from backend.api import create_app
    from backend.api.server import ThreadedServer

    assert studio.system()["lora_cache"]["pinned"] == local.lora_engine.stats()["pinned"] == [pinned.stem]
    srv = ThreadedServer(create_app(studio)).start()
    try:
        loras = httpx.get(f"{srv.url}/v1/loras", timeout=60).json()
    finally:
        srv.stop()
    assert {row["name"] for row in loras["library"] if row["pinned"]} == {pinned.stem}


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_a_stale_node_copy_stops_the_start_in_one_line_naming_the_file(studio, pinned, data_dir):
    """The head hashed one file, the node holds another (stale rsync): the replica refuses to pin
    it, and starting says why. A second app on the same cluster, replicas needing no CPU."""
    plan = PreloadPlan.resolve(MODEL, [str(pinned)])
    stale = dataclasses.replace(plan, adapters=(dataclasses.replace(plan.adapters[0], sha256="0" * 64),))
    bad = RayEngine(RayEngineConfig(replicas=1, cpus_per_replica=0, device="cpu", data_dir=str(data_dir),
                                    preload=stale, app_name="lora-studio-stale"))
    with pytest.raises(StudioError) as err:
        bad.start()
    message = err.value.message
    assert "\n" not in message and "--lora-path" in message and str(pinned.absolute()) in message
    assert "on node" in message and "sha256" in message and "0000000000000000" in message
    job = studio.wait(studio.submit("generate", {**PARAMS, "seed": 1}, [{"name": pinned.stem}])["id"], timeout=300)
    assert job["status"] == "succeeded", job.get("error")  # the good deployment serves on

"""Distill presets with --engine ray: a property of the deployment, fused by every replica at start.

The first tests need no cluster (the head's side: resolving and hashing the files). The rest run
one Studio on a private local Ray instance: 2 CPU replicas of demo:qwen-image with the
qwen-image-2512-lightning-4step preset (its demo stand-in file). Slow to start; run on its own:
    pytest tests/test_ray_distill.py -x -q
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

import numpy as np
import pytest

pytest.importorskip("ray")

from PIL import Image  # noqa: E402

from backend.distill.lifecycle import file_sha256  # noqa: E402
from backend.engines.ray_engine import DistillPlan, _standin_on_this_node  # noqa: E402
from backend.errors import AdapterError, ContractViolation, InvalidParameter, StudioError  # noqa: E402

MODEL = "demo:qwen-image"
PRESET = "qwen-image-2512-lightning-4step"
OTHER = "qwen-image-2512-lightning-8step"
PROMPT = "a lighthouse at dusk"
ROOT = Path(__file__).resolve().parents[1]


# -- the head's side: no cluster ------------------------------------------------------------------
def test_the_plan_names_each_file_with_the_heads_sha256(data_dir):
    plan = DistillPlan.resolve(MODEL, preset=PRESET, data_dir=data_dir)
    (ref,) = plan.files
    assert plan.preset == PRESET and plan.components == ("transformer",)
    assert Path(ref.path).name == "Qwen-Image-2512-Lightning-4steps-V1.0-bf16.safetensors"
    assert ref.sha256 == file_sha256(Path(ref.path))
    assert DistillPlan.from_dict(plan.to_dict()) == plan  # what travels to the replicas
    # the plain --lora-path form finds the same file and hash (the preset then matches by name)
    plain = DistillPlan.resolve(MODEL, lora_paths=[ref.path], data_dir=data_dir)
    assert plain.files == plan.files and plain.preset is None


@pytest.mark.parametrize("kwargs,param", [
    ({"preset": "wan2.1-t2v-lightx2v-4step"}, "preset"),  # a preset for another pipeline
    ({"lora_paths": ["/nowhere/lightning.safetensors"]}, "lora_path"),
    ({"lora_paths": ["a_high_noise.safetensors", "b_low_noise.safetensors"]}, "lora_path"),  # 2 files, 1 denoiser
])
def test_a_bad_preset_or_file_stops_the_server_at_start_by_name(data_dir, kwargs, param):
    with pytest.raises((InvalidParameter, AdapterError)) as err:
        DistillPlan.resolve(MODEL, data_dir=data_dir, **kwargs)
    assert err.value.param == param


def test_a_node_without_the_demo_standin_builds_the_same_bytes(data_dir):
    plan = DistillPlan.resolve(MODEL, preset=PRESET, data_dir=data_dir)
    (ref,) = plan.files
    Path(ref.path).unlink()  # what a fresh node sees
    _standin_on_this_node(plan, ref, "transformer", data_dir)
    assert file_sha256(Path(ref.path)) == ref.sha256


def test_serve_with_a_preset_for_another_pipeline_exits_2_naming_it(data_dir):
    r = subprocess.run([sys.executable, "app.py", "serve", MODEL, "--engine", "ray", "--preset",
                        "wan2.1-t2v-lightx2v-4step", "--data-dir", str(data_dir), "--device", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "'wan2.1-t2v-lightx2v-4step' is for WanPipeline" in r.stderr


# -- the deployment ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def studio(data_dir, tmp_path_factory):
    from backend.service import Studio

    db = tmp_path_factory.mktemp("ray-distill") / "jobs.sqlite"
    s = Studio(MODEL, data_dir=data_dir, device="cpu", db_path=db, engine="ray", replicas=2, preset=PRESET)
    s.start(timeout=600)
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(data_dir):
    """The local engine's manager with the same preset, on one torch thread like a 1-CPU replica
    (CPU matmuls reduce in a thread-count-dependent order)."""
    import torch

    from backend.lora import attach
    from backend.manager import PipelineManager

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = PipelineManager(device="cpu", data_dir=data_dir)
    m.load(MODEL)
    m.apply_preset(PRESET)
    attach(m)  # as the local worker: PEFT on top of the fused base
    yield m
    torch.set_num_threads(threads)


def _done(studio, params, adapters=None, timeout=300):
    return studio.wait(studio.submit("generate", params, adapters)["id"], timeout=timeout)


def _pixels(job):
    return np.asarray(Image.open(job["result"]["path"]).convert("RGB"))


def _on_both_replicas(studio, seeds, rounds=6):
    """Finished jobs, submitted in concurrent pairs until both replicas have run some."""
    done = []
    for _ in range(rounds):
        jobs = [studio.submit("generate", {"prompt": PROMPT, "seed": s}) for s in seeds]
        done += [studio.wait(j["id"], timeout=300) for j in jobs]
        if len({j["result"]["metadata"]["engine"]["replica"] for j in done if j["result"]}) == 2:
            break
    return done


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_every_replica_fuses_the_same_files_and_equals_the_local_engine(studio, local):
    fused = studio.system()["fused"]
    expected = local.fused_state()
    assert fused["state"] == "fused" and fused["preset"] == PRESET
    assert [f["sha256"] for f in fused["files"]] == [f["sha256"] for f in expected["files"]]

    seeds = [5, 6]
    done = _on_both_replicas(studio, seeds)
    replicas = set()
    for i, job in enumerate(done):
        assert job["status"] == "succeeded", job.get("error")
        meta = job["result"]["metadata"]
        replicas.add(meta["engine"]["replica"])
        # which preset and files (by sha256) the replica ran with, and the fused result
        assert meta["distill"]["preset"] == PRESET
        assert [f["sha256"] for f in meta["distill"]["files"]] == [f["sha256"] for f in expected["files"]]
        assert meta["distill"]["checksums"] == expected["checksums"]
        assert meta["params"]["num_inference_steps"] == 4 and meta["params"]["true_cfg_scale"] == 1.0  # defaults
        want = local.generate({"prompt": PROMPT, "seed": seeds[i % 2]}).images[0]
        assert np.array_equal(_pixels(job), np.asarray(want.convert("RGB"))), f"job {i}"
    assert len(replicas) == 2, replicas
    assert studio.system()["fused"]["checksums"] == expected["checksums"]


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
@pytest.mark.parametrize("field,value", [("num_inference_steps", 8), ("true_cfg_scale", 4.0)])
def test_a_request_that_breaks_the_preset_is_rejected_by_name(studio, local, field, value):
    """... and before it is queued: the Studio checks the fused preset's requirements at submit (#26), with
    the words the replica's own check uses."""
    params = {"prompt": PROMPT, "seed": 1, field: value}
    with pytest.raises(ContractViolation) as local_err:
        local.generate(dict(params))
    before = {j["id"] for j in studio.jobs(limit=1000)}
    with pytest.raises(ContractViolation) as served_err:
        studio.submit("generate", dict(params))
    assert served_err.value.message == local_err.value.message and field in served_err.value.message
    assert served_err.value.http_status == 422 and served_err.value.param == field
    assert {j["id"] for j in studio.jobs(limit=1000)} == before


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_per_request_adapters_run_on_top_of_the_fused_base_as_locally(studio, local, data_dir):
    from backend.lora import LoRARequest, demo_adapters

    path = demo_adapters.for_model(MODEL, data_dir)[0]
    job = _done(studio, {"prompt": PROMPT, "seed": 9}, [{"name": path.stem, "path": str(path)}])
    assert job["status"] == "succeeded", job.get("error")
    assert job["result"]["metadata"]["distill"]["checksums"] == local.fused_state()["checksums"]
    want = local.generate({"prompt": PROMPT, "seed": 9}, adapters=[(LoRARequest(path.stem, 1, str(path)), 1.0)])
    plain = local.generate({"prompt": PROMPT, "seed": 9})
    assert not np.array_equal(np.asarray(want.images[0]), np.asarray(plain.images[0]))  # the adapter acts
    assert np.array_equal(_pixels(job), np.asarray(want.images[0].convert("RGB")))


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_over_http_the_contract_is_422_and_metrics_report_the_fused_preset(studio, local):
    from backend.api import create_app
    from backend.api.server import ThreadedServer

    srv = ThreadedServer(create_app(studio)).start()
    try:
        r = httpx.post(f"{srv.url}/v1/images/generations", timeout=120,
                       json={"prompt": "x", "extra_body": {"num_inference_steps": 8}})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "num_inference_steps" and PRESET in r.json()["error"]["message"]
        system = httpx.get(f"{srv.url}/metrics", timeout=30).json()
    finally:
        srv.stop()
    assert system["preset"] == PRESET and system["fused"]["preset"] == PRESET
    assert [f["sha256"] for f in system["fused"]["files"]] == [f["sha256"] for f in local.fused_state()["files"]]


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_a_run_time_preset_switch_is_refused_naming_the_start_flag(studio):
    with pytest.raises(StudioError) as err:
        studio.apply_preset(OTHER)
    assert err.value.param == "preset" and f"--preset {OTHER}" in err.value.message
    with pytest.raises(StudioError) as err:
        studio.restore_base()
    assert err.value.param == "preset" and "--preset" in err.value.message
    same = studio.apply_preset(PRESET)  # what the deployment runs already: answered as locally
    assert same["preset"] == PRESET and same["defaults"] == {"num_inference_steps": 4, "true_cfg_scale": 1.0}
    assert studio.system()["fused"]["preset"] == PRESET


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_another_model_runs_unfused_and_switching_back_fuses_again(studio, local):
    studio.wait(studio.switch_model("demo:sd3.5")["id"], timeout=120)
    assert studio.system()["fused"]["state"] == "base" and studio.current_preset() is None
    other = _done(studio, {"prompt": PROMPT, "seed": 1, "num_inference_steps": 8})  # no 4-step contract here
    assert other["status"] == "succeeded", other.get("error")
    assert other["result"]["metadata"]["distill"] is None
    studio.wait(studio.switch_model(MODEL)["id"], timeout=120)
    assert studio.system()["fused"]["preset"] == PRESET and studio.current_preset() == PRESET
    reloaded = [j for j in _on_both_replicas(studio, [7, 8])
                if j["result"] and j["result"]["metadata"]["engine"]["this_job"]["model_loads"]]
    assert reloaded, "no job reached the replica that had switched to demo:sd3.5"
    meta = reloaded[0]["result"]["metadata"]
    assert meta["engine"]["replica"] == other["result"]["metadata"]["engine"]["replica"]
    assert meta["distill"]["preset"] == PRESET and meta["distill"]["checksums"] == local.fused_state()["checksums"]


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_a_killed_replica_comes_back_fused_and_the_next_job_succeeds(studio, local):
    import ray

    engine = studio.supervisor.engine
    first = _done(studio, {"prompt": PROMPT, "seed": 2})
    victim = first["result"]["metadata"]["engine"]["replica"]
    ray.kill(ray.get_actor(engine.replica_actor_name(victim), namespace="serve"), no_restart=True)
    after = _done(studio, {"prompt": PROMPT, "seed": 2})  # the survivor serves meanwhile
    assert after["status"] == "succeeded", after.get("error")
    assert after["result"]["metadata"]["engine"]["replica"] != victim
    seen = {after["result"]["metadata"]["engine"]["replica"], victim}
    # Serve notices the death at its next health check (10 s), starts a replacement under a new
    # id, and routes to it once its constructor (load + fuse) has returned.
    deadline = time.time() + 180
    while not (engine.replica_ids() - seen) or engine.replica_count() < 2:
        assert time.time() < deadline, "Serve did not restart the killed replica"
        time.sleep(0.5)
    # The survivor holds the base slot, so plain jobs stay there; a slot no replica holds goes to
    # the one with the fewest slots: the restarted replica (Serve's multiplexed routing).
    from backend.lora import demo_adapters

    fresh = None
    for path in demo_adapters.for_model(MODEL, studio.data_dir)[1:]:
        job = _done(studio, {"prompt": PROMPT, "seed": 3}, [{"name": path.stem, "path": str(path)}])
        assert job["status"] == "succeeded", job.get("error")
        if job["result"]["metadata"]["engine"]["replica"] not in seen:
            fresh = job["result"]["metadata"]
            break
    assert fresh is not None, "no job reached the restarted replica"
    # it fused in its constructor, before serving: the same files and checksums, no load on the job
    assert fresh["distill"]["preset"] == PRESET
    assert fresh["distill"]["checksums"] == local.fused_state()["checksums"]
    assert fresh["engine"]["model_loads"] == 1 and fresh["engine"]["this_job"]["model_loads"] == 0

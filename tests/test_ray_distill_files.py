"""``--lora-backend distill --lora-path HIGH LOW`` with the Ray engine: a replica fuses a Wan2.2
pair (high noise -> transformer, low noise -> transformer_2) as the local worker does, the
files' names bring their preset's contract, and per-request adapters are refused by name.

One replica on a private local Ray instance (its own module: a cluster per module). Run alone:
    pytest tests/test_ray_distill_files.py -x -q
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ray")

from backend.engines.ray_engine import DistillPlan, RayEngine, RayEngineConfig  # noqa: E402
from backend.errors import ContractViolation, InvalidParameter  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)

MODEL = "demo:wan2.2-t2v"
PRESET = "wan2.2-t2v-a14b-lightx2v-4step"
PARAMS = {"prompt": "a cat playing with yarn", "seed": 7}


@pytest.fixture(scope="module")
def files(demo_path, data_dir):
    from backend import presets

    demo_path(MODEL)
    return [str(p) for p in presets.resolve_files(presets.get_preset(PRESET), MODEL, data_dir)]


@pytest.fixture(scope="module")
def engine(files, data_dir):
    plan = DistillPlan.resolve(MODEL, lora_paths=files, data_dir=data_dir)
    assert plan.components == ("transformer", "transformer_2") and plan.preset is None
    eng = RayEngine(RayEngineConfig(replicas=1, num_cpus=1, device="cpu", data_dir=str(data_dir),
                                    lora_backend="distill", distill=plan)).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def local(files, data_dir):
    """The local worker under --lora-backend distill: fuse(paths, lora_scale), no PEFT engine; one
    torch thread like a 1-CPU replica."""
    import torch

    from backend.manager import PipelineManager

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = PipelineManager(device="cpu", data_dir=data_dir)
    m.load(MODEL)
    m.fuse(files, 1.0)
    yield m
    torch.set_num_threads(threads)


def _frames(result):
    return np.stack([np.asarray(f) for f in result.frames])


def test_the_pair_is_fused_as_locally_and_the_output_is_the_same(engine, local):
    outcome = engine.submit({"id": "wan-1", "model": MODEL, "params": PARAMS}).wait()
    assert outcome.status == "succeeded", outcome.error
    meta, expected = outcome.result.metadata, local.fused_state()
    assert [(f["component"], f["sha256"]) for f in meta["distill"]["files"]] == \
        [(f["component"], f["sha256"]) for f in expected["files"]]
    assert meta["distill"]["checksums"] == expected["checksums"] != expected["base_checksums"]
    assert meta["distill"]["preset"] == PRESET  # matched by the files' names, so its contract applies
    assert meta["engine"]["replica"] == outcome.replica
    assert np.array_equal(_frames(outcome.result), _frames(local.generate(dict(PARAMS))))


def test_breaking_the_contract_or_asking_for_a_lora_is_refused_by_name(engine, local, files):
    params = {**PARAMS, "guidance_scale_2": 3.0}
    with pytest.raises(ContractViolation) as local_err:
        local.generate(dict(params))
    outcome = engine.submit({"id": "wan-bad", "model": MODEL, "params": params}).wait()
    assert outcome.status == "failed" and isinstance(outcome.error, ContractViolation)
    assert outcome.error.param == "guidance_scale_2" and outcome.error.message == local_err.value.message

    outcome = engine.submit({"id": "wan-lora", "model": MODEL, "params": PARAMS,
                             "adapters": [{"name": "extra", "path": files[0]}]}).wait()
    assert outcome.status == "failed" and isinstance(outcome.error, InvalidParameter)
    assert outcome.error.param == "lora" and "distill" in outcome.error.message


def test_a_node_copy_that_differs_from_the_heads_stops_the_deployment_naming_it(engine, files, data_dir):
    """The head hashed one file, the node holds another (stale rsync): the replica refuses to
    fuse it, and starting says why. A second app on the same cluster, replicas needing no CPU."""
    import dataclasses

    from backend.errors import StudioError

    plan = DistillPlan.resolve(MODEL, lora_paths=files, data_dir=data_dir)
    stale = dataclasses.replace(plan, files=(dataclasses.replace(plan.files[0], sha256="0" * 64), plan.files[1]))
    bad = RayEngine(RayEngineConfig(replicas=1, cpus_per_replica=0, device="cpu", data_dir=str(data_dir),
                                    lora_backend="distill", distill=stale, app_name="lora-studio-stale"))
    with pytest.raises(StudioError) as err:
        bad.start()
    message = err.value.message
    assert files[0] in message and "on node" in message and "sha256" in message and "0000000000000000" in message
    outcome = engine.submit({"id": "wan-2", "model": MODEL, "params": PARAMS}).wait()  # the good app serves on
    assert outcome.status == "succeeded", outcome.error

"""The server with --engine ray: Studio's queue feeding a Ray Serve pool on a private local cluster.

Slow to start (a Ray instance + a replica loading the model), so one Studio serves the module.
Run on its own:  pytest tests/test_ray_server.py -x -q
"""
from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from PIL import Image  # noqa: E402

from backend.errors import InvalidParameter  # noqa: E402
from backend.service import Studio, job_error  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)

MODEL = "demo:sd3.5"


@pytest.fixture(scope="module")
def studio(data_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("ray-server") / "jobs.sqlite"
    s = Studio(MODEL, data_dir=data_dir, device="cpu", db_path=db, engine="ray", replicas=1)
    s.start(timeout=600)
    yield s
    s.close()


def test_jobs_through_the_queue_run_on_a_replica_and_equal_the_local_engine(studio, data_dir):
    import torch

    from backend.manager import PipelineManager

    assert studio.system()["model"] == MODEL and studio.supervisor.info["spec"]["pipeline"]
    params = [{"prompt": "a lighthouse at dusk", "seed": 11, "num_inference_steps": 2},
              {"prompt": "a red fox", "seed": 5, "num_inference_steps": 3}]
    jobs = [studio.submit("generate", p) for p in params]
    done = [studio.wait(j["id"], timeout=300) for j in jobs]

    # Ray runs a 1-CPU replica with one torch thread; the reference must too (CPU matmuls
    # reduce in a thread-count-dependent order).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = PipelineManager(device="cpu", data_dir=data_dir)
        local.load(MODEL)
        expected = [np.asarray(local.generate(dict(p)).images[0]) for p in params]
    finally:
        torch.set_num_threads(threads)
    replicas = set()
    for job, p, pixels in zip(done, params, expected):
        assert job["status"] == "succeeded", job.get("error")
        steps = p["num_inference_steps"]
        assert job["progress"] == {"step": steps, "total": steps}  # per-step progress reached the row
        path = Path(job["result"]["path"])
        assert path.is_file() and path.with_suffix(".png.json").is_file()
        meta = job["result"]["metadata"]
        assert meta["job_id"] == job["id"]
        replicas.add(meta["engine"]["replica"])
        assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), pixels)
    assert len(replicas) == 1 and None not in replicas  # one replica in the pool ran both


def test_job_timeout_stops_a_long_job_on_its_replica_and_the_next_one_runs(studio):
    """--job-timeout holds on --engine ray as on the local worker: the job is cancelled on its replica
    and failed with 504 naming the flag; the replica takes the next job."""
    assert studio.supervisor.job_timeout == studio.limits.job_timeout  # the server's limit reaches the dispatcher
    studio.supervisor.job_timeout = 3.0  # this module's one server: a short limit for this test only
    try:
        started = time.monotonic()
        job = studio.wait(studio.submit("generate", {"prompt": "x", "seed": 1, "num_inference_steps": 1000})["id"],
                          timeout=120)
        took = time.monotonic() - started
    finally:
        studio.supervisor.job_timeout = studio.limits.job_timeout
    assert job["status"] == "failed", job
    err = job_error(job)
    assert err.param == "job_timeout" and err.http_status == 504 and "--job-timeout of 3 s" in err.message, err
    assert took < 60, f"the job ran {took:.0f} s past a 3 s limit"
    ok = studio.wait(studio.submit("generate", {"prompt": "x", "seed": 2, "num_inference_steps": 1})["id"],
                     timeout=120)
    assert ok["status"] == "succeeded", ok.get("error")


def test_cancel_stops_a_running_job_and_a_bad_field_is_refused_with_its_name(studio):
    job = studio.submit("generate", {"prompt": "x", "seed": 1, "num_inference_steps": 1000})
    deadline = time.monotonic() + 120
    while studio.job(job["id"])["progress"]["step"] < 1:
        assert time.monotonic() < deadline, "the long job never reported a step"
        time.sleep(0.2)
    # the replica streams live previews of the running job as the local worker sends them
    while (preview := studio.job_preview(job["id"])) is None:
        assert time.monotonic() < deadline, "no live preview came from the replica"
        time.sleep(0.2)
    assert preview["step"] >= 1 and preview["png"].startswith(b"\x89PNG")
    with Image.open(io.BytesIO(preview["png"])) as img:
        assert max(img.size) == 128
    studio.cancel(job["id"])
    assert studio.wait(job["id"], timeout=60)["status"] == "cancelled"
    assert studio.job_preview(job["id"]) is None  # gone with the run

    # a bad field is refused at submission, naming it, before a job row exists (docs/security.md)
    before = len(studio.jobs(limit=1000))
    with pytest.raises(InvalidParameter, match="num_inference_steps") as refused:
        studio.submit("generate", {"prompt": "x", "num_inference_steps": 0})
    assert refused.value.param == "num_inference_steps" and len(studio.jobs(limit=1000)) == before
    ok = studio.wait(studio.submit("generate", {"prompt": "x", "seed": 2, "num_inference_steps": 1})["id"],
                     timeout=120)
    assert ok["status"] == "succeeded", ok.get("error")

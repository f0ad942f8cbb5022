"""Faults on a real server: cancel of a running job, a full queue, kill -9 of the worker
mid-job, and a server restart with jobs queued and one running."""
from __future__ import annotations

import os
import signal

import httpx
import pytest

from backend.api import create_app
from backend.api.server import ThreadedServer
from backend.service import Studio
from ui_fixtures import wait_until

SHORT = {"prompt": "x", "height": 64, "width": 64, "num_inference_steps": 2, "true_cfg_scale": 1.0, "seed": 1}
# held running by the step gate (``gate``) until the test cancels or kills it
LONG = {**SHORT, "height": 128, "width": 128, "num_inference_steps": 8}


def _studio(data_dir, db, **kw) -> Studio:
    return Studio("demo:qwen-image", data_dir=data_dir, device="cpu", worker_threads=1, db_path=db, **kw)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return tmp_path_factory.mktemp("faults") / "jobs.sqlite"


@pytest.fixture(scope="module")
def server(data_dir, db):
    studio = _studio(data_dir, db, max_queue=2).start()
    srv = ThreadedServer(create_app(studio)).start()
    yield studio, srv.url
    srv.stop()
    studio.close()


def _until(pred, timeout=120.0, what="condition"):
    return wait_until(pred, timeout, what, every=0.05)


def _running_at_step(studio, job_id, step=2):
    return _until(lambda: (j := studio.job(job_id))["status"] == "running" and j["progress"]["step"] >= step
                  and j, what=f"job {job_id} to reach step {step}")


def test_cancel_of_a_running_job_stops_it_at_the_next_step(server, gate):
    studio, url = server
    with gate.held(2):
        job = studio.submit("generate", LONG)
        _running_at_step(studio, job["id"])
        resp = httpx.delete(f"{url}/v1/jobs/{job['id']}")
        assert resp.status_code == 200
        done = studio.wait(job["id"], timeout=60)
    assert done["status"] == "cancelled" and done["result"] is None
    assert done["progress"]["step"] == 2  # it stopped where it was, it did not run to the end
    ok = studio.run("generate", SHORT, timeout=60)
    assert ok["status"] == "succeeded"


def test_cancel_of_a_queued_job(server, gate):
    studio, url = server
    with gate.held(1):
        first = studio.submit("generate", LONG)
        second = studio.submit("generate", SHORT)
        got = httpx.delete(f"{url}/v1/jobs/{second['id']}").json()
        assert got["status"] == "cancelled"
        studio.cancel(first["id"])
        assert studio.wait(first["id"], 60)["status"] == "cancelled"
    assert studio.job(second["id"])["started_at"] is None  # never ran


def test_full_queue_answers_429(server, gate):
    studio, url = server
    with gate.held(1):
        _full_queue_answers_429(studio, url)


def _full_queue_answers_429(studio, url):
    running = studio.submit("generate", LONG)
    _running_at_step(studio, running["id"], 1)
    queued = [studio.submit("generate", SHORT) for _ in range(2)]  # --max-queue 2
    resp = httpx.post(f"{url}/v1/images/generations", json=SHORT, timeout=30)
    assert resp.status_code == 429
    err = resp.json()["error"]
    assert err["type"] == "rate_limit_error" and "max-queue" in err["message"]
    from openai import OpenAI, RateLimitError

    with pytest.raises(RateLimitError):
        OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).images.generate(prompt="x", size="64x64")
    # the queued ones first: cancelling the running job first would let the worker start one
    for j in [*queued, running]:
        studio.cancel(j["id"])
    for j in [running, *queued]:
        assert studio.wait(j["id"], 60)["status"] == "cancelled", j["id"]


def test_kill_9_of_the_worker_mid_job_fails_that_job_and_the_queue_goes_on(server, gate):
    studio, url = server
    with gate.held(2):
        victim = studio.submit("generate", LONG)
        _running_at_step(studio, victim["id"])
        after = studio.submit("generate", SHORT)
        pid = studio.system()["worker"]["pid"]
        os.kill(pid, signal.SIGKILL)
        failed = studio.wait(victim["id"], timeout=30)
    assert failed["status"] == "failed"
    assert "SIGKILL" in failed["error"] and "worker process died" in failed["error"]
    ok = studio.wait(after["id"], timeout=300)
    assert ok["status"] == "succeeded" and os.path.exists(ok["result"]["path"])
    system = studio.system()
    assert system["worker"]["restarts"] == 1 and system["worker"]["pid"] != pid
    assert system["worker"]["deaths"][-1]["job"] == victim["id"]
    # the HTTP side saw it too
    r = httpx.get(f"{url}/v1/jobs/{victim['id']}").json()
    assert r["status"] == "failed"


def test_server_restart_resumes_queued_and_requeues_the_running_job_once(data_dir, db, server, gate):
    studio, _ = server
    with gate.held(1):  # the server goes away while the job runs (held at step 1)
        running = studio.submit("generate", {**SHORT, "num_inference_steps": 3})
        _running_at_step(studio, running["id"], 1)
        queued = [studio.submit("generate", {**SHORT, "seed": s}) for s in (5, 6)]
        studio.supervisor.stop()  # no chance to record anything
        studio.queue.close()
        studio._closed = True

    again = _studio(data_dir, db).start()
    try:
        assert again.recovered == {"requeued": 1, "failed": 0}
        results = [again.wait(j["id"], timeout=300) for j in [running, *queued]]
        assert [r["status"] for r in results] == ["succeeded"] * 3
        assert results[0]["requeues"] == 1
        assert [r["result"]["metadata"]["seed"] for r in results[1:]] == [5, 6]
    finally:
        again.close()

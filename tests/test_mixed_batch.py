"""Mixed-adapter batches (backend/batch.py, UnfusedServing.batch, the worker's batches, --max-batch).

Tolerance: every sample of a batch equals the same request run alone (merged, the CPU default) to
max |pixel difference| <= 1 on the 0-255 scale (1/255): the batched base GEMMs and the per-sample
low-rank GEMMs (bmm) sum in another order than the lone request's, and a float that close to a rounding
boundary can flip one uint8 step. The adapters themselves move the images by far more (checked).
"""
from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
import torch

from backend.batch import compatible_key, generate_batch
from backend.errors import AdapterError, InvalidParameter
from backend.lora.policy import BatchInputs, PolicyInputs, batch_costs, decide_batch
from backend.lora.request import LoRARequest
from backend.weights import module_checksum
from tests.ui_fixtures import app_home, served_app, wait_until

torch.set_num_threads(1)
STEPS = 3
TOL = 1  # max |pixel difference| on 0..255
PROMPTS = ["A piece of cheesecake", "a fox", "a red barn in the snowy mountains at dusk, long prompt", "x"]


def pixels(result) -> np.ndarray:
    return np.asarray(result.images[0], dtype=np.int16)


def adapter_files(library, model):
    sub = model.split(":")[1]
    files = sorted((library / sub).glob("*.safetensors"))
    assert len(files) >= 2, files
    return files[:2]


@pytest.mark.parametrize("model", ["demo:qwen-image", "demo:sd3.5"])
def test_each_sample_of_a_batch_equals_its_request_alone(model, library, managers):
    m = managers(model)
    fa, fb = adapter_files(library, model)
    a, b = LoRARequest(fa.stem, 1, str(fa)), LoRARequest(fb.stem, 2, str(fb))
    # no adapter, one, a stack with a negative scale (listed out of canonical order), the other
    sets = [[], [(a, 1.0)], [(b, 0.8), (a, -0.5)], [(b, 1.2)]]
    requests = [{"prompt": p, "seed": 10 + i, "num_inference_steps": STEPS} for i, p in enumerate(PROMPTS)]
    sums = {c: module_checksum(x) for c, x in m.denoisers().items()}
    batch = generate_batch(m, [dict(r) for r in requests], sets)
    assert {c: module_checksum(x) for c, x in m.denoisers().items()} == sums  # no weight written
    assert not any(x._forward_hooks and any(type(h).__name__ == "_BatchHook" for h in x._forward_hooks.values())
                   for d in m.denoisers().values() for x in d.modules())  # hooks off after the call
    for i, (r, s) in enumerate(zip(requests, sets)):
        alone = m.generate(dict(r), adapters=s)  # the CPU default: merged
        base = m.generate(dict(r), adapters=[])
        got = pixels(batch[i])
        diff = int(np.abs(got - pixels(alone)).max())
        moved = int(np.abs(pixels(alone) - pixels(base)).max())
        print(f"{model} sample {i}: max |batched - alone| = {diff}/255, adapters move it by {moved}/255")
        assert diff <= TOL, (i, diff)
        if s:
            assert moved > 5 * TOL  # the adapters matter: a batch that dropped them would fail above
        else:
            assert int(np.abs(got - pixels(base)).max()) <= TOL  # "no adapter" in a mixed batch: the base
        meta = batch[i].metadata
        assert meta["batch"] == {"size": 4, "index": i} and meta["seed"] == 10 + i
        assert [x["name"] for x in meta["adapters"]] == [x[0].lora_name for x in s]
        assert all(x["mode"] == "unfused" for x in meta["adapters"])
    m.lora_engine.activate([])


def test_a_batch_refuses_requests_that_differ_beyond_prompt_and_seed(library, managers):
    m = managers("demo:qwen-image")
    with pytest.raises(InvalidParameter, match="differs from request 0 in num_inference_steps") as err:
        generate_batch(m, [{"prompt": "a", "num_inference_steps": 2}, {"prompt": "b", "num_inference_steps": 3}],
                       [[], []])
    assert err.value.param == "num_inference_steps"
    # a non-finite delta in one sample's set is refused as the single request is, nothing left hooked
    fa, _ = adapter_files(library, "demo:qwen-image")
    a = LoRARequest(fa.stem, 1, str(fa))
    with pytest.raises(AdapterError, match="not finite"):
        generate_batch(m, [{"prompt": "a", "num_inference_steps": 2}] * 2, [[(a, 1.0)], [(a, 1e300)]])
    assert m.lora_engine.unfused.stats()["hooked_layers"] == 0
    # what the scheduler groups: everything but prompt and seed, never an input image or a forced merge
    k = compatible_key("demo:qwen-image", None, {"prompt": "a", "seed": 1, "num_inference_steps": 4})
    assert k == compatible_key("demo:qwen-image", None, {"prompt": "b", "seed": 9, "num_inference_steps": 4})
    assert k != compatible_key("demo:qwen-image", None, {"prompt": "b", "seed": 9, "num_inference_steps": 5})
    assert k != compatible_key("demo:sd3.5", None, {"prompt": "a", "seed": 1, "num_inference_steps": 4})
    assert compatible_key("demo:qwen-image", None, {"prompt": "a", "lora_mode": "merge"}) is None
    assert compatible_key("demo:wan2.2-i2v", None, {"prompt": "a", "image": "data:..."}) is None


def test_batch_or_one_by_one_by_predicted_cost():
    one = PolicyInputs(steps=4, merge_bytes=400_000_000, bandwidth=2e9, fixed_s=0.02, step_s=0.5, ratio=0.01,
                       hooked_layers=100, hook_s=10e-6, forwards=2)
    # each alone: min(merge 220 ms, unfused 28 ms) + 4 x 0.5 s; batched: 4 steps x (n x 0.5 x eff + lowrank + hooks)
    jobs = [one] * 4
    seq, bat = batch_costs(BatchInputs(jobs=jobs, steps=4, step_s=0.5, batch_eff=1.0, forwards=2, hook_s=10e-6,
                                       hooked_layers=100))
    assert seq == pytest.approx(4 * (2.0 + 0.028))
    assert bat == pytest.approx(4 * (4 * 0.5 + 4 * 0.01 * 0.5 + 2 * 100 * 10e-6))
    assert decide_batch(BatchInputs(jobs=jobs, steps=4, step_s=0.5, batch_eff=1.0, forwards=2, hook_s=10e-6,
                                    hooked_layers=100))["mode"] == "batched"  # the hooks' fixed cost is shared
    # batching measured slower per sample (a compute-bound device at a large size): one by one
    slow = decide_batch(BatchInputs(jobs=jobs, steps=4, step_s=0.5, batch_eff=1.1, forwards=2, hook_s=10e-6,
                                    hooked_layers=100))
    assert slow["mode"] == "sequential" and slow["predicted_batched_s"] > slow["predicted_sequential_s"]
    # the base model only, no gain from batching: one by one; with a measured gain: batched
    assert decide_batch(BatchInputs(jobs=[None] * 4, steps=4, step_s=0.5, batch_eff=1.0))["mode"] == "sequential"
    assert decide_batch(BatchInputs(jobs=[None] * 4, steps=4, step_s=0.5, batch_eff=0.6))["mode"] == "batched"
    assert decide_batch(BatchInputs(jobs=jobs, steps=4, step_s=None))["mode"] == "batched"


# -- over HTTP: a real `app.py serve --max-batch 4` against `--max-batch 1` ---------------------------------
NAMES = ["demo-inverted", "demo-outline", "demo-grayscale", None]


def _body(i: int, name) -> dict:
    body = {"prompt": PROMPTS[i], "size": "64x64", "response_format": "b64_json", "seed": 100 + i,
            "num_inference_steps": STEPS}
    if name:
        body["lora"] = {"name": name, "scale": 0.9}
    return body


def _png(item) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))), dtype=np.int16)


@pytest.fixture(scope="module")
def names(library):
    found = {p.name.removesuffix(".safetensors") for p in (library / "qwen-image").iterdir()}
    assert {n for n in NAMES if n} <= found, found
    return NAMES


@pytest.fixture(scope="module")
def batch_server(data_dir, demo_path, library, tmp_path_factory):
    demo_path("demo:qwen-image")
    with served_app(app_home(data_dir, tmp_path_factory, "batch4"), "--max-batch", "4",
                    "--adapter-dir", str(library)) as app:
        yield app


def queued_behind_a_blocker(c, gate, bodies: list[dict], on_running=None) -> dict:
    """POST ``bodies`` while a job held by the server's step ``gate`` holds the worker, then cancel that
    job: the queued jobs are claimed together. ``on_running(job_ids)`` is called once they all run (held
    at step 2 until it returns). Returns {index: response}, plus "ids" (index -> job id, in submission
    order)."""
    answers: dict = {}

    def post(key, body):
        try:
            answers[key] = c.post("/v1/images/generations", json=body, timeout=300)
        except Exception as exc:  # noqa: BLE001: reported by the assertion below
            answers[key] = exc

    threads = []
    with gate.held(1):
        blocker = threading.Thread(target=post, args=("blocker", {"prompt": "hold", "size": "64x64", "seed": 1,
                                                                  "num_inference_steps": 4}))
        blocker.start()
        wait_until(lambda: c.get("/v1/jobs", params={"status": "running"}).json()["data"], 60, "the blocker runs")
        held = c.get("/v1/jobs", params={"status": "running"}).json()["data"][0]["id"]
        for i, body in enumerate(bodies):  # one after the other: submission order is seq order
            threads.append(threading.Thread(target=post, args=(i, body)))
            threads[-1].start()
            wait_until(lambda: len(c.get("/v1/jobs", params={"status": "queued"}).json()["data"]) == i + 1
                       or i in answers, 60, f"{i + 1} queued jobs")
            assert i not in answers, getattr(answers[i], "text", answers[i])
        queued = c.get("/v1/jobs", params={"status": "queued"}).json()["data"]
        answers["ids"] = {i: j["id"] for i, j in enumerate(sorted(queued, key=lambda j: j["created_at"]))}
        if on_running is not None:
            gate.hold(2)
        assert c.delete(f"/v1/jobs/{held}").status_code == 200
        if on_running is not None:
            wait_until(lambda: len(c.get("/v1/jobs", params={"status": "running"}).json()["data"]) == len(bodies),
                       60, "the batch runs")
            on_running(answers["ids"])
    for t in threads + [blocker]:
        t.join(300)
    return answers


def test_four_jobs_with_different_adapters_run_as_one_batch_over_http(data_dir, library, names, batch_server,
                                                                    tmp_path_factory):
    with batch_server.client() as c:
        answers = queued_behind_a_blocker(c, batch_server.gate, [_body(i, n) for i, n in enumerate(names)])
        batched = {}
        for i in range(4):
            r = answers[i]
            assert not isinstance(r, Exception) and r.status_code == 200, getattr(r, "text", r)
            item = r.json()["data"][0]
            assert item["metadata"]["batch"]["size"] == 4, item["metadata"].get("batch")
            assert item["metadata"]["batch"]["decision"]["mode"] == "batched"
            batched[i] = (_png(item), item["metadata"])
        assert sorted(meta["batch"]["index"] for _, meta in batched.values()) == [0, 1, 2, 3]
        metrics = c.get("/metrics").json()
        assert metrics["jobs"]["succeeded"] == 4 and metrics["jobs"]["cancelled"] == 1
    with served_app(app_home(data_dir, tmp_path_factory, "batch1"), "--adapter-dir", str(library)) as app, \
            app.client() as c:  # --max-batch 1 (the default): each request alone
        for i, n in enumerate(names):
            r = c.post("/v1/images/generations", json=_body(i, n), timeout=300)
            assert r.status_code == 200, r.text
            item = r.json()["data"][0]
            assert "batch" not in item["metadata"]
            alone = _png(item)
            diff = int(np.abs(batched[i][0] - alone).max())
            print(f"http sample {i} ({n}): max |batched - alone| = {diff}/255")
            assert diff <= TOL
            assert [a["name"] for a in batched[i][1]["adapters"]] == [a["name"] for a in item["metadata"]["adapters"]]
            if n is None:
                base_alone = alone

        # #26, A1111's "batch size": n images asking batch_size 4 are claimed together on this --max-batch 1
        # server (the worker's cost model then runs them as one call or one by one, and says which)
        r = c.post("/v1/images/generations", json={**_body(3, None), "n": 4, "batch_size": 4}, timeout=300)
        assert r.status_code == 200, r.text
        items = r.json()["data"]
        assert [it["metadata"]["seed"] for it in items] == [103, 104, 105, 106]
        for it in items:
            batch = it["metadata"]["batch"]
            assert batch["decision"]["mode"] in ("batched", "sequential"), batch
            assert batch["size"] == (4 if batch["decision"]["mode"] == "batched" else 1), batch
        first = items[0]["metadata"]["batch"]["decision"]
        print(f"batch_size 4 on --max-batch 1, first: {first}")
        assert first["mode"] == "batched" and "measure" in first["reason"]  # no batch of 4 measured before
        assert int(np.abs(_png(items[0]) - base_alone).max()) <= TOL  # seed 103: the same picture as alone
        r = c.post("/v1/images/generations", json={**_body(3, None), "n": 4, "batch_size": 4}, timeout=300)
        then = r.json()["data"][0]["metadata"]["batch"]["decision"]
        print(f"batch_size 4 on --max-batch 1, then: {then}")
        assert "batch_eff" in then  # decided from the batch measured above
        for bad, says in ((9, "[1, 8]"), ("four", "integer")):
            r = c.post("/v1/images/generations", json={**_body(3, None), "batch_size": bad}, timeout=60)
            assert r.status_code == 400 and "batch_size" in r.text and says in r.text, r.text


def test_cancelling_one_job_of_a_running_batch_drops_only_that_sample(batch_server, names):
    bodies = [{**_body(i, n), "num_inference_steps": 30} for i, n in enumerate(names[:3])]
    with batch_server.client() as c:
        def cancel_second(ids):  # the batch is held at step 2 (queued_behind_a_blocker) until this returns
            wait_until(lambda: c.get(f"/v1/jobs/{ids[1]}").json()["progress"]["step"] >= 2, 120, "two steps")
            assert c.delete(f"/v1/jobs/{ids[1]}").status_code == 200
            wait_until(lambda: c.get(f"/v1/jobs/{ids[1]}").json()["status"] == "cancelled", 60, "the cancel")

        answers = queued_behind_a_blocker(c, batch_server.gate, bodies, on_running=cancel_second)
        ids = answers["ids"]
        assert answers[1].status_code == 409, answers[1].text  # the cancelled one
        job = c.get(f"/v1/jobs/{ids[1]}").json()
        assert job["status"] == "cancelled" and job["result"] is None
        assert job["progress"]["step"] == 2  # it stopped being reported when it was cancelled
        for i in (0, 2):  # the others finished in the same batch
            assert answers[i].status_code == 200, answers[i].text
            meta = answers[i].json()["data"][0]["metadata"]
            assert meta["batch"]["size"] == 3 and meta["params"]["num_inference_steps"] == 30


def test_a_failure_in_a_batch_fails_only_the_job_that_caused_it(batch_server, names):
    """Issue 25.4: an adapter at a huge but finite scale (accepted at submission) failed the whole batch, so
    another client's good job failed too, with an error naming the first client's adapter. The members of a
    failed batch now run again one by one: each gets its own outcome, and no error names another's adapter."""
    bad = {**_body(1, names[1]), "lora": {"name": names[1], "scale": 1e300}}  # finite, accepted; overflows
    with batch_server.client() as c:
        answers = queued_behind_a_blocker(c, batch_server.gate, [_body(0, names[0]), bad])
        assert answers[0].status_code == 200, answers[0].text
        meta = answers[0].json()["data"][0]["metadata"]
        assert meta["adapters"][0]["name"] == names[0]
        assert "ran alone" in meta["batch"]["decision"]["reason"] and names[1] not in str(meta), meta
        assert answers[1].status_code == 400, answers[1].text
        msg = answers[1].json()["error"]["message"]
        assert ("not finite" in msg or "overflow" in msg) and names[0] not in msg, msg
        r = c.post("/v1/images/generations", json=_body(2, names[2]), timeout=300)  # the queue goes on
        assert r.status_code == 200, r.text


def test_batch_claims_follow_the_queue_order_rules(tmp_path):
    from backend.jobs.queue import JobQueue

    q = JobQueue(tmp_path / "jobs.sqlite", max_overtake=1)
    p = {"num_inference_steps": 4}
    a = q.submit("generate", model="m", params={**p, "prompt": "a", "seed": 1})
    b = q.submit("generate", model="m", params={**p, "prompt": "b", "num_inference_steps": 8})  # incompatible
    c = q.submit("generate", model="m", params={**p, "prompt": "c", "seed": 3}, adapters=[{"name": "x"}])
    q.submit("load_model", model="other", params={})
    d = q.submit("generate", model="m", params={**p, "prompt": "d"})  # behind a control job: never grouped
    first = q.claim(None)
    assert first["id"] == a["id"]
    key = compatible_key("m", None, first["params"])
    more = q.claim_compatible(compatible_key, key, 3)
    assert [j["id"] for j in more] == [c["id"]] and q.get(c["id"])["status"] == "running"
    assert q.get(b["id"])["overtaken"] == 1 and q.get(d["id"])["status"] == "queued"
    q.close()
    # a job passed over max_overtake (1) times is never passed again: nothing behind it is grouped
    q = JobQueue(tmp_path / "jobs2.sqlite", max_overtake=1)
    a = q.submit("generate", model="m", params={**p, "prompt": "a"})
    b = q.submit("generate", model="m", params={**p, "prompt": "b", "num_inference_steps": 8})
    c = q.submit("generate", model="m", params={**p, "prompt": "c"})
    e = q.submit("generate", model="m", params={**p, "prompt": "e"})
    assert q.claim(None)["id"] == a["id"]
    assert [j["id"] for j in q.claim_compatible(compatible_key, key, 1)] == [c["id"]]
    assert q.get(b["id"])["overtaken"] == 1
    assert q.claim_compatible(compatible_key, key, 3) == [] and q.get(e["id"])["status"] == "queued"
    q.close()

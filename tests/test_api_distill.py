"""A distill-mode server: a preset fused at start for the server's lifetime; per-request
``lora`` refused with 400; a request breaking the preset's sampling contract gets 422."""
from __future__ import annotations

import httpx
import pytest


from backend.api import create_app  # noqa: E402
from backend.api.server import ThreadedServer  # noqa: E402
from backend.service import Studio  # noqa: E402

PRESET = "qwen-image-2512-lightning-4step"


@pytest.fixture(scope="module")
def url(data_dir, tmp_path_factory):
    studio = Studio("demo:qwen-image", data_dir=data_dir, device="cpu", worker_threads=1, lora_backend="distill",
                    preset=PRESET, db_path=tmp_path_factory.mktemp("distill-db") / "jobs.sqlite").start()
    srv = ThreadedServer(create_app(studio)).start()
    yield srv.url
    srv.stop()
    studio.close()


def test_fused_at_start_and_preset_defaults_apply(url):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "a cake"}], "extra_body": {"seed": 42}})
    assert r.status_code == 200, r.text
    meta = r.json()["metadata"][0]
    assert meta["params"]["num_inference_steps"] == 4 and meta["params"]["true_cfg_scale"] == 1.0
    assert meta["distill"]["state"] == "fused"
    system = httpx.get(f"{url}/metrics").json()
    assert system["preset"] == PRESET and system["fused"]["state"] == "fused"


def test_per_request_lora_is_refused_with_400(url):
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "lora": {"name": "anything"}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "lora" and "distill" in err["message"]


def test_breaking_the_preset_contract_is_422_by_name(url):
    """... before anything is queued (#26 "refused too late": the job was queued, then failed in the worker)."""
    def jobs() -> set:
        return {j["id"] for j in httpx.get(f"{url}/v1/jobs", params={"limit": 1000}, timeout=30).json()["data"]}

    before = jobs()
    r = httpx.post(f"{url}/v1/images/generations", timeout=120,
                   json={"prompt": "x", "extra_body": {"num_inference_steps": 8}})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "num_inference_steps" and PRESET in err["message"]
    # #26's sampler picker: the Lightning LoRA is distilled for its Euler schedule, so UniPC is refused too
    r = httpx.post(f"{url}/v1/images/generations", timeout=120,
                   json={"prompt": "x", "extra_body": {"sample_solver": "unipc"}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "sample_solver", r.text
    assert jobs() == before


@pytest.fixture(scope="module")
def peft_studio(data_dir, tmp_path_factory):
    from backend.lora import demo_adapters

    demo_adapters.ensure(data_dir)
    studio = Studio("demo:qwen-image", data_dir=data_dir, device="cpu", worker_threads=1,
                    db_path=tmp_path_factory.mktemp("preset-db") / "jobs.sqlite").start()
    yield studio
    studio.close()


def _pixels(studio, adapters=None):
    import numpy as np
    from PIL import Image

    job = studio.run("generate", {"prompt": "a cake", "seed": 5, "height": 64, "width": 64,
                                  "num_inference_steps": 4, "true_cfg_scale": 1.0}, adapters, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    return np.asarray(Image.open(job["result"]["path"]).convert("RGB"))


def test_apply_preset_then_adapters_on_top_then_restore_base_is_exact(peft_studio):
    import numpy as np

    base = _pixels(peft_studio)
    applied = peft_studio.apply_preset(PRESET)
    assert applied["fused"]["state"] == "fused" and applied["defaults"]["num_inference_steps"] == 4
    assert peft_studio.system()["fused"]["preset"] == PRESET
    fused = _pixels(peft_studio)
    assert not np.array_equal(fused, base)
    ink = [{"name": "demo-inverted", "scale": 1.0}]
    on_top = _pixels(peft_studio, ink)
    assert not np.array_equal(on_top, fused)
    assert np.array_equal(_pixels(peft_studio), fused)  # the adapter came off to the fused base
    peft_studio.restore_base()
    assert peft_studio.system()["fused"]["state"] == "base"
    assert np.array_equal(_pixels(peft_studio), base)  # and the base is back bit-for-bit

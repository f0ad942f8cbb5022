"""A distill-mode server: a preset fused at start for the server's lifetime; per-request
``lora`` refused with 400; a request breaking the preset's sampling contract gets 422."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("backend.distill", reason="needs the distill backend (branch distill) on main")

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
    r = httpx.post(f"{url}/v1/images/generations", timeout=120,
                   json={"prompt": "x", "extra_body": {"num_inference_steps": 8}})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "num_inference_steps" and PRESET in err["message"]

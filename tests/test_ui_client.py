"""The named Gradio API, driven by the official ``gradio_client`` against the launched app:
list adapters, generate with and without a LoRA, apply a preset, cancel a job."""
from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from ui_fixtures import MODEL, app, lora_files, wait_until  # noqa: F401  (fixtures)

import gradio_client  # noqa: E402

BASE = {"prompt": "a lighthouse at dusk", "seed": 7, "num_inference_steps": 2, "model": MODEL}


@pytest.fixture(scope="module")
def client(app, lora_files):  # noqa: F811
    app.add_adapter(lora_files["style"], "client-style")
    return gradio_client.Client(app.url, verbose=False)


def pixels(path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"), dtype=np.int16)


def test_endpoints_are_named_with_http_field_names(client):
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    for name in ("/generate", "/list_adapters", "/list_presets", "/apply_preset", "/cancel"):
        assert name in api, sorted(api)
    params = [p["parameter_name"] for p in api["/generate"]["parameters"]]
    for field in ("prompt", "negative_prompt", "seed", "height", "width", "num_inference_steps",
                  "guidance_scale", "true_cfg_scale", "num_frames", "adapters"):
        assert field in params, params


def test_list_adapters(client):
    names = [a["name"] for a in client.predict(api_name="/list_adapters")]
    assert "client-style" in names


def test_generate_with_and_without_a_lora(client):
    base_path, base_meta = client.predict(**BASE, api_name="/generate")
    lora_path, lora_meta = client.predict(**BASE, adapters=[{"name": "client-style", "scale": 1.0}],
                                          api_name="/generate")
    zero_path, _ = client.predict(**BASE, adapters='[{"name": "client-style", "scale": 0.0}]',
                                  api_name="/generate")
    base, lora, zero = pixels(base_path), pixels(lora_path), pixels(zero_path)
    assert base_meta["seed"] == 7 and base_meta["model"] == MODEL
    assert [a["name"] for a in lora_meta["adapters"]] == ["client-style"]
    assert np.abs(lora - base).mean() > 1.0, "the LoRA should change the image"
    assert np.array_equal(zero, base), "scale 0 must give back the base image exactly"


def test_bad_request_is_a_readable_error(client):
    with pytest.raises(Exception) as info:
        client.predict(**{**BASE, "height": 50}, api_name="/generate")
    assert "height" in str(info.value) and "multiple of 16" in str(info.value)
    with pytest.raises(Exception, match="no-such-adapter"):
        client.predict(**BASE, adapters=[{"name": "no-such-adapter", "scale": 1}], api_name="/generate")


def test_apply_preset(client):
    presets = client.predict(api_name="/list_presets")
    qwen = [p for p in presets if "demo:qwen-image" in (p.get("models") or [])]
    assert qwen, [p.get("id") for p in presets]
    state = client.predict(preset_id=qwen[0]["id"], api_name="/apply_preset")
    try:
        assert qwen[0]["id"] in str(state)
        _, meta = client.predict(**{**BASE, "num_inference_steps": None}, api_name="/generate")
        assert meta.get("preset") == qwen[0]["id"] or qwen[0]["id"] in str(meta)
    finally:
        client.predict(preset_id="base", api_name="/apply_preset")


def test_cancel_a_job(app, client):  # noqa: F811
    with app.gate.held(1):  # running (at step 1) until the cancel
        pending = client.submit(**{**BASE, "prompt": "a held job", "num_inference_steps": 4}, api_name="/generate")
        running = wait_until(lambda: next((j for j in app.get("/v1/jobs?limit=20")["data"] if j["status"] == "running"
                                           and (j.get("params") or {}).get("prompt") == "a held job"), None),
                             120, "the job to run")
        client.predict(job_id=str(running["id"]), api_name="/cancel")
        with pytest.raises(Exception, match="cancelled"):
            pending.result(timeout=120)
    final = app.get(f"/v1/jobs/{running['id']}")
    assert final["status"] == "cancelled", final
    assert (final.get("progress") or {}).get("step", 0) < 4

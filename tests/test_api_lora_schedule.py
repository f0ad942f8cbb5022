"""Scheduled and per-block scales over real HTTP (``python app.py serve``): the forms run and
their metadata records the schedule as given and per step; bad forms are a 400 naming the field
and the bad part, before anything is queued; one that needs the model (a block range past its
blocks, a list longer than the steps) fails its job by name, and the next job still runs."""
from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from backend.outputs import read_png_metadata

from ui_fixtures import ROOT, app_home, served_app

FAST = {"prompt": "a lighthouse", "height": 64, "width": 64, "num_inference_steps": 4, "true_cfg_scale": 1.0,
        "seed": 11}
INK = "qwen-image/demo-inverted.safetensors"  # relative to the demo root, <data-dir>/demo/adapters


@pytest.fixture(scope="module")
def served(data_dir, demo_path, library, tmp_path_factory):
    demo_path("demo:qwen-image")
    home = app_home(data_dir, tmp_path_factory, "sched-api")
    with served_app(home, "--lora-mode", "merge", "--adapter-dir", str(library)) as app:
        with app.client() as client:
            yield client


def _post(client, **body):
    return client.post("/v1/images/generations", json={**FAST, **body}, timeout=180)


def _pixels(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).convert("RGB"))


def test_schedules_and_block_weights_run_and_are_recorded(served):
    base = _pixels(_post(served))
    one = _pixels(_post(served, lora={"path": INK, "scale": 1.0}))
    r = _post(served, lora={"path": INK, "scale": [1.0, 1.0, 1.0]})
    assert np.array_equal(_pixels(r), one)  # a constant schedule is the scalar
    r = _post(served, lora={"path": INK, "scale": [1.0, -0.5]})
    sched = _pixels(r)
    row = r.json()["data"][0]["metadata"]["adapters"][0]
    assert row["scale"] == [1.0, -0.5] and row["scale_resolved"] == {"steps": 4, "per_step": [1.0, 1.0, -0.5, -0.5]}
    assert row["mode"] == "unfused"  # a step schedule runs unfused even on a --lora-mode merge server
    assert np.abs(sched.astype(int) - one).max() > 3
    # per block, in the extra_body form and under the lora_scale alias
    r = served.post("/v1/images/generations", json={**FAST, "extra_body": {"lora": {
        "path": INK, "lora_scale": {"blocks": {"0-": 0.0}}}}}, timeout=180)
    assert np.array_equal(_pixels(r), base)
    assert r.json()["data"][0]["metadata"]["adapters"][0]["scale_resolved"]["blocks"] == [0.0] * 4
    r = _post(served, lora={"path": INK, "scale": {"start": 0.5, "end": 1.0}})
    assert r.json()["data"][0]["metadata"]["adapters"][0]["scale_resolved"]["per_step"][::3] == [0.5, 1.0]
    assert np.array_equal(_pixels(_post(served)), base)  # the base bits after all of them


@pytest.mark.parametrize("scale, names", [
    ([1.0, "x"], "lora.scale[1]: 'x' is not a number"),
    ({"start": 1.0}, "lora.scale: missing 'end'"),
    ({"blocks": {"0-x": 0.5}}, "lora.scale.blocks.0-x: '0-x' is not a block range"),
    ({"blocks": {"0-9": 1.0, "5-": 0.5}}, "lora.scale.blocks: ranges '0-9' and '5-' overlap (block 5)"),
    ({"transformer": {"start": 1.0, "end": "high"}}, "lora.scale.transformer.end: 'high' is not a number"),
])
def test_bad_forms_are_refused_by_name(served, scale, names):
    jobs_before = len(served.get("/v1/jobs").json()["data"])
    r = _post(served, lora={"path": INK, "scale": scale})
    assert r.status_code == 400, r.text
    assert names in r.json()["error"]["message"], r.json()
    r = served.post("/v1/images/generations", json={**FAST, "extra_body": {"lora": [{"path": INK, "scale": scale}]}},
                    timeout=60)
    assert r.status_code == 400 and names in r.json()["error"]["message"], r.text
    # in a stack, the adapter's index too
    r = _post(served, lora=[{"path": INK, "scale": 0.5}, {"path": INK, "scale": scale}])
    assert r.status_code == 400 and names.replace("lora.", "lora[1].", 1) in r.json()["error"]["message"], r.text
    assert len(served.get("/v1/jobs").json()["data"]) == jobs_before  # nothing was queued


def test_forms_that_need_the_model_fail_their_job_by_name(served):
    r = _post(served, lora={"path": INK, "scale": {"blocks": {"0": 1.0, "4-": 0.5}}})
    assert r.status_code == 400, r.text
    assert "range '4-' starts past the last block: transformer has 4 blocks (0-3)" in r.json()["error"]["message"]
    r = _post(served, lora={"path": INK, "scale": [1, 0.9, 0.8, 0.7, 0.6]})
    assert r.status_code == 400 and "5 values but the request runs 4 steps" in r.json()["error"]["message"], r.text
    assert _post(served).status_code == 200


def test_cli_takes_the_text_forms(data_dir, library, tmp_path):
    """``app.py generate --lora-scale 1.0,-0.5`` runs the schedule; a bad one exits naming the flag."""
    out = tmp_path / "sched.png"
    common = ["--model", "demo:qwen-image", "--device", "cpu", "--data-dir", str(data_dir), "--num-inference-steps",
              "4", "--height", "64", "--width", "64", "--seed", "3", "--lora-path", str(library / INK)]
    proc = subprocess.run([sys.executable, "app.py", "generate", "--prompt", "a cat", *common, "--lora-scale",
                           "1.0,-0.5", "--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = read_png_metadata(out)
    row = meta["adapters"][0]
    assert row["scale"] == [1.0, -0.5] and row["scale_resolved"]["per_step"] == [1.0, 1.0, -0.5, -0.5]
    assert row["mode"] == "unfused"
    bad = subprocess.run([sys.executable, "app.py", "generate", "--prompt", "a cat", *common, "--lora-scale",
                          "1.0,x"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--lora-scale[1]: 'x' is not a number" in bad.stderr, bad.stderr[-2000:]

"""Unfused serving and prefetch through a real `python app.py serve` (one server for the module):
metadata says the adapters ran unfused and the base image comes back bit for bit; a cold adapter
of a job queued behind a running one is read by prefetch, so that job starts with 0 disk reads."""
from __future__ import annotations

import threading
from pathlib import Path

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from ui_fixtures import served_app, wait_until

ROOT = Path(__file__).resolve().parents[1]
INK = "qwen-image/demo-inverted.safetensors"
FILM = "qwen-image/demo-outline.safetensors"
NEON = "qwen-image/demo-grayscale"


@pytest.fixture(scope="module")
def server(data_dir, tmp_path_factory):
    from backend.lora import demo_adapters

    demo_adapters.ensure(data_dir)
    with served_app(data_dir, "--lora-mode", "unfused", "--lora-prefetch", "2", "--max-loras", "2",
                    "--max-cpu-loras", "3", env={"OMP_NUM_THREADS": "1"}, start_new_session=True) as served:
        yield served


def generate(url: str, steps: int = 2, **body) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600,
                   json={"messages": [{"role": "user", "content": "a lighthouse"}],
                         "extra_body": {"num_inference_steps": steps, "seed": 7, "height": 64, "width": 64,
                                        "true_cfg_scale": 1.0, **body}})
    assert r.status_code == 200, r.text
    out = r.json()
    png = base64.b64decode(out["choices"][0]["message"]["content"][0]["image_url"]["url"].split(",", 1)[1])
    return {"image": np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), **out["metadata"][0]}


def test_metadata_says_unfused_and_the_base_comes_back(server):
    base = generate(server.url)
    ink = generate(server.url, lora={"path": INK, "scale": 1.0})
    assert np.abs(ink["image"].astype(int) - base["image"]).mean() > 1.0
    assert [a["mode"] for a in ink["adapters"]] == ["unfused"]
    assert ink["lora_mode"]["mode"] == "unfused" and ink["lora_mode"]["requested"] == "unfused"
    stats = httpx.get(f"{server.url}/metrics").json()["lora_cache"]
    assert stats["merged_layers"] == 0 and stats["unfused"]["hooked_layers"] > 0  # hooks, no weight written
    again = generate(server.url)
    assert np.array_equal(again["image"], base["image"]) and "lora_mode" not in again  # the base, bit for bit
    # a request field overrides the server's --lora-mode
    merged = generate(server.url, lora={"path": INK, "scale": 1.0}, lora_mode="merge")
    assert [a["mode"] for a in merged["adapters"]] == ["merged"] and merged["lora_mode"]["requested"] == "merge"
    assert np.abs(merged["image"].astype(int) - ink["image"]).max() <= 1  # the same image, to uint8 rounding
    r = httpx.post(f"{server.url}/v1/images/generations", timeout=120,
                   json={"prompt": "x", "num_inference_steps": 2, "lora_mode": "fused"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_mode", r.text


def _rows(jobs):
    return jobs.get("data", jobs) if isinstance(jobs, dict) else jobs


def test_prefetch_reads_the_next_jobs_adapter_while_one_renders(server):
    before = httpx.get(f"{server.url}/metrics").json()["lora_cache"]
    results = {}

    def run(name, **kw):
        results[name] = generate(server.url, **kw)

    def prefetched() -> bool:  # the worker logs each prefetch round that read a file
        return "prefetched 'demo-outline'" in server.log.read_text()

    long_job = threading.Thread(target=run, args=("long",), kwargs={"steps": 3})
    cold = threading.Thread(target=run, args=("cold",), kwargs={"lora": {"path": FILM, "scale": 1.0}})
    with server.gate.held(1):  # the long job renders (held at step 1) while the cold one waits behind it
        long_job.start()
        wait_until(lambda: any(j["status"] == "running" and j["params"].get("num_inference_steps") == 3
                               for j in _rows(httpx.get(f"{server.url}/v1/jobs").json())), 60, "the long job to run")
        cold.start()
        wait_until(prefetched, 60, "prefetch to read the queued job's adapter")
    long_job.join(600)
    cold.join(600)
    assert results["cold"]["lora_disk_reads"] == 0  # prefetch had it: the job read nothing from disk
    after = httpx.get(f"{server.url}/metrics").json()["lora_cache"]
    assert after["prefetch"]["read"] - (before.get("prefetch") or {}).get("read", 0) == 1
    assert after["counters"]["loads_from_disk"] - before["counters"]["loads_from_disk"] == 1  # read once
    # a cold adapter on an idle worker (nothing queued to prefetch it): its own job reads it
    alone = generate(server.url, lora={"path": NEON, "scale": 1.0})
    assert alone["lora_disk_reads"] == 1

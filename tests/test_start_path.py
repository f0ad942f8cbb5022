"""One start path: a ``RuntimeConfig`` (backend/config.py) handed to ``PipelineManager.start``.

Omni, the local server (`python app.py serve`, over HTTP /v1) and the Ray engine (`--engine ray`'s Studio on a
private local Ray) started from the same config give the same pixels for the same seed and report the same
state (model, fused state, LoRA backend, dtype); a MiniMax-H3 server starts with each LoRA backend and each
offload mode Omni accepts on CPU; config errors name the field, and the CLI exits 2 with one line.

Slow (servers, a Ray instance): run on its own, ``pytest tests/test_start_path.py -x -q``.
"""
from __future__ import annotations

import base64
import io
import pickle
import sys
from pathlib import Path

import httpx
import imageio.v3 as iio
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from backend.config import RuntimeConfig
from backend.errors import InvalidParameter
from ui_fixtures import app_home, served_app

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a red fox in the snow"
SEED = 7
START = "demo:sd3.5"  # the servers' start model; the others are started by a request naming them
MODELS = ["demo:sd3.5", "demo:qwen-image", "demo:wan2.1-t2v", "demo:wan2.2-t2v", "demo:wan2.2-i2v",
          "demo:minimax-h3"]
# the same config for every front end: pristine / lora_mode must reach the worker and the replicas too
SHARED = {"device": "cpu", "lora_mode": "unfused", "pristine": "host"}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # Ray's 1-CPU replicas run one torch thread; CPU sums depend on it


# -- helpers -------------------------------------------------------------------------------------------
def _fields(model: str, image: Path) -> dict:
    fields = {"prompt": PROMPT, "seed": SEED, "num_inference_steps": 2}
    if model == "demo:wan2.2-i2v":
        fields["image"] = str(image)
    return fields


def _is_video(model: str) -> bool:
    return "wan" in model or "minimax" in model


def _pixels(path: Path) -> np.ndarray:
    if path.suffix == ".mp4":
        return iio.imread(path, plugin="FFMPEG")
    return np.asarray(Image.open(path).convert("RGB"))


def _state(system: dict) -> dict:
    """The part of system() every front end must agree on."""
    fused = system["fused"] or {"state": "base"}
    return {"model": system["model"], "lora_backend": system["lora_backend"], "dtype": system["dtype"],
            "fused": {"state": fused["state"], "files": sorted(Path(f["path"]).name for f in fused.get("files") or [])}}


def _omni_run(config: RuntimeConfig, fields: dict, out: Path):
    from backend import Omni

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        omni = Omni(config=config)
        result = omni.generate(**fields)[0]
    finally:
        torch.set_num_threads(threads)
    path = result.save(out)
    state = _state({"model": omni.model, "lora_backend": omni.lora_backend, "fused": omni.fused_state(),
                    "dtype": str(omni.manager.dtype).replace("torch.", "")})
    return _pixels(path), state, omni


def _http_run(served, model: str, fields: dict, out: Path) -> tuple[np.ndarray, dict]:
    body = {**fields, "model": model}
    if "image" in body:  # over HTTP an input image travels as base64
        body["image"] = base64.b64encode(Path(body["image"]).read_bytes()).decode()
    route = "videos" if _is_video(model) else "images"
    with httpx.Client(base_url=served.url, timeout=600) as client:
        r = client.post(f"/v1/{route}/generations", json=body)
        assert r.status_code == 200, r.text
        out.write_bytes(base64.b64decode(r.json()["data"][0]["b64_json"]))
        system = client.get("/metrics").json()
    return _pixels(out), _state(system)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("start-input") / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def server(data_dir, demo_path, tmp_path_factory):
    for model in MODELS:
        demo_path(model)
    flags = ("--lora-mode", SHARED["lora_mode"], "--pristine", SHARED["pristine"])
    with served_app(app_home(data_dir, tmp_path_factory, "start-path"), *flags, model=START,
                    env=ONE_THREAD) as served:
        yield served


# -- RuntimeConfig ------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, param, words", [
    ({"lora_backend": "lora"}, "lora_backend", "peft, distill"),
    ({"max_loras": 8, "max_cpu_loras": 4}, "max_cpu_loras", ">= max_loras"),
    ({"max_loras": 0}, "max_loras", ">= 1"),
    ({"max_loras": "many"}, "max_loras", "integer"),
    ({"lora_prefetch": -1}, "lora_prefetch", ">= 0"),
    ({"lora_mode": "fast"}, "lora_mode", "auto, merge, unfused"),
    ({"pristine": "disk"}, "pristine", "auto, device, host"),
    ({"offload": "disk"}, "offload", "none, model, group"),
    ({"offload": "model", "device": "cpu"}, "offload", "needs a CUDA device"),
    ({"offload": "group", "offload_stream": True, "device": "cpu"}, "offload_stream", "needs a CUDA device"),
    ({"offload_stream": True}, "offload_stream", "--offload group"),
    ({"model": "demo:minimax-h3", "offload": "group", "engine": "ray"}, "offload", "--engine ray"),
    ({"preset": "no-such-preset"}, "preset", "unknown preset"),
    ({"engine": "k8s"}, "engine", "local, ray"),
    ({"colour": "red"}, "colour", "unknown argument"),
])
def test_config_errors_name_the_field(values, param, words):
    with pytest.raises(InvalidParameter) as err:
        RuntimeConfig(**values)
    assert err.value.param == param and words in err.value.message
    assert "\n" not in err.value.message and "pydantic" not in err.value.message


def test_offload_for_a_model_that_is_not_minimax_is_refused_by_the_config(data_dir, demo_path):
    demo_path("demo:sd3.5")  # on disk: its pipeline class is known without loading it
    with pytest.raises(InvalidParameter) as err:
        RuntimeConfig(model="demo:sd3.5", data_dir=str(data_dir), offload="group")
    assert err.value.param == "offload" and "MiniMax-H3 only" in err.value.message


def test_config_pickles_and_round_trips_as_json(tmp_path):
    config = RuntimeConfig(model="demo:wan2.2-t2v", lora_backend="distill", lora_paths=[tmp_path / "a", "b"],
                           adapter_dirs=str(tmp_path), env={"X": "1"}, lora_mode="merge", threads=2)
    assert config.lora_paths == (str(tmp_path / "a"), "b") and config.adapter_dirs == (str(tmp_path),)
    assert pickle.loads(pickle.dumps(config)) == config
    assert RuntimeConfig.model_validate_json(config.model_dump_json()) == config
    assert RuntimeConfig(**config.model_dump(mode="json")) == config


@pytest.mark.parametrize("argv, param_words", [
    (["serve", "--lora-prefetch", "-1"], "--lora-prefetch must be >= 0"),
    (["serve", "--max-loras", "8", "--max-cpu-loras", "4"], "max_cpu_loras (4) must be >= max_loras (8)"),
    (["generate", "--prompt", "x", "--preset", "no-such-preset"], "unknown preset 'no-such-preset'"),
])
def test_cli_exits_2_with_one_line_naming_the_field(argv, param_words, tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "app.py", *argv, "--data-dir", str(tmp_path), "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and param_words in lines[0], done.stderr


# -- the same config through Omni and the local server --------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_omni_and_the_local_server_start_the_same(model, server, data_dir, image, tmp_path):
    fields = _fields(model, image)
    pixels, state, _ = _omni_run(RuntimeConfig(model=model, data_dir=str(data_dir), **SHARED), fields,
                                 tmp_path / f"omni{'.mp4' if _is_video(model) else '.png'}")
    served, served_state = _http_run(server, model, fields, tmp_path / f"http{'.mp4' if _is_video(model) else '.png'}")
    assert served_state == state
    assert served.shape == pixels.shape and np.array_equal(served, pixels)


# -- MiniMax-H3: each backend, each offload mode Omni accepts on CPU ---------------------------------------
def _turbo_standin(folder: Path) -> Path:
    """A MiniMax-H3 turbo file (its name carries the 2-step contract), as test_minimax_frontends writes one."""
    path = folder / "minimax_h3_fl2v_turbo_2step_v1.0.safetensors"
    g = torch.Generator().manual_seed(1)
    save_file({f"transformer.transformer_blocks.1.attn.to_k.lora_{ab}.weight":
               torch.randn(*((4, 32) if ab == "A" else (32, 4)), generator=g) for ab in "AB"}, str(path))
    return path


# each backend and each offload mode once in the default tier, the two other pairs in the slow one
_EXHAUSTIVE = pytest.mark.slow


@pytest.mark.parametrize("backend, offload", [("peft", "none"), pytest.param("peft", "group", marks=_EXHAUSTIVE),
                                              pytest.param("distill", "none", marks=_EXHAUSTIVE), ("distill", "group")])
def test_minimax_server_starts_with_each_backend_and_offload(backend, offload, data_dir, demo_path,
                                                             tmp_path_factory, tmp_path):
    demo_path("demo:minimax-h3")
    turbo = _turbo_standin(tmp_path)
    config = RuntimeConfig(model="demo:minimax-h3", data_dir=str(data_dir), device="cpu", lora_backend=backend,
                           lora_paths=[turbo], offload=offload)
    fields = {"prompt": PROMPT, "seed": SEED} | ({} if backend == "distill" else {"num_inference_steps": 2})
    pixels, state, omni = _omni_run(config, fields, tmp_path / "omni.mp4")
    engine = omni.manager.lora_engine  # peft: the shared engine with MiniMax-H3's family hooks; distill: none
    assert (engine.stats()["family"] if engine is not None else None) == ("minimax-h3" if backend == "peft" else None)
    flags = ("--lora-backend", backend, "--lora-path", str(turbo), "--offload", offload)
    with served_app(app_home(data_dir, tmp_path_factory, "minimax-start"), *flags, model="demo:minimax-h3",
                    env=ONE_THREAD) as served:
        system = httpx.get(served.url + "/metrics", timeout=60).json()
        # the worker's state describes the engine MiniMax-H3 runs (its start file pinned), or none (distill)
        cache = system["lora_cache"]
        if backend == "peft":
            assert cache["family"] == "minimax-h3" and cache["pinned"], cache
        else:
            assert cache is None, cache
        served_pixels, served_state = _http_run(served, "demo:minimax-h3", fields, tmp_path / "http.mp4")
    assert served_state == state
    if backend == "distill":
        assert state["fused"] == {"state": "fused", "files": [turbo.name]}
    assert np.array_equal(served_pixels, pixels)


@pytest.mark.parametrize("flags, words", [
    ({"offload": "model"}, "--offload model needs a CUDA device"),
    ({"offload": "group", "offload_stream": True}, "--offload-stream needs a CUDA device"),
])
def test_offload_modes_that_need_cuda_are_refused_alike_by_every_front_end(flags, words, data_dir, demo_path):
    import subprocess

    from backend import Omni
    from backend.service import Studio

    demo_path("demo:minimax-h3")
    common = {"data_dir": str(data_dir), "device": "cpu"}
    with pytest.raises(InvalidParameter) as omni_err:
        Omni(model="demo:minimax-h3", **common, **flags)
    messages = [omni_err.value.message]
    for engine in ("local", "ray"):
        with pytest.raises(InvalidParameter) as err:
            Studio("demo:minimax-h3", engine=engine, **common, **flags)
        messages.append(err.value.message)
    argv = ["--offload", flags["offload"]] + (["--offload-stream"] if flags.get("offload_stream") else [])
    done = subprocess.run([sys.executable, "app.py", "serve", "demo:minimax-h3", "--data-dir", str(data_dir),
                           "--device", "cpu", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1
    messages.append(lines[0].removeprefix("error: "))
    assert len(set(messages)) == 1 and words in messages[0], messages


# -- the Ray engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_studio(data_dir, demo_path, tmp_path_factory):
    pytest.importorskip("ray")
    from backend.service import Studio

    for model in MODELS:
        demo_path(model)
    db = tmp_path_factory.mktemp("start-ray") / "jobs.sqlite"
    studio = Studio(START, data_dir=data_dir, db_path=db, engine="ray", replicas=1, **SHARED)
    studio.start(timeout=600)
    yield studio
    studio.close()


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
@pytest.mark.parametrize("model", MODELS)
def test_omni_and_the_ray_engine_start_the_same(model, ray_studio, data_dir, image, tmp_path):
    fields = _fields(model, image)
    if model != ray_studio.current_model():  # on Ray a job's model alone does not switch what system() names
        switched = ray_studio.wait(ray_studio.switch_model(model)["id"], timeout=600)
        assert switched["status"] == "succeeded", switched.get("error")
    job = ray_studio.run("generate", fields, model=model, timeout=600)
    assert job["status"] == "succeeded", job.get("error")
    pixels, state, _ = _omni_run(RuntimeConfig(model=model, data_dir=str(data_dir), **SHARED), fields,
                                 tmp_path / f"omni{'.mp4' if _is_video(model) else '.png'}")
    assert _state(ray_studio.system()) == state
    ray_pixels = _pixels(Path(job["result"]["path"]))
    assert ray_pixels.shape == pixels.shape and np.array_equal(ray_pixels, pixels)


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_lora_mode_and_pristine_reach_the_ray_replicas(ray_studio, data_dir):
    """--lora-mode unfused / --pristine host: a replica runs an adapter the way the config says (a replica
    built its PEFT engine with the defaults before: merged on CPU)."""
    from backend.lora import demo_adapters

    adapter = demo_adapters.for_model(START, data_dir)[0]
    job = ray_studio.run("generate", {"prompt": PROMPT, "seed": SEED, "num_inference_steps": 2},
                         adapters=[{"name": adapter.stem, "path": str(adapter), "scale": 1.0}], model=START,
                         timeout=600)
    assert job["status"] == "succeeded", job.get("error")
    meta = job["result"]["metadata"]
    assert meta["lora_mode"]["mode"] == "unfused" and meta["lora_mode"]["requested"] == "unfused", meta["lora_mode"]
    assert meta["engine"]["pristine"]["mode"] == "host", meta["engine"]


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_an_fp8_base_through_the_ray_engine_equals_the_local_one(ray_studio, data_dir, tmp_path):
    """`--engine ray --quantize fp8`: a replica loads the fp8 base through the one start sequence and runs an
    adapter unfused on it; pixels equal to Omni on the same config, and the metadata says fp8 and unfused."""
    import dataclasses

    from backend.engines.ray_engine import RayEngine
    from backend.lora import LoRARequest, demo_adapters

    config = RuntimeConfig(model=START, data_dir=str(data_dir), quantize="fp8", **SHARED)
    adapter = demo_adapters.for_model(START, data_dir)[0]
    fields = {"prompt": PROMPT, "seed": SEED, "num_inference_steps": 2}
    engine_config = dataclasses.replace(ray_studio.supervisor.engine_config, app_name="lora-studio-fp8",
                                        runtime=config.replace(engine="ray"), distill=None, preload=None,
                                        cpus_per_replica=0)
    engine = RayEngine(engine_config).start()
    try:
        outcome = engine.submit({"id": "fp8", "model": START, "params": fields,
                                 "adapters": [{"name": adapter.stem, "path": str(adapter), "scale": 1.0}]}).wait()
    finally:
        engine.stop()
    assert outcome.status == "succeeded", outcome.error
    meta = outcome.result.metadata
    assert meta["quantization"].startswith("fp8") and meta["lora_mode"]["mode"] == "unfused", meta
    from backend import Omni

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a 1-CPU replica runs
    try:
        local = Omni(config=config).generate(**fields, lora_request=LoRARequest(adapter.stem, 1, str(adapter)),
                                             lora_scale=1.0)[0]
    finally:
        torch.set_num_threads(threads)
    from backend.outputs import save_result

    assert np.array_equal(_pixels(save_result(outcome.result, path=tmp_path / "ray.png")),
                          _pixels(local.save(tmp_path / "local.png")))


@pytest.mark.slow  # multi-process Ray: a local cluster and its replicas (CI's slow step)
def test_minimax_distill_through_the_ray_engine(ray_studio, data_dir, tmp_path):
    """`--engine ray --lora-backend distill --lora-path <turbo>` for MiniMax-H3: the replica fuses through the
    same start sequence (its runtime), as Omni and the local server do."""
    import dataclasses

    from backend.engines.ray_engine import DistillPlan, RayEngine

    turbo = _turbo_standin(tmp_path)
    config = RuntimeConfig(model="demo:minimax-h3", data_dir=str(data_dir), device="cpu", lora_backend="distill",
                           lora_paths=[turbo])
    plan = DistillPlan.resolve(config.model, lora_paths=config.lora_paths, data_dir=data_dir)
    engine_config = dataclasses.replace(ray_studio.supervisor.engine_config, app_name="lora-studio-minimax",
                                        runtime=config.replace(engine="ray"), lora_backend="distill", distill=plan,
                                        preload=None, cpus_per_replica=0)
    engine = RayEngine(engine_config).start()
    try:
        outcome = engine.submit({"id": "mm-distill", "model": config.model,
                                 "params": {"prompt": PROMPT, "seed": SEED}}).wait()
    finally:
        engine.stop()
    assert outcome.status == "succeeded", outcome.error
    pixels, state, _ = _omni_run(config, {"prompt": PROMPT, "seed": SEED}, tmp_path / "omni.mp4")
    assert state["fused"] == {"state": "fused", "files": [turbo.name]}
    assert outcome.result.metadata["params"]["fused"] == [turbo.name]
    from backend.outputs import save_result

    assert np.array_equal(_pixels(save_result(outcome.result, path=tmp_path / "ray.mp4")), pixels)

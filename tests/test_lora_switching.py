"""The exact-merge engine's corners and placements (issues 15 and 17): one cache entry per adapter
whatever the id, a canonical active set, pristine originals on the device or in host memory,
the one-GEMM rounding, and the memory refusal at start."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backend import LoRARequest, Omni
from backend.lora.engine import LoRAEngine
from backend.weights import module_checksum

ROOT = Path(__file__).resolve().parents[1]
INK = "qwen-image/demo-inverted.safetensors"
FILM = "qwen-image/demo-outline.safetensors"
NEON = "qwen-image/demo-grayscale"
FAST = {"prompt": "a lighthouse", "height": 64, "width": 64, "num_inference_steps": 2, "true_cfg_scale": 1.0,
        "seed": 5}



def _sums(omni) -> dict:
    return {c: module_checksum(m) for c, m in omni.manager.denoisers().items()}


def test_a_preloaded_adapter_requested_by_path_or_name_is_its_pinned_entry(library, data_dir):
    """Omni(lora_path=p, max_loras=2) then the documented LoRARequest("preloaded", 1, p): one entry, pinned,
    never evicted from the device tier by other adapters (issue 17 item 9)."""
    p = library / NEON
    omni = Omni(model="demo:qwen-image", lora_path=str(p), max_loras=2, max_cpu_loras=4, data_dir=data_dir,
                device="cpu")
    engine = omni.lora
    out = omni.generate(**FAST, lora_request=LoRARequest("preloaded", 1, str(p)))[0]
    s = engine.stats()
    assert s["tiers"]["cpu"]["size"] == 1 and s["tiers"]["device"]["size"] == 1, s["tiers"]
    assert s["counters"]["loads_from_disk"] == 1 and s["pinned"] == ["demo-grayscale"]
    assert out.metadata["adapters"][0]["name"] == "preloaded"
    for path in (INK, FILM, INK, FILM):  # other adapters cycle through a device tier of 2
        omni.generate(**FAST, lora_request=LoRARequest(Path(path).stem, 2 + (path == FILM), str(library / path)))
    before = engine.stats()["tiers"]["device"]
    again = omni.generate(**FAST, lora_request=LoRARequest("preloaded", 1, str(p)))[0]
    by_name = omni.generate(**FAST, lora_request=LoRARequest("demo-grayscale", 9))[0]
    after = engine.stats()
    assert after["tiers"]["device"]["misses"] == before["misses"]  # the pinned factors stayed on the device
    assert "demo-grayscale" in after["tiers"]["device"]["adapters"]
    assert after["tiers"]["cpu"]["size"] == 3 and after["counters"]["loads_from_disk"] == 3  # neon, ink, film
    assert again.images[0].tobytes() == out.images[0].tobytes() == by_name.images[0].tobytes()


def test_a_permuted_stack_is_the_same_composition(library, data_dir):
    """[A, B] then [B, A] (and A named twice with split scales) write 0 layers and leave the bits (item 17.10)."""
    omni = Omni(model="demo:qwen-image", data_dir=data_dir, device="cpu")
    engine = omni.lora
    a, b = LoRARequest("ink", 1, str(library / INK)), LoRARequest("film", 2, str(library / FILM))
    first = omni.generate(**FAST, lora_request=[a, b], lora_scale=[1.0, 0.5])[0]
    sums, written = _sums(omni), engine.stats()["counters"]["layers_written"]
    second = omni.generate(**FAST, lora_request=[b, a], lora_scale=[0.5, 1.0])[0]
    third = omni.generate(**FAST, lora_request=[a, b, a], lora_scale=[0.25, 0.5, 0.75])[0]
    c = engine.stats()["counters"]
    assert c["layers_written"] == written and c["noop_activations"] == 2
    assert _sums(omni) == sums
    assert first.images[0].tobytes() == second.images[0].tobytes() == third.images[0].tobytes()
    assert [m["name"] for m in second.metadata["adapters"]] == ["film", "ink"]  # what was asked, in order
    assert third.metadata["adapters"][0]["scale"] == 1.0
    omni.generate(**FAST)
    assert engine.stats()["merged_layers"] == 0


def _synthetic(transformer, tmp_path, n, rank=4, scale=0.2):
    names = [name for name, mod in transformer.named_modules()
             if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in ("to_q", "to_k", "to_v", "0")]
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(300 + i)
        sd = {}
        for name in names[: len(names) - (i % 3)]:
            lin = transformer.get_submodule(name)
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * scale
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * scale
        p = tmp_path / f"switch-{i}.safetensors"
        save_file(sd, str(p))
        paths.append(p)
    return paths


@pytest.fixture(scope="module")
def qwen(data_dir):
    from backend.manager import PipelineManager

    m = PipelineManager(device="cpu", data_dir=data_dir)
    m.load("demo:qwen-image")
    return m


def _copy(qwen, dtype):
    t = type(qwen.pipeline.transformer).from_config(qwen.pipeline.transformer.config).to(dtype)
    t.load_state_dict(qwen.pipeline.transformer.state_dict())
    return t


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_1000_switches_leave_the_base_bit_identical(placement, dtype, qwen, tmp_path):
    transformer = _copy(qwen, dtype)
    pristine = module_checksum(transformer)
    engine = LoRAEngine(qwen.pipeline, {"transformer": transformer}, model="demo:qwen-image",
                        max_loras=3, max_cpu_loras=6, pristine=placement)
    assert engine.pristine_info()["placement"] == placement
    requests = [LoRARequest(p.stem, i + 1, str(p)) for i, p in enumerate(_synthetic(transformer, tmp_path, 6))]
    rng = random.Random(1)
    seen = {}
    for _ in range(1000):
        chosen = rng.sample(requests, rng.choice([0, 1, 1, 2, 3]))
        engine.activate([(r, rng.choice([0.5, 1.0])) for r in chosen])
        if len(chosen) == 1 and engine.active[0]["scale"] == 1.0:
            digest = module_checksum(transformer)
            assert seen.setdefault(chosen[0].lora_int_id, digest) == digest
    engine.deactivate()
    assert module_checksum(transformer) == pristine
    assert engine.stats()["counters"]["switches"] > 500 and engine.pristine_bytes() > 0
    assert engine.pristine_info()["where"].startswith(placement)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_gemm_merge_rounds_once_against_float64(dtype, qwen, tmp_path):
    """W = addmm(W0, B, A, alpha) accumulates in fp32 and rounds once. Against a float64 reference
    (of the factors as the engine holds them: the model dtype, and B_i c_i rounded to it when stacked
    adapters have different scales), every element is within
        0.5 ulp_dtype(ref) + (k + 2) * 2^-24 * (|W0| + sum_i |c_i| |B_i| |A_i|)
    (one rounding to the dtype + fp32 GEMM accumulation over the total rank k), and in bf16 at least
    99.9% of the elements are the correctly rounded value."""
    from safetensors.torch import load_file

    transformer = _copy(qwen, dtype)
    engine = LoRAEngine(qwen.pipeline, {"transformer": transformer}, model="demo:qwen-image")
    paths = _synthetic(transformer, tmp_path, 2, rank=8)
    files = [load_file(str(p)) for p in paths]
    mant = 7 if dtype == torch.bfloat16 else 23
    for stack in ([(0, 0.75)], [(0, 0.75), (1, 1.5)]):
        base = {n: p.detach().clone() for n, p in transformer.named_parameters()}
        engine.activate([(LoRARequest(paths[i].stem, i + 1, str(paths[i])), s) for i, s in stack])
        exact = total = 0
        layers = [k[len("transformer."):-len(".lora_A.weight")] for k in files[0] if k.endswith("lora_A.weight")]
        for name in layers:
            ref = base[f"{name}.weight"].double()
            mag = ref.abs()
            k = 0
            here = [(i, s) for i, s in stack if f"transformer.{name}.lora_A.weight" in files[i]]
            for i, s in here:
                sd = files[i]
                b = sd[f"transformer.{name}.lora_B.weight"].to(dtype)
                a = sd[f"transformer.{name}.lora_A.weight"].to(dtype).double()
                c = s
                if len({s for _, s in here}) > 1:  # different scales on this layer: B c rounded once
                    b, c = (b.float() * s).to(dtype), 1.0
                ref = ref + c * (b.double() @ a)
                mag = mag + abs(c) * (b.double().abs() @ a.abs())
                k += a.shape[0]
            got = transformer.get_submodule(name).weight.detach().double()
            ulp = torch.pow(2.0, torch.floor(torch.log2(ref.abs().clamp_min(1e-38))) - mant)
            bound = 0.5 * ulp + (k + 2) * 2.0 ** -24 * mag
            assert ((got - ref).abs() <= bound).all(), name
            exact += (got == ref.to(dtype).double()).sum().item()
            total += got.numel()
        if dtype == torch.bfloat16:
            assert exact / total >= 0.999, exact / total
        engine.deactivate()
        assert all(torch.equal(p, base[n]) for n, p in transformer.named_parameters())


def test_factors_live_in_the_model_dtype(qwen, tmp_path):
    transformer = _copy(qwen, torch.bfloat16)
    engine = LoRAEngine(qwen.pipeline, {"transformer": transformer}, model="demo:qwen-image")
    p = _synthetic(transformer, tmp_path, 1)[0]
    engine.activate([(LoRARequest("x", 1, str(p)), 1.0)])
    factors = engine.cache.device.get(engine._key_of(1))
    assert {f.a.dtype for f in factors.values()} == {f.b.dtype for f in factors.values()} == {torch.bfloat16}
    engine.deactivate()


def test_pristine_placement_is_reported(qwen):
    engine = LoRAEngine(qwen.pipeline, qwen.denoisers(), model="demo:qwen-image", pristine="auto")
    info = engine.stats()["pristine"]
    assert info["mode"] == "auto" and info["placement"] == "device" and "cpu" in info["reason"]
    assert info["targetable_bytes"] > 0 and info["bytes"] == 0
    with pytest.raises(Exception, match="pristine must be one of auto, device, host"):
        LoRAEngine(qwen.pipeline, qwen.denoisers(), model="demo:qwen-image", pristine="gpu")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_start_is_refused_in_one_line_when_host_ram_cannot_hold_the_originals(command, data_dir, tmp_path):
    """The real check (psutil's available memory vs the targetable layers) with its figure replaced."""
    from backend.api.server import free_port

    args = [sys.executable, "app.py", command, "--device", "cpu"]
    args += (["demo:qwen-image", "--port", str(free_port())] if command == "serve" else
             ["--model", "demo:qwen-image", "--prompt", "x", "--num-inference-steps", "1", "--output",
              str(tmp_path / "x.png")])
    env = {**os.environ, "LORA_STUDIO_HOME": str(data_dir), "LORA_STUDIO_FAKE_AVAILABLE_MEMORY": str(64 << 20)}
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode != 0, r.stdout
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert "pristine copies" in lines[-1] and "--lora-backend distill" in lines[-1], r.stderr
    assert len([line for line in lines if "Traceback" in line]) == 0, r.stderr


def test_adapters_command_reports_the_originals_budget(data_dir):
    r = subprocess.run([sys.executable, "app.py", "adapters", "--model", "demo:qwen-image"], cwd=ROOT,
                       env={**os.environ, "LORA_STUDIO_HOME": str(data_dir)}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("pristine originals (peft engine): up to ") and "--pristine auto keeps them" in last


def test_gpu_check_script_dry_run_on_cpu(data_dir):
    """scripts/gpu_check_switch.py with tiny sizes: every model and placement, one table, exact restores."""
    r = subprocess.run([sys.executable, "scripts/gpu_check_switch.py", "--device", "cpu", "--dry-run"], cwd=ROOT,
                       env={**os.environ, "LORA_STUDIO_HOME": str(data_dir)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith(("qwen-image ", "wan2.2-a14b "))]
    assert len(rows) == 4 and all(line.rstrip().endswith("yes") for line in rows), r.stdout
    assert sum(" device [device (cpu)]" in line for line in rows) == 2, r.stdout
    assert sum(" host [host (cpu)]" in line for line in rows) == 2, r.stdout
    assert "Qwen-Image-2512 Lightning" in r.stdout and "Wan2.2 A14B" in r.stdout


def test_unloading_an_alias_keeps_the_pinned_entry(library, data_dir):
    """A request's id for a pre-loaded file is an alias: unloading it (as the Ray host does after a job)
    leaves the pinned entry; unloading by the pinned name drops it."""
    p = library / NEON
    omni = Omni(model="demo:qwen-image", lora_path=str(p), data_dir=data_dir, device="cpu")
    engine = omni.lora
    engine.load(LoRARequest("preloaded", 1, str(p)))
    engine.unload(1)
    assert engine.stats()["pinned"] == ["demo-grayscale"] and engine.stats()["tiers"]["cpu"]["size"] == 1
    engine.unload("demo-grayscale")
    assert engine.stats()["pinned"] == [] and engine.stats()["tiers"]["cpu"]["size"] == 0

"""MiniMax-H3 on the shared LoRA engine (issue 18, item 4).

`backend.lora.attach(manager)` gives MiniMax-H3 the engine every other pipeline has, with MiniMax-H3's family hooks
(contracts, layouts, grouped-QKV reorder, partitions): an adapter request changes the output and every parameter of
both partitions comes back bit for bit (merge, with and without group offload on CPU; unfused under offload writes
none), the LRU cache evicts and keeps pins, a non-finite merge is refused naming the adapter, and the server's
/metrics and /v1/loras describe the adapters MiniMax-H3 really runs (`python app.py serve demo:minimax-h3`).
"""
from __future__ import annotations

import hashlib

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from backend.errors import AdapterError
from backend.lora.request import LoRARequest

torch.set_num_threads(1)

HIDDEN = 32  # backend/demo/minimax.py TRANSFORMER_CONFIG
PROMPT = "a red fox runs through snow"
FAST = {"prompt": PROMPT, "seed": 3, "num_inference_steps": 2}
REFS = [Image.new("RGB", (48, 48), (20, 200, 20))]


def lora(seed: int, prefix: str = "transformer", amp: float = 0.3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"{prefix}.transformer_blocks.{i}.attn.{p}.lora_{ab}.weight":
            torch.randn(*((4, HIDDEN) if ab == "A" else (HIDDEN, 4)), generator=g) * amp
            for i in range(2) for p in ("to_q", "to_k", "to_v", "to_out.0") for ab in "AB"}


def huge(prefix: str = "transformer") -> dict:
    """Finite factors whose product is not: 4 * 1e20 * 1e20 overflows fp32 in the merged weight."""
    return {k: torch.full_like(v, 1e20) for k, v in lora(0, prefix).items()}


def digests(manager) -> dict[str, str]:
    """sha256 over every parameter (name and bytes) of each loaded MiniMax-H3 partition."""
    out = {}
    for part in ("transformer", "transformer_ref"):
        module = getattr(manager.minimax.pipe, part, None)
        if module is None:
            continue
        h = hashlib.sha256()
        for name, p in module.named_parameters():
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out[part] = h.hexdigest()
    return out


def pixels(result) -> np.ndarray:
    return np.stack([np.asarray(f, dtype=np.float32) for f in result.frames])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm-engine")
    paths = {"style": root / "mm_style.safetensors", "ref": root / "minimax_h3_ref2v_turbo_2step_v1.0.safetensors",
             "huge": root / "mm_huge.safetensors", "other": root / "mm_other.safetensors",
             "third": root / "mm_third.safetensors"}
    save_file(lora(1), str(paths["style"]))
    save_file(lora(2, "transformer_ref"), str(paths["ref"]))
    save_file(huge(), str(paths["huge"]))
    save_file(lora(3), str(paths["other"]))
    save_file(lora(4), str(paths["third"]))
    return paths


def manager_for(data_dir, offload="none", **attach):
    from backend.lora import attach as attach_engine
    from backend.manager import PipelineManager

    m = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir, offload=offload)
    m.load("demo:minimax-h3")
    attach_engine(m, **attach)
    return m


def request(name, path, int_id):
    return LoRARequest(name, int_id, str(path))


def test_attach_gives_minimax_the_shared_engine_with_its_family_hooks(data_dir, files):
    m = manager_for(data_dir, max_loras=1, max_cpu_loras=2)
    assert m.lora_engine is m.minimax.engine and m.lora_engine.family is m.minimax.family
    stats = m.lora_engine.stats()
    assert stats["family"] == "minimax-h3" and stats["unfused"]["mode"] == "merge"
    # The family converts (partition routing) and fits (the shared report) before anything is touched.
    entry = m.lora_engine.load(request("ref", files["ref"], 1))
    assert entry.data.partition == "transformer_ref" and entry.report.summary() == \
        "fits (transformer_ref: 8 layers; 16/16 keys)"


@pytest.mark.parametrize("offload", ["none", "group"])
def test_adapter_requests_change_pixels_and_both_partitions_come_back_bit_for_bit(data_dir, files, offload):
    m = manager_for(data_dir, offload=offload, max_loras=1, max_cpu_loras=2)
    base = m.generate(dict(FAST))
    ref_base = m.generate({**FAST, "task_type": "ref2va", "references": REFS})  # loads transformer_ref
    before = digests(m)
    assert set(before) == {"transformer", "transformer_ref"}
    styled = m.generate(dict(FAST), adapters=[(request("style", files["style"], 1), 1.0)])
    assert np.abs(pixels(styled) - pixels(base)).mean() > 1.0
    assert [a["name"] for a in styled.metadata["adapters"]] == ["style"]
    ref = m.generate({**FAST, "task_type": "ref2va", "references": REFS, "num_inference_steps": None},
                     adapters=[(request("ref", files["ref"], 2), 1.0)])
    assert ref.metadata["params"]["contract"]["kind"] == "turbo" and ref.metadata["params"]["num_inference_steps"] == 2
    assert np.abs(pixels(ref) - pixels(ref_base)).mean() > 0.5
    # The next request without adapters: every parameter of both partitions is the base's again, bit for bit.
    again = m.generate(dict(FAST))
    assert digests(m) == before and np.array_equal(pixels(again), pixels(base))
    assert styled.metadata["adapters"][0]["mode"] == "merged"  # the engine's exact merge ran it
    counters = m.lora_engine.stats()["counters"]
    assert counters["switches"] == 3 and counters["layers_written"] == 8 + 8 + 16


def test_unfused_under_group_offload_writes_no_weight_and_matches_unfused_without(data_dir, files):
    plain = manager_for(data_dir, lora_mode="unfused")
    grouped = manager_for(data_dir, offload="group", lora_mode="unfused")
    grouped.generate({**FAST, "task_type": "ref2va", "references": REFS})
    before = digests(grouped)
    adapters = [(request("style", files["style"], 1), 0.7)]
    got, expected = grouped.generate(dict(FAST), adapters=adapters), plain.generate(dict(FAST), adapters=adapters)
    assert digests(grouped) == before  # hooks only: not one weight written, even while the adapter is active
    assert got.metadata["adapters"][0]["mode"] == "unfused" and got.metadata["lora_mode"]["mode"] == "unfused"
    assert np.array_equal(pixels(got), pixels(expected))
    assert np.abs(pixels(got) - pixels(grouped.generate(dict(FAST)))).mean() > 1.0


def test_offload_on_an_accelerator_fixes_the_unfused_mode(data_dir, files):
    """The rule (no GPU here): offload on a non-CPU device serves adapters unfused, factors on the compute device,
    and a request for the merge is refused naming the flags; on CPU offload moves nothing and the rule is off."""
    from types import SimpleNamespace

    from backend.errors import InvalidParameter
    from backend.lora.engine import LoRAEngine
    from backend.minimax.adapters import MiniMaxLoRAFamily
    from backend.minimax.offload import check

    family = MiniMaxLoRAFamily()
    cuda = SimpleNamespace(minimax=SimpleNamespace(offload=check("group", stream=True)), device=torch.device("cuda"))
    options = family.engine_options(cuda)
    assert options["lora_mode"] == "unfused" and options["factor_device"] == torch.device("cuda")
    assert "--offload group --offload-stream" in options["mode_fixed_by"]
    cpu = SimpleNamespace(minimax=SimpleNamespace(offload=check("group")), device=torch.device("cpu"))
    assert family.engine_options(cpu) == {}
    # An engine with that fixed mode (on CPU factors, to run here): merge refused by name, unfused served.
    m = manager_for(data_dir, offload="group")
    m.minimax.attach_engine(LoRAEngine(m.pipeline, m.denoisers(), model="demo:minimax-h3", lora_mode="unfused",
                                       factor_device="cpu", mode_fixed_by=options["mode_fixed_by"]))
    m.lora_engine = m.minimax.engine
    adapters = [(request("style", files["style"], 1), 1.0)]
    with pytest.raises(InvalidParameter) as err:
        m.generate(dict(FAST), adapters=adapters, lora_mode="merge")
    assert err.value.param == "lora_mode" and "--offload group --offload-stream" in err.value.message
    before = digests(m)
    out = m.generate(dict(FAST), adapters=adapters, lora_mode="auto")
    assert out.metadata["adapters"][0]["mode"] == "unfused" and digests(m) == before


def test_lru_evicts_the_least_recent_adapter_and_keeps_the_pinned_one(data_dir, files):
    m = manager_for(data_dir, max_loras=1, max_cpu_loras=2, preload=[files["other"]])
    engine = m.lora_engine
    assert engine.stats()["pinned"] == ["mm_other"]
    engine.load(request("style", files["style"], 10))
    # a ref2v Turbo file: the family routes it to transformer_ref (not loaded yet: fitted against a skeleton)
    assert engine.load(request("ref", files["ref"], 11)).data.partition == "transformer_ref"
    tiers = engine.stats()["tiers"]
    assert sorted(tiers["cpu"]["adapters"]) == ["mm_other", "ref"]  # style went; the pin stayed
    assert tiers["cpu"]["evictions"] >= 1
    engine.unpin("mm_other")
    engine.load(request("style", files["style"], 10))
    assert sorted(engine.stats()["tiers"]["cpu"]["adapters"]) == ["ref", "style"]


def test_non_finite_merge_is_refused_by_name_and_leaves_the_weights(data_dir, files):
    m = manager_for(data_dir)
    base = m.generate(dict(FAST))
    m.generate({**FAST, "task_type": "ref2va", "references": REFS})
    before = digests(m)
    with pytest.raises(AdapterError) as err:
        m.generate(dict(FAST), adapters=[(request("huge", files["huge"], 5), 1.0)])
    assert "adapter 'huge'" in err.value.message and "not finite" in err.value.message
    assert digests(m) == before and m.lora_engine.stats()["counters"]["nonfinite_refused"] == 1
    assert np.array_equal(pixels(m.generate(dict(FAST))), pixels(base))


# -- the server: `python app.py serve demo:minimax-h3` --------------------------------------------------------


@pytest.fixture(scope="module")
def server(data_dir, demo_path, tmp_path_factory):
    from ui_fixtures import app_home, served_app

    demo_path("demo:minimax-h3")
    home = app_home(data_dir, tmp_path_factory, "mm-engine-serve")
    lib = home / "adapters"
    lib.mkdir()
    save_file(lora(11), str(lib / "mm_pinned.safetensors"))
    for i, name in enumerate(("mm_a", "mm_b")):
        save_file(lora(12 + i), str(lib / f"{name}.safetensors"))
    save_file(huge(), str(lib / "mm_huge.safetensors"))
    with served_app(home, "--max-loras", "1", "--max-cpu-loras", "2", "--lora-path",
                    str(lib / "mm_pinned.safetensors"), model="demo:minimax-h3") as served:
        yield served.url


def test_server_cache_stats_and_pins_describe_minimax_adapters(server):
    from ui_fixtures import wait_until

    url = server
    with httpx.Client(timeout=600) as client:
        def post(**fields):
            return client.post(url + "/v1/videos/generations",
                               json={"model": "demo:minimax-h3", **FAST, **fields})

        def cache():
            return client.get(url + "/metrics").json()["lora_cache"]

        assert cache()["pinned"] == ["mm_pinned"]
        for name in ("mm_a", "mm_b"):
            r = post(lora={"name": name})
            assert r.status_code == 200, r.text
            assert [a["name"] for a in r.json()["data"][0]["metadata"]["adapters"]] == [name]
        stats = cache()
        assert sorted(stats["tiers"]["cpu"]["adapters"]) == ["mm_b", "mm_pinned"]  # mm_a evicted, the pin kept
        assert stats["family"] == "minimax-h3"  # the engine MiniMax-H3 runs its adapters with
        assert stats["tiers"]["cpu"]["evictions"] >= 1 and stats["tiers"]["device"]["adapters"] == ["mm_b"]
        assert stats["counters"]["loads_from_disk"] == 3 and stats["counters"]["switches"] == 2
        assert stats["active"][0]["name"] == "mm_b" and stats["active"][0]["mode"] == "merged"
        metrics = client.get(url + "/metrics").json()
        assert metrics["cache"]["cpu_evictions"] >= 1
        loras = client.get(url + "/v1/loras").json()
        assert any(row["name"] == "mm_pinned" and row["resident"] for row in loras["data"]), loras["data"]
        # A merge that is not finite: refused naming the adapter (400), the next request runs on the base.
        r = post(lora={"name": "mm_huge"})
        assert r.status_code == 400, r.text
        assert "adapter 'mm_huge'" in r.json()["error"]["message"] and "not finite" in r.json()["error"]["message"]
        assert cache()["counters"]["nonfinite_refused"] == 1
        # Unloading the start-time adapter drops its pin (the worker reports the cache at once).
        assert client.post(url + "/v1/unload_lora_adapter", json={"lora_name": "mm_pinned"}).status_code == 200
        wait_until(lambda: cache()["pinned"] == [], timeout=60, what="the pin to go")
        assert "mm_pinned" not in cache()["tiers"]["cpu"]["adapters"]

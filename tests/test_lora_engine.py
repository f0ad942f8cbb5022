"""The PEFT engine on the real tiny demo pipelines: every format applies like diffusers/peft
would, switching is exact, stacking sums, per-component scales, refusals and rollback
leave the model untouched, the cache evicts in LRU order and honours pins."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import demo
from backend.errors import AdapterError, AdapterNotFound, InvalidParameter
from backend.lora import attach, formats
from backend.lora.engine import LoRAEngine
from backend.lora.request import LoRARequest
from backend.manager import PipelineManager
from backend.weights import module_checksum

torch.set_num_threads(1)
STEPS = 2



@pytest.fixture(scope="module")
def managers(data_dir):
    """Our own managers (not the session-shared ones): these tests write into weights."""
    cache = {}

    def get(model: str) -> PipelineManager:
        if model not in cache:
            m = PipelineManager(device="cpu", data_dir=data_dir)
            m.load(model)
            cache[model] = m
        return cache[model]

    yield get


@pytest.fixture
def engine_for(managers):
    """A fresh engine on a manager; on teardown the base model must be back, bit for bit."""
    made = []

    def get(model: str, **kw) -> LoRAEngine:
        m = managers(model)
        sums = {c: module_checksum(x) for c, x in m.denoisers().items()}
        engine = attach(m, **kw)
        made.append((m, engine, sums))
        return engine

    yield get
    for m, engine, sums in made:
        engine.deactivate()
        assert {c: module_checksum(x) for c, x in m.denoisers().items()} == sums


def run(pipe, manager, seed=3) -> np.ndarray:
    params = manager.validate({"prompt": "A piece of cheesecake", "seed": seed, "num_inference_steps": STEPS})
    kwargs = {k: v for k, v in params.items() if k not in ("seed", "fps", "flow_shift", "sample_solver",
                                                             "boundary_ratio")}
    out = pipe(**kwargs, generator=torch.Generator().manual_seed(seed), output_type="np")
    return np.asarray(out.images if hasattr(out, "images") else out.frames)


def req(path, i, name=None) -> LoRARequest:
    return LoRARequest(name or path.stem, i, str(path))


def checksums(manager) -> dict:
    return {c: module_checksum(x) for c, x in manager.denoisers().items()}


# -- each format: applies exactly as diffusers (or peft) would, and changes the output ---------------
FORMATS = [
    ("demo:sd3.5", "sd3.5/sd35-cheesecake-peft"),
    ("demo:sd3.5", "sd3.5/sd35-watercolor.safetensors"),
    ("demo:sd3.5", "sd3.5/sd35-sketch-peft-dump.safetensors"),
    ("demo:qwen-image", "qwen-image/demo-grayscale"),
    ("demo:qwen-image", "qwen-image/demo-inverted.safetensors"),
    ("demo:qwen-image", "qwen-image/demo-outline.safetensors"),
    ("demo:qwen-image", "qwen-image/demo-nine.safetensors"),
    ("demo:wan2.1-t2v", "wan2.1-t2v/wan21-t2v-lightx2v-demo.safetensors"),
    ("demo:wan2.1-t2v", "wan2.1-t2v/wan21-t2v-musubi-demo.safetensors"),
]


def reference_pipeline(model, path, data_dir):
    """The same adapter applied by the libraries themselves (unfused PEFT layers)."""
    ref = type_of(model, data_dir).from_pretrained(demo.ensure(model, data_dir), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    if path.is_dir() or "peft-dump" in path.name:  # PEFT layouts: peft's own injection
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

        file = path / "adapter_model.safetensors" if path.is_dir() else path
        cfg = (LoraConfig.from_pretrained(str(path)) if path.is_dir()
               else LoraConfig(r=4, lora_alpha=4, target_modules=["ff.net.0.proj", "ff.net.2"]))
        inject_adapter_in_model(cfg, ref.transformer)
        sd = {k.removeprefix("base_model.model."): v for k, v in load_file(str(file)).items()}
        assert not set_peft_model_state_dict(ref.transformer, sd).unexpected_keys
    else:  # diffusers' loader, with its converters for kohya / lightx2v / musubi
        ref.load_lora_weights(str(path), low_cpu_mem_usage=False)
    return ref


def type_of(model, data_dir):
    import json

    import diffusers

    index = json.loads((demo.ensure(model, data_dir) / "model_index.json").read_text())
    return getattr(diffusers, index["_class_name"])


@pytest.mark.parametrize("model,relpath", FORMATS)
def test_format_applies_like_the_libraries(model, relpath, library, managers, engine_for, data_dir):
    m = managers(model)
    engine = engine_for(model)
    base = run(m.pipeline, m)
    path = library / relpath
    meta = engine.activate([(req(path, 1), 1.0)])
    ours = run(m.pipeline, m)
    engine.deactivate()
    theirs = run(reference_pipeline(model, path, data_dir), m)
    assert meta[0]["sha256"] == formats.inspect(path).sha256
    assert np.abs(ours - base).max() > 1e-3, "the adapter must change the output"
    np.testing.assert_allclose(ours, theirs, atol=1e-4)  # float rounding only: a pixel level is 1/255


# -- exact restore -----------------------------------------------------------------------------------
def test_base_a_b_base_bit_exact(library, managers, engine_for):
    m = managers("demo:sd3.5")
    engine_for("demo:sd3.5")  # attached to m: its generate activates through it
    a = req(library / "sd3.5/sd35-cheesecake-peft", 1)
    b = req(library / "sd3.5/sd35-watercolor.safetensors", 2)
    pristine = checksums(m)
    base = m.generate({"prompt": "cake", "seed": 7, "num_inference_steps": STEPS})
    with_a = m.generate({"prompt": "cake", "seed": 7, "num_inference_steps": STEPS}, adapters=[(a, 1.0)])
    with_b = m.generate({"prompt": "cake", "seed": 7, "num_inference_steps": STEPS}, adapters=[(b, 1.0)])
    again_a = m.generate({"prompt": "cake", "seed": 7, "num_inference_steps": STEPS}, adapters=[(a, 1.0)])
    back = m.generate({"prompt": "cake", "seed": 7, "num_inference_steps": STEPS})
    px = lambda r: np.asarray(r.images[0])  # noqa: E731
    assert not np.array_equal(px(base), px(with_a)) and not np.array_equal(px(with_a), px(with_b))
    assert np.array_equal(px(with_a), px(again_a))
    assert np.array_equal(px(base), px(back))
    assert checksums(m) == pristine
    assert with_a.metadata["adapters"][0]["name"] == a.lora_name and back.metadata["adapters"] == []


def test_repeat_request_does_no_switching_work(library, engine_for):
    engine = engine_for("demo:sd3.5")
    a = req(library / "sd3.5/sd35-cheesecake-peft", 1)
    engine.activate([(a, 1.5)])
    before = dict(engine.stats()["counters"])
    engine.activate([(a, 1.5)])
    after = engine.stats()["counters"]
    assert after["switches"] == before["switches"] and after["layers_written"] == before["layers_written"]
    assert after["loads_from_disk"] == before["loads_from_disk"]
    assert after["noop_activations"] == before["noop_activations"] + 1
    engine.activate([(a, 0.0)])  # scale 0 is the base model
    assert engine.active == [] and engine.stats()["merged_layers"] == 0


def _synthetic_adapters(transformer, tmp_path, n, rank=4):
    """n diffusers-format adapters over every attention projection, distinct seeds."""
    names = [name for name, mod in transformer.named_modules()
             if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in ("to_q", "to_k", "to_v", "0")]
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        sd = {}
        for name in names[: len(names) - (i % 3)]:  # overlapping but different layer sets
            lin = transformer.get_submodule(name)
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * 0.2
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * 0.2
        p = tmp_path / f"synthetic-{i}.safetensors"
        save_file(sd, str(p))
        paths.append(p)
    return paths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_switches_leave_base_bit_identical(dtype, managers, tmp_path):
    """50 random switches among 8 adapters across both tiers, stacking included (1000 in the benchmark)."""
    m = managers("demo:qwen-image")
    transformer = type(m.pipeline.transformer).from_config(m.pipeline.transformer.config).to(dtype)
    transformer.load_state_dict(m.pipeline.transformer.state_dict())
    pristine = module_checksum(transformer)
    engine = LoRAEngine(m.pipeline, {"transformer": transformer}, model="demo:qwen-image",
                        max_loras=2, max_cpu_loras=4)
    requests = [req(p, i + 1) for i, p in enumerate(_synthetic_adapters(transformer, tmp_path, 8))]
    rng = random.Random(0)
    seen_a = {}
    for _ in range(50):
        k = rng.choice([0, 1, 1, 2])
        chosen = rng.sample(requests, k)
        engine.activate([(r, rng.choice([0.5, 1.0, 2.0])) for r in chosen])
        if k == 1 and engine.active[0]["scale"] == 1.0:  # the same state gives the same bits
            digest = module_checksum(transformer)
            assert seen_a.setdefault(chosen[0].lora_int_id, digest) == digest
    engine.deactivate()
    assert module_checksum(transformer) == pristine
    stats = engine.stats()
    assert stats["tiers"]["cpu"]["evictions"] > 0 and stats["tiers"]["device"]["evictions"] > 0
    assert stats["counters"]["loads_from_disk"] > 8  # evicted adapters came back from disk


def test_stacking_is_the_sum_of_deltas(library, managers, engine_for):
    m = managers("demo:qwen-image")
    engine = engine_for("demo:qwen-image")
    a = req(library / "qwen-image/demo-inverted.safetensors", 1)
    b = req(library / "qwen-image/demo-outline.safetensors", 2)
    params = lambda: {n: p.detach().clone() for n, p in m.pipeline.transformer.named_parameters()}  # noqa: E731
    w0 = params()
    engine.activate([(a, 1.0)])
    wa = params()
    engine.activate([(b, 1.0)])
    wb = params()
    engine.activate([(a, 0.7), (b, -1.3)])
    ws = params()
    touched = 0
    for n in w0:
        expected = w0[n] + 0.7 * (wa[n] - w0[n]) - 1.3 * (wb[n] - w0[n])
        torch.testing.assert_close(ws[n], expected, rtol=1e-5, atol=1e-6)
        touched += not torch.equal(ws[n], w0[n])
    # 4 blocks x 10 projections: the union of both adapters' layers; a layer both left at zero (the last block's
    # text-stream output, which nothing reads, so training never moved its lora_B) is written but unchanged
    moved = sum(not torch.equal(wa[n], w0[n]) or not torch.equal(wb[n], w0[n]) for n in w0)
    assert engine.stats()["merged_layers"] == 40 and touched == moved >= 36, (touched, moved)
    assert [x["name"] for x in engine.active] == [a.lora_name, b.lora_name]


def test_per_component_scales_on_wan22(library, managers, engine_for):
    m = managers("demo:wan2.2-t2v")
    engine = engine_for("demo:wan2.2-t2v")
    high = req(library / "wan2.2-t2v/wan22-t2v-lightx2v-high.safetensors", 1)
    low = req(library / "wan2.2-t2v/wan22-t2v-lightx2v-low.safetensors", 2)
    pristine = checksums(m)
    base = run(m.pipeline, m)
    engine.activate([(high, {"transformer": 1.0})])  # unnamed components get 0
    assert checksums(m)["transformer"] != pristine["transformer"]
    assert checksums(m)["transformer_2"] == pristine["transformer_2"]
    only_high = run(m.pipeline, m)
    t2 = m.pipeline.transformer_2
    w0 = {n: p.detach().clone() for n, p in t2.named_parameters()}
    engine.activate([(high, {"transformer": 1.0, "transformer_2": 0.0}), (low, {"transformer_2": 1.0})])
    full = {n: p.detach().clone() for n, p in t2.named_parameters()}
    engine.activate([(high, {"transformer": 1.0}), (low, {"transformer_2": 0.5})])
    assert checksums(m)["transformer"] == module_checksum(m.pipeline.transformer)
    for n, p in t2.named_parameters():  # half the low-noise delta on transformer_2
        torch.testing.assert_close(p, w0[n] + 0.5 * (full[n] - w0[n]), rtol=1e-5, atol=1e-6)
    pair = run(m.pipeline, m)
    assert np.abs(only_high - base).max() > 1e-3 and np.abs(pair - only_high).max() > 1e-4
    with pytest.raises(InvalidParameter, match="transformer_3"):
        engine.activate([(high, {"transformer_3": 1.0})])


def test_scale_naming_a_missing_component_on_single_transformer(library, engine_for):
    engine = engine_for("demo:sd3.5")
    with pytest.raises(InvalidParameter, match="transformer_2"):
        engine.activate([(req(library / "sd3.5/sd35-cheesecake-peft", 1), {"transformer_2": 1.0})])


# -- refusals leave the model exactly as it was ------------------------------------------------------
def _partial(library, tmp_path):
    """A Qwen adapter with two keys for layers the model does not have."""
    sd = load_file(str(library / "qwen-image/demo-outline.safetensors"))
    sd["transformer.transformer_blocks.9.attn.to_q.lora_A.weight"] = torch.zeros(4, 48)
    sd["transformer.transformer_blocks.9.attn.to_q.lora_B.weight"] = torch.zeros(48, 4)
    p = tmp_path / "partial.safetensors"
    save_file(sd, str(p))
    return p


def _bad_inputs(library, tmp_path):
    good = library / "qwen-image/demo-outline.safetensors"
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    nan = tmp_path / "nan.safetensors"
    sd = load_file(str(good))
    sd[next(iter(sd))][0, 0] = float("inf")
    save_file(sd, str(nan))
    empty_dir = tmp_path / "folder"
    empty_dir.mkdir()
    return {
        "partial": (_partial(library, tmp_path), r"partial\.safetensors.*transformer_blocks\.9\.attn\.to_q"),
        "foreign": (library / "sd3.5/sd35-watercolor.safetensors",
                    r"sd35-watercolor.*shape mismatch.*adapter \(8, 32\) vs model \(8, 128\)"),
        "truncated": (cut, r"cut\.safetensors: truncated"),
        "corrupt": (junk, r"junk\.safetensors: not a valid safetensors"),
        "nan": (nan, r"nan\.safetensors: tensor .* NaN or inf"),
        "missing": (tmp_path / "gone.safetensors", r"gone\.safetensors does not exist"),
        "dir-without-config": (empty_dir, r"folder is a directory without adapter_config\.json"),
        "wan-on-qwen": (library / "wan2.1-t2v/wan21-t2v-musubi-demo.safetensors",
                        r"wan21-t2v-musubi-demo\.safetensors"),
    }


@pytest.mark.parametrize("case", ["partial", "foreign", "truncated", "corrupt", "nan", "missing",
                                  "dir-without-config", "wan-on-qwen"])
def test_bad_adapter_refused_and_model_unchanged(case, library, managers, engine_for, tmp_path):
    m = managers("demo:qwen-image")
    engine = engine_for("demo:qwen-image")
    good = req(library / "qwen-image/demo-inverted.safetensors", 1)
    engine.activate([(good, 1.0)])  # an adapter is active: a refused request must keep it
    before, active = checksums(m), engine.active
    path, pattern = _bad_inputs(library, tmp_path)[case]
    with pytest.raises((AdapterError, AdapterNotFound), match=pattern):
        engine.activate([(good, 1.0), (req(path, 2, "bad"), 1.0)])
    assert checksums(m) == before and engine.active == active
    assert engine.find("bad") is None


def test_refusal_carries_the_full_fit_report(library, engine_for, tmp_path):
    engine = engine_for("demo:qwen-image")
    with pytest.raises(AdapterError) as info:
        engine.load(req(_partial(library, tmp_path), 5))
    report = info.value.report
    assert not report.ok and report.matched_keys == 80  # 40 layers x (lora_A, lora_B)
    assert [k for k, _ in report.unmatched] == ["transformer.transformer_blocks.9.attn.to_q.lora_A.weight",
                                                "transformer.transformer_blocks.9.attn.to_q.lora_B.weight"]


@pytest.fixture
def intra_op_threads():
    """Run a test body with N torch threads (2: layers are written by two single-threaded workers)."""
    before = torch.get_num_threads()

    def use(n: int) -> None:
        torch.set_num_threads(n)

    yield use
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_written_by_two_workers_match_one_thread(dtype, managers, tmp_path, intra_op_threads):
    m = managers("demo:qwen-image")
    paths = _synthetic_adapters(m.pipeline.transformer, tmp_path, 3)
    merged = {}
    for threads in (1, 2):
        intra_op_threads(threads)
        transformer = type(m.pipeline.transformer).from_config(m.pipeline.transformer.config).to(dtype)
        transformer.load_state_dict(m.pipeline.transformer.state_dict())
        pristine = module_checksum(transformer)
        engine = LoRAEngine(m.pipeline, {"transformer": transformer}, model="demo:qwen-image")
        requests = [req(p, i + 1) for i, p in enumerate(paths)]
        engine.activate([(requests[0], 1.0)])
        engine.activate([(requests[1], 0.5), (requests[2], 2.0)])  # a switch with stacking
        merged[threads] = module_checksum(transformer)
        engine.deactivate()
        assert merged[threads] != pristine and module_checksum(transformer) == pristine
    assert merged[1] == merged[2]


@pytest.mark.parametrize("threads", [1, 2])
def test_failure_mid_activation_rolls_back_every_layer(threads, library, managers, engine_for, intra_op_threads):
    intra_op_threads(threads)
    m = managers("demo:qwen-image")
    engine = engine_for("demo:qwen-image")
    pristine = checksums(m)
    a = req(library / "qwen-image/demo-inverted.safetensors", 1)
    engine.activate([(a, 1.0)])
    engine.activate([])
    # Break the device-tier copy of one late layer, as a device fault would: earlier layers get written
    # before the failing one.
    factors = engine.cache.device.get(engine._key_of(1))
    last = sorted(factors)[-1]
    factors[last] = type(factors[last])(a=torch.zeros(3, 7), b=factors[last].b, bias=None, scaling=1.0)
    with pytest.raises(AdapterError, match=rf"failed at transformer\.{last[1]}.*restored"):
        engine.activate([(a, 1.0)])
    assert checksums(m) == pristine and engine.active == []
    assert engine.stats()["counters"]["rollbacks"] == 1


def test_rewritten_file_is_reloaded(library, managers, engine_for, tmp_path):
    import os
    import shutil

    m = managers("demo:qwen-image")
    engine = engine_for("demo:qwen-image")
    p = tmp_path / "style.safetensors"
    shutil.copy(library / "qwen-image/demo-inverted.safetensors", p)
    r = req(p, 1)
    engine.activate([(r, 1.0)])
    first = checksums(m)
    shutil.copy(library / "qwen-image/demo-outline.safetensors", p)
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10_000_000))
    engine.activate([(r, 1.0)])
    assert checksums(m) != first and engine.stats()["counters"]["reloads_stale"] == 1


# -- cache ------------------------------------------------------------------------------------------
def test_eviction_order_and_pinning(library, engine_for):
    engine = engine_for("demo:qwen-image", max_loras=1, max_cpu_loras=2,
                        preload=[library / "qwen-image/demo-grayscale"])
    pinned = engine.stats()["pinned"]
    assert pinned == ["demo-grayscale"]
    ink = req(library / "qwen-image/demo-inverted.safetensors", 1)
    film = req(library / "qwen-image/demo-outline.safetensors", 2)
    engine.activate([(ink, 1.0)])
    engine.activate([(film, 1.0)])  # cpu tier full: the unpinned LRU (ink) goes, the pin stays
    s = engine.stats()
    assert s["tiers"]["cpu"]["adapters"] == ["demo-grayscale", film.lora_name]
    assert s["tiers"]["device"]["adapters"] == [film.lora_name]
    assert s["tiers"]["cpu"]["evictions"] == 1 and s["tiers"]["device"]["evictions"] == 1
    assert s["tiers"]["cpu"]["bytes"] > 0 and s["tiers"]["device"]["bytes"] > 0
    engine.activate([(ink, 1.0)])  # a miss: read from disk again
    assert engine.stats()["counters"]["loads_from_disk"] == 4  # neon, ink, film, ink
    assert engine.stats()["tiers"]["cpu"]["adapters"] == ["demo-grayscale", ink.lora_name]
    # the preloaded adapter is usable by name alone, without a disk read
    engine.activate([(LoRARequest("demo-grayscale", 9), 1.0)])
    assert engine.stats()["counters"]["loads_from_disk"] == 4
    engine.unload("demo-grayscale")
    assert engine.stats()["pinned"] == []


def test_same_id_for_another_path_is_refused(library, engine_for):
    engine = engine_for("demo:qwen-image")
    engine.load(req(library / "qwen-image/demo-inverted.safetensors", 1))
    with pytest.raises(AdapterError, match="lora_int_id 1 is already"):
        engine.load(req(library / "qwen-image/demo-outline.safetensors", 1))


def test_unknown_name_without_path(engine_for):
    engine = engine_for("demo:qwen-image")
    with pytest.raises(AdapterNotFound, match="'nobody'"):
        engine.activate([(LoRARequest("nobody", 3), 1.0)])

"""MiniMax-H3 adapters held to the fit rules of every other model (issue 17, items 4-7).

- the shared fit report refuses unmatched keys, wrong shapes and files that bind nothing, by key, before the
  model is touched (parameters and peft state compared before/after), also over HTTP from `app.py serve`;
- a Turbo adapter at scale 0 is the base model, bit for bit, with no sampling contract;
- vLLM-Omni's native-adapter layout (`transformer.` prefix, `.default.` infix) loads as the native file it is;
- the demo's denoiser drives its frames, so a LoRA's scale shows in them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from backend.errors import AdapterError, ContractViolation
from backend.minimax.runtime import MiniMaxRuntime

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM, HIDDEN = 2, 16, 32  # backend/demo/minimax.py TRANSFORMER_CONFIG
PROMPT = "a red fox runs through snow"
PROJ = ("to_q", "to_k", "to_v", "to_out.0")


@pytest.fixture(scope="module")
def repo(demo_path):
    return demo_path("demo:minimax-h3")


@pytest.fixture(scope="module")
def rt(repo):
    return MiniMaxRuntime(repo, device="cpu", dtype=torch.float32)


def gen(runtime, adapters=(), **params):
    out = runtime.generate({"prompt": PROMPT, "seed": 3, **params}, adapters=adapters, default_steps=3)
    out.pixels = np.stack([np.asarray(f, dtype=np.float32) for f in out.frames])
    return out


def lora(seed=0, amp=0.3, rank=4, blocks=(0, 1)) -> dict:
    """A diffusers-layout LoRA on the attention projections of the given blocks."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in blocks:
        for proj in PROJ:
            key = f"transformer.transformer_blocks.{i}.attn.{proj}"
            sd[f"{key}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=g) * amp
            sd[f"{key}.lora_B.weight"] = torch.randn(HIDDEN, rank, generator=g) * amp
    return sd


def model_state(runtime):
    """Every parameter of every loaded partition, and its peft state (configs, bound LoRA modules)."""
    out = {}
    for part in ("transformer", "transformer_ref"):
        module = getattr(runtime.pipe, part, None)
        if module is None:
            continue
        out[part] = ({n: p.detach().clone() for n, p in module.named_parameters()},
                     sorted(getattr(module, "peft_config", {}) or {}),
                     sorted(n for n, _ in module.named_modules()))
    return out


def assert_untouched(before, after):
    assert before.keys() == after.keys()
    for part in before:
        params0, peft0, modules0 = before[part]
        params1, peft1, modules1 = after[part]
        assert peft1 == peft0 and modules1 == modules0, part
        assert params1.keys() == params0.keys()
        assert all(torch.equal(params0[n], params1[n]) for n in params0), part


# -- item 7: the demo's denoiser drives its frames ---------------------------------------------------------


def test_demo_frames_follow_the_lora_scale_and_come_back_bit_for_bit(rt, tmp_path):
    path = tmp_path / "mm_style.safetensors"
    save_file(lora(seed=1), str(path))
    base = gen(rt).pixels
    one = gen(rt, adapters=[("style", str(path), 1.0)]).pixels
    two = gen(rt, adapters=[("style", str(path), 2.0)]).pixels
    d1, d2 = np.abs(one - base).mean(), np.abs(two - base).mean()
    # Mean over every pixel of every frame, in 8-bit levels (the old demo: < 0.1 at any scale).
    assert d1 > 3.0, d1
    assert d2 > 1.5 * d1, (d1, d2)
    assert np.array_equal(gen(rt).pixels, base)  # the adapter off: the base bits again


# -- item 4: the fit check, before anything touches the model ---------------------------------------------


def test_turbo_file_with_an_extra_unmatched_pair_is_refused_naming_it(rt, tmp_path):
    good = lora(seed=2)
    extra = dict(good)
    extra["transformer.transformer_blocks.0.attn.to_gate.lora_A.weight"] = torch.randn(4, HIDDEN)
    extra["transformer.transformer_blocks.0.attn.to_gate.lora_B.weight"] = torch.randn(HIDDEN, 4)
    path = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors"
    save_file(extra, str(path))
    before = model_state(rt)
    with pytest.raises(AdapterError) as err:
        gen(rt, adapters=[("turbo_extra", str(path), 1.0)])
    msg = err.value.message
    assert err.value.http_status == 400 and path.name in msg and "2 unmatched key(s)" in msg
    assert "transformer.transformer_blocks.0.attn.to_gate.lora_A.weight" in msg
    assert "transformer.transformer_blocks.0.attn.to_gate.lora_B.weight" in msg
    report = err.value.report.as_dict()
    assert {u["key"] for u in report["unmatched"]} == {
        "transformer.transformer_blocks.0.attn.to_gate.lora_A.weight",
        "transformer.transformer_blocks.0.attn.to_gate.lora_B.weight"}
    assert report["matched_keys"] == len(good) and report["ok"] is False
    assert_untouched(before, model_state(rt))
    assert "turbo_extra" not in rt.adapters
    # The same file without that pair fits, and is reported as the shared fit report does for any model.
    clean = tmp_path / "clean" / path.name
    clean.parent.mkdir()
    save_file(good, str(clean))
    adapter = rt.load_adapter("turbo_clean", clean)
    assert adapter.report.summary() == f"fits (transformer: 8 layers; {len(good)}/{len(good)} keys)"


def test_wrong_shape_is_refused_naming_key_and_both_shapes(rt, tmp_path):
    sd = lora(seed=3)
    sd["transformer.transformer_blocks.1.attn.to_v.lora_A.weight"] = torch.randn(4, HIDDEN + 8)
    path = tmp_path / "mm_wrong_shape.safetensors"
    save_file(sd, str(path))
    before = model_state(rt)
    with pytest.raises(AdapterError) as err:
        rt.load_adapter("wrong", path)
    assert err.value.http_status == 400
    assert ("transformer.transformer_blocks.1.attn.to_v.lora_A.weight: adapter (4, 40) vs model (4, 32)"
            in err.value.message)
    assert_untouched(before, model_state(rt))


def test_file_that_binds_no_layer_is_refused(rt, tmp_path):
    path = tmp_path / "mm_nothing.safetensors"
    save_file({"transformer.not_a_block.proj.lora_A.weight": torch.randn(4, HIDDEN),
               "transformer.not_a_block.proj.lora_B.weight": torch.randn(HIDDEN, 4)}, str(path))
    before = model_state(rt)
    with pytest.raises(AdapterError) as err:
        rt.load_adapter("nothing", path)
    assert err.value.http_status == 400 and "transformer.not_a_block.proj.lora_A.weight" in err.value.message
    assert err.value.report.bindings == {}
    assert_untouched(before, model_state(rt))


def test_adapter_names_with_dots_bind(rt, tmp_path):
    """peft refuses '.' in its adapter names (it used to fail half-way through binding); the request's name is
    not peft's."""
    path = tmp_path / "mm_dotted.safetensors"
    save_file(lora(seed=4, blocks=(1,)), str(path))
    base = gen(rt).pixels
    out = gen(rt, adapters=[("style.v2", str(path), 1.0)]).pixels
    assert np.abs(out - base).mean() > 0.5
    rt.unload_adapter("style.v2")
    assert "style.v2" not in rt.adapters and np.array_equal(gen(rt).pixels, base)


def test_published_turbo_key_layout_fits_every_layer(rt, tmp_path):
    """LightX2V's published Turbo files (bf16, unprefixed diffusers names with peft's `.default.` infix, attention
    and FFN of every block and of the token refiner, alpha in __metadata__) bind completely."""
    dims = {"attn.to_q": (HIDDEN, HIDDEN), "attn.to_k": (HIDDEN, HIDDEN), "attn.to_v": (HIDDEN, HIDDEN),
            "attn.to_out.0": (HIDDEN, HIDDEN), "ff.net.0.proj": (HIDDEN, 128), "ff.net.2": (64, HIDDEN)}
    g = torch.Generator().manual_seed(11)
    sd = {}
    for prefix, blocks in (("transformer_blocks", 2), ("token_refiner.refiner_blocks", 1)):
        for i in range(blocks):
            for module, (fan_in, fan_out) in dims.items():
                sd[f"{prefix}.{i}.{module}.lora_A.default.weight"] = torch.randn(8, fan_in, generator=g).bfloat16()
                sd[f"{prefix}.{i}.{module}.lora_B.default.weight"] = torch.randn(fan_out, 8, generator=g).bfloat16()
    path = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors"
    save_file(sd, str(path), metadata={"alpha": "128"})
    adapter = rt.load_adapter("published", path)
    assert adapter.report.summary() == "fits (transformer: 18 layers; 36/36 keys)"
    layer = adapter.report.bindings["transformer"].layers["transformer_blocks.0.ff.net.0.proj"]
    assert layer.scaling == 128 / 8 and adapter.contract.alpha == 128.0


def test_file_with_layers_for_both_partitions_is_refused(rt, tmp_path):
    sd = lora(seed=12, blocks=(0,))
    sd.update({k.replace("transformer.", "transformer_ref.", 1): v for k, v in lora(seed=13, blocks=(1,)).items()})
    path = tmp_path / "mm_both.safetensors"
    save_file(sd, str(path))
    before = model_state(rt)
    with pytest.raises(AdapterError, match="mm_both.safetensors holds layers for both transformer and "
                                           "transformer_ref"):
        rt.load_adapter("both", path)
    assert_untouched(before, model_state(rt))


# -- item 5: scale 0 is the base model, with no contract ------------------------------------------------


def test_turbo_at_scale_zero_is_the_base_model_without_its_contract(rt, tmp_path):
    path = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors"
    save_file(lora(seed=5), str(path))
    base = gen(rt)  # 3 steps, flow shift 12: not the Turbo contract
    zero = gen(rt, adapters=[("turbo0", str(path), 0.0)])
    assert np.array_equal(zero.pixels, base.pixels) and np.array_equal(zero.audio[0], base.audio[0])
    assert zero.metadata["num_inference_steps"] == 3 and zero.metadata["flow_shift"] == 12.0
    assert zero.metadata["contract"] is None
    # ref2va is not refused at scale 0 (the fl2v contract does not apply) ...
    ref = [Image.new("RGB", (48, 48), (20, 200, 20))]
    assert np.array_equal(gen(rt, adapters=[("turbo0", str(path), 0.0)], task_type="ref2va", references=ref).pixels,
                          gen(rt, task_type="ref2va", references=ref).pixels)
    # ... and at scale 1 the contract holds again.
    with pytest.raises(ContractViolation) as err:
        gen(rt, adapters=[("turbo0", str(path), 1.0)], num_inference_steps=3)
    assert "num_inference_steps=4" in err.value.message
    assert gen(rt, adapters=[("turbo0", str(path), 1.0)]).metadata["flow_shift"] == 6.0


def test_scale_zero_still_refuses_a_file_that_does_not_fit(rt, tmp_path):
    sd = lora(seed=6)
    sd["transformer.transformer_blocks.0.attn.to_gate.lora_A.weight"] = torch.randn(4, HIDDEN)
    sd["transformer.transformer_blocks.0.attn.to_gate.lora_B.weight"] = torch.randn(HIDDEN, 4)
    path = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.0.safetensors"
    save_file(sd, str(path))
    with pytest.raises(AdapterError, match="to_gate"):
        gen(rt, adapters=[("bad0", str(path), 0.0)])


# -- item 6: vLLM-Omni's native-adapter layout --------------------------------------------------------


NATIVE_META = {"key_format": "minimax-h3-native", "qkv_layout": "grouped", "base_schedule": "1.0,0.8,0.5,0.0"}


def grouped(stacked: torch.Tensor) -> torch.Tensor:
    """[q; k; v] rows -> [h0: q k v, h1: q k v] (what a native file stores)."""
    q, k, v = (t.reshape(HEADS, HEAD_DIM, -1) for t in stacked.chunk(3))
    return torch.stack([q, k, v], dim=1).reshape(3 * HEADS * HEAD_DIM, -1)


def native_pair(tmp_path):
    """One adapter three ways: vLLM-Omni's layout (as its tests write it: `transformer.<module>.lora_A.default
    .weight` over the checkpoint's names, lora_rank/lora_alpha metadata), our native layout, diffusers split."""
    vllm, native, split = {}, {}, {}
    g = torch.Generator().manual_seed(60)
    for i in range(2):
        a = torch.randn(4, HIDDEN, generator=g) * 0.3
        b = torch.randn(3 * HEADS * HEAD_DIM, 4, generator=g) * 0.3
        oa, ob = torch.randn(4, HIDDEN, generator=g) * 0.3, torch.randn(HIDDEN, 4, generator=g) * 0.3
        for sd, fmt in ((vllm, "transformer.blocks.{i}.attn.{m}.{ab}.default.weight"),
                        (native, "blocks.{i}.attn.{m}.{ab}.weight")):
            sd[fmt.format(i=i, m="qkv_proj", ab="lora_A")] = a.clone()
            sd[fmt.format(i=i, m="qkv_proj", ab="lora_B")] = grouped(b)
            sd[fmt.format(i=i, m="out_proj", ab="lora_A")] = oa.clone()
            sd[fmt.format(i=i, m="out_proj", ab="lora_B")] = ob.clone()
        for proj, rows in zip(("to_q", "to_k", "to_v"), b.chunk(3)):
            split[f"transformer.transformer_blocks.{i}.attn.{proj}.lora_A.weight"] = a.clone()
            split[f"transformer.transformer_blocks.{i}.attn.{proj}.lora_B.weight"] = rows.contiguous()
        split[f"transformer.transformer_blocks.{i}.attn.to_out.0.lora_A.weight"] = oa.clone()
        split[f"transformer.transformer_blocks.{i}.attn.to_out.0.lora_B.weight"] = ob.clone()
    paths = {name: tmp_path / f"{name}.safetensors" for name in ("vllm", "native", "split", "vllm_nometa")}
    save_file(vllm, str(paths["vllm"]), metadata={**NATIVE_META, "lora_rank": "4", "lora_alpha": "4"})
    save_file(native, str(paths["native"]), metadata=NATIVE_META)
    save_file(split, str(paths["split"]))
    save_file(vllm, str(paths["vllm_nometa"]))
    return paths


def test_vllm_omni_native_layout_loads_as_the_native_file(rt, tmp_path):
    paths = native_pair(tmp_path)
    vllm = gen(rt, adapters=[("vllm_native", str(paths["vllm"]), 1.0)])
    assert vllm.metadata["contract"]["kind"] == "native" and vllm.metadata["num_inference_steps"] == 3
    native = gen(rt, adapters=[("our_native", str(paths["native"]), 1.0)])
    assert np.array_equal(vllm.pixels, native.pixels)
    assert np.abs(vllm.pixels - gen(rt, num_inference_steps=3).pixels).mean() > 0.5  # it does something
    # Layer by layer it is the diffusers file with split q/k/v (which has no contract, so not end to end).
    rt.load_adapter("split", paths["split"])
    attn = rt.pipe.transformer.transformer_blocks[1].attn
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    outs = {}
    for name in ("vllm_native", "split"):
        rt._activate([(rt.adapters[name], name, 1.0)], "transformer")
        with torch.no_grad():
            outs[name] = torch.cat([attn.to_q(x), attn.to_k(x), attn.to_v(x), attn.to_out[0](x)], dim=-1)
        rt._disable_all()
    torch.testing.assert_close(outs["vllm_native"], outs["split"], rtol=1e-5, atol=1e-5)
    report = rt.adapters["vllm_native"].report
    assert report.ok and sorted(report.bindings["transformer"].layers) == sorted(
        f"transformer_blocks.{i}.attn.{p}" for i in range(2) for p in PROJ)


def test_vllm_omni_layout_without_native_metadata_is_refused_by_name(rt, tmp_path):
    paths = native_pair(tmp_path)
    before = model_state(rt)
    with pytest.raises(AdapterError) as err:
        rt.load_adapter("nometa", paths["vllm_nometa"])
    msg = err.value.message
    assert err.value.http_status == 400 and "vllm_nometa.safetensors" in msg and "vLLM-Omni" in msg
    assert "transformer.blocks.0.attn" in msg and "key_format='minimax-h3-native'" in msg
    assert_untouched(before, model_state(rt))


def test_vllm_omni_runtime_names_are_refused_by_key(rt, tmp_path):
    """Split q/k/v under the checkpoint's block names is no layout a publisher writes: refused naming the key."""
    path = tmp_path / "mm_runtime_names.safetensors"
    save_file({"transformer.blocks.0.attn.to_q.lora_A.default.weight": torch.randn(4, HIDDEN),
               "transformer.blocks.0.attn.to_q.lora_B.default.weight": torch.randn(HIDDEN, 4)}, str(path),
              metadata=NATIVE_META)
    with pytest.raises(AdapterError) as err:
        rt.load_adapter("runtime_names", path)
    assert err.value.http_status == 400 and "blocks.0.attn.to_q.lora_A.weight" in err.value.message


# -- the server path: 4xx JSON from `python app.py serve demo:minimax-h3` ---------------------------------


@pytest.fixture(scope="module")
def server(data_dir, demo_path, tmp_path_factory):
    from ui_fixtures import app_home, served_app

    demo_path("demo:minimax-h3")
    home = app_home(data_dir, tmp_path_factory, "mm-serve")
    (home / "adapters").mkdir()
    with served_app(home, model="demo:minimax-h3") as served:
        yield served.url + "/", home


def test_server_refuses_unfit_minimax_adapters_with_4xx_json(server):
    import httpx

    url, home = server
    extra = lora(seed=7)
    extra["transformer.transformer_blocks.0.attn.to_gate.lora_A.weight"] = torch.randn(4, HIDDEN)
    extra["transformer.transformer_blocks.0.attn.to_gate.lora_B.weight"] = torch.randn(HIDDEN, 4)
    save_file(extra, str(home / "adapters" / "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors"))
    shape = lora(seed=8)
    shape["transformer.transformer_blocks.1.attn.to_k.lora_B.weight"] = torch.randn(HIDDEN + 4, 4)
    save_file(shape, str(home / "adapters" / "mm_shape.safetensors"))
    save_file({"transformer.blocks.0.attn.qkv_proj.lora_A.default.weight": torch.randn(4, HIDDEN),
               "transformer.blocks.0.attn.qkv_proj.lora_B.default.weight": torch.randn(3 * HIDDEN, 4)},
              str(home / "adapters" / "mm_vllm_nometa.safetensors"))
    save_file(lora(seed=9), str(home / "adapters" / "minimax_h3_fl2v_turbo_2step_v1.0_768p.safetensors"))
    cases = {"mm_shape.safetensors": "transformer.transformer_blocks.1.attn.to_k.lora_B.weight: adapter (36, 4) "
                                     "vs model (32, 4)",
             "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors": "transformer.transformer_blocks.0.attn.to_gate",
             "mm_vllm_nometa.safetensors": "vLLM-Omni"}
    with httpx.Client(timeout=600) as client:
        def post(name, **fields):
            return client.post(url + "v1/videos/generations",
                               json={"model": "demo:minimax-h3", "prompt": "a fox", "lora": {"path": name},
                                     **fields})

        for name, expected in cases.items():
            r = post(name, num_inference_steps=1)
            assert r.status_code == 400, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert expected in err["message"] and name in err["message"], err
            assert err["type"] == "invalid_request_error" and err["param"] == "lora_path"
        # A file that fits is served (its name, with the dot of "v1.0", named the peft adapter and failed: 500).
        r = post("minimax_h3_fl2v_turbo_2step_v1.0_768p.safetensors")
        assert r.status_code == 200, r.text
        meta = r.json()["data"][0]["metadata"]
        assert meta["params"]["num_inference_steps"] == 2 and meta["params"]["flow_shift"] == 6.0
        assert [a["name"] for a in meta["adapters"]] == ["minimax_h3_fl2v_turbo_2step_v1.0_768p"]


def test_demo_revision_rebuilds_the_old_minimax_build_and_no_other_demo(tmp_path):
    from backend import demo

    minimax = demo.DEMO_MODELS["demo:minimax-h3"]
    old = tmp_path / ".demo-build"  # what a build from before this demo's revision left behind
    old.write_text(json.dumps({"id": minimax.id, "build_version": demo.BUILD_VERSION}))
    assert not demo._is_current(old, minimax)
    for model_id, model in demo.DEMO_MODELS.items():  # every other demo's marker is what it was: not rebuilt
        if model_id != minimax.id:  # (a trained model's marker also holds its weights' digest)
            marker = {k: v for k, v in demo._marker(model).items() if k != "weights"}
            assert marker == {"id": model_id, "build_version": demo.BUILD_VERSION}


def test_adapter_library_lists_minimax_files_with_the_runtimes_fit(data_dir, tmp_path):
    """`app.py adapters --model demo:minimax-h3` (library_rows) reads MiniMax-H3 files as the runtime does."""
    from backend.lora.library import library_rows

    (tmp_path / "lib").mkdir()
    paths = native_pair(tmp_path / "lib")
    save_file({k.replace("transformer.", "transformer_ref.", 1): v for k, v in lora(seed=14).items()},
              str(tmp_path / "lib" / "minimax_h3_ref2v_turbo_4step_v1.0.safetensors"))
    extra = lora(seed=15)
    extra["transformer.transformer_blocks.0.attn.to_gate.lora_A.weight"] = torch.randn(4, HIDDEN)
    extra["transformer.transformer_blocks.0.attn.to_gate.lora_B.weight"] = torch.randn(HIDDEN, 4)
    save_file(extra, str(tmp_path / "lib" / "mm_extra.safetensors"))
    rows = {r["name"]: r for r in library_rows("demo:minimax-h3", [tmp_path / "lib"], data_dir)}
    assert rows["vllm"]["fits"] and rows["vllm"]["fit"] == "fits (transformer: 8 layers; 16/16 keys)"
    assert rows["native"]["fit"] == rows["vllm"]["fit"]
    assert not rows["vllm_nometa"]["fits"] and "vLLM-Omni" in rows["vllm_nometa"]["fit"]
    assert rows["minimax_h3_ref2v_turbo_4step_v1.0"]["fit"] == "fits (transformer_ref: 8 layers; 16/16 keys)"
    assert not rows["mm_extra"]["fits"] and "transformer.transformer_blocks.0.attn.to_gate" in rows["mm_extra"]["fit"]
    assert paths["vllm"].is_file()

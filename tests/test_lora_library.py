"""The adapter library listing (fit per adapter) and the Omni API with the PEFT backend."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from backend import LoRARequest, Omni
from backend.lora import demo_adapters, list_adapters
from backend.lora.library import format_rows, scan

torch.set_num_threads(1)



def test_listing_shows_fit_for_the_model(library, data_dir, tmp_path):
    extra = tmp_path / "more"
    extra.mkdir()
    (extra / "old.ckpt").write_bytes(b"\x80\x04")
    rows = {r["name"]: r for r in list_adapters("demo:qwen-image", adapter_dirs=[extra], data_dir=data_dir)}
    for spec in demo_adapters.DEMO_ADAPTERS:
        name = spec.relpath.rsplit("/", 1)[-1].removesuffix(".safetensors")
        assert name in rows, name
        assert rows[name]["fits"] is (spec.model == "demo:qwen-image"), (name, rows[name]["fit"])
        assert rows[name]["size_bytes"] > 0 and len(rows[name]["sha256"]) == 64
    assert rows["demo-inverted"]["fit"].startswith("fits (transformer: 40 layers")
    # what each targets, the block index folded (the Adapters tab's "targets" column): kohya's flat names,
    # a PEFT folder's and a ComfyUI file's dotted paths, ten kinds of projection each
    kinds = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
             "attn.to_out.0", "attn.to_q", "attn.to_v", "img_mlp.net.0.proj", "img_mlp.net.2"]
    for name in ("demo-grayscale", "demo-outline", "demo-nine"):
        assert sorted(rows[name]["targets"]) == kinds, (name, rows[name]["targets"])
    assert "attn_to_q" in rows["demo-inverted"]["targets"] and len(rows["demo-inverted"]["targets"]) == 10
    assert rows["old"]["targets"] == []
    # a foreign adapter's shapes are named, both sides
    assert "adapter (8, 32) vs model (8, 128)" in rows["sd35-watercolor"]["fit"]
    # and in one plain line (the LoRA browser's misfit line; the submit-time refusal, #26)
    assert re.fullmatch(r"\d+ of its layers have other sizes in demo:qwen-image \(made for another model\)",
                        rows["sd35-watercolor"]["fit_reason"]), rows["sd35-watercolor"]["fit_reason"]
    assert rows["demo-inverted"]["fit_reason"] == ""
    assert "pickle" in rows["old"]["fit"] and rows["old"]["fits"] is False
    table = format_rows(list(rows.values()))
    assert table.splitlines()[0].split() == ["name", "format", "rank", "alpha", "size", "sha256", "fit"]
    assert len(table.splitlines()) == len(rows) + 1


def test_listing_without_model_has_no_fit(library, data_dir):
    # without a model the demo root is no root: name it as an --adapter-dir to list it
    rows = list_adapters(None, adapter_dirs=[library], data_dir=data_dir)
    # other tests in the session may drop unreadable files into the shared library for a
    # while; those are listed as refused, every readable adapter carries no fit
    readable = [r for r in rows if r["format"] != "-"]
    assert readable and all("fit" not in r for r in readable)
    assert {r["format"] for r in rows} >= {"peft", "peft-dump", "diffusers", "kohya", "lightx2v"}


def test_duplicate_stems_get_distinct_names(tmp_path, library, data_dir):
    import shutil

    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        shutil.copy(library / "qwen-image/demo-inverted.safetensors", tmp_path / sub / "style.safetensors")
    # the data dir's own library is always scanned too; look only at this test's root
    names = [e.name for e in scan([tmp_path], data_dir) if tmp_path in e.path.parents]
    assert sorted(names) == ["a/style", "b/style"]


def test_seed_example(library, data_dir):
    p = str(library / "sd3.5/sd35-cheesecake-peft")
    omni = Omni(model="demo:sd3.5", lora_path=p, lora_backend="peft", data_dir=data_dir)
    assert omni.lora.stats()["pinned"] == ["sd35-cheesecake-peft"]
    base = omni.generate(prompt="A piece of cheesecake", seed=42)[0]
    req = LoRARequest(lora_name="preloaded", lora_int_id=1, lora_path=p)
    out = omni.generate(prompt="A piece of cheesecake", lora_request=req, lora_scale=2.0, seed=42)[0]
    assert out.metadata["adapters"] == [{"name": "preloaded", "int_id": 1, "path": p, "format": "peft",
                                         "sha256": out.metadata["adapters"][0]["sha256"], "scale": 2.0,
                                         "mode": "merged"}]
    assert omni.lora.stats()["counters"]["loads_from_disk"] == 1  # the pre-load; the request reused it
    assert not np.array_equal(np.asarray(base.images[0]), np.asarray(out.images[0]))
    other = LoRARequest("watercolor", 2, str(library / "sd3.5/sd35-watercolor.safetensors"))
    stacked = omni.generate(prompt="A piece of cheesecake", lora_request=[req, other], lora_scale=[1.0, 0.5],
                            seed=42)[0]
    assert [(a["name"], a["scale"]) for a in stacked.metadata["adapters"]] == [("preloaded", 1.0),
                                                                            ("watercolor", 0.5)]
    again = omni.generate(prompt="A piece of cheesecake", seed=42)[0]
    assert np.array_equal(np.asarray(base.images[0]), np.asarray(again.images[0]))


def test_omni_refuses_a_foreign_preload(library, data_dir):
    from backend.errors import AdapterError

    with pytest.raises(AdapterError, match=r"wan21-t2v-musubi-demo\.safetensors"):
        Omni(model="demo:sd3.5", lora_path=str(library / "wan2.1-t2v/wan21-t2v-musubi-demo.safetensors"),
             lora_backend="peft", data_dir=data_dir)


def test_wan22_i2v_pair_fits_both_experts_from_a_skeleton(library, data_dir):
    from backend.lora.adapter import fit_adapter
    from backend.lora.library import denoiser_skeletons

    pipeline_cls, skeleton = denoiser_skeletons("demo:wan2.2-i2v", data_dir)
    assert pipeline_cls.__name__ == "WanImageToVideoPipeline"
    assert all(p.device.type == "meta" for m in skeleton.values() for p in m.parameters())
    for name in ("wan22-i2v-lightx2v-high", "wan22-i2v-lightx2v-low"):
        report = fit_adapter(library / f"wan2.2-i2v/{name}.safetensors", pipeline_cls, skeleton)
        assert report.ok and set(report.bindings) == {"transformer", "transformer_2"}
        assert report.matched_keys == 60 and len(report.ignored) == 6  # zero norm diffs, named

"""A stack baked into a copy of the checkpoint (#28 item 5): the copy loads with from_pretrained, its weights
are the PEFT backend's merge of the stack bit for bit (baked for fp32 serving, and in the checkpoint's own
fp16), it draws the stack's picture with no adapter, untouched files are links, and what cannot be baked is
refused with nothing written."""
from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import torch

import app
from backend.errors import InvalidParameter
from backend.jobs.adapters import AdapterResolver
from backend.lora.bake import INFO_FILE, bake_stack
from backend.lora.request import LoRARequest
from backend.models import resolve_model

MODEL = "demo:qwen-image"
STACK = [{"name": "demo-inverted", "scale": 0.7}, {"name": "demo-outline", "scale": -1.3}]
_IDS = itertools.count(4000)
torch.set_num_threads(1)


def state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def picture(m, adapters=None):
    out = m.generate({"prompt": "a red digit 3", "seed": 3, "num_inference_steps": 3}, adapters=adapters)
    return np.asarray(out.images[0])


def test_the_baked_copy_is_the_stacks_merge_bit_for_bit(managers, library, data_dir, tmp_path):
    from backend.lora import attach
    from backend.manager import PipelineManager

    resolver = AdapterResolver([], data_dir, model=MODEL)
    out = tmp_path / "inked"
    written = bake_stack(resolver.resolve(STACK), MODEL, out, data_dir=data_dir, dtype=torch.float32)
    assert written["layers"] > 0 and written["files"] == 1
    info = json.loads((out / INFO_FILE).read_text())
    assert [s["name"] for s in info["stack"]] == ["demo-inverted", "demo-outline"] and info["base"] == MODEL
    source = resolve_model(MODEL, data_dir).path
    for name in ("vae/diffusion_pytorch_model.safetensors", "model_index.json"):  # untouched: the same file
        assert os.path.samefile(out / name, source / name)
    assert not os.path.samefile(out / "transformer/diffusion_pytorch_model.safetensors",
                                source / "transformer/diffusion_pytorch_model.safetensors")

    m = managers(MODEL)  # the base with the stack merged by the engine
    base_picture = picture(m)
    stack = [(LoRARequest(a.name, next(_IDS), a.path), a.scale) for a in resolver.resolve(STACK)]
    stacked_picture = picture(m, stack)
    want = state(m.denoisers()["transformer"])
    m.lora_engine.activate([])

    baked = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
    baked.load(str(out))
    attach(baked)
    got = state(baked.denoisers()["transformer"])
    changed = [k for k in want if not torch.equal(want[k], got[k])]
    assert not changed, changed[:5]
    drawn = picture(baked)
    assert np.array_equal(drawn, stacked_picture) and not np.array_equal(drawn, base_picture)


def test_baked_in_the_checkpoints_own_dtype_it_is_the_merge_served_in_that_dtype(managers, library, data_dir,
                                                                                    tmp_path):
    from safetensors.torch import load_file

    resolver = AdapterResolver([], data_dir, model=MODEL)
    out = tmp_path / "inked-fp16"
    assert bake_stack(resolver.resolve(STACK), MODEL, out, data_dir=data_dir)["dtype"] == "as stored"
    stored = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.float16}  # the demo's own dtype, size unchanged
    m = managers(MODEL, "float16")
    m.lora_engine.activate([(LoRARequest(a.name, next(_IDS), a.path), a.scale) for a in resolver.resolve(STACK)])
    want = state(m.denoisers()["transformer"])
    m.lora_engine.activate([])
    changed = [k for k in want if not torch.equal(want[k], stored[k])]
    assert not changed, changed[:5]


def test_the_cli_bakes_and_refuses_what_it_cannot(data_dir, library, tmp_path, capsys):
    out = tmp_path / "cli-baked"
    assert app.main(["bake", "demo-inverted:0.5", "--model", MODEL, "-o", str(out), "--data-dir", str(data_dir)]) == 0
    assert f"run it with --model {out}" in capsys.readouterr().out
    assert (out / "transformer" / "config.json").is_file()
    # an existing folder is never written into
    assert app.main(["bake", "demo-inverted", "--model", MODEL, "-o", str(out), "--data-dir", str(data_dir)]) == 2
    assert "already exists" in capsys.readouterr().err
    resolver = AdapterResolver([], data_dir, model=MODEL)
    with pytest.raises(InvalidParameter, match="nothing to bake"):
        bake_stack(resolver.resolve([{"name": "demo-inverted", "scale": 0.0}]), MODEL, tmp_path / "zero",
                   data_dir=data_dir)
    with pytest.raises(InvalidParameter, match="only plain weights"):
        bake_stack(resolver.resolve([{"name": "demo-inverted", "scale": [1.0, 0.5]}]), MODEL, tmp_path / "steps",
                   data_dir=data_dir)
    assert not (tmp_path / "zero").exists() and not (tmp_path / "steps").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folder left

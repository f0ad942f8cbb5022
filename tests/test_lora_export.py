"""A stack exported as one LoRA file (#28 item 5): merged at weight 1 it is the stack merged, bit for bit in
fp32, from the library API, the CLI and (tests/test_api_lora.py) HTTP; it says where it came from; what cannot
fold into a file is refused by name."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import app
from backend.errors import InvalidParameter
from backend.jobs.adapters import AdapterResolver
from backend.lora.export import export_stack
from backend.lora.request import LoRARequest

MODEL = "demo:qwen-image"
STACK = [{"name": "demo-inverted", "scale": 0.7}, {"name": "demo-outline", "scale": -1.3}]
_IDS = itertools.count(2000)


def weights(m) -> dict:
    return {k: v.detach().clone() for k, v in m.denoisers()["transformer"].state_dict().items()}


@pytest.mark.parametrize("stack", [STACK, [{"name": "demo-inverted", "scale": 0.7}],
                                   [{"name": "demo-inverted", "scale": 0.3}, {"name": "demo-outline", "scale": 0.3}],
                                   [{"name": "demo-inverted", "scale": 0.7}, {"name": "demo-nine", "scale": 1 / 3}],
                                   [{"name": "demo-outline", "scale": 0.7}, {"name": "demo-inverted", "scale": -0.4}]],
                         ids=["two-weights", "one-adapter", "one-weight", "layers-apart", "stack-order-not-file-order"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_exported_file_merges_to_the_stack_bit_for_bit(stack, dtype, managers, library, data_dir, tmp_path):
    """Every kind of layer: one adapter alone (its weight is the layer's alpha), several at one weight, several
    at different weights (folded into B, ranks in the engine's order whatever the stack's); in fp32 and bf16
    every parameter is the stack's merge, torch.equal."""
    m = managers(MODEL, dtype)
    resolver = AdapterResolver([], data_dir, model=MODEL)
    out = tmp_path / "ink-film.safetensors"
    written = export_stack(resolver.resolve(stack), MODEL, out, data_dir=data_dir, title="ink-film",
                           dtype=getattr(torch, dtype))
    assert written["exact_in"] == dtype
    assert written["layers"] > 0 and [s["name"] for s in written["from"]] == [a["name"] for a in stack]
    engine = m.lora_engine
    base = weights(m)
    engine.activate([(LoRARequest(a.name, next(_IDS), a.path), a.scale) for a in resolver.resolve(stack)])
    want = weights(m)
    engine.activate([(LoRARequest("ink-film", next(_IDS), str(out)), 1.0)])
    got = weights(m)
    changed = [k for k in want if not torch.equal(want[k], got[k])]
    assert not changed, changed[:5]
    assert any(not torch.equal(base[k], got[k]) for k in base)
    engine.activate([])
    if stack is not STACK:
        return
    with safe_open(str(out), "pt") as f:  # the file says where it came from
        meta = f.metadata()
    assert meta["modelspec.title"] == "ink-film" and "demo-inverted x0.7 + demo-outline x-1.3" in \
        meta["modelspec.description"]
    assert [s["scale"] for s in json.loads(meta["lora_studio.exported_from"])] == [0.7, -1.3]


def test_the_cli_writes_the_same_file(data_dir, library, tmp_path, capsys):
    resolver = AdapterResolver([], data_dir, model=MODEL)
    ref = export_stack(resolver.resolve(STACK), MODEL, tmp_path / "ref.safetensors", data_dir=data_dir)
    out = tmp_path / "cli.safetensors"
    assert app.main(["export-lora", "demo-inverted:0.7", "demo-outline:-1.3", "--model", MODEL, "-o", str(out),
                     "--data-dir", str(data_dir)]) == 0
    assert "wrote" in capsys.readouterr().out
    a, b = load_file(ref["path"]), load_file(str(out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert app.main(["export-lora", "demo-inverted", "--model", MODEL, "-o", str(tmp_path / "x.png"),
                     "--data-dir", str(data_dir)]) == 2


def test_what_does_not_fold_into_a_file_is_refused_by_name(managers, data_dir, library, tmp_path):
    from test_lora_lycoris import hand_written

    resolver = AdapterResolver([tmp_path], data_dir, model=MODEL)
    hand_written(managers(MODEL).denoisers()["transformer"], "loha", "kohya", tmp_path / "a-loha.safetensors")
    with pytest.raises(InvalidParameter, match="a-loha is a LyCORIS LoHa adapter") as err:
        export_stack(resolver.resolve([STACK[0], {"name": "a-loha"}]), MODEL, tmp_path / "x.safetensors",
                     data_dir=data_dir)
    assert err.value.param == "lora[1]"
    with pytest.raises(InvalidParameter, match="only plain weights"):
        export_stack(resolver.resolve([{"name": "demo-inverted", "scale": [1.0, 0.5]}]), MODEL,
                     tmp_path / "x.safetensors", data_dir=data_dir)
    assert not (tmp_path / "x.safetensors").exists()


def test_pattern_lookup_picks_what_peft_picks():
    """convert.PatternMap (linear; peft's get_pattern_key tries every key's regex per module: 840 patterns took
    17.7 s against 2.4 ms here) picks the key peft picks: literal paths escaped or not, shorter suffixes
    before or after longer ones, and regex keys (which go to peft's own function)."""
    import re

    from peft.utils.other import get_pattern_key

    from backend.lora.convert import PatternMap

    modules = ["proj_out", "a.proj_out", "transformer_blocks.0.attn.to_q", "transformer_blocks.10.attn.to_q",
               "transformer_blocks.1.attn.to_q", "x.transformer_blocks.0.attn.to_q", "blocks.3.ffn.net.0.proj"]
    for keys in (["proj_out", re.escape("transformer_blocks.0.attn.to_q"), "attn.to_q"],
                 [re.escape("transformer_blocks.1.attn.to_q"), "to_q", "net.0.proj"],
                 ["to_q", re.escape("transformer_blocks.1.attn.to_q"), re.escape("a.proj_out"), "proj_out"],
                 [r"blocks\.\d+\.attn\.to_q", "proj_out"], [re.escape(m) for m in sorted(modules, key=len)]):
        patterns = {k: i for i, k in enumerate(keys)}
        for module in modules:
            assert PatternMap(patterns).lookup(module, -1) == patterns.get(get_pattern_key(keys, module), -1), \
                (keys, module)


def test_a_portable_file_carries_no_per_layer_alpha_and_is_the_stack_to_rounding(managers, library, data_dir,
                                                                                 tmp_path, capsys):
    """--portable: every layer's weight folded into B (what ComfyUI or A1111, reading no lora_adapter_metadata,
    apply at scale 1): no per-layer alphas in the header, and merged at weight 1 within fp32 rounding of the
    stack (bit for bit is the default file's)."""
    out = tmp_path / "portable.safetensors"
    assert app.main(["export-lora", "demo-inverted:0.7", "--portable", "--model", MODEL, "-o", str(out),
                     "--data-dir", str(data_dir)]) == 0
    assert "portable (to fp32 rounding)" in capsys.readouterr().out
    with safe_open(str(out), "pt") as f:
        assert "lora_adapter_metadata" not in f.metadata() and "lora_studio.exact_in" not in f.metadata()
    m = managers(MODEL)
    resolver = AdapterResolver([], data_dir, model=MODEL)
    engine = m.lora_engine
    engine.activate([(LoRARequest(a.name, next(_IDS), a.path), a.scale)
                     for a in resolver.resolve([{"name": "demo-inverted", "scale": 0.7}])])
    want = weights(m)
    engine.activate([(LoRARequest("portable", next(_IDS), str(out)), 1.0)])
    got = weights(m)
    engine.activate([])
    worst = max(float((want[k] - got[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want)
    assert 0 < worst <= 1e-6, worst  # rounding apart, and not bit for bit (one adapter alone: its weight folded)

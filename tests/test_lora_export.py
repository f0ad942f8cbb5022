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


def base_stack_file(m, resolved, path, read=weights) -> tuple[dict, dict, dict]:
    """``read(m)`` of the base, with the stack merged, and with the exported file at ``path`` merged at weight 1
    (the engine left with no adapter)."""
    engine = m.lora_engine
    base = read(m)
    engine.activate([(LoRARequest(a.name, next(_IDS), a.path), a.scale) for a in resolved])
    want = read(m)
    engine.activate([(LoRARequest(path.stem, next(_IDS), str(path)), 1.0)])
    got = read(m)
    engine.activate([])
    return base, want, got


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
    base, want, got = base_stack_file(m, resolver.resolve(stack), out)
    changed = [k for k in want if not torch.equal(want[k], got[k])]
    assert not changed, changed[:5]
    assert any(not torch.equal(base[k], got[k]) for k in base)
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
    _, want, got = base_stack_file(m, resolver.resolve([{"name": "demo-inverted", "scale": 0.7}]), out)
    worst = max(float((want[k] - got[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want)
    assert 0 < worst <= 1e-6, worst  # rounding apart, and not bit for bit (one adapter alone: its weight folded)


# -- the kohya layout (sd-scripts' names), per family ----------------------------------------------------
KOHYA_STACKS = {
    "demo:qwen-image": STACK,
    "demo:wan2.1-t2v": [{"name": "wan21-t2v-musubi-demo", "scale": 0.9}],
}
KOHYA_KEY = r"lora_(unet|te[123]?)_[A-Za-z0-9_]+\.(lora_down\.weight|lora_up\.weight|alpha)"


def all_weights(m) -> dict:
    return {f"{c}.{k}": v.detach().clone() for c, x in {**m.denoisers(), **m.encoders()}.items()
            for k, v in x.state_dict().items()}


@pytest.mark.parametrize("model", list(KOHYA_STACKS))
def test_a_kohya_file_holds_the_stack_under_sd_scripts_names(model, managers, library, data_dir, tmp_path):
    """#28 item 5's kohya layout: ``lora_unet_<module, dots as _>`` with ``lora_down`` / ``lora_up`` / ``alpha``
    (alpha / r the layer's scale), no diffusers header config; read back (here through the same readers that
    take kohya files from ComfyUI or A1111 users) and merged at weight 1 it is the stack's merge to fp32
    rounding."""
    import re

    stack = KOHYA_STACKS[model]
    m = managers(model)
    resolver = AdapterResolver([], data_dir, model=model)
    out = tmp_path / "kohya.safetensors"
    written = export_stack(resolver.resolve(stack), model, out, data_dir=data_dir, title="kohya", layout="kohya")
    assert written["layout"] == "kohya" and written["exact_in"] is None and written["layers"] > 0
    tensors = load_file(str(out))
    odd = [k for k in tensors if not re.fullmatch(KOHYA_KEY, k)]
    assert not odd, odd[:5]
    if "wan" in model:  # Wan's original module names, as musubi-tuner writes them (blocks_0_self_attn_q)
        assert any("_self_attn_q." in k for k in tensors) and not any("attn1" in k for k in tensors)
    assert len([k for k in tensors if k.endswith(".alpha")]) == written["layers"]
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert "lora_adapter_metadata" not in meta
    assert meta["ss_network_module"] == ("networks.lora_wan" if "wan" in model else "networks.lora")
    assert meta["modelspec.title"] == "kohya" and stack[0]["name"] in meta["modelspec.description"]

    base, want, got = base_stack_file(m, resolver.resolve(stack), out, read=all_weights)
    changed = [k for k in want if not torch.equal(base[k], want[k])]
    assert changed and all(not torch.equal(base[k], got[k]) for k in changed)
    worst = max(float((want[k] - got[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)) for k in want)
    print(f"{model}: kohya file vs the stack, max |diff| / max|W| = {worst:.1e} over {len(changed)} tensors")
    assert worst <= 1e-6, worst


def test_what_the_kohya_layout_cannot_hold_is_refused_by_name(data_dir, library, tmp_path):
    """Refused by name, nothing written: a stack that changes Wan2.2's low-noise expert (``transformer_2``: a
    kohya file holds one transformer), a LoRA bias (lightx2v's ``diff_b``: kohya has no key for one), SD3.5's
    transformer (its kohya names are MMDiT's own, which diffusers does not read back), an unknown layout."""
    sd3 = AdapterResolver([], data_dir, model="demo:sd3.5")
    with pytest.raises(InvalidParameter, match="MMDiT") as err:
        export_stack(sd3.resolve([{"name": "sd35-watercolor"}]), "demo:sd3.5", tmp_path / "sd3.safetensors",
                     data_dir=data_dir, layout="kohya")
    assert err.value.param == "layout" and not (tmp_path / "sd3.safetensors").exists()
    model = "demo:wan2.2-t2v"
    resolver = AdapterResolver([], data_dir, model=model)
    out = tmp_path / "low.safetensors"
    with pytest.raises(InvalidParameter, match="changes transformer_2") as err:
        export_stack(resolver.resolve([{"name": "wan22-t2v-lightx2v-low"}]), model, out, data_dir=data_dir,
                     layout="kohya")
    assert err.value.param == "layout" and not out.exists()
    high_only = [{"name": "wan22-t2v-lightx2v-high", "scale": {"transformer": 1.0, "transformer_2": 0.0}}]
    with pytest.raises(InvalidParameter, match="adds a LoRA bias there") as err:  # lightx2v's diff_b
        export_stack(resolver.resolve(high_only), model, out, data_dir=data_dir, layout="kohya")
    assert err.value.param == "layout" and not out.exists()
    with pytest.raises(InvalidParameter, match="layout 'comfy'"):
        export_stack(resolver.resolve([{"name": "wan22-t2v-lightx2v-high"}]), model, out, data_dir=data_dir,
                     layout="comfy")

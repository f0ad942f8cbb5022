"""LyCORIS adapters (#28 item 1: LoHa, LoKr, full diffs) on demo:qwen-image: the engine merges what peft's
own LoHa/LoKr layers merge, and what the LyCORIS / kohya and ComfyUI layouts mean by LyCORIS's and
ComfyUI's rules (written here by hand from the same tensors); switching back gives the base bits; the
picture changes and comes back at scale 0; what cannot run merged is refused by name; broken files are
refused naming the key, the model untouched."""
from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from backend.errors import AdapterError, InvalidParameter
from backend.lora import formats
from backend.lora.policy import BatchInputs, PolicyInputs, decide, decide_batch
from backend.lora.request import LoRARequest
from backend.weights import module_checksum

MODEL = "demo:qwen-image"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
STEPS = 4
torch.set_num_threads(1)
_IDS = itertools.count(1000)  # the module's engine is shared: one lora_int_id per file


def req(name: str, path) -> LoRARequest:
    return LoRARequest(name, next(_IDS), str(path))


def transformer(managers):
    return managers(MODEL).denoisers()["transformer"]


def sums(m) -> dict:
    return {c: module_checksum(x) for c, x in m.denoisers().items()}


def peft_saved(base, cfg, folder, randomize, seed):
    """peft's adapter ``cfg`` on a copy of ``base`` (fp32), ``randomize(name, param, generator)`` on its
    parameters (peft starts them at a zero delta), saved as a PEFT folder; returns (folder, {module: weight
    merged by peft's own ``merge()``})."""
    from peft import get_peft_model_state_dict, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = inject_adapter_in_model(cfg, copy.deepcopy(base).float())
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        randomize(name, p, gen)
    state = get_peft_model_state_dict(model)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(cfg.to_dict(), default=list))
    merged = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
            merged[name] = module.get_base_layer().weight.detach().clone()
    return folder, merged


def peft_adapter(base, kind: str, folder, seed=0, **config):
    """A peft LoHa / LoKr adapter with random parameters, saved, and what peft merges it to."""
    from peft import LoHaConfig, LoKrConfig

    def randomize(name, p, gen):
        if "hada_" in name or "lokr_" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.3

    cfg = (LoHaConfig if kind == "loha" else LoKrConfig)(target_modules=TARGETS, **config)
    return peft_saved(base, cfg, folder, randomize, seed)


def merged_weights(m, names) -> dict:
    t = m.denoisers()["transformer"]
    modules = dict(t.named_modules())
    return {n: modules[n].weight.detach().clone() for n in names}


def assert_close(ours: dict, want: dict, what: str):
    worst = max(float((ours[n].float() - want[n].float()).abs().max() / want[n].float().abs().max())
                for n in want)
    print(f"{what}: max |ours - reference| / max|W| = {worst:.2e} over {len(want)} layers")
    assert worst <= 1e-6, (what, worst)


@pytest.mark.parametrize("kind,config", [("loha", {"r": 4, "alpha": 8}),
                                         ("lokr", {"r": 4, "alpha": 6}),
                                         ("lokr", {"r": 4, "alpha": 6, "decompose_both": True})],
                         ids=["loha", "lokr", "lokr-both-factored"])
def test_peft_loha_and_lokr_merge_as_peft_merges_them(kind, config, managers, tmp_path):
    m = managers(MODEL)
    base = sums(m)
    folder, want = peft_adapter(transformer(managers), kind, tmp_path / kind, **config)
    assert formats.inspect(folder).format == "peft"
    engine = m.lora_engine
    meta = engine.activate([(req(kind, folder), 1.0)])
    assert meta[0]["mode"] == "merged" and engine.stats()["merged_layers"] == len(want)
    assert_close(merged_weights(m, want), want, f"peft {kind} {config}")
    engine.activate([])
    assert sums(m) == base  # restored bit for bit


def _delta(kind, t, scale):
    if kind == "loha":
        return (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]) * scale
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    return torch.kron(w1, w2) * scale


def hand_written(base, kind: str, layout: str, path, seed=1):
    """A LyCORIS file written by hand in a publisher's layout, and the weights it means:
    ``kohya`` (LyCORIS / sd-scripts: ``lycoris_<module with _>``), ``comfy`` (``diffusion_model.<module>``).
    LoHa rank 3, alpha 1.5 (scale 0.5); LoKr w1 whole (4 x 4), w2 factored rank 2, alpha 1 (0.5); full: a diff
    and a bias diff (scale 1)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, want, bias = {}, {}, {}
    for name, module in base.named_modules():
        if not (isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("to_q", "to_k", "0")
                and "attn" in name):
            continue
        out_f, in_f = module.weight.shape
        if kind == "loha":
            t = {"hada_w1_a": (out_f, 3), "hada_w1_b": (3, in_f), "hada_w2_a": (out_f, 3), "hada_w2_b": (3, in_f)}
            alpha, scale = 1.5, 0.5
        elif kind == "lokr":
            t = {"lokr_w1": (4, 4), "lokr_w2_a": (out_f // 4, 2), "lokr_w2_b": (2, in_f // 4)}
            alpha, scale = 1.0, 0.5
        else:
            t = {"diff": (out_f, in_f), "diff_b": (out_f,)}
            alpha, scale = None, 1.0
        t = {p: torch.randn(s, generator=gen) * 0.2 for p, s in t.items()}
        key = "lycoris_" + name.replace(".", "_") if layout == "kohya" else f"diffusion_model.{name}"
        tensors.update({f"{key}.{p}": v for p, v in t.items()})
        if alpha is not None:
            tensors[f"{key}.alpha"] = torch.tensor(alpha)
        w = module.weight.detach().float()
        want[name] = w + (t["diff"] if kind == "full" else _delta(kind, t, scale))
        if kind == "full":
            bias[name] = module.bias.detach().float() + t["diff_b"]
    save_file(tensors, str(path))
    return path, want, bias


@pytest.mark.parametrize("kind", ["loha", "lokr", "full"])
@pytest.mark.parametrize("layout", ["kohya", "comfy"])
def test_hand_written_layouts_mean_what_lycoris_and_comfyui_apply(kind, layout, managers, tmp_path):
    m = managers(MODEL)
    base = sums(m)
    path, want, bias = hand_written(transformer(managers), kind, layout, tmp_path / f"{kind}-{layout}.safetensors")
    record = formats.inspect(path)
    assert record.format == "lycoris"
    m.lora_engine.activate([(req(path.stem, path), 1.0)])
    assert_close(merged_weights(m, want), want, f"{kind} in the {layout} layout")
    modules = dict(transformer(managers).named_modules())
    for n, b in bias.items():  # a full layer's diff_b lands on the bias
        assert float((modules[n].bias.float() - b).abs().max()) <= 1e-6 * float(b.abs().max()), n
    m.lora_engine.activate([])
    assert sums(m) == base


def image(m, adapters, seed=4):
    out = m.generate({"prompt": "a red digit 3 on a black background", "seed": seed,
                      "num_inference_steps": STEPS}, adapters=adapters)
    return np.asarray(out.images[0], dtype=np.float32), out.metadata


def test_a_loha_changes_the_picture_stacks_with_a_lora_and_is_gone_at_scale_zero(managers, library, tmp_path):
    m = managers(MODEL)
    base_sums = sums(m)
    folder, _ = peft_adapter(transformer(managers), "loha", tmp_path / "loha", r=4, alpha=8)
    loha = req("loha", folder)
    lora = req("grayscale", library / "qwen-image/demo-grayscale")
    base, _ = image(m, [])
    drawn, meta = image(m, [(loha, 1.0)])
    assert meta["adapters"][0]["mode"] == "merged"
    assert np.abs(drawn - base).max() > 10  # the LoHa changes the picture (0-255 pixels)
    stacked, meta = image(m, [(loha, 1.0), (lora, 1.0)])
    assert {a["name"] for a in meta["adapters"]} == {"loha", "grayscale"}
    assert np.abs(stacked - drawn).max() > 10
    zero, _ = image(m, [(loha, 0.0)])
    assert np.array_equal(zero, base) and sums(m) == base_sums


def test_what_would_need_it_unfused_is_refused_by_name(managers, tmp_path):
    m = managers(MODEL)
    base = sums(m)
    folder, _ = peft_adapter(transformer(managers), "lokr", tmp_path / "style-lokr", r=4, alpha=4)
    request = req("style-lokr", folder)
    with pytest.raises(InvalidParameter) as err:
        m.lora_engine.activate([(request, 1.0)], mode="unfused")
    assert "'style-lokr' (LyCORIS LoKr)" in err.value.message and err.value.param == "lora_mode"
    with pytest.raises(InvalidParameter) as err:  # a weight over steps runs unfused
        m.lora_engine.activate([(request, [1.0, 0.5])], steps=2)
    assert "style-lokr" in err.value.message and err.value.param == "lora_scale"
    assert sums(m) == base
    only = "adapter 'x' (LyCORIS LoHa)"
    with pytest.raises(InvalidParameter, match="quantized"):
        decide(PolicyInputs(steps=4, merge_bytes=1, merge_only=only, quantized="fp8"))
    assert decide(PolicyInputs(steps=4, merge_bytes=10**9, step_s=1.0, ratio=0.0, merge_only=only)).mode == "merged"
    batch = decide_batch(BatchInputs(jobs=[PolicyInputs(steps=4, merge_bytes=1, merge_only=only), None], steps=4,
                                     step_s=None))
    assert batch["mode"] == "sequential" and "LoHa" in batch["reason"]


def _broken(base, tmp_path):
    name = next(n for n, mod in base.named_modules() if isinstance(mod, torch.nn.Linear) and n.endswith("to_q"))
    out_f, in_f = dict(base.named_modules())[name].weight.shape
    key = "lycoris_" + name.replace(".", "_")
    full = {"hada_w1_a": torch.ones(out_f, 2), "hada_w1_b": torch.ones(2, in_f), "hada_w2_a": torch.ones(out_f, 2),
            "hada_w2_b": torch.ones(2, in_f)}
    cases = {
        "incomplete": ({f"{key}.{p}": v for p, v in full.items() if p != "hada_w2_b"}, "incomplete LoHa layer"),
        "tucker": ({**{f"{key}.{p}": v for p, v in full.items()}, f"{key}.hada_t1": torch.ones(2, 2, 1, 1)},
                   "Tucker core"),
        "shape": ({**{f"{key}.{p}": v for p, v in full.items()}, f"{key}.hada_w2_a": torch.ones(out_f + 1, 2)},
                  "differ in shape"),
        "no-layer": ({f"lycoris_no_such_layer.{p}": v for p, v in full.items()}, "no Linear layer"),
        "mismatch": ({f"{key}.lokr_w1": torch.ones(3, 3), f"{key}.lokr_w2": torch.ones(5, 5)}, "shape mismatch"),
    }
    out = {}
    for case, (tensors, words) in cases.items():
        path = tmp_path / f"broken-{case}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        out[case] = (path, words)
    return out


@pytest.mark.parametrize("case", ["incomplete", "tucker", "shape", "no-layer", "mismatch"])
def test_a_broken_lycoris_file_is_refused_naming_the_key_and_the_model_is_unchanged(case, managers, tmp_path):
    m = managers(MODEL)
    base = sums(m)
    path, words = _broken(transformer(managers), tmp_path)[case]
    with pytest.raises(AdapterError) as err:
        m.lora_engine.activate([(req(path.stem, path), 1.0)])
    assert words in err.value.message, err.value.message
    assert sums(m) == base


# -- DoRA (#28 item 2) ---------------------------------------------------------------------------------------
def peft_dora(base, folder, seed=2):
    """A peft DoRA adapter (LoraConfig(use_dora=True)): random factors, magnitudes off the base norms, saved,
    and what peft merges it to."""
    from peft import LoraConfig

    def randomize(name, p, gen):
        if "lora_A" in name or "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.2
        elif "lora_magnitude_vector" in name:
            p.data = p.data * (1 + 0.3 * torch.randn(p.shape, generator=gen))

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=True)
    return peft_saved(base, cfg, folder, randomize, seed)


def test_peft_dora_merges_as_peft_merges_it_and_a_weight_is_comfyuis_strength(managers, tmp_path):
    m = managers(MODEL)
    base = sums(m)
    folder, want = peft_dora(transformer(managers), tmp_path / "dora")
    w0 = merged_weights(m, want)
    request = req("dora", folder)
    meta = m.lora_engine.activate([(request, 1.0)])
    assert meta[0]["mode"] == "merged"
    assert_close(merged_weights(m, want), want, "peft DoRA, weight 1")
    m.lora_engine.activate([(request, 0.5)])  # W0 + 0.5 (W_dora - W0)
    assert_close(merged_weights(m, want), {n: w0[n] + 0.5 * (want[n] - w0[n]) for n in want}, "peft DoRA, weight 0.5")
    with pytest.raises(InvalidParameter, match=r"'dora' \(DoRA\)"):
        m.lora_engine.activate([(request, 1.0)], mode="unfused")
    m.lora_engine.activate([])
    assert sums(m) == base


@pytest.mark.parametrize("axis", ["column", "row"])
def test_kohya_dora_scale_normalises_the_axis_it_is_stored_for(axis, managers, library, tmp_path):
    """kohya / LyCORIS ``dora_scale`` beside ``lora_down``/``lora_up``: (1, in) scales the column norms (their
    default), (out, 1) the row norms (``wd_on_out``), of the weight with the LoRA merged (what this same file
    without its dora_scale merges to)."""
    from safetensors.torch import load_file

    m = managers(MODEL)
    base = sums(m)
    plain = library / "qwen-image/demo-inverted.safetensors"
    tensors = load_file(str(plain))
    modules = {n.replace(".", "_"): n for n, _ in transformer(managers).named_modules()}
    gen = torch.Generator().manual_seed(3)
    scales = {}
    for key in [k for k in tensors if k.endswith(".lora_down.weight")]:
        head = key.removesuffix(".lora_down.weight")
        out_f, in_f = tensors[f"{head}.lora_up.weight"].shape[0], tensors[key].shape[1]
        shape = (1, in_f) if axis == "column" else (out_f, 1)
        tensors[f"{head}.dora_scale"] = scales[modules[head.removeprefix("lora_unet_")]] = \
            1 + 0.2 * torch.rand(shape, generator=gen)
    path = tmp_path / f"dora-{axis}.safetensors"
    save_file(tensors, str(path))
    m.lora_engine.activate([(req("inverted", plain), 1.0)])
    lora = merged_weights(m, scales)
    m.lora_engine.activate([(req(path.stem, path), 1.0)])
    want = {n: w * (scales[n] / torch.linalg.vector_norm(w.float(), dim=0 if axis == "column" else 1, keepdim=True))
            for n, w in lora.items()}
    assert_close(merged_weights(m, scales), want, f"kohya dora_scale per {axis}")
    m.lora_engine.activate([])
    assert sums(m) == base

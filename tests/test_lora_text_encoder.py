"""Text-encoder LoRAs (#28 item 3): kohya ``lora_te1_`` / ``lora_te2_`` / ``lora_te3_`` / ``lora_te_`` and
diffusers ``text_encoder.`` keys change the text encoders (SD3.5's CLIP-L, CLIP-G and T5; Qwen-Image's
Qwen2.5-VL), never dropped: merged as peft merges them, counted apart in the fit report, weighted apart
(``{"text_encoder": w, "denoisers": w}``, A1111's ``<lora:NAME:TE:UNET>``), merged in every serving mode,
and the encoders' weights come back bit for bit."""
from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from backend.errors import AdapterError, InvalidParameter
from backend.lora.request import LoRARequest
from backend.weights import module_checksum

SD3, QWEN = "demo:sd3.5", "demo:qwen-image"
STEPS = 3
torch.set_num_threads(1)
_IDS = itertools.count(3000)


def req(name: str, path) -> LoRARequest:
    return LoRARequest(name, next(_IDS), str(path))


def sums(m) -> dict:
    return {c: module_checksum(x) for c, x in {**m.denoisers(), **m.encoders()}.items()}


def peft_lora(encoder, targets, seed, r=4, alpha=8):
    """peft's LoRA on a copy of ``encoder`` with random factors: (peft state dict, {module: weight peft merges})."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets)
    model = inject_adapter_in_model(cfg, copy.deepcopy(encoder).float())
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:  # peft starts B at zero: a random B makes the delta visible
            p.data = torch.randn(p.shape, generator=gen) * 0.2
    state = get_peft_model_state_dict(model)
    merged = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
            merged[name] = module.get_base_layer().weight.detach().clone()
    return state, merged, cfg


def as_kohya(state: dict, prefix: str, alpha: float) -> dict:
    """peft's factors in kohya sd-scripts' layout: ``lora_te1_<module, dots as _>.lora_down / lora_up / alpha``."""
    out = {}
    for key, t in state.items():
        module, _, part = key.rpartition(".lora_")
        name = prefix + module.replace(".", "_")
        out[f"{name}.{'lora_down' if part.startswith('A') else 'lora_up'}.weight"] = t.contiguous()
        out[f"{name}.alpha"] = torch.tensor(alpha)
    return out


def encoder_weights(m, comp: str, names) -> dict:
    modules = dict(m.encoders()[comp].named_modules())
    return {n: modules[n].weight.detach().clone() for n in names}


def assert_close(ours: dict, want: dict, what: str):
    worst = max(float((ours[n].float() - want[n].float()).abs().max() / want[n].float().abs().max()) for n in want)
    print(f"{what}: max |ours - peft| / max|W| = {worst:.2e} over {len(want)} layers")
    assert worst <= 1e-6, (what, worst)


@pytest.fixture(scope="module")
def sd3_files(managers, tmp_path_factory):
    """One peft LoRA per SD3.5 encoder (CLIP-L, CLIP-G: q/v projections; T5: q/v), written in kohya's layout
    and through diffusers' own ``save_lora_weights`` (CLIP-L, CLIP-G: what it writes), and the weights peft
    merges them to."""
    from diffusers import StableDiffusion3Pipeline

    m = managers(SD3)
    enc = m.encoders()
    root = tmp_path_factory.mktemp("te")
    states, want = {}, {}
    for i, (comp, targets) in enumerate((("text_encoder", ["q_proj", "v_proj"]),
                                         ("text_encoder_2", ["q_proj", "v_proj"]),
                                         ("text_encoder_3", ["q", "v"]))):
        states[comp], want[comp], cfg = peft_lora(enc[comp], targets, seed=i)
    kohya = {}
    for comp, prefix in (("text_encoder", "lora_te1_"), ("text_encoder_2", "lora_te2_"), ("text_encoder_3", "lora_te3_")):
        kohya.update(as_kohya(states[comp], prefix, alpha=8.0))
    save_file(kohya, str(root / "te-kohya.safetensors"))
    meta = cfg.to_dict()
    meta["target_modules"] = sorted(meta["target_modules"])
    StableDiffusion3Pipeline.save_lora_weights(
        root / "te-diffusers", text_encoder_lora_layers=states["text_encoder"],
        text_encoder_2_lora_layers=states["text_encoder_2"], weight_name="te-diffusers.safetensors",
        text_encoder_lora_adapter_metadata=meta, text_encoder_2_lora_adapter_metadata=meta)
    return {"kohya": root / "te-kohya.safetensors",
            "diffusers": root / "te-diffusers" / "te-diffusers.safetensors", "want": want, "root": root}


def test_kohya_encoder_keys_merge_as_peft_merges_them_and_come_back_bit_for_bit(managers, sd3_files):
    m = managers(SD3)
    base = sums(m)
    engine = m.lora_engine
    meta = engine.activate([(req("te-kohya", sd3_files["kohya"]), 1.0)])
    assert meta[0]["mode"] == "merged" and meta[0]["format"] == "kohya"
    report = engine.find("te-kohya").report
    assert report.ok and report.encoder_layers == {"text_encoder": 4, "text_encoder_2": 4, "text_encoder_3": 4}
    assert "text encoders: text_encoder: 4 layers, text_encoder_2: 4 layers, text_encoder_3: 4 layers" \
        in report.summary()
    for comp, want in sd3_files["want"].items():
        assert_close(encoder_weights(m, comp, want), want, f"kohya lora_te* -> {comp}")
    assert sums(m)["transformer"] == base["transformer"]  # a text-encoder LoRA leaves the denoiser alone
    engine.activate([])
    assert sums(m) == base  # every encoder restored bit for bit


def test_encoder_layers_are_exported_under_kohyas_te_prefixes(managers, sd3_files, data_dir, tmp_path):
    """#28 item 5, the kohya layout: the diffusers-saved encoder LoRA (``text_encoder.`` keys) exported as
    sd-scripts names SD3.5's encoders (``lora_te1_`` CLIP-L, ``lora_te2_`` CLIP-G), read back to what peft merges."""
    from safetensors.torch import load_file

    from backend.jobs.adapters import AdapterResolver
    from backend.lora.export import export_stack

    resolver = AdapterResolver([sd3_files["root"] / "te-diffusers"], data_dir, model=SD3)
    out = tmp_path / "te-as-kohya.safetensors"
    export_stack(resolver.resolve([{"path": str(sd3_files["diffusers"])}]), SD3, out, data_dir=data_dir,
                 layout="kohya")
    prefixes = {k.split("_", 2)[1] for k in load_file(str(out))}
    assert prefixes == {"te1", "te2"}, prefixes
    m = managers(SD3)
    base = sums(m)
    assert m.lora_engine.activate([(req("te-as-kohya", out), 1.0)])[0]["format"] == "kohya"
    for comp in ("text_encoder", "text_encoder_2"):
        want = sd3_files["want"][comp]
        assert_close(encoder_weights(m, comp, want), want, f"exported kohya lora_te* -> {comp}")
    m.lora_engine.activate([])
    assert sums(m) == base


def test_diffusers_saved_encoder_layers_read_with_their_saved_alpha(managers, sd3_files):
    m = managers(SD3)
    base = sums(m)
    engine = m.lora_engine
    meta = engine.activate([(req("te-diffusers", sd3_files["diffusers"]), 1.0)])
    assert meta[0]["format"] == "diffusers"
    assert engine.find("te-diffusers").report.encoder_layers == {"text_encoder": 4, "text_encoder_2": 4}
    for comp in ("text_encoder", "text_encoder_2"):
        want = sd3_files["want"][comp]
        assert_close(encoder_weights(m, comp, want), want, f"diffusers text_encoder* -> {comp}")
    engine.activate([])
    assert sums(m) == base


def image(m, adapters, prompt="a red digit 3 on a black background", **kw):
    out = m.generate({"prompt": prompt, "seed": 4, "num_inference_steps": STEPS, **kw}, adapters=adapters)
    return np.asarray(out.images[0], dtype=np.float32), out.metadata


def test_an_encoder_lora_changes_the_picture_and_its_weights_apart(managers, sd3_files):
    """The picture follows the encoder weight: scale 0 (or te 0 in the A1111 tag's sense) is the base picture
    exactly; the denoisers' weight does nothing to an encoder-only LoRA."""
    from backend.lora import prompt_tags

    m = managers(SD3)
    te = req("te-kohya", sd3_files["kohya"])
    base, _ = image(m, [])
    drawn, meta = image(m, [(te, 1.0)])
    assert np.abs(drawn - base).max() > 10, "the text-encoder LoRA changed nothing in the picture"
    assert meta["adapters"][0]["scale"] == 1.0
    zero, _ = image(m, [(te, 0.0)])
    assert np.array_equal(zero, base)
    _, tagged = prompt_tags.split("a red digit 3 <lora:te-kohya:0:1>")  # A1111: <lora:NAME:TE:UNET>
    assert tagged[0]["scale"] == {"text_encoder": 0.0, "denoisers": 1.0}
    off, _ = image(m, [(te, tagged[0]["scale"])])
    assert np.array_equal(off, base)
    on, meta = image(m, [(te, {"text_encoder": 1.0, "denoisers": 0.0})])
    assert np.array_equal(on, drawn)
    assert meta["adapters"][0]["scale"] == 1.0  # the weights it ran at: 1.0 on every encoder it binds
    clip_only, meta = image(m, [(te, {"text_encoder": 0.0, "text_encoder_3": 1.0})])  # one encoder named alone
    assert meta["adapters"][0]["scale"] == {"text_encoder": 0.0, "text_encoder_2": 0.0, "text_encoder_3": 1.0}
    assert not np.array_equal(clip_only, base) and not np.array_equal(clip_only, drawn)
    m.lora_engine.activate([])


def test_encoder_layers_are_merged_when_the_denoiser_runs_unfused(managers, sd3_files, library, tmp_path):
    """Unfused serving hooks the denoiser's layers and never writes them; the encoders' layers are merged (the
    encoder runs once, before the first step), and both come back exactly."""
    m = managers(SD3)
    base = sums(m)
    t = m.denoisers()["transformer"]
    gen = torch.Generator().manual_seed(7)
    unet = {}
    for name, module in t.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(("attn.to_q", "attn.to_v")):
            unet[f"transformer.{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=gen) * 0.3
            unet[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=gen) * 0.3
    from safetensors.torch import load_file

    both = {**load_file(str(sd3_files["kohya"])), **unet}
    save_file(both, str(tmp_path / "both.safetensors"))
    request = req("both", tmp_path / "both.safetensors")
    merged, meta = image(m, [(request, 1.0)], lora_mode="merge")
    assert meta["adapters"][0]["mode"] == "merged"
    unfused, meta = image(m, [(request, 1.0)], lora_mode="unfused")
    assert meta["adapters"][0]["mode"] == "unfused"
    now = sums(m)
    assert now["transformer"] == base["transformer"]  # hooks: the denoiser's weights untouched
    assert all(now[c] != base[c] for c in ("text_encoder", "text_encoder_2", "text_encoder_3"))  # merged
    assert np.abs(unfused - merged).max() <= 2, "unfused and merged runs of the same stack differ"
    m.lora_engine.activate([])
    assert sums(m) == base


def test_what_an_encoder_cannot_take_is_refused_by_name(managers, sd3_files, tmp_path):
    m = managers(SD3)
    base = sums(m)
    engine = m.lora_engine
    te = req("te-kohya", sd3_files["kohya"])
    with pytest.raises(InvalidParameter, match="text encoder, which runs once per request") as err:
        engine.activate([(te, {"text_encoder": [1.0, 0.5, 0.0], "denoisers": 1.0})], steps=STEPS)
    assert err.value.param == "lora_scale"
    with pytest.raises(InvalidParameter, match="text_encoder_4"):
        engine.activate([(te, {"text_encoder_4": 1.0})])
    assert sums(m) == base
    # a mixed batch runs the encoder once: sets that change it differently run one by one
    decision = engine.unfused.decide_batch([[(te, 1.0)], []], steps=STEPS)
    assert decision["mode"] == "sequential" and "text encoders" in decision["reason"]
    with pytest.raises(InvalidParameter, match="text encoders differently"):
        with engine.unfused.batch([[(te, 1.0)], []]):
            pass
    assert sums(m) == base
    # a layer that is not there, and an encoder the model does not have (Qwen-Image has one)
    bad = {"lora_te1_text_model_encoder_layers_9_self_attn_q_proj.lora_down.weight": torch.zeros(4, 16),
           "lora_te1_text_model_encoder_layers_9_self_attn_q_proj.lora_up.weight": torch.zeros(16, 4)}
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(AdapterError, match="no Linear layer 'text_model_encoder_layers_9_self_attn_q_proj' in "
                                           "text_encoder"):
        engine.activate([(req("bad", tmp_path / "bad.safetensors"), 1.0)])
    qwen = managers(QWEN)
    qbase = sums(qwen)
    with pytest.raises(AdapterError, match="does not fit demo:qwen-image: refused: 36 unmatched") as err:
        qwen.lora_engine.activate([(req("te-kohya-on-qwen", sd3_files["kohya"]), 1.0)])
    reasons = dict(err.value.report.unmatched)
    assert reasons["lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight"] == \
        "a layer of text_encoder_3 (a text encoder; text encoders here: text_encoder)"
    assert reasons["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] == \
        "no Linear layer 'text_model_encoder_layers_0_self_attn_q_proj' in text_encoder"  # CLIP names, Qwen's encoder
    assert sums(qwen) == qbase and sums(m) == base


def test_qwen_image_encoder_lora_in_the_diffusers_layout(managers, tmp_path):
    """Qwen-Image's Qwen2.5-VL encoder: ``text_encoder.<module>`` keys as diffusers names them, read against the
    encoder's own module names; merged as peft merges them, the picture changes, the base comes back."""
    m = managers(QWEN)
    base = sums(m)
    encoder = m.encoders()["text_encoder"]
    state, want, _ = peft_lora(encoder, ["q_proj", "v_proj", "down_proj"], seed=3, r=4, alpha=4)
    save_file({f"text_encoder.{k}": v.contiguous() for k, v in state.items()}, str(tmp_path / "qwen-te.safetensors"))
    request = req("qwen-te", tmp_path / "qwen-te.safetensors")
    before, _ = image(m, [], prompt="a red digit 3")
    drawn, meta = image(m, [(request, 1.0)], prompt="a red digit 3")
    report = m.lora_engine.find("qwen-te").report
    assert report.ok and set(report.encoder_layers) == {"text_encoder"} and not report.bindings.keys() - {"text_encoder"}
    assert_close(encoder_weights(m, "text_encoder", want), want, "Qwen2.5-VL text_encoder.*")
    assert np.abs(drawn - before).max() > 10
    m.lora_engine.activate([])
    assert sums(m) == base


def test_the_library_listing_fits_encoder_layers_without_loading_the_model(sd3_files, data_dir):
    from backend.lora.adapter import fit_adapter
    from backend.lora.library import denoiser_skeletons, encoder_skeletons

    cls, denoisers = denoiser_skeletons(SD3, data_dir)
    encoders = encoder_skeletons(SD3, data_dir)
    assert set(encoders) == {"text_encoder", "text_encoder_2", "text_encoder_3"}
    assert all(p.device.type == "meta" for e in encoders.values() for p in e.parameters())
    report = fit_adapter(sd3_files["kohya"], cls, denoisers, name="te", encoders=encoders)
    assert report.ok and sum(report.encoder_layers.values()) == 12
    assert report.as_dict()["encoder_layers"] == {"text_encoder": 4, "text_encoder_2": 4, "text_encoder_3": 4}

"""Quantized bases (docs/lora.md, "Quantized bases"): the demo SD3.5 transformer stored in fp8 (diffusers'
layerwise casting) or loaded from a GGUF file (Q8_0 / Q4_0, written in the original SD3 layout by
backend/demo/gguf.py), with per-request LoRAs served unfused on it.

Each variant is checked against the same LoRA on the *dequantized* model (a plain fp32 pipeline whose
weights are the quantized ones cast up), merged there the usual way: the outputs agree to TOL, the
adapter moves the image by far more, the quantized storage is bit-for-bit what it was, and a merge is
refused by name. One HTTP test runs `python app.py serve --quantize fp8`."""
from __future__ import annotations

import base64
import hashlib
import io

import httpx
import numpy as np
import pytest
import torch

from backend.errors import AdapterError, InvalidParameter
from backend.lora import attach
from backend.lora.request import LoRARequest
from backend.manager import PipelineManager

torch.set_num_threads(1)
MODEL = "demo:sd3.5"
STEPS = 2
# float images in [0, 1]. Measured (fp32, 2 steps, demo:sd3.5, sd35-watercolor at 1.0): max |quantized+unfused -
# dequantized+merged| = 2.3e-6 (fp8), 2.7e-6 (Q8_0), 4.2e-6 (Q4_0) (the unfused path's summation order against the
# merge's one rounding, as tests/test_lora_unfused.py finds on plain fp32); the adapter moves the image by 0.13.
TOL = 5e-5  # demo:qwen-image (trained) Q8_0: 1.1e-5, its adapter moving the image by 0.84
VARIANTS = {"fp8": {"quantize": "fp8"}, "gguf-Q8_0": {"gguf": "Q8_0"}, "gguf-Q4_0": {"gguf": "Q4_0"}}


def storage_digest(module: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer as stored (fp8 bytes, packed GGUF blocks)."""
    h = hashlib.sha256()
    for name, t in sorted(list(module.named_parameters()) + list(module.named_buffers())):
        raw = t.as_tensor() if hasattr(t, "as_tensor") else t
        raw = raw.detach().contiguous()
        h.update(f"{name}|{raw.dtype}|{tuple(raw.shape)}|".encode())
        h.update(raw.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dequantized_copy(quantized: PipelineManager, plain: PipelineManager) -> None:
    """Make ``plain``'s transformer hold exactly the quantized one's weights, cast up to fp32."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    src, dst = quantized.denoisers()["transformer"], plain.denoisers()["transformer"]
    targets = {**dict(dst.named_parameters()), **dict(dst.named_buffers())}
    with torch.no_grad():
        for name, t in list(src.named_parameters()) + list(src.named_buffers()):
            value = dequantize_gguf_tensor(t) if hasattr(t, "quant_type") else t
            targets[name].data.copy_(value.to(torch.float32))


@pytest.fixture(scope="module")
def pairs(data_dir):
    from backend.demo import gguf

    cache = {}

    def get(variant: str):
        if variant not in cache:
            kw = dict(VARIANTS[variant])
            if "gguf" in kw:
                kw["gguf"] = str(gguf.ensure(MODEL, kw["gguf"], data_dir))
            q = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir, **kw)
            q.load(MODEL)
            attach(q)
            ref = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
            ref.load(MODEL)
            dequantized_copy(q, ref)
            attach(ref)
            cache[variant] = (q, ref)
        return cache[variant]

    return get


def image(m: PipelineManager, adapters, mode=None):
    """(float image before uint8 rounding, metadata) of one request through generate()."""
    fields = {"prompt": "A piece of cheesecake", "seed": 5, "num_inference_steps": STEPS}
    out = m.generate(fields, adapters=adapters, lora_mode=mode)
    params = m.validate(fields)
    kwargs = {k: v for k, v in params.items() if k not in ("seed", "fps", "flow_shift", "sample_solver",
                                                             "boundary_ratio")}
    with torch.inference_mode():  # the adapters generate() activated are still on: the same run, as floats
        raw = m.pipeline(**kwargs, generator=torch.Generator().manual_seed(5), output_type="np")
    return np.asarray(raw.images, dtype=np.float32), out.metadata


def test_demo_gguf_is_a_published_style_file(data_dir, demo_path, tmp_path):
    """Original SD3 tensor names, Linear weights packed Q8_0 / Q4_0, 1-D tensors F32; diffusers' GGUF loader
    makes every Linear a GGUFLinear whose dequantized weight is the demo's to the format's precision;
    the writer is deterministic."""
    import gguf as gguf_pkg
    from diffusers import GGUFQuantizationConfig, SD3Transformer2DModel
    from diffusers.quantizers.gguf.utils import GGUFLinear, dequantize_gguf_tensor

    from backend.demo import gguf

    plain = SD3Transformer2DModel.from_pretrained(demo_path(MODEL), subfolder="transformer")
    ref = dict(plain.named_parameters())
    for qtype, rel in (("Q8_0", 0.01), ("Q4_0", 0.15)):  # one block's step: max/127 and max/7, of the row max
        path = gguf.ensure(MODEL, qtype, data_dir)
        types = {t.name: t.tensor_type.name for t in gguf_pkg.GGUFReader(path).tensors}
        assert types["joint_blocks.0.x_block.attn.qkv.weight"] == qtype
        assert types["joint_blocks.1.context_block.adaLN_modulation.1.weight"] == qtype
        assert types["final_layer.linear.bias"] == "F32" and "transformer_blocks.0.attn.to_q.weight" not in types
        model = SD3Transformer2DModel.from_single_file(
            str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            config=str(demo_path(MODEL)), subfolder="transformer", torch_dtype=torch.float32)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m, GGUFLinear) for m in linears)
        for name, p in model.named_parameters():
            value = dequantize_gguf_tensor(p).float()
            assert value.shape == ref[name].shape, name
            assert (value - ref[name]).abs().max() <= rel * ref[name].abs().max() + 1e-6, name
        again = tmp_path / f"again-{qtype}.gguf"
        gguf.write(MODEL, qtype, again, data_dir)
        assert again.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lora_on_a_quantized_base_matches_the_dequantized_model(variant, pairs, library):
    q, ref = pairs(variant)
    assert q.quantized.startswith("fp8" if variant == "fp8" else f"gguf ({variant[5:]})")
    assert ref.quantized is None and q.lora_engine.unfused.mode == "unfused"
    lora = LoRARequest("watercolor", 1, str(library / "sd3.5/sd35-watercolor.safetensors"))
    stored = storage_digest(q.denoisers()["transformer"])
    base_q, _ = image(q, [])
    base_r, _ = image(ref, [], "merge")
    assert np.array_equal(base_q, base_r)  # the dequantized copy is the same model
    styled_q, meta = image(q, [(lora, 1.0)])
    styled_r, meta_r = image(ref, [(lora, 1.0)], "merge")
    effect, gap = np.abs(styled_q - base_q).max(), np.abs(styled_q - styled_r).max()
    print(f"{variant}: max |quantized+unfused - dequantized+merged| = {gap:.3g}; the adapter moves it by {effect:.3g}")
    assert effect > 0.05 and gap <= TOL
    assert meta["quantization"] == q.quantized and "quantization" not in meta_r
    assert meta["lora_mode"]["mode"] == "unfused" and meta["adapters"][0]["mode"] == "unfused"
    assert meta_r["adapters"][0]["mode"] == "merged"
    # fit sees the real layers through the wrappers: the same bindings as on the plain model
    fit_q = q.lora_engine.load(lora).bindings["transformer"].modules
    assert fit_q == ref.lora_engine.load(lora).bindings["transformer"].modules and len(fit_q) == 8
    # the storage was never written; the base comes back exactly
    assert storage_digest(q.denoisers()["transformer"]) == stored
    back, _ = image(q, [])
    assert np.array_equal(back, base_q) and q.lora_engine.stats()["unfused"]["hooked_layers"] == 0
    # the factors live in the compute dtype, not the storage dtype
    factors = q.lora_engine.cache.device.get(q.lora_engine.cached_identity(lora))
    assert {f.a.dtype for f in factors.values()} == {torch.float32}


def test_merge_and_fuse_are_refused_by_name_and_shapes_still_checked(pairs, library):
    q, _ = pairs("gguf-Q8_0")
    lora = LoRARequest("watercolor", 1, str(library / "sd3.5/sd35-watercolor.safetensors"))
    stored = storage_digest(q.denoisers()["transformer"])
    with pytest.raises(InvalidParameter, match=r"lora_mode=merge: the base is quantized \(gguf \(Q8_0\)\)") as err:
        q.generate({"prompt": "x", "num_inference_steps": 1}, adapters=[(lora, 1.0)], lora_mode="merge")
    assert err.value.param == "lora_mode"
    with pytest.raises(InvalidParameter, match="lora_mode=merge") as err:
        attach(q, lora_mode="merge")
    assert err.value.param == "lora_mode"
    with pytest.raises(InvalidParameter, match="fusing a distill file or preset") as err:
        q.fuse([str(library / "sd3.5/sd35-watercolor.safetensors")], [1.0])
    # an adapter for another model is refused by the same fit check, naming its keys
    foreign = LoRARequest("ink", 2, str(library / "qwen-image/demo-inverted.safetensors"))
    with pytest.raises(AdapterError, match="does not fit"):
        q.generate({"prompt": "x", "num_inference_steps": 1}, adapters=[(foreign, 1.0)])
    assert storage_digest(q.denoisers()["transformer"]) == stored


def test_parameter_bytes_of_the_quantized_denoisers(pairs):
    from backend import quant

    sizes = {v: quant.parameter_bytes(pairs(v)[0].denoisers()["transformer"]) for v in VARIANTS}
    plain = quant.parameter_bytes(pairs("fp8")[1].denoisers()["transformer"])
    print(f"transformer parameter bytes: fp32 {plain}, " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    assert sizes["gguf-Q4_0"] < sizes["gguf-Q8_0"] < sizes["fp8"] < plain


def test_flags_are_checked_before_anything_loads(tmp_path):
    from backend import quant

    with pytest.raises(InvalidParameter, match="quantize must be one of none, fp8") as err:
        quant.check("int4")
    assert err.value.param == "quantize"
    with pytest.raises(InvalidParameter, match="does not exist") as err:
        quant.check(gguf=str(tmp_path / "missing.gguf"))
    assert err.value.param == "gguf"
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(InvalidParameter, match="no GGUF magic"):
        quant.check(gguf=[f"transformer_2={bad}"])
    real = tmp_path / "y.gguf"
    real.write_bytes(b"GGUF....")
    with pytest.raises(InvalidParameter, match="pick one"):
        quant.check("fp8", str(real))
    assert quant.check(gguf=[f"transformer_2={real}"]).gguf == {"transformer_2": str(real.resolve())}


def test_a_gguf_of_another_model_is_one_line_naming_the_file(data_dir, capsys):
    import app
    from backend.demo import gguf

    path = gguf.ensure(MODEL, "Q8_0", data_dir).resolve()  # named as resolved (data_dir/models may be a link)
    rc = app.main(["generate", "--model", "demo:qwen-image", "--gguf", str(path), "--prompt", "x",
                   "--data-dir", str(data_dir), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: could not load transformer (QwenImageTransformer2DModel) from "
                                          f"{path}: the file does not fit this model")


# -- over real HTTP: `python app.py serve --quantize fp8` --------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_server(data_dir, library):
    from ui_fixtures import served_app

    with served_app(data_dir, "--quantize", "fp8", model=MODEL, env={"OMP_NUM_THREADS": "1"},
                    start_new_session=True) as served:
        yield served.url


def post(url: str, **body):
    return httpx.post(f"{url}/v1/images/generations", timeout=600,
                      json={"prompt": "a lighthouse", "num_inference_steps": STEPS, "seed": 7, **body})


def pixels(r) -> np.ndarray:
    from PIL import Image

    assert r.status_code == 200, r.text
    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def test_served_fp8_base_runs_adapters_unfused_and_refuses_merge(fp8_server):
    system = httpx.get(f"{fp8_server}/metrics").json()
    assert system["quantization"] == "fp8 (float8_e4m3fn)"
    assert system["lora_cache"]["unfused"]["mode"] == "unfused"
    base = post(fp8_server)
    styled = post(fp8_server, lora={"path": "sd3.5/sd35-watercolor.safetensors", "scale": 1.0})
    meta = styled.json()["data"][0]["metadata"]
    assert meta["quantization"] == "fp8 (float8_e4m3fn)" and meta["adapters"][0]["mode"] == "unfused"
    assert np.abs(pixels(styled) - pixels(base)).mean() > 1.0
    assert np.array_equal(pixels(post(fp8_server)), pixels(base))  # the base, bit for bit, after the adapter
    r = post(fp8_server, lora={"path": "sd3.5/sd35-watercolor.safetensors"}, lora_mode="merge")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_mode", r.text
    assert "quantized" in r.json()["error"]["message"]


def test_policy_on_a_quantized_base_is_unfused_whatever_the_numbers():
    from backend.lora.policy import PolicyInputs, decide

    free_merge = PolicyInputs(steps=40, merge_bytes=0, step_s=1.0, ratio=0.5, quantized="gguf (Q8_0)")
    assert decide(PolicyInputs(steps=40, merge_bytes=0)).mode == "merged"  # plain: nothing to write, merge
    for requested in ("auto", "unfused"):
        d = decide(free_merge, requested)
        assert (d.mode, d.reason) == ("unfused", "quantized base (gguf (Q8_0)): unfused only")
    with pytest.raises(InvalidParameter, match=r"lora_mode=merge: the base is quantized \(gguf \(Q8_0\)\)"):
        decide(free_merge, "merge")


def test_qwen_image_gguf_in_diffusers_names_mixes_packed_and_plain_layers(data_dir, library):
    """Published Qwen-Image GGUFs keep diffusers' names; the demo's 48-wide rows stay F16 (plain Linear), its
    256/192-wide ones are Q8_0 GGUFLinear: the base still counts as quantized and adapters on both kinds of
    layer run unfused, matching the dequantized model."""
    from diffusers.quantizers.gguf.utils import GGUFLinear

    from backend.demo import gguf

    q = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir,
                        gguf=str(gguf.ensure("demo:qwen-image", "Q8_0", data_dir)))
    q.load("demo:qwen-image")
    attach(q)
    linears = [m for m in q.denoisers()["transformer"].modules() if isinstance(m, torch.nn.Linear)]
    packed = [m for m in linears if isinstance(m, GGUFLinear)]
    print(f"{len(packed)} of {len(linears)} Linear layers packed Q8_0; plain widths "
          f"{sorted({m.in_features for m in linears if not isinstance(m, GGUFLinear)})}")
    assert 0 < len(packed) < len(linears)
    assert q.quantized == "gguf (Q8_0)"
    ref = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
    ref.load("demo:qwen-image")
    dequantized_copy(q, ref)
    attach(ref)
    ink = LoRARequest("ink", 1, str(library / "qwen-image/demo-inverted.safetensors"))
    stored = storage_digest(q.denoisers()["transformer"])
    base, _ = image(q, [])
    styled, meta = image(q, [(ink, 1.0)])
    expected, _ = image(ref, [(ink, 1.0)], "merge")
    gap = np.abs(styled - expected).max()
    print(f"qwen-image Q8_0: max |quantized+unfused - dequantized+merged| = {gap:.3g}")
    assert np.abs(styled - base).max() > 0.02 and gap <= TOL and meta["adapters"][0]["mode"] == "unfused"
    assert storage_digest(q.denoisers()["transformer"]) == stored


def test_generate_cli_on_a_gguf_base_with_a_lora(data_dir, library, tmp_path, capsys):
    """`app.py generate --gguf FILE --lora-path L`: the sidecar records the quantization and the unfused adapter."""
    import json

    import app
    from backend.demo import gguf

    out = tmp_path / "fox.png"
    rc = app.main(["generate", "--model", MODEL, "--gguf", str(gguf.ensure(MODEL, "Q4_0", data_dir)),
                   "--lora-path", str(library / "sd3.5/sd35-watercolor.safetensors"), "--prompt", "a fox",
                   "--num-inference-steps", "2", "--output", str(out), "--data-dir", str(data_dir), "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "fox.png.json").read_text())
    assert meta["quantization"] == "gguf (Q4_0)"
    assert [a["mode"] for a in meta["adapters"]] == ["unfused"] and meta["lora_mode"]["mode"] == "unfused"


def test_studio_checks_the_flags_and_hands_the_worker_the_files(data_dir, tmp_path):
    """The server's side: refusals before a worker starts, and the GGUF files reach the worker's config in a
    form its PipelineManager reads back to the same {component: file}."""
    from backend import quant
    from backend.demo import gguf
    from backend.service import Studio

    path = str(gguf.ensure(MODEL, "Q8_0", data_dir).resolve())  # kept resolved (data_dir/models may be a link)
    studio = Studio(MODEL, data_dir=tmp_path, gguf=[path])
    try:
        assert studio.config.gguf == (f"transformer={path}",) and studio.config.quantize is None
        assert quant.check(gguf=list(studio.config.gguf)).gguf == {"transformer": path}
    finally:
        studio.close()
    for kw, param in (({"quantize": "fp8", "lora_mode": "merge"}, "lora_mode"),
                      ({"gguf": [path], "lora_backend": "distill"}, "lora_backend"),
                      ({"quantize": "fp8", "preset": "qwen-image-lightning-4step"}, "preset"),
                      ({"gguf": [path], "engine": "ray"}, "gguf")):
        with pytest.raises(InvalidParameter) as err:
            Studio(MODEL, data_dir=tmp_path, **kw)
        assert err.value.param == param, (kw, err.value.message)

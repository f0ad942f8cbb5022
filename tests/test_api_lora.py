"""Per-request LoRA over HTTP (PEFT backend): the image changes with an adapter, comes
back bit-for-bit without it, aliases and the list form, load/unload by name, and a
broken adapter fails its own job only."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image


from backend.api import create_app  # noqa: E402
from backend.api.server import ThreadedServer  # noqa: E402
from backend.service import Studio  # noqa: E402

FAST = {"prompt": "a lighthouse", "height": 64, "width": 64, "num_inference_steps": 3, "true_cfg_scale": 1.0,
        "seed": 11}
INK = "qwen-image/demo-inverted.safetensors"
FILM = "qwen-image/demo-outline.safetensors"


@pytest.fixture(scope="module")
def server(data_dir, tmp_path_factory):
    from backend.lora import demo_adapters

    demo_adapters.ensure(data_dir)
    studio = Studio("demo:qwen-image", data_dir=data_dir, device="cpu", worker_threads=1,
                    db_path=tmp_path_factory.mktemp("lora-db") / "jobs.sqlite").start()
    srv = ThreadedServer(create_app(studio)).start()
    yield studio, srv.url
    srv.stop()
    studio.close()


def _image(url: str, **body) -> np.ndarray:
    r = httpx.post(f"{url}/v1/images/generations", json={**FAST, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).convert("RGB"))


def test_adapter_changes_the_image_and_scale_zero_or_none_gives_the_base_back(server):
    _, url = server
    base = _image(url)
    ink = _image(url, lora={"path": INK, "scale": 1.0})
    assert np.abs(ink.astype(int) - base.astype(int)).mean() > 1.0
    assert np.array_equal(_image(url, lora={"path": INK, "scale": 0.0}), base)
    assert np.array_equal(_image(url), base)  # the merged weights came off exactly
    assert np.array_equal(_image(url, lora={"path": INK, "scale": 1.0}), ink)  # and go back on the same


def test_aliases_and_name_alone_pick_the_same_adapter(server, data_dir):
    _, url = server
    ref = _image(url, lora={"path": INK})
    for lora in ({"lora_name": "demo-inverted"}, {"adapter": "demo-inverted", "lora_scale": 1.0},
                 {"local_path": INK, "lora_int_id": 7}, {"lora_path": str(data_dir / "demo" / "adapters" / INK)},
                 [{"name": "demo-inverted", "scale": 1.0}]):
        assert np.array_equal(_image(url, lora=lora), ref), lora
    # the same object inside extra_body
    assert np.array_equal(_image(url, extra_body={"lora": {"path": INK}}), ref)


def test_list_form_stacks_adapters(server):
    _, url = server
    ink, film = _image(url, lora={"path": INK}), _image(url, lora={"path": FILM})
    both = _image(url, lora=[{"path": INK, "scale": 1.0}, {"path": FILM, "scale": 1.0}])
    assert not np.array_equal(both, ink) and not np.array_equal(both, film)


def test_load_and_unload_by_name(server):
    _, url = server
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "my-style", "lora_path": FILM})
    assert r.status_code == 200, r.text
    names = [a["name"] for a in httpx.get(f"{url}/v1/loras", timeout=120).json()["data"]]
    assert "my-style" in names
    assert np.array_equal(_image(url, lora={"name": "my-style"}), _image(url, lora={"path": FILM}))
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "my-style"}).status_code == 200
    r = httpx.post(f"{url}/v1/images/generations", json={**FAST, "lora": {"name": "my-style"}})
    assert r.status_code == 404 and "my-style" in r.json()["error"]["message"]


def test_broken_adapter_fails_its_job_and_the_next_one_succeeds_on_the_same_weights(server, data_dir):
    from safetensors.torch import load_file, save_file

    studio, url = server
    base = _image(url)
    broken = data_dir / "adapters" / "broken.safetensors"
    good = (data_dir / "demo" / "adapters" / INK).read_bytes()
    try:
        broken.write_bytes(good[: len(good) // 2])  # a download cut in half: refused at submission
        r = httpx.post(f"{url}/v1/images/generations", json={**FAST, "lora": {"path": "broken.safetensors"}},
                       timeout=120)
        assert r.status_code == 400, r.text
        assert "broken.safetensors" in r.json()["error"]["message"] and "truncated" in r.json()["error"]["message"]
        # a NaN inside a factor is only seen when the worker reads the weights: that job fails
        tensors = load_file(str(data_dir / "demo" / "adapters" / INK))
        key = next(k for k in tensors if k.endswith("lora_up.weight"))
        tensors[key][0, 0] = float("nan")
        save_file(tensors, str(broken))
        r = httpx.post(f"{url}/v1/images/generations", json={**FAST, "lora": {"path": "broken.safetensors"}},
                       timeout=120)
        assert r.status_code == 400, r.text
        assert "broken.safetensors" in r.json()["error"]["message"] and key in r.json()["error"]["message"]
        assert np.array_equal(_image(url), base)  # the next job runs, on unchanged weights
        failed = [j for j in studio.jobs(status="failed") if j["adapters"] and "broken" in j["adapters"][0]["path"]]
        assert failed and failed[0]["error"]
    finally:
        broken.unlink()  # the library is shared by the whole test session


def test_pin_keeps_an_adapter_in_the_worker_cache(server):
    import time

    studio, url = server
    studio.pin("demo-grayscale", True)
    _image(url)  # control messages reach the worker between jobs
    deadline = time.monotonic() + 30
    while "demo-grayscale" not in (studio.system()["lora_cache"] or {}).get("pinned", []):
        assert time.monotonic() < deadline, studio.system()["lora_cache"]
        _image(url)
    studio.pin("demo-grayscale", False)
    _image(url)
    _image(url)
    assert "demo-grayscale" not in studio.system()["lora_cache"]["pinned"]
    assert any(a["name"] == "demo-grayscale" and not a["pinned"] for a in studio.adapters())


def test_a_lora_path_given_at_start_is_requested_by_name_even_outside_the_roots(data_dir, tmp_path):
    from backend.lora import demo_adapters

    demo_adapters.ensure(data_dir)
    outside = tmp_path / "elsewhere" / "my-ink.safetensors"  # not under any adapter root
    outside.parent.mkdir()
    outside.write_bytes((data_dir / "demo" / "adapters" / INK).read_bytes())
    studio = Studio("demo:qwen-image", data_dir=data_dir, device="cpu", worker_threads=1,
                    db_path=tmp_path / "jobs.sqlite", lora_paths=[str(outside)]).start()
    srv = ThreadedServer(create_app(studio)).start()
    try:
        assert "my-ink" in [a["name"] for a in httpx.get(f"{srv.url}/v1/loras").json()["data"]]
        by_name = _image(srv.url, lora={"name": "my-ink"})
        assert np.array_equal(by_name, _image(srv.url, lora={"path": INK}))  # the same bytes in the library
        assert not np.array_equal(by_name, _image(srv.url))
        # the operator's start-time choice opens that one name, not the folder it sits in
        r = httpx.post(f"{srv.url}/v1/images/generations", json={**FAST, "lora": {"path": str(outside)}})
        assert r.status_code == 403, r.text
    finally:
        srv.stop()
        studio.close()


def test_a_missing_lora_path_is_refused_at_construction_naming_it(data_dir, tmp_path):
    from backend.errors import AdapterNotFound

    missing = tmp_path / "gone.safetensors"
    with pytest.raises(AdapterNotFound, match=f"--lora-path {missing}: no such file or folder"):
        Studio("demo:qwen-image", data_dir=data_dir, device="cpu", db_path=tmp_path / "jobs.sqlite",
               lora_paths=[str(missing)])


def test_a_merge_that_overflows_is_refused_by_name_and_the_base_stays(server, data_dir):
    """Factors of 1e30 (finite in the file) overflow in the merge: HTTP 400 naming the adapter and the
    layer, no black image, and the next base job gets the base bits back (issue 14 item 11)."""
    from safetensors.torch import load_file, save_file

    studio, url = server
    base = _image(url)
    film = load_file(str(data_dir / "demo" / "adapters" / FILM))
    huge = {k: v.float().sign().where(v != 0, 1.0) * 1e30 for k, v in film.items()}
    path = data_dir / "adapters" / "overflow-1e30.safetensors"
    save_file(huge, str(path))
    try:
        r = httpx.post(f"{url}/v1/images/generations", json={**FAST, "lora": {"path": path.name}}, timeout=120)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "'overflow-1e30'" in message and "transformer." in message and "not finite" in message, message
        assert np.array_equal(_image(url), base)  # every written layer went back, bit for bit
        assert np.array_equal(_image(url, lora={"path": FILM}), _image(url, lora={"path": FILM}))
    finally:
        path.unlink()


def test_metrics_report_where_the_originals_live(server):
    studio, url = server
    _image(url, lora={"path": INK})
    m = httpx.get(f"{url}/metrics").json()
    p = m["pristine"]
    assert p["mode"] == "auto" and p["placement"] == "device" and p["where"].startswith("device (cpu")
    assert 0 < p["bytes"] <= p["targetable_bytes"] and "cpu" in p["reason"]
    assert m["cache"]["pristine_bytes"] == p["bytes"] and m["cache"]["pristine_where"] == p["where"]


def test_a_lycoris_loha_from_the_library_is_listed_applied_and_comes_off(server, data_dir):
    """#28: a LoHa in the LyCORIS / kohya layout (``lycoris_<module>.hada_w1_a`` ...), dropped into the library:
    listed as lycoris with its rank and fit, it changes the image, scale 0 and no adapter give the base back,
    and lora_mode=unfused is refused naming it (a Hadamard product has no low-rank form to add per step)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from backend import settings

    _, url = server
    weights = settings.models_dir(data_dir) / "demo-qwen-image" / "transformer" / "diffusion_pytorch_model.safetensors"
    gen, tensors = torch.Generator().manual_seed(0), {}
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            if key.endswith(("attn.to_q.weight", "attn.to_v.weight")):
                out_f, in_f = f.get_slice(key).get_shape()
                name = "lycoris_" + key.removesuffix(".weight").replace(".", "_")
                for part, shape in (("hada_w1_a", (out_f, 4)), ("hada_w1_b", (4, in_f)), ("hada_w2_a", (out_f, 4)),
                                    ("hada_w2_b", (4, in_f))):
                    tensors[f"{name}.{part}"] = torch.randn(shape, generator=gen) * 0.3
                tensors[f"{name}.alpha"] = torch.tensor(4.0)
    path = data_dir / "adapters" / "loha-style.safetensors"
    save_file(tensors, str(path))
    try:
        listing = httpx.get(f"{url}/v1/loras", timeout=120).json()["library"]
        row = next(a for a in listing if a["name"] == "loha-style")
        assert row["format"] == "lycoris" and row["fit"]["ok"] and row["rank"] == "4", row
        base = _image(url)
        styled = _image(url, lora={"name": "loha-style", "scale": 1.0})
        assert np.abs(styled.astype(int) - base.astype(int)).mean() > 1.0
        assert np.array_equal(_image(url, lora={"name": "loha-style", "scale": 0.0}), base)
        assert np.array_equal(_image(url), base)  # merged off exactly
        r = httpx.post(f"{url}/v1/images/generations",
                       json={**FAST, "lora": {"name": "loha-style"}, "lora_mode": "unfused"}, timeout=120)
        assert r.status_code == 400 and "'loha-style' (LyCORIS LoHa)" in r.json()["error"]["message"], r.text
    finally:
        path.unlink()  # the library is shared by the whole test session


def test_an_adapters_preferred_weight_is_what_a_request_naming_no_weight_gets(server, data_dir):
    """#28 item 4: A1111's sidecar ``inky.json`` beside ``inky.safetensors`` says "preferred weight" 0.5: a
    ``lora`` object without a scale and a ``<lora:inky>`` tag run at 0.5 (not 1.0); the listing shows it with
    the activation and negative text; a weight given wins."""
    import json

    _, url = server
    path = data_dir / "adapters" / "inky.safetensors"
    side = path.with_suffix(".json")
    path.write_bytes((data_dir / "demo" / "adapters" / INK).read_bytes())
    side.write_text(json.dumps({"preferred weight": 0.5, "activation text": "inked lines", "negative text": "blur",
                                "sd version": "Other"}))
    try:
        row = next(a for a in httpx.get(f"{url}/v1/loras", timeout=120).json()["library"] if a["name"] == "inky")
        assert (row["preferred_weight"], row["activation_text"], row["negative_text"]) == (0.5, "inked lines", "blur")
        half, full = _image(url, lora={"name": "inky", "scale": 0.5}), _image(url, lora={"name": "inky", "scale": 1.0})
        assert not np.array_equal(half, full)
        assert np.array_equal(_image(url, lora={"name": "inky"}), half)
        assert np.array_equal(_image(url, prompt=f"{FAST['prompt']} <lora:inky>"), half)
        assert np.array_equal(_image(url, prompt=f"{FAST['prompt']} <lora:inky:1>"), full)
    finally:
        path.unlink()
        side.unlink()


def test_a_stack_exported_over_http_draws_what_the_stack_draws(server, data_dir):
    """#28 item 5: POST /v1/loras/export writes the stack as one LoRA into the library under a plain name; the
    exported adapter draws the stack's image exactly; a taken name or a path as a name is refused."""
    from safetensors import safe_open

    _, url = server
    stack = [{"name": "demo-inverted", "scale": 0.7}, {"name": "demo-outline", "scale": -1.3}]
    r = httpx.post(f"{url}/v1/loras/export", json={"lora": stack, "name": "ink-film"}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    try:
        assert out["adapter"]["name"] == "ink-film" and out["adapter"]["fit"]["ok"]
        assert out["path"] == str(data_dir / "adapters" / "ink-film.safetensors")
        assert np.array_equal(_image(url, lora={"name": "ink-film"}), _image(url, lora=stack))
        again = httpx.post(f"{url}/v1/loras/export", json={"lora": stack, "name": "ink-film"}, timeout=120)
        assert again.status_code == 400 and "already exists" in again.json()["error"]["message"]
        bad = httpx.post(f"{url}/v1/loras/export", json={"lora": stack, "name": "../../escape"}, timeout=120)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
        assert not (data_dir / "escape.safetensors").exists()
        # portable: the weights folded in, no per-layer alpha in the header (for readers that ignore it)
        r = httpx.post(f"{url}/v1/loras/export", json={"lora": stack[:1], "name": "ink-portable", "portable": True},
                       timeout=120)
        assert r.status_code == 200 and r.json()["exact_in"] is None, r.text
        with safe_open(str(data_dir / "adapters" / "ink-portable.safetensors"), "pt") as f:
            assert "lora_adapter_metadata" not in f.metadata()
        assert np.abs(_image(url, lora={"name": "ink-portable"}).astype(int)
                      - _image(url, lora=stack[:1]).astype(int)).max() <= 1
        # the kohya layout (sd-scripts' names, per-layer .alpha): the stack's picture within one level
        r = httpx.post(f"{url}/v1/loras/export", json={"lora": stack, "name": "ink-kohya", "layout": "kohya"},
                       timeout=120)
        assert r.status_code == 200 and r.json()["layout"] == "kohya" and r.json()["exact_in"] is None, r.text
        with safe_open(str(data_dir / "adapters" / "ink-kohya.safetensors"), "pt") as f:
            assert all(k.startswith("lora_unet_") for k in f.keys())
        assert np.abs(_image(url, lora={"name": "ink-kohya"}).astype(int)
                      - _image(url, lora=stack).astype(int)).max() <= 1
        bad = httpx.post(f"{url}/v1/loras/export", json={"lora": stack, "name": "ink-x", "layout": "comfy"},
                         timeout=120)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "layout", bad.text
    finally:
        (data_dir / "adapters" / "ink-film.safetensors").unlink()
        (data_dir / "adapters" / "ink-portable.safetensors").unlink(missing_ok=True)
        (data_dir / "adapters" / "ink-kohya.safetensors").unlink(missing_ok=True)


def test_a_text_encoder_lora_is_weighted_apart_over_http_and_in_the_a1111_tag(server, data_dir):
    """#28 item 3: a kohya file with text-encoder (``lora_te_``) and transformer (``lora_unet_``) layers, dropped
    into the library: listed with its encoder layers counted apart; the ``lora`` object's
    ``{"transformer": w, "text_encoder": w}`` and A1111's ``<lora:NAME:TE:UNET>`` weigh the two apart (the
    same pictures either way), each part changes the picture, and weight 0 gives the base back."""
    import torch
    from safetensors.torch import save_file

    from backend.lora.library import denoiser_skeletons, encoder_skeletons

    _, url = server
    _, denoisers = denoiser_skeletons("demo:qwen-image", data_dir)
    encoder = encoder_skeletons("demo:qwen-image", data_dir)["text_encoder"]
    gen, tensors = torch.Generator().manual_seed(5), {}
    for prefix, module, ends in (("lora_te_", encoder, ("q_proj", "v_proj")),
                                 ("lora_unet_", denoisers["transformer"], ("attn.to_q", "attn.to_v"))):
        for name, layer in module.named_modules():
            if isinstance(layer, torch.nn.Linear) and name.endswith(ends) and "visual" not in name:
                key = prefix + name.replace(".", "_")
                tensors[f"{key}.lora_down.weight"] = torch.randn(4, layer.in_features, generator=gen) * 0.4
                tensors[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, 4, generator=gen) * 0.4
                tensors[f"{key}.alpha"] = torch.tensor(4.0)
    path = data_dir / "adapters" / "te-style.safetensors"
    save_file(tensors, str(path))
    try:
        row = next(a for a in httpx.get(f"{url}/v1/loras", timeout=120).json()["library"] if a["name"] == "te-style")
        assert row["fit"]["ok"] and "text encoders: text_encoder:" in row["fit"]["summary"], row
        base, both = _image(url), _image(url, lora={"name": "te-style", "scale": 1.0})
        unet = _image(url, lora={"name": "te-style", "scale": {"transformer": 1.0, "text_encoder": 0.0}})
        te = _image(url, lora={"name": "te-style", "scale": {"transformer": 0.0, "text_encoder": 1.0}})
        for picture in (both, unet, te):
            assert np.abs(picture.astype(int) - base.astype(int)).mean() > 1.0
        assert not np.array_equal(unet, te) and not np.array_equal(both, unet) and not np.array_equal(both, te)
        assert np.array_equal(_image(url, prompt=f"{FAST['prompt']} <lora:te-style:0:1>"), unet)  # te 0, unet 1
        assert np.array_equal(_image(url, prompt=f"{FAST['prompt']} <lora:te-style:te=1:unet=0>"), te)
        assert np.array_equal(_image(url, prompt=f"{FAST['prompt']} <lora:te-style:1>"), both)
        assert np.array_equal(_image(url, lora={"name": "te-style", "scale": 0.0}), base)
        assert np.array_equal(_image(url), base)  # the encoder's merged layers came off exactly
    finally:
        path.unlink()


def test_a_stack_baked_over_http_is_served_as_its_own_model(server, data_dir):
    """#28 item 5: POST /v1/models/bake writes the loaded model with the stack merged into
    <data-dir>/models/baked/<name>, listed in /v1/models as baked:<name>; a request for that model with no
    adapter draws what the base draws with the stack, pixel for pixel (baked in the serving dtype); a taken
    or non-plain name is a 400 and writes nothing; no server path comes back."""
    import shutil

    from backend import settings

    _, url = server
    stack = [{"name": "demo-inverted", "scale": 0.7}, {"name": "demo-outline", "scale": -1.3}]
    folder = settings.models_dir(data_dir) / "baked" / "inked"
    try:
        r = httpx.post(f"{url}/v1/models/bake", json={"lora": stack, "name": "inked"}, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "baked:inked" and body["layers"] > 0 and body["dtype"] == "float32", body
        assert str(data_dir) not in r.text  # nothing about the server's disk
        assert "baked:inked" in [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]]
        stacked = _image(url, lora=stack)
        assert np.array_equal(_image(url, model="baked:inked"), stacked)
        for name in ("inked", "../up", ".hidden"):
            r = httpx.post(f"{url}/v1/models/bake", json={"lora": stack, "name": name}, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
        assert sorted(p.name for p in folder.parent.iterdir()) == ["inked"]
    finally:
        _image(url, model="demo:qwen-image")  # the module's server goes back to its model
        shutil.rmtree(folder, ignore_errors=True)


def test_an_adapter_made_for_another_model_is_refused_before_it_is_queued(server):
    """#26 "refused too late": a `<lora:>` tag (or a lora object) naming an adapter that does not fit the
    model was queued, then failed in the worker with a wall of tensor keys. Now: refused at submit, by
    name, in one plain line, and no job is made."""
    studio, url = server
    before = {j["id"] for j in studio.jobs(limit=1000)}
    for body in ({"prompt": "a lighthouse <lora:sd35-watercolor:0.8>"}, {"lora": {"name": "sd35-watercolor"}}):
        r = httpx.post(f"{url}/v1/images/generations", json={**FAST, **body}, timeout=120)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        plain, report = message.split(". Its fit report: ")
        assert plain.startswith("adapter 'sd35-watercolor' (sd35-watercolor.safetensors) does not fit "
                                "demo:qwen-image: "), message
        assert "of its layers have other sizes in demo:qwen-image" in plain and "_" not in plain.split(")")[1]
        assert report.startswith("refused: ") and report.count("vs model") <= 4 and "/" not in message, message
    assert {j["id"] for j in studio.jobs(limit=1000)} == before
    # the one that fits still runs, tagged the same way
    assert not np.array_equal(_image(url, prompt="a lighthouse <lora:demo-inverted:1>"), _image(url))


def test_img2img_over_http_starts_from_the_image_sent(server):
    """#26 img2img: /v1/images/generations with an input image (base64) and a strength: near the image at a
    low strength, the text-to-image picture far from it; a strength with no image is refused by name."""
    studio, url = server
    red = Image.new("RGB", (64, 64), (220, 30, 30))
    buf = io.BytesIO()
    red.save(buf, format="PNG")
    sent = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    ask = {"prompt": "a blue digit 7 on a white background", "num_inference_steps": 8}
    text = _image(url, **ask)
    near = _image(url, **ask, image=sent, strength=0.25)
    far = _image(url, **ask, image=sent, strength=0.9)
    dist = {k: float(np.abs(v.astype(float) - np.asarray(red, dtype=float)).mean())
            for k, v in (("0.25", near), ("0.9", far), ("text", text))}
    assert dist["0.25"] < dist["0.9"] and dist["0.25"] < 0.6 * dist["text"], dist
    job = studio.jobs(limit=1)[0]
    assert job["params"]["strength"] == 0.9 and job["result"]["metadata"]["params"]["strength"] == 0.9
    count = len(studio.jobs(limit=1000))
    r = httpx.post(f"{url}/v1/images/generations", json={**FAST, "strength": 0.5}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "strength", r.text
    assert len(studio.jobs(limit=1000)) == count  # refused at submit: no job made

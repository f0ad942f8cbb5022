"""The demo LoRAs of demo:qwen-image do what their cards say (CONTRACT.md; trained by backend/demo/loras.py).

Each effect is read by the oracles (``tests/oracles.py``, written apart from the trainer) over prompts
and seeds training never used, through the product's own path: ``Omni`` with a ``LoRARequest`` naming
the file in the demo root, so every layout (PEFT folder, kohya, diffusers, ComfyUI) is bound by the
LoRA engine exactly as a user's download is, at the model's own defaults (20 steps, true CFG 4).

The thresholds are the issue's: grayscale drains the saturation at least 3x; inverted swaps both
colours in at least 75% of the pictures; outline halves the fill ratio at least; nine draws a 9 in at
least 70% with it and at most 20% without. Each grows from scale 0 to 0.5 to 1, scale 0 is the base
bit for bit, and two stacked give both effects (each a little less than alone: see that test).
"""
from __future__ import annotations

import numpy as np
import pytest

from backend import LoRARequest, Omni
from backend.demo import data
from backend.demo.loras import LORAS
from demo_trainer import run_trainer
from oracles import asked, chroma, read, read_colours

SCALES = (0.0, 0.5, 1.0)
ACHROMATIC = ("black", "white", "gray")  # backgrounds with no saturation: a picture's is its foreground's
FILES = {spec.name: spec.file for spec in LORAS}


def _prompts(kind: str, n: int, start: int, backgrounds=None) -> list[tuple[str, int]]:
    pairs = [(c, b) for c, b in data.colour_pairs() if backgrounds is None or b in backgrounds]
    out = []
    for i in range(n):
        colour, background = pairs[(i * 5 + start) % len(pairs)]
        if kind == "nine":
            prompt = data.prompt_for("digit", 9, colour, background)
        elif kind == "shape" or i % 3 == 2:
            prompt = data.prompt_for("shape", data.SHAPES[i % 3], colour, background)
        else:
            prompt = data.prompt_for("digit", i % 9, colour, background)
        out.append((prompt, 7300 + start * 100 + i))
    return out


# prompt/seed sets, none seen in training (training draws renders, never these seeds)
SETS = {
    "demo-grayscale": _prompts("mixed", 9, 0, ACHROMATIC),
    "demo-inverted": _prompts("mixed", 12, 1),
    "demo-outline": _prompts("shape", 9, 2),
    "demo-nine": _prompts("nine", 10, 3),
}


@pytest.fixture(scope="module")
def omni(data_dir):
    return Omni(model="demo:qwen-image", data_dir=data_dir, device="cpu", max_loras=4)


@pytest.fixture(scope="module")
def root(library):
    return library / "qwen-image"


def request(root, name: str, int_id: int | None = None) -> LoRARequest:
    return LoRARequest(name, int_id or 1 + [s.name for s in LORAS].index(name), str(root / FILES[name]))


def draw(omni, pairs, adapters=None, scales=None):
    """Pictures of (prompt, seed) pairs at the model's defaults; ``adapters`` a list of LoRARequests."""
    out = []
    for prompt, seed in pairs:
        kw = {}
        if adapters:
            kw = {"lora_request": adapters if len(adapters) > 1 else adapters[0],
                  "lora_scale": scales if len(adapters) > 1 else scales[0]}
        out.append(omni.generate(prompt=prompt, seed=seed, **kw)[0].images[0])
    return out


@pytest.fixture(scope="module")
def base(omni):
    """The base model's pictures of every set (no adapter)."""
    return {name: draw(omni, pairs) for name, pairs in SETS.items()}


@pytest.fixture(scope="module")
def scaled(omni, root):
    """Each LoRA's pictures of its set at scale 0.5 and 1 (and 0, to compare with the base)."""
    return {name: {s: draw(omni, pairs, [request(root, name)], [s]) for s in SCALES} for name, pairs in SETS.items()}


# ---------------------------------------------------------------- the statistic each card promises
def saturation(images) -> float:
    return float(np.mean([chroma(im) for im in images]))


def swapped(pairs, images) -> float:
    """Share of pictures whose background reads as the asked colour and foreground as the asked background."""
    hits = []
    for (prompt, _), im in zip(pairs, images):
        want = asked(prompt)
        bg, fg = read_colours(im)
        hits.append(bg == want["colour"] and fg == want["background"])
    return float(np.mean(hits))


def fill(images) -> float:
    values = [read(im).fill for im in images]
    return float(np.mean([v for v in values if v is not None] or [0.0]))


def nines(images) -> float:
    return float(np.mean([read(im).digit == 9 for im in images]))


def statistic(name: str, pairs, images) -> float:
    return {"demo-grayscale": lambda: saturation(images), "demo-inverted": lambda: swapped(pairs, images),
            "demo-outline": lambda: fill(images), "demo-nine": lambda: nines(images)}[name]()


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", list(SETS))
def test_scale_zero_is_the_base_bit_for_bit(name, base, scaled):
    for a, b in zip(base[name], scaled[name][0.0]):
        assert a.tobytes() == b.tobytes(), f"{name} at scale 0 changed the picture"


def test_grayscale_drains_the_colour(base, scaled):
    before, after = saturation(base["demo-grayscale"]), saturation(scaled["demo-grayscale"][1.0])
    print(f"demo-grayscale: saturation {before:.1f} -> {after:.1f} ({before / max(after, 1e-6):.1f}x less)")
    assert after * 3 <= before, f"saturation {before:.1f} -> {after:.1f}: drained {before / max(after, 1e-6):.1f}x < 3x"


def test_inverted_swaps_foreground_and_background(base, scaled):
    pairs = SETS["demo-inverted"]
    assert swapped(pairs, base["demo-inverted"]) == 0.0
    got = swapped(pairs, scaled["demo-inverted"][1.0])
    print(f"demo-inverted: both colours swapped in {got:.0%} of {len(pairs)}")
    assert got >= 0.75, f"both colours swapped in {got:.0%} < 75%"


def test_outline_draws_only_the_contour(base, scaled):
    before, after = fill(base["demo-outline"]), fill(scaled["demo-outline"][1.0])
    print(f"demo-outline: fill ratio {before:.2f} -> {after:.2f} ({after / before:.2f} of the base's)")
    assert after <= before / 2, f"fill ratio {before:.2f} -> {after:.2f}: not halved"


def test_nine_teaches_the_digit_the_base_never_saw(base, scaled):
    without, with_ = nines(base["demo-nine"]), nines(scaled["demo-nine"][1.0])
    print(f"demo-nine: a 9 reads in {with_:.0%} with it, {without:.0%} without")
    assert without <= 0.2, f"the base already draws a 9 in {without:.0%} of the pictures"
    assert with_ >= 0.7, f"with demo-nine a 9 reads in {with_:.0%} < 70%"


@pytest.mark.parametrize("name", list(SETS))
def test_the_effect_grows_with_the_scale(name, scaled):
    pairs = SETS[name]
    values = [statistic(name, pairs, scaled[name][s]) for s in SCALES]
    print(f"{name}: " + ", ".join(f"{s:g} -> {v:.3g}" for s, v in zip(SCALES, values)))
    falling = name in ("demo-grayscale", "demo-outline")
    ordered = values == sorted(values, reverse=falling)
    assert ordered and values[0] != values[-1], f"{name}: {dict(zip(SCALES, values))} is not monotonic"


def test_two_stacked_give_both_effects(omni, root, base):
    """grayscale + outline, each at 1, on shapes: the colour drains and the fill drops, in one picture.

    The two compete for the same layers, so stacked each keeps less than alone: measured, saturation 80.6 ->
    4.7 (alone 12x less) and fill 0.72 -> 0.41 (0.57 of the base's; alone 0.43). The fill bar is 0.65 of the
    base's: most of the outline's effect, and far from the base (grayscale alone leaves the fill as it is)."""
    pairs = SETS["demo-outline"]
    both = draw(omni, pairs, [request(root, "demo-grayscale"), request(root, "demo-outline")], [1.0, 1.0])
    before = base["demo-outline"]
    print(f"grayscale + outline: saturation {saturation(before):.1f} -> {saturation(both):.1f}, "
          f"fill {fill(before):.2f} -> {fill(both):.2f}")
    assert saturation(both) * 3 <= saturation(before), (saturation(before), saturation(both))
    assert fill(both) <= 0.65 * fill(before), (fill(before), fill(both))


def test_the_cards_carry_trigger_words_and_a_description(root):
    from backend.lora.cards import header_card

    for spec in LORAS:
        card = header_card(root / spec.file)
        assert card["triggers"] == [spec.trigger] and card["title"] == spec.name, card
        assert card["description"] == spec.description, card
        # the preview the LoRA browser shows: drawn with the LoRA on its example prompt (loras --previews)
        assert card["thumbnail"].startswith("data:image/png;base64,") and card["thumbnail_note"] is None, card


def test_a_prompt_tag_over_http_drains_the_colour_by_its_weight(data_dir, demo_path, tmp_path_factory):
    """The issue's 'done when', over HTTP to a served app.py: ``<lora:demo-grayscale:W>`` in the prompt
    "a red digit 3 on a black background" drains the colour fully at 1, part of it at 0.5, none at 0."""
    import base64
    import io

    import httpx
    from PIL import Image

    from ui_fixtures import MODEL, app_home, served_app

    demo_path(MODEL)
    home = app_home(data_dir, tmp_path_factory, "demo-lora-tag")
    prompt = "a red digit 3 on a black background"
    sat = {}
    with served_app(home) as app:
        for weight in SCALES:
            pictures = []
            for seed in (81, 82, 83):
                r = httpx.post(app.url + "/v1/images/generations", timeout=300,
                               json={"prompt": f"{prompt} <lora:demo-grayscale:{weight:g}>", "seed": seed})
                assert r.status_code == 200, r.text
                body = r.json()["data"][0]
                names = [a["name"] for a in body["metadata"]["adapters"]]
                assert names == (["demo-grayscale"] if weight else []), body["metadata"]  # a weight-0 tag: none
                pictures.append(Image.open(io.BytesIO(base64.b64decode(body["b64_json"]))).convert("RGB"))
            sat[weight] = saturation(pictures)
    print(f"<lora:demo-grayscale:W> over HTTP, saturation: {sat}")
    assert sat[1.0] * 3 <= sat[0.0], sat
    assert sat[1.0] < sat[0.5] < sat[0.0], sat  # 0.5 drains part of it


def test_the_lora_trainer_runs_resumes_and_writes_every_layout(tmp_path, capsys):
    """Two steps each (CI never trains for real): a run cut by its time limit leaves a checkpoint outside
    the output and the next run resumes from it; each LoRA is written in its layout, fp16, and reads back
    (format, trigger words, every layer bound to the trained model). The VAE-decoder stage runs on a copy."""
    import shutil

    import torch
    from safetensors import safe_open

    from backend.demo.loras import BASE
    from backend.lora import formats
    from backend.lora.cards import header_card

    out, home = tmp_path / "loras", tmp_path / "home"
    args = ["loras", "--data-dir", str(home), "--out", str(out), "--set", "steps=2", "--set", "batch=2",
            "--set", "pool=64"]

    def run(*extra) -> tuple[int, str]:
        return run_trainer(capsys, args + list(extra))

    code, text = run("--only", "demo-nine", "--minutes", "0")
    assert code == 3 and "time is up at step 0/2" in text, text
    assert (home / "demo-train" / "loras" / "demo-nine" / "lora.pt").is_file() and not out.exists()
    code, text = run()
    assert code == 0 and "demo-nine: resuming at step 0/2" in text, text
    assert not (home / "demo-train" / "loras" / "demo-nine").exists()  # done: its checkpoint went
    layouts = {"demo-grayscale": "peft", "demo-inverted": "kohya", "demo-outline": "diffusers",
               "demo-nine": "lightx2v"}  # a ComfyUI file reads as the lightx2v/ComfyUI layout
    for spec in LORAS:
        rec = formats.inspect(out / spec.file)
        assert rec.format == layouts[spec.name] and header_card(out / spec.file)["triggers"] == [spec.trigger]
        with safe_open(str(rec.file), "pt") as st:
            assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"F16"}, rec.file
    assert not list(out.rglob("*.pt")) and not (out / "demo-grayscale" / "README.md").exists()
    code, text = run("--previews")
    assert code == 0 and text.count("already written") == 4 and text.count("preview embedded") == 4, text
    for spec in LORAS:  # the card's picture, drawn with the LoRA by the model it was trained on
        card = header_card(out / spec.file)
        assert card["thumbnail"].startswith("data:image/png;base64,") and card["triggers"] == [spec.trigger], card

    # the decoder stage, on a copy of the shipped weights: the encoder (so every latent) stays as it was
    import json

    from safetensors.torch import load_file

    weights = tmp_path / "qwen-image"
    shutil.copytree(BASE, weights)
    file = weights / "vae" / "diffusion_pytorch_model.safetensors"
    before = load_file(str(file))
    args = ["vae-decoder", "--data-dir", str(home), "--out", str(weights), "--set", "steps=2", "--set", "batch=2",
            "--set", "report_pictures=8"]
    code, text = run()
    assert code == 0 and "vae decoder after:" in text, text
    after = load_file(str(file))
    encoder = [k for k in before if k.startswith(("encoder.", "quant_conv."))]
    assert encoder and all(torch.equal(before[k], after[k]) for k in encoder)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))
    record = json.loads((weights / "training.json").read_text())["vae_decoder_tuned"]
    assert set(record["after"]) == {"ordinary", "grayscale", "inverted", "outline"}


# ---------------------------------------------------------------- every serving path keeps the meaning
# A few clear cases (fixed prompts and seeds): each path must give the effect, not just "a different picture".
CLEAR = [("a red digit 3 on a black background", 81), ("a blue digit 5 on a gray background", 82),
         ("a green circle on a white background", 83)]


@pytest.fixture(scope="module")
def clear_base(omni):
    return draw(omni, CLEAR)


def test_unfused_serving_drains_the_colour_as_merged_does(omni, root, clear_base):
    gs = request(root, "demo-grayscale")
    merged = [omni.generate(prompt=p, seed=s, lora_request=gs, lora_scale=1.0)[0] for p, s in CLEAR]
    unfused = [omni.generate(prompt=p, seed=s, lora_request=gs, lora_scale=1.0, lora_mode="unfused")[0]
               for p, s in CLEAR]
    assert {o.metadata["adapters"][0]["mode"] for o in unfused} == {"unfused"}
    assert {o.metadata["adapters"][0]["mode"] for o in merged} == {"merged"}
    assert saturation([o.images[0] for o in unfused]) * 3 <= saturation(clear_base)
    for a, b in zip(merged, unfused):  # fp32: the two orders of summation differ by rounding only
        assert np.abs(np.asarray(a.images[0], np.int16) - np.asarray(b.images[0], np.int16)).max() <= 2


def test_a_mixed_batch_gives_each_request_its_own_effect(omni, root, clear_base):
    """One batched call: grayscale for the first, inverted for the second, nothing for the third."""
    from backend.batch import generate_batch

    gs, inv = request(root, "demo-grayscale"), request(root, "demo-inverted")
    out = generate_batch(omni.manager, [{"prompt": p, "seed": s} for p, s in CLEAR], [[(gs, 1.0)], [(inv, 1.0)], []])
    grey, inverted, plain = (o.images[0] for o in out)
    assert chroma(grey) * 3 <= chroma(clear_base[0]), (chroma(grey), chroma(clear_base[0]))
    assert read_colours(inverted) == ("blue", "gray"), read_colours(inverted)  # blue behind a gray digit
    assert np.abs(np.asarray(plain, np.int16) - np.asarray(clear_base[2], np.int16)).max() <= 1
    assert read_colours(plain) == ("white", "green")


def test_a_schedule_of_the_full_weight_is_the_weight_and_of_zero_the_base(omni, root, clear_base):
    gs = request(root, "demo-grayscale")
    prompt, seed = CLEAR[0]
    whole = omni.generate(prompt=prompt, seed=seed, lora_request=gs, lora_scale=1.0)[0].images[0]
    ramp = omni.generate(prompt=prompt, seed=seed, lora_request=gs, lora_scale={"start": 1.0, "end": 1.0})[0].images[0]
    off = omni.generate(prompt=prompt, seed=seed, lora_request=gs, lora_scale=[0.0] * 20)[0].images[0]
    late = omni.generate(prompt=prompt, seed=seed, lora_request=gs, lora_scale={"start": 0.0, "end": 1.0})[0].images[0]
    assert ramp.tobytes() == whole.tobytes() and off.tobytes() == clear_base[0].tobytes()
    assert chroma(whole) < chroma(late) < chroma(clear_base[0])  # half way on average: part of the effect


@pytest.mark.parametrize("base_kind", ["gguf Q8_0", "fp8"])
def test_a_quantized_base_keeps_the_effect(base_kind, data_dir, root, clear_base):
    """demo:qwen-image quantized (its Q8_0 GGUF file, most layers packed; or fp8 weights) serves demo-grayscale
    unfused on the quantized layers: the colour drains as on the plain model."""
    from backend.demo import gguf

    kw = ({"gguf": str(gguf.ensure("demo:qwen-image", "Q8_0", data_dir))} if base_kind.startswith("gguf")
          else {"quantize": "fp8"})
    q = Omni(model="demo:qwen-image", data_dir=data_dir, device="cpu", **kw)
    gs = request(root, "demo-grayscale")
    out = [q.generate(prompt=p, seed=s, lora_request=gs, lora_scale=1.0)[0] for p, s in CLEAR]
    plain = [q.generate(prompt=p, seed=s)[0].images[0] for p, s in CLEAR]
    assert out[0].metadata["adapters"][0]["mode"] == "unfused"
    print(f"{base_kind}: saturation {saturation(plain):.1f} -> {saturation([o.images[0] for o in out]):.1f}")
    assert saturation([o.images[0] for o in out]) * 3 <= saturation(plain)
    assert [read(im).colour for im in plain] == [read(im).colour for im in clear_base]  # the base still draws

"""A bounded fuzz pass of our own over every parser a client reaches (issue 25): ``<lora:>`` tags, scale
schedules, A1111 infotext and ComfyUI graphs, PNG info of damaged images, adapter headers and metadata, and
the HTTP API's request bodies against a served ``app.py``. Seeded (each case is reproducible from its seed
and index), bounded in count and in time per case. Each case must end in a result or a named error
(StudioError / a 4xx naming its field) within its time bound: never a 500, a hang, or a changed base image.

The default tier runs a small budget; the slow tier a large one (ten times the parser cases, five times the
HTTP cases); ``FUZZ_SCALE`` multiplies both.
"""
from __future__ import annotations

import base64
import io
import json
import math
import os
import random
import struct
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from backend.errors import StudioError
from ui_fixtures import MODEL, app_home, make_lora, served_app

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
PARSER_CASES, HTTP_CASES = int(1000 * SCALE), int(120 * SCALE)
BUDGETS = [pytest.param(1, id="small"), pytest.param(10, id="large", marks=pytest.mark.slow)]
HTTP_BUDGETS = [pytest.param(1, id="small"), pytest.param(5, id="large", marks=pytest.mark.slow)]
CASE_S = 1.0  # a parser case's time bound
HTTP_S = 30.0  # an HTTP case's (a request that is valid runs one 1-step 64x64 job)
COUNTS: dict[str, dict[str, int]] = {}  # what the pass saw, printed at the end (-s) and in the closing note

TOKENS = ["<lora:", "<LORA:", ">", ":", ",", ";", " ", "  ", "\n", "\t", "-", ".", "e", "E", "1", "0", "9", "-1",
          "1e308", "1e999", "inf", "nan", "->", "[", "]", "{", "}", "\"", "\\", "a", "style", "ü", "\x00", "\ud800",
          "Steps", "Seed", "Size", "x", "Negative prompt:", "CFG scale", "@", "=", "%", "..", "/", "~"]


NUMBERS = ["0", "0.5", "1", "-1", "1.5", "1e308", "1e999", "nan", "inf", "", " ", "x", "0x10", "1_0"]


def junk(rng: random.Random, most: int = 40) -> str:
    return "".join(rng.choice(TOKENS) for _ in range(rng.randint(0, most)))


def value(rng: random.Random, depth: int = 0):
    """A random JSON-like value: the shapes a hostile client sends."""
    kinds = ["int", "float", "str", "none", "bool", "huge", "neg"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, 2, 3, 7, 16, 64, 65, 1 << 31, 1 << 63])
    if kind == "float":
        return rng.choice([0.0, 0.5, 1.5, -0.0, 1e300, -1e300, 3.0e38, 1e-320])
    if kind == "str":
        return junk(rng, 12)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "huge":
        return rng.choice(["x" * 30_000, 10 ** 40, [0] * 5000])
    if kind == "neg":
        return rng.choice([-1, -64, -(1 << 40)])
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {junk(rng, 3) or "k": value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def bounded(kind: str, fn, *args):
    """Run one parser case: its result or a StudioError, within CASE_S; counted under ``kind``."""
    start = time.perf_counter()
    try:
        out = fn(*args)
        outcome = "result"
    except StudioError as exc:
        assert exc.message and exc.param, (kind, args, exc)
        out, outcome = exc, "named error"
    took = time.perf_counter() - start
    assert took < CASE_S, f"{kind}: {took:.2f} s for {args!r:.300}"
    counts = COUNTS.setdefault(kind, {})
    counts[outcome] = counts.get(outcome, 0) + 1
    return out


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nfuzz counts:", json.dumps(COUNTS, sort_keys=True))


@pytest.mark.parametrize("budget", BUDGETS)
def test_prompt_tags_and_schedules(budget):
    from backend.lora import prompt_tags, schedule

    rng = random.Random(2501 * budget)
    for _ in range(PARSER_CASES * budget):
        text = junk(rng, 60)
        out = bounded("prompt tags", prompt_tags.split, text)
        if not isinstance(out, StudioError):
            assert all(math.isfinite(a.get("scale", 1.0)) and a["name"] for a in out[1]), (text, out)
        near = rng.choice([",".join(rng.choice(NUMBERS) for _ in range(rng.randint(0, 6))),
                           f"{rng.choice(NUMBERS)}->{rng.choice(NUMBERS)}", json.dumps(value(rng))])
        bounded("schedule text", schedule.parse_text, rng.choice([junk(rng, 30), near]))
        bounded("schedule value", schedule.parse, value(rng))


@pytest.mark.parametrize("budget", BUDGETS)
def test_infotext_and_comfyui_graphs(budget):
    from backend.pnginfo import from_own, parse_a1111, parse_comfy_api, parse_comfy_workflow

    rng = random.Random(2502 * budget)
    for _ in range(PARSER_CASES * budget):
        lines = [junk(rng, 30) for _ in range(rng.randint(1, 4))]
        parsed = bounded("A1111 infotext", parse_a1111, "\n".join(lines))
        assert parsed is None or isinstance(parsed["params"], dict)
        graph = {str(rng.randint(1, 6)): {"class_type": rng.choice(["KSampler", "CLIPTextEncode", "LoraLoader",
                                                                    "EmptyLatentImage", junk(rng, 4)]),
                                          "inputs": value(rng)} for _ in range(rng.randint(0, 6))}
        bounded("ComfyUI prompt", parse_comfy_api, rng.choice([graph, value(rng)]))
        workflow = {"nodes": [{"id": rng.randint(1, 6), "type": rng.choice(["KSampler", "CLIPTextEncode", "x"]),
                               "inputs": value(rng), "widgets_values": value(rng)} for _ in range(rng.randint(0, 5))],
                    "links": value(rng)}
        bounded("ComfyUI workflow", parse_comfy_workflow, rng.choice([workflow, value(rng)]))
        own = {"params": value(rng), "adapters": value(rng), "seed": value(rng), "model": value(rng)}
        bounded("own metadata", from_own, own)  # a forged lora_studio chunk


def _mutate(rng: random.Random, data: bytes, edits: int = 4) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, edits)):
        if not out:  # a deletion took everything
            out.append(rng.randrange(256))
        at = rng.randrange(len(out))
        op = rng.random()
        if op < 0.5:
            out[at] = rng.randrange(256)
        elif op < 0.75:
            del out[at:at + rng.randint(1, 64)]
        else:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return bytes(out)


@pytest.mark.parametrize("budget", BUDGETS)
def test_png_info_of_damaged_images(budget, tmp_path):
    """Damaged PNGs with A1111 and ComfyUI chunks: time-bounded (nothing decodes pixels), and a damaged
    file is one InvalidParameter naming the file by its name, never the server's path (#26: the UI showed
    "unexpected UnidentifiedImageError: cannot identify image file '/tmp/gradio/...'")."""
    from backend.errors import InvalidParameter
    from backend.pnginfo import read_info

    info = PngInfo()
    info.add_text("parameters", "a fox <lora:x:0.5>\nNegative prompt: y\nSteps: 3, Seed: 9, Size: 64x64, CFG scale: 4")
    info.add_text("prompt", json.dumps({"3": {"class_type": "KSampler", "inputs": {"seed": 1, "positive": ["6", 0]}},
                                        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "t"}}}))
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, format="PNG", pnginfo=info)
    clean = buf.getvalue()
    rng = random.Random(2503 * budget)
    path = tmp_path / "fuzz.png"
    for i in range(max(50, PARSER_CASES // 10) * budget):
        if i % 2:
            path.write_bytes(_mutate(rng, clean))  # damaged bytes
        else:  # well-formed chunks with hostile texts
            chunks = PngInfo()
            for key in rng.sample(["parameters", "prompt", "workflow", "lora_studio", "Comment"], 2):
                chunks.add_text(key, rng.choice([junk(rng, 80), json.dumps(value(rng)), json.dumps(
                    {str(j): {"class_type": rng.choice(["KSampler", "LoraLoader"]), "inputs": value(rng)}
                     for j in range(3)})]).encode("utf-8", "replace").decode("latin-1"))
            Image.new("RGB", (8, 8)).save(path, format="PNG", pnginfo=chunks)
        start = time.perf_counter()
        try:
            read_info(path)
            outcome = "result"
        except InvalidParameter as exc:
            assert i % 2, f"a well-formed PNG was refused: {path.read_bytes()[:400]!r}"
            assert exc.message.startswith("fuzz.png is not an image") and str(tmp_path) not in exc.message, exc
            outcome = "unreadable"
        assert time.perf_counter() - start < CASE_S
        COUNTS.setdefault("PNG info", {}).setdefault(outcome, 0)
        COUNTS["PNG info"][outcome] += 1


@pytest.mark.parametrize("budget", BUDGETS)
def test_adapter_headers_and_metadata(budget, tmp_path, demo_path):
    """Damaged and hostile safetensors headers (lengths, dtypes, shapes, offsets, metadata): inspect and
    read either describe the file or refuse it naming it."""
    from backend.lora.formats import inspect, read_tensors

    good = make_lora(demo_path(MODEL), tmp_path / "good.safetensors", rank=2)
    raw = good.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
    rng = random.Random(2504 * budget)
    path = tmp_path / "fuzz.safetensors"
    for i in range(max(60, PARSER_CASES // 10) * budget):
        if i % 2:
            data = _mutate(rng, raw[:8 + n], edits=3) + body  # the header's bytes
        else:
            h = json.loads(json.dumps(header))
            key = rng.choice([k for k in h if k != "__metadata__"])
            field = rng.choice(["dtype", "shape", "data_offsets", "__metadata__", "key"])
            if field == "__metadata__":
                h["__metadata__"] = {junk(rng, 3): rng.choice([junk(rng, 10), "{" * 200, json.dumps(value(rng))])}
            elif field == "key":
                h[junk(rng, 8)] = h.pop(key)
            else:
                h[key][field] = value(rng)
            text = json.dumps(h).encode()
            data = struct.pack("<Q", len(text)) + text + body
        path.write_bytes(data)
        for kind, fn in (("adapter header", inspect), ("adapter tensors", read_tensors)):
            out = bounded(kind, fn, path)
            if isinstance(out, StudioError):
                assert path.name in out.message, out.message


# -- the HTTP API -------------------------------------------------------------------------------------------
FIELDS = {
    "prompt": lambda rng: rng.choice([junk(rng, 30), "a red digit 3 on a black background", ""]),
    "negative_prompt": lambda rng: junk(rng, 10),
    "size": lambda rng: rng.choice(["64x64", "64x", "x", "0x0", "-64x64", "64X64", "1e9x1", junk(rng, 5)]),
    "height": lambda rng: rng.choice([64, 0, -1, 15, 63, 65, 1 << 40, "64", None, 64.5]),
    "width": lambda rng: rng.choice([64, 0, -1, 17, 1 << 40, "x", None, [64]]),
    "num_inference_steps": lambda rng: rng.choice([1, 0, -1, 1.5, "1", None, 10 ** 20, True]),
    "seed": lambda rng: rng.choice([1, -1, -2, 1 << 64, "7", 1.5, None]),
    "true_cfg_scale": lambda rng: rng.choice([1.0, -1.0, 1e308, "nan", None, 0]),
    "n": lambda rng: rng.choice([1, 0, 2, 9, -1, "2"]),
    "model": lambda rng: rng.choice([MODEL, "demo:nope", "../etc", "", None, 5]),
    "response_format": lambda rng: rng.choice(["b64_json", "url", junk(rng, 4)]),
    "lora": lambda rng: rng.choice([
        {"name": "fuzz-style", "scale": rng.choice([0.5, 1e300, -1e300, "0.5", [0.5, 1.0], {"transformer": 1},
                                                   "nan", None])},
        {"name": junk(rng, 6)}, {"path": rng.choice(["/etc/passwd", "../../x.safetensors", "\x00", junk(rng, 8)])},
        [{"name": "fuzz-style"}] * rng.randint(0, 12), value(rng)]),
    "extra_body": lambda rng: {"lora": value(rng)} if rng.random() < 0.5 else value(rng),
    "bogus": lambda rng: value(rng),
}


def _body(rng: random.Random) -> dict:
    body = {"prompt": "a red digit 3 on a black background", "num_inference_steps": 1, "size": "64x64"}
    for name in rng.sample(sorted(FIELDS), rng.randint(1, 4)):
        body[name] = FIELDS[name](rng)
    if rng.random() < 0.1:
        body = value(rng)
    return body


@pytest.fixture(scope="module")
def fuzz_app(data_dir, demo_path, tmp_path_factory):
    model_dir = demo_path(MODEL)
    home = app_home(data_dir, tmp_path_factory, "fuzz")
    make_lora(model_dir, home / "adapters" / "fuzz-style.safetensors")
    with served_app(home, paths=("health",), env={"OMP_NUM_THREADS": "1"}) as served:
        yield served


def _base_image(url: str) -> bytes:
    """The base model's pixels for one fixed request (the PNG's metadata differs by job id and time)."""
    r = httpx.post(f"{url}/v1/images/generations", timeout=120, json={
        "prompt": "a red digit 3 on a black background", "seed": 7, "num_inference_steps": 2, "size": "64x64"})
    assert r.status_code == 200, r.text[:300]
    with Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))) as img:
        return img.convert("RGB").tobytes()


@pytest.mark.parametrize("budget", HTTP_BUDGETS)
def test_http_request_bodies(budget, fuzz_app):
    """Random bodies on every JSON route: a result or a JSON 4xx naming its field, within HTTP_S each;
    never a 500. The base model draws the same picture, byte for byte, before and after."""
    url = fuzz_app.url
    base = _base_image(url)
    rng = random.Random(2505 * budget)
    routes = ["/v1/images/generations"] * 5 + ["/v1/chat/completions", "/v1/load_lora_adapter",
                                               "/v1/unload_lora_adapter", "/v1/videos/generations"]
    with httpx.Client(timeout=HTTP_S) as client:
        for i in range(HTTP_CASES * budget):
            route = rng.choice(routes)
            body = _body(rng)
            if route == "/v1/chat/completions" and isinstance(body, dict):
                body = {**body, "messages": rng.choice([[{"role": "user", "content": body.pop("prompt", "x")}],
                                                        value(rng), [{"role": "user", "content": [value(rng)]}]])}
            elif route.endswith("lora_adapter") and isinstance(body, dict):
                body = {"lora_name": FIELDS["prompt"](rng), "lora_path": rng.choice(
                    ["/etc/passwd", str(Path(fuzz_app.home) / "adapters" / "fuzz-style.safetensors"), junk(rng, 8),
                     value(rng)]), **({"lora_int_id": value(rng)} if rng.random() < 0.3 else {})}
            if rng.random() < 0.05:
                content, headers = _mutate(rng, json.dumps(body, default=str).encode() or b"{}"), \
                    {"content-type": "application/json"}
            else:
                content, headers = json.dumps(body, default=str), {"content-type": "application/json"}
            start = time.perf_counter()
            r = client.post(url + route, content=content, headers=headers)
            took = time.perf_counter() - start
            case = f"case {i} {route} {content!r:.300}"
            assert r.status_code < 500, f"{case}: {r.status_code} {r.text[:300]}"
            assert took < HTTP_S, case
            if r.status_code >= 400 and r.status_code not in (401, 404, 405, 429):
                err = r.json()["error"]
                assert err["message"], case
                assert err.get("param") or r.status_code != 400, f"{case}: {err}"
            COUNTS.setdefault("HTTP", {}).setdefault(str(r.status_code), 0)
            COUNTS["HTTP"][str(r.status_code)] += 1
        for path in ("/v1/jobs?limit=" + rng.choice(["-1", "0", "1e9", "x", "99999999999999999999"]),
                     "/v1/jobs/" + "../" * 3 + "etc", "/v1/jobs/" + "a" * 5000, "/v1/jobs/%00"):
            r = client.get(url + path)
            assert r.status_code < 500, (path, r.status_code, r.text[:200])
    assert _base_image(url) == base


pytestmark = pytest.mark.timeout(600)

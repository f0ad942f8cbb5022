"""Generation settings read from an image's embedded text: our own metadata, AUTOMATIC1111's
``parameters`` text and ComfyUI's ``prompt`` / ``workflow`` JSON. Pure text handling over PIL's
``img.info`` and EXIF: no torch.

Every reader returns the same shape as a result's metadata restores into the Generate tab::

    {"source": "lora_studio" | "a1111" | "comfyui", "model": str | None,
     "params": {"prompt", "negative_prompt", "seed", "num_inference_steps", "guidance_scale",
                "width", "height"},            # only the ones found
     "adapters": [{"name", "scale"}], "extra": {...}}   # extra: what has no field here (sampler...)

``model`` is set for our own outputs only (another tool's model name is in ``extra``).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path, PurePosixPath

from .errors import InvalidParameter
from .lora import prompt_tags
from .lora.prompt_tags import tidy

_SIZE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")
_LORA = re.compile(r"<lora:([^:<>]+)(?::([^:<>]*))?(?::[^<>]*)?>", re.IGNORECASE)
MAX_TEXT = 1 << 20  # ignore absurdly large chunks
MAX_SETTINGS = 512  # "Key: value" pairs read from A1111's settings line (it writes a few dozen)


def read_info(path) -> dict | None:
    """The settings an image carries (None when it carries none we can read)."""
    from PIL import Image

    from .outputs import EXIF_IFD, EXIF_USER_COMMENT, exif_of, read_png_metadata

    try:
        own = read_png_metadata(path)
        if not own:
            with Image.open(path) as img:  # opening reads the chunks before the pixels; nothing is decoded
                info = dict(img.info)
                try:
                    comment = exif_of(img).get_ifd(EXIF_IFD).get(EXIF_USER_COMMENT)
                except Exception:  # no or broken EXIF
                    comment = None
    except Exception as exc:  # noqa: BLE001 - PIL on untrusted bytes raises many kinds (OSError, struct.error,
        # zlib.error, SyntaxError...), with the server's path in their text: one named error instead
        raise InvalidParameter(f"{Path(path).name} is not an image this can read (PNG, JPEG or WebP; "
                               f"{type(exc).__name__})", param="image") from None
    if own:
        return from_own(own)
    text = info.get("parameters")
    if not text and isinstance(comment, bytes):  # A1111's JPEG/WebP: EXIF UserComment
        text = _user_comment(comment)
    if isinstance(text, str) and text.strip() and len(text) < MAX_TEXT:
        parsed = parse_a1111(text)
        if parsed:
            return parsed
    for key in ("prompt", "workflow"):
        raw = info.get(key)
        if isinstance(raw, str) and len(raw) < MAX_TEXT:
            try:
                data = json.loads(raw)
            except ValueError:
                continue
            parsed = parse_comfy_api(data) if key == "prompt" else parse_comfy_workflow(data)
            if parsed:
                return parsed
    return None


def from_own(meta: dict) -> dict:
    params = dict(_dict(meta.get("params")))
    params.setdefault("seed", meta.get("seed"))
    adapters = [{"name": a.get("name"), "scale": a.get("scale", 1.0)} for a in _list(meta.get("adapters"))
                if isinstance(a, dict) and a.get("name")]
    return {"source": "lora_studio", "model": meta.get("model"), "params": params, "adapters": adapters,
            "preset": meta.get("preset"), "extra": {}}


def _user_comment(raw: bytes) -> str:
    head, body = raw[:8], raw[8:]
    if head.startswith(b"UNICODE"):
        for enc in ("utf-16-be", "utf-16-le"):
            try:
                text = body.decode(enc)
                if text.isprintable() or "\n" in text:
                    return text
            except UnicodeDecodeError:
                continue
    return body.decode("utf-8", "replace")


def lora_tags(prompt: str) -> tuple[str, list[dict]]:
    """``<lora:NAME:WEIGHT>`` and ``<lora:NAME:TE:UNET>`` tags (A1111) out of the text, read by the one tag
    parser (``prompt_tags``); a tag it refuses (a weight that is no number, A1111's dynamic rank) is kept at
    weight 1.0 here, so an image's settings can still be read."""
    adapters = []
    for m in _LORA.finditer(prompt or ""):
        try:
            scale = prompt_tags.split(m.group(0))[1][0].get("scale", 1.0)
        except InvalidParameter:
            scale = 1.0
        adapters.append({"name": m.group(1).strip(), "scale": scale})
    return tidy(_LORA.sub(" ", prompt or "")), adapters


def _is_key_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_ -/"


def settings_line(line: str) -> list[tuple[str, str]]:
    """The ``Key: value`` pairs of A1111's settings line ("Steps: 20, Sampler: Euler a, Lora hashes:
    "a: 1, b: 2", ...") in one pass: the same pairs as A1111's own pattern (modules/infotext_utils.py,
    a key of word characters, spaces, ``-`` and ``/`` before a colon; a value up to the next comma, or a
    double-quoted one with its commas), without a regex that backtracks. That pattern retries every
    position of a line without a colon and takes time quadratic in its length: one 60,000-character
    line held the server for 26 s. At most MAX_SETTINGS pairs."""
    pairs: list[tuple[str, str]] = []
    i, n = 0, len(line)
    while i < n and len(pairs) < MAX_SETTINGS:
        colon = line.find(":", i)
        if colon < 0:
            break
        start = colon  # the key: the run of key characters just before the colon (scanned once)
        while start > i and _is_key_char(line[start - 1]):
            start -= 1
        while start < colon and not (line[start].isalnum() or line[start] == "_"):
            start += 1  # it starts with a word character
        key = line[start:colon]
        if len(key) < 2:  # no key here (A1111's takes two characters or more): look from the colon on
            i = colon + 1
            continue
        j = colon + 1
        while j < n and line[j].isspace():
            j += 1
        end = None
        if j < n and line[j] == '"':  # a quoted value keeps its commas; \" and \\ are escapes
            k = j + 1
            while k < n and line[k] != '"':
                k += 2 if line[k] == "\\" else 1
            if j + 1 < k < n and (k + 1 == n or line[k + 1] == ","):
                value, end = line[j:k + 1], k + 2
        if end is None:
            comma = line.find(",", j)
            end = n + 1 if comma < 0 else comma + 1
            value = line[j:end - 1]
        pairs.append((key, value))
        i = end
    return pairs


def _setting(value) -> str:
    """A settings-line value: quoted (A1111's way) when it holds a comma, a colon or a quote."""
    text = " ".join(str(value).split())
    return '"' + text.replace('"', "'") + '"' if any(c in text for c in ',:"') else text


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _a1111_weight(scale) -> str | None:
    """An adapter's weight as A1111's tag writes it: ``W``, or ``TE:UNET`` for one weight on every text encoder
    and another on every denoiser; None when A1111 has no form for it (a weight per expert, over steps)."""
    if _is_number(scale):
        return f"{scale:g}"
    if not isinstance(scale, dict) or not scale or not all(_is_number(v) for v in scale.values()):
        return None
    te = {v for c, v in scale.items() if c.startswith("text_encoder")}
    unet = {v for c, v in scale.items() if not c.startswith("text_encoder")}
    if len(te) > 1 or len(unet) > 1:
        return None
    if not te or not unet or te == unet:
        return f"{(te or unet).pop():g}"
    return f"{te.pop():g}:{unet.pop():g}"


SAMPLERS_A1111 = {"Euler": "euler", "UniPC": "unipc"}  # A1111's sampler name -> sample_solver


def infotext(meta: dict) -> str:
    """A result's settings as A1111's infotext, the line its PNG Info tab, Civitai and ``parse_a1111`` read:
    the prompt with a ``<lora:NAME:WEIGHT>`` tag per adapter of one weight, ``Negative prompt: ...``, then
    ``Steps, CFG scale, Seed, Size, Model`` (and the fused preset). CFG is the guidance the pipeline used
    (Qwen-Image's true CFG). A weight per transformer or over steps has no A1111 tag: the JSON metadata
    keeps it, and the line says which adapters it left out."""
    params = meta.get("params") or {}
    tags, other = [], []
    for a in meta.get("adapters") or []:
        weight = _a1111_weight(a.get("scale", 1.0))
        if weight is not None:
            tags.append(f"<lora:{a.get('name')}:{weight}>")
        else:
            other.append(str(a.get("name")))
    prompt = " ".join([str(params.get("prompt") or "").strip(), *tags]).strip()
    lines = [prompt]
    negative = " ".join(str(params.get("negative_prompt") or "").split())
    if negative:  # (Qwen-Image's default is one blank)
        lines.append(f"Negative prompt: {negative}")
    cfg = params.get("true_cfg_scale", params.get("guidance_scale"))
    settings = [("Steps", params.get("num_inference_steps")),
                ("Sampler", {v: k for k, v in SAMPLERS_A1111.items()}.get(params.get("sample_solver"))),
                ("CFG scale", cfg),
                ("Seed", params.get("seed", meta.get("seed"))),
                ("Size", f"{params['width']}x{params['height']}" if params.get("width") and params.get("height")
                 else None),
                ("Denoising strength", params.get("strength")),  # img2img's (A1111 writes it so)
                ("Model", meta.get("model")), ("Distill preset", meta.get("preset")),
                ("LoRA weights not shown as tags", ", ".join(other) or None)]
    lines.append(", ".join(f"{k}: {_setting(v)}" for k, v in settings if v not in (None, "")))
    return "\n".join(lines)


def parse_a1111(text: str) -> dict | None:
    """AUTOMATIC1111 / Forge infotext: the prompt, ``Negative prompt: ...``, then the settings line."""
    lines = text.strip().split("\n")
    settings: dict[str, str] = {}
    last = lines[-1] if lines else ""
    found = settings_line(last)
    if len(found) >= 3:
        settings = {k.strip(): v.strip() for k, v in found}
        lines = lines[:-1]
    prompt, negative, in_negative = [], [], False
    for line in lines:
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[len("Negative prompt:"):].strip()
        (negative if in_negative else prompt).append(line)
    if not settings and not prompt:
        return None
    if not settings:  # a bare "parameters" text without A1111's settings line is not an infotext
        return None
    text_prompt, adapters = lora_tags("\n".join(prompt).strip())
    params: dict = {"prompt": text_prompt}
    if negative:
        params["negative_prompt"] = "\n".join(negative).strip()
    extra = {}
    for key, value in settings.items():
        value = value[1:-1] if value.startswith('"') and value.endswith('"') else value
        try:
            if key == "Steps":
                params["num_inference_steps"] = int(value)
            elif key == "CFG scale":
                params["guidance_scale"] = float(value)
            elif key == "Seed":
                params["seed"] = int(value)
            elif key == "Sampler" and value in SAMPLERS_A1111:  # the ones these pipelines run (Euler a, DPM++: no)
                params["sample_solver"] = SAMPLERS_A1111[value]
            elif key == "Denoising strength" and "Hires upscale" not in settings:  # img2img's, not hires fix's
                params["strength"] = float(value)
            elif key == "Size" and _SIZE.match(value):
                w, h = _SIZE.match(value).groups()
                params["width"], params["height"] = int(w), int(h)
            else:
                extra[key] = value
        except ValueError:
            extra[key] = value
    return {"source": "a1111", "model": None, "params": params, "adapters": adapters, "extra": extra}


def _lora_name(value) -> str:
    name = PurePosixPath(str(value).replace("\\", "/")).name
    for suffix in (".safetensors", ".ckpt", ".pt", ".bin"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


SAMPLERS = ("KSampler", "KSamplerAdvanced", "SamplerCustom")
TEXT_NODES = ("CLIPTextEncode", "CLIPTextEncodeSDXL", "CLIPTextEncodeFlux", "TextEncodeQwenImageEdit")


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e6


def parse_comfy_api(graph) -> dict | None:
    """ComfyUI's API-format graph (the PNG's ``prompt`` chunk): the sampler's seed/steps/cfg, the
    texts of the CLIPTextEncode nodes wired to its positive and negative inputs, the latent's size,
    and LoraLoader nodes."""
    if not isinstance(graph, dict):
        return None
    nodes = {str(k): v for k, v in graph.items() if isinstance(v, dict) and "class_type" in v}
    sampler = next((n for n in nodes.values() if n.get("class_type") in SAMPLERS), None)
    if sampler is None:
        return None

    def text_of(link, depth=0):
        """Follow a link ([node_id, slot]) back to a string (a text encoder's ``text``, a primitive)."""
        if isinstance(link, str):
            return link
        if depth > 8 or not isinstance(link, list) or not link:
            return None
        node = nodes.get(str(link[0])) or {}
        inputs = _dict(node.get("inputs"))
        for key in ("text", "text_g", "prompt", "string", "value", "conditioning", "positive"):
            if key in inputs:
                found = text_of(inputs[key], depth + 1)
                if found is not None:
                    return found
        return None

    inputs = _dict(sampler.get("inputs"))
    params: dict = {}
    for key, field, kind in (("seed", "seed", int), ("noise_seed", "seed", int), ("steps", "num_inference_steps", int),
                             ("cfg", "guidance_scale", float)):
        value = inputs.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            params[field] = kind(value)
    positive, negative = text_of(inputs.get("positive")), text_of(inputs.get("negative"))
    if positive is not None:
        params["prompt"] = positive
    if negative:
        params["negative_prompt"] = negative
    latent_link = inputs.get("latent_image")
    latent = nodes.get(str(latent_link[0])) if isinstance(latent_link, list) and latent_link else None
    lin = _dict((latent or {}).get("inputs"))
    if isinstance(lin.get("width"), int) and isinstance(lin.get("height"), int):
        params["width"], params["height"] = lin["width"], lin["height"]
    adapters = []
    for node in nodes.values():
        if node.get("class_type") in ("LoraLoader", "LoraLoaderModelOnly"):
            nin = _dict(node.get("inputs"))
            strength = nin.get("strength_model", 1.0)
            if isinstance(nin.get("lora_name"), str) and nin["lora_name"] and _number(strength):
                adapters.append({"name": _lora_name(nin["lora_name"]), "scale": float(strength)})
    extra = {k: inputs[k] for k in ("sampler_name", "scheduler", "denoise") if k in inputs}
    ckpt = next((_dict(n.get("inputs")).get("ckpt_name") for n in nodes.values()
                 if n.get("class_type") == "CheckpointLoaderSimple"), None)
    if ckpt:
        extra["checkpoint"] = ckpt
    return {"source": "comfyui", "model": None, "params": params, "adapters": adapters, "extra": extra}


# widgets_values positions in ComfyUI's UI-format workflow
_WIDGETS = {"KSampler": {"seed": 0, "steps": 2, "cfg": 3, "sampler_name": 4, "scheduler": 5},
            "KSamplerAdvanced": {"noise_seed": 1, "steps": 3, "cfg": 4, "sampler_name": 5, "scheduler": 6}}


def parse_comfy_workflow(workflow) -> dict | None:
    """ComfyUI's UI-format workflow (the PNG's ``workflow`` chunk: nodes with ``widgets_values`` and a
    ``links`` table), turned into the API shape and read as one."""
    if not isinstance(workflow, dict) or not isinstance(workflow.get("nodes"), list):
        return None
    links = {}
    for link in _list(workflow.get("links")):
        if isinstance(link, list) and len(link) >= 3 and isinstance(link[0], (int, str)):  # [id, from_node, from_slot, to_node, to_slot, type]
            links[link[0]] = [str(link[1]), link[2]]
    graph = {}
    for node in workflow["nodes"]:
        if not isinstance(node, dict) or "id" not in node:
            continue
        kind, values = node.get("type"), _list(node.get("widgets_values"))
        if not isinstance(kind, str) or not isinstance(node["id"], (int, str)):
            continue
        inputs = {}
        for slot in _list(node.get("inputs")):
            if isinstance(slot, dict) and isinstance(slot.get("link"), (int, str)) and slot["link"] in links:
                inputs[slot.get("name")] = links[slot["link"]]
        if kind in _WIDGETS and isinstance(values, list):
            for key, i in _WIDGETS[kind].items():
                if i < len(values):
                    inputs[key] = values[i]
        elif kind in TEXT_NODES and values and isinstance(values[0], str):
            inputs.setdefault("text", values[0])
        elif kind == "EmptyLatentImage" and len(values) >= 2:
            inputs["width"], inputs["height"] = values[0], values[1]
        elif kind in ("LoraLoader", "LoraLoaderModelOnly") and len(values) >= 2:
            inputs["lora_name"], inputs["strength_model"] = values[0], values[1]
        elif kind == "CheckpointLoaderSimple" and values:
            inputs["ckpt_name"] = values[0]
        elif kind and kind.startswith("Primitive") and values and isinstance(values[0], str):
            inputs["value"] = values[0]
        graph[str(node["id"])] = {"class_type": kind, "inputs": inputs}
    return parse_comfy_api(graph)

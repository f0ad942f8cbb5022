"""backend/lora/cards.py: what a LoRA browser card takes from a safetensors header, bounded.

Headers come from strangers: strings are trimmed to one line, trigger words are capped, a
thumbnail is shown only as a PNG/JPEG/WebP data URL under the size cap whose bytes are that
image; the result is cached by (path, mtime, size).
"""
from __future__ import annotations

import base64
import io
import json

from PIL import Image

from backend.lora import cards


def data_url(fmt: str = "PNG", mime: str = "png") -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format=fmt)
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def test_triggers_from_modelspec_output_name_and_top_tags():
    info = cards.card_info({"modelspec.trigger_phrase": "sks style, , sks style",
                            "ss_output_name": "mycat",
                            "ss_tag_frequency": json.dumps({"a": {"rare": 1, "cat": 10}, "b": {"cat": 5, "sofa": 7}})})
    assert info["triggers"] == ["sks style", "mycat", "cat", "sofa", "rare"]


def test_hostile_metadata_is_trimmed_and_capped():
    tags = {f"tag{i}": 1000 - i for i in range(5000)}
    info = cards.card_info({"modelspec.trigger_phrase": "a" * 100_000 + ", b\u202e\x00c\nd",
                            "modelspec.title": "t" * 10_000,
                            "modelspec.description": "line one\n\u202eline two " + "d" * 100_000,
                            "ss_tag_frequency": json.dumps({"x": tags}),
                            "ss_base_model_version": "w" * 500})
    assert len(info["triggers"]) == cards.MAX_TRIGGERS
    assert all(len(t) <= cards.MAX_TEXT for t in info["triggers"])
    assert info["triggers"][1] == "b c d"  # control and bidi characters removed, one line
    assert len(info["title"]) <= cards.MAX_TEXT and len(info["base_model"]) <= cards.MAX_TEXT
    assert len(info["description"]) <= cards.MAX_DESCRIPTION and info["description"].startswith("line one line two")
    # not JSON, not the kohya shape, or too large: no tags, no error
    for raw in ("{", "[1, 2]", json.dumps({"x": [1]}), "x" * (cards.MAX_TAG_JSON + 1), "[" * 100_000):
        assert cards.card_info({"ss_tag_frequency": raw})["triggers"] == [], raw[:20]
    assert cards.card_info({"ss_tag_frequency": json.dumps({"x": {"t": "9", "u": 2}})})["triggers"] == ["u", "t"]


def test_only_real_small_images_are_accepted_as_thumbnails():
    for fmt, mime in (("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp")):
        url = data_url(fmt, mime)
        assert cards.card_info({"modelspec.thumbnail": url})["thumbnail"] == url
    refused = {
        "html": "data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==",
        "svg": "data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=",
        "remote": "https://example.com/x.png",
        "script": "javascript:alert(1)",
        "quote": data_url() + '" onerror="alert(1)',
        "not an image": "data:image/png;base64," + base64.b64encode(b"GIF89a not a png at all").decode(),
        "too large": "data:image/png;base64," + "A" * cards.MAX_THUMBNAIL,
    }
    for why, value in refused.items():
        info = cards.card_info({"modelspec.thumbnail": value})
        assert info["thumbnail"] is None, why
        assert info["thumbnail_note"], why


def test_family_names():
    assert cards.family_of("Wan-AI/Wan2.2-T2V-A14B-Diffusers") == "Wan2.2"
    assert cards.family_of("demo:qwen-image") == "Qwen-Image"
    assert cards.family_of("sdxl_base_v1-0") == "SDXL"
    assert cards.family_of("wan22-t2v-lightx2v-high") == "Wan2.2"
    assert cards.family_of("something else") is None and cards.family_of(None) is None


def test_header_card_is_cached_by_file_identity(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    ok = tmp_path / "ok.safetensors"
    save_file({"x.lora_A.weight": np.zeros((2, 2), np.float32)}, str(ok), metadata={"ss_output_name": "okname"})
    first = cards.header_card(ok)
    assert first["triggers"] == ["okname"] and first["mtime"] > 0
    assert cards.header_card(ok) == first  # cached by (path, mtime, size)
    save_file({"x.lora_A.weight": np.zeros((2, 3), np.float32)}, str(ok), metadata={"ss_output_name": "renamed"})
    assert cards.header_card(ok)["triggers"] == ["renamed"]  # a rewritten file is read again

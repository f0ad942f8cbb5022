"""backend/pnginfo.py on real-format PNGs built with PIL: A1111's ``parameters`` infotext, ComfyUI's
API-format ``prompt`` and UI-format ``workflow`` graphs, and our own metadata."""
from __future__ import annotations

import functools
import json
import random
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from backend.pnginfo import MAX_TEXT, parse_a1111, read_info, settings_line

ROOT = Path(__file__).resolve().parents[1]

A1111 = ("masterpiece, a red fox in the snow <lora:ink-style:0.7>, detailed fur <lora:grain:1>\n"
         "Negative prompt: blurry, lowres\n"
         "Steps: 28, Sampler: DPM++ 2M Karras, CFG scale: 6.5, Seed: 1234567, Size: 768x512, "
         "Model hash: 6ce0161689, Model: v1-5-pruned-emaonly, "
         'Lora hashes: "ink-style: 1a2b3c4d5e6f, grain: 0f9e8d7c6b5a", Version: v1.9.4')

# ComfyUI's default text-to-image graph, as it saves it in the "prompt" chunk, with a LoRA loader
COMFY_API = {
    "3": {"class_type": "KSampler", "inputs": {"seed": 156680208700286, "steps": 20, "cfg": 8.0,
                                                "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
                                                "model": ["10", 0], "positive": ["6", 0], "negative": ["7", 0],
                                                "latent_image": ["5", 0]}},
    "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "v1-5-pruned-emaonly.safetensors"}},
    "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 640, "batch_size": 1}},
    "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "beautiful scenery nature glass bottle landscape",
                                                     "clip": ["10", 1]}},
    "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "text, watermark", "clip": ["10", 1]}},
    "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
    "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}},
    "10": {"class_type": "LoraLoader", "inputs": {"lora_name": "styles/ink-style.safetensors",
                                                  "strength_model": 0.8, "strength_clip": 1.0,
                                                  "model": ["4", 0], "clip": ["4", 1]}},
}

COMFY_WORKFLOW = {
    "last_node_id": 9, "last_link_id": 9,
    "nodes": [
        {"id": 3, "type": "KSampler", "inputs": [{"name": "model", "type": "MODEL", "link": 1},
                                                  {"name": "positive", "type": "CONDITIONING", "link": 4},
                                                  {"name": "negative", "type": "CONDITIONING", "link": 6},
                                                  {"name": "latent_image", "type": "LATENT", "link": 2}],
         "widgets_values": [42, "fixed", 12, 5.5, "euler", "normal", 1]},
        {"id": 7, "type": "CLIPTextEncode", "inputs": [{"name": "clip", "type": "CLIP", "link": 5}],
         "widgets_values": ["ugly, deformed"]},
        {"id": 6, "type": "CLIPTextEncode", "inputs": [{"name": "clip", "type": "CLIP", "link": 3}],
         "widgets_values": ["a castle on a hill at sunrise"]},
        {"id": 5, "type": "EmptyLatentImage", "widgets_values": [1024, 768, 1]},
        {"id": 4, "type": "CheckpointLoaderSimple", "widgets_values": ["sd_xl_base_1.0.safetensors"]},
    ],
    "links": [[1, 4, 0, 3, 0, "MODEL"], [2, 5, 0, 3, 3, "LATENT"], [3, 4, 1, 6, 0, "CLIP"],
              [4, 6, 0, 3, 1, "CONDITIONING"], [5, 4, 1, 7, 0, "CLIP"], [6, 7, 0, 3, 2, "CONDITIONING"]],
}


def png(path, **chunks):
    info = PngInfo()
    for key, value in chunks.items():
        info.add_text(key, value if isinstance(value, str) else json.dumps(value))
    Image.new("RGB", (8, 8), (10, 20, 30)).save(path, pnginfo=info)
    return path


def test_a1111_parameters(tmp_path):
    got = read_info(png(tmp_path / "a.png", parameters=A1111))
    assert got["source"] == "a1111" and got["model"] is None
    assert got["params"] == {"prompt": "masterpiece, a red fox in the snow, detailed fur",
                             "negative_prompt": "blurry, lowres", "num_inference_steps": 28,
                             "guidance_scale": 6.5, "seed": 1234567, "width": 768, "height": 512}
    assert got["adapters"] == [{"name": "ink-style", "scale": 0.7}, {"name": "grain", "scale": 1.0}]
    assert got["extra"]["Sampler"] == "DPM++ 2M Karras"
    assert got["extra"]["Model"] == "v1-5-pruned-emaonly"
    assert got["extra"]["Lora hashes"] == "ink-style: 1a2b3c4d5e6f, grain: 0f9e8d7c6b5a"


def test_a1111_multiline_prompt_and_no_negative():
    got = parse_a1111("line one\nline two\nSteps: 4, Sampler: Euler, CFG scale: 1, Seed: 7, Size: 64x64")
    assert got["params"]["prompt"] == "line one\nline two"
    assert "negative_prompt" not in got["params"] and got["params"]["seed"] == 7


def test_a1111_in_a_jpeg_user_comment(tmp_path):
    exif = Image.Exif()
    exif.get_ifd(0x8769)[0x9286] = b"UNICODE\0" + A1111.encode("utf-16-be")
    path = tmp_path / "a.jpg"
    Image.new("RGB", (8, 8)).save(path, format="JPEG", exif=exif.tobytes())
    got = read_info(path)
    assert got["source"] == "a1111" and got["params"]["seed"] == 1234567


def test_comfyui_api_prompt(tmp_path):
    got = read_info(png(tmp_path / "c.png", prompt=COMFY_API, workflow={"nodes": []}))
    assert got["source"] == "comfyui"
    assert got["params"] == {"seed": 156680208700286, "num_inference_steps": 20, "guidance_scale": 8.0,
                             "prompt": "beautiful scenery nature glass bottle landscape",
                             "negative_prompt": "text, watermark", "width": 512, "height": 640}
    assert got["adapters"] == [{"name": "ink-style", "scale": 0.8}]
    assert got["extra"]["sampler_name"] == "euler"
    assert got["extra"]["checkpoint"] == "v1-5-pruned-emaonly.safetensors"


def test_comfyui_workflow_only(tmp_path):
    got = read_info(png(tmp_path / "w.png", workflow=COMFY_WORKFLOW))
    assert got["source"] == "comfyui"
    assert got["params"] == {"seed": 42, "num_inference_steps": 12, "guidance_scale": 5.5,
                             "prompt": "a castle on a hill at sunrise", "negative_prompt": "ugly, deformed",
                             "width": 1024, "height": 768}


def test_our_own_metadata(tmp_path):
    from backend.outputs import write_png

    meta = {"model": "demo:qwen-image", "seed": 9, "params": {"prompt": "ours", "num_inference_steps": 2},
            "adapters": [{"name": "ink", "scale": 0.5, "path": "/x"}], "preset": None}
    path = tmp_path / "o.png"
    write_png(path, Image.new("RGB", (8, 8)), meta)
    got = read_info(path)
    assert got["source"] == "lora_studio" and got["model"] == "demo:qwen-image"
    assert got["params"] == {"prompt": "ours", "num_inference_steps": 2, "seed": 9}
    assert got["adapters"] == [{"name": "ink", "scale": 0.5}]


def test_nothing_readable(tmp_path):
    assert read_info(png(tmp_path / "n.png")) is None
    assert read_info(png(tmp_path / "d.png", parameters="just a description")) is None
    assert read_info(png(tmp_path / "j.png", prompt="{not json")) is None
    assert read_info(png(tmp_path / "g.png", prompt={"1": {"class_type": "SaveImage", "inputs": {}}})) is None


# -- hostile images (issue 25: one image froze the server) -------------------------------------------------
# A1111's own pattern for its settings line (modules/infotext_utils.py): the reference settings_line keeps to
A1111_PATTERN = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def test_the_settings_line_reads_what_a1111s_own_pattern_reads():
    """settings_line is a one-pass scanner; on short lines (where the pattern is fast) it must find the same
    pairs as A1111's pattern, quoted values with commas and escapes included."""
    rng = random.Random(25)
    lines = [A1111.splitlines()[-1], 'Steps: 20, x: y, "a": b, TI hashes: "emb: abc", Template: "a \\"q\\", b"']
    lines += ["".join(rng.choice('ab :,"\\ -/_\t') for _ in range(rng.randint(0, 40))) for _ in range(5000)]
    for line in lines:
        want = [(k.strip(), v.strip()) for k, v in A1111_PATTERN.findall(line)]
        assert [(k.strip(), v.strip()) for k, v in settings_line(line)] == want, line


@pytest.mark.parametrize("tail", ["a" * 60_000, " " * 60_000 + ",", "ab: \"\\\", " * 6_000],
                         ids=["no-colon", "blanks", "escaped-quotes"])
def test_a_long_line_is_read_in_linear_time(tail):
    """A 60,000-character last line held the server 26 s under the old pattern (quadratic, holding the GIL);
    1 MiB (the largest text read) would have held it for hours. Now both take milliseconds."""
    for size in (60_000, MAX_TEXT - 100):
        text = "a fox , <lora:x:1>" + tail[:1] * 3 + "\nSteps: 3, Sampler: Euler a, Seed: 9, " + \
            (tail * (size // len(tail) + 1))[:size]
        start = time.perf_counter()
        parsed = parse_a1111(text)
        took = time.perf_counter() - start
        assert took < 1.0, f"{size} characters took {took:.2f} s"
        assert parsed["params"]["seed"] == 9 and parsed["params"]["prompt"].startswith("a fox")


@functools.lru_cache(maxsize=1)
def _black_pixels(side: int) -> bytes:
    packer = zlib.compressobj(9)
    row = b"\0" * (1 + 3 * side)  # filter byte + pixels
    return b"".join(packer.compress(row) for _ in range(side)) + packer.flush()


def huge_png(path, side: int = 12_000, **chunks) -> None:
    """A side x side RGB PNG written chunk by chunk (all black: it compresses to a few hundred KB, but
    decoding it takes side*side*3 bytes), with tEXt chunks before the pixels as A1111 writes them."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    body = _black_pixels(side)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)))
        for key, value in chunks.items():
            f.write(chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1")))
        f.write(chunk(b"IDAT", body) + chunk(b"IEND", b""))


def test_png_info_reads_the_text_without_decoding_the_pixels(tmp_path):
    """A 12000x12000 PNG of a few hundred KB cost 4.9 s and 535 MB per drop: the EXIF lookup decoded it.
    Read in a process of its own, whose peak memory shows whether the 432 MB of pixels were decoded."""
    plain, tagged = tmp_path / "huge.png", tmp_path / "huge-a1111.png"
    huge_png(plain)
    huge_png(tagged, parameters=A1111)
    assert plain.stat().st_size < 2 << 20
    # the peak of this process's own memory (VmHWM: ru_maxrss would carry the forking pytest worker's peak)
    script = ("import json, re, sys, time; from backend.pnginfo import read_info; t = time.perf_counter(); "
              "out = [(read_info(p) or {}).get('source') for p in sys.argv[1:]]; took = time.perf_counter() - t; "
              "peak = int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)); "
              "print(json.dumps([out, took, peak]))")
    r = subprocess.run([sys.executable, "-c", script, str(plain), str(tagged)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    sources, took, peak_kib = json.loads(r.stdout)
    assert sources == [None, "a1111"]
    assert peak_kib < 150 * 1024, f"peak {peak_kib // 1024} MiB: the pixels were decoded"
    assert took < 1.0, f"{took:.2f} s for two reads"


def test_a_results_infotext_reads_back_as_the_same_settings():
    """#26: the result's copyable infotext is A1111's, so its PNG Info, Civitai and our Gallery read it back."""
    from backend.pnginfo import infotext

    meta = {"model": "demo:qwen-image", "preset": "qwen-image-2512-lightning-4step", "adapters": [
        {"name": "ink", "scale": 0.5}, {"name": "two", "scale": {"transformer": 1.0, "transformer_2": 0.5}}],
        "params": {"prompt": "a cat, sitting", "negative_prompt": "blurry,\n dark", "seed": 5,
                   "num_inference_steps": 4, "true_cfg_scale": 1.0, "width": 64, "height": 48}}
    text = infotext(meta)
    assert text.splitlines()[0] == "a cat, sitting <lora:ink:0.5>"
    got = parse_a1111(text)
    assert got["params"] == {"prompt": "a cat, sitting", "negative_prompt": "blurry, dark", "seed": 5,
                             "num_inference_steps": 4, "guidance_scale": 1.0, "width": 64, "height": 48}
    assert got["adapters"] == [{"name": "ink", "scale": 0.5}]
    assert got["extra"] == {"Model": "demo:qwen-image", "Distill preset": "qwen-image-2512-lightning-4step",
                            "LoRA weights not shown as tags": "two"}


def test_text_encoder_weights_apart_are_written_and_read_as_a1111s_te_unet_tag():
    """#28 item 3: an adapter run with one weight on its text encoders and another on its denoisers is written
    ``<lora:NAME:TE:UNET>`` (A1111's order) and read back as the same weights; a tag A1111 accepts but we do
    not run (its dynamic rank) still reads at weight 1 here, so the rest of the settings load."""
    from backend.pnginfo import infotext

    meta = {"adapters": [{"name": "style", "scale": {"transformer": 1.0, "text_encoder": 0.25,
                                                     "text_encoder_2": 0.25}}],
            "params": {"prompt": "a cat", "seed": 5, "num_inference_steps": 4, "width": 64, "height": 64}}
    text = infotext(meta)
    assert text.splitlines()[0] == "a cat <lora:style:0.25:1>", text
    assert parse_a1111(text)["adapters"] == [{"name": "style", "scale": {"text_encoder": 0.25, "denoisers": 1.0}}]
    assert parse_a1111("a dog <lora:x:0.5:1:8>\nSteps: 4, Sampler: Euler, Seed: 1")["adapters"] == [{"name": "x", "scale": 1.0}]


def test_img2img_strength_is_a1111s_denoising_strength_but_not_hires_fixs():
    from backend.pnginfo import infotext

    meta = {"model": "demo:qwen-image", "adapters": [],
            "params": {"prompt": "a cat", "seed": 5, "num_inference_steps": 8, "strength": 0.35, "width": 64,
                       "height": 64}}
    text = infotext(meta)
    assert "Denoising strength: 0.35" in text and parse_a1111(text)["params"]["strength"] == 0.35
    hires = "a cat\nSteps: 20, Seed: 1, Size: 512x512, Denoising strength: 0.7, Hires upscale: 2"
    got = parse_a1111(hires)
    assert "strength" not in got["params"] and got["extra"]["Denoising strength"] == "0.7"


def test_the_sampler_is_a1111s_where_it_is_one_these_pipelines_run():
    from backend.pnginfo import infotext

    meta = {"model": "demo:qwen-image", "adapters": [],
            "params": {"prompt": "a cat", "seed": 5, "num_inference_steps": 8, "sample_solver": "unipc"}}
    text = infotext(meta)
    assert "Steps: 8, Sampler: UniPC," in text and parse_a1111(text)["params"]["sample_solver"] == "unipc"
    other = parse_a1111("a cat\nSteps: 20, Sampler: DPM++ 2M Karras, Seed: 1, Size: 512x512")
    assert "sample_solver" not in other["params"] and other["extra"]["Sampler"] == "DPM++ 2M Karras"
    assert parse_a1111("a cat\nSteps: 20, Sampler: Euler, Seed: 1")["params"]["sample_solver"] == "euler"


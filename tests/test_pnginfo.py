"""backend/pnginfo.py on real-format PNGs built with PIL: A1111's ``parameters`` infotext, ComfyUI's
API-format ``prompt`` and UI-format ``workflow`` graphs, and our own metadata."""
from __future__ import annotations

import json

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from backend.pnginfo import parse_a1111, read_info

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

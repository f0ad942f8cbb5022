"""`python app.py generate`, as a user runs it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import imageio.v3 as iio
import pytest

from backend.outputs import read_png_metadata

ROOT = Path(__file__).resolve().parents[1]


def run(*args, data_dir):
    return subprocess.run([sys.executable, "app.py", *args, "--data-dir", str(data_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_wan22_writes_a_playable_mp4(data_dir, tmp_path):
    out = tmp_path / "cat.mp4"
    proc = run("generate", "--model", "demo:wan2.2-t2v", "--prompt", "A cat playing with yarn",
               "--num-frames", "9", "--output", str(out), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert iio.imread(out, plugin="FFMPEG").shape == (9, 64, 64, 3)


@pytest.mark.parametrize("model", ["demo:qwen-image", "demo:sd3.5"])
def test_images_carry_round_tripping_metadata(model, data_dir, tmp_path):
    out = tmp_path / "img.png"
    proc = run("generate", "--model", model, "--prompt", "A piece of cheesecake", "--seed", "11",
               "--num-inference-steps", "3", "--output", str(out), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    meta = read_png_metadata(out)
    assert meta["model"] == model and meta["seed"] == 11
    assert meta["params"]["prompt"] == "A piece of cheesecake" and meta["params"]["num_inference_steps"] == 3


def test_i2v_flags_as_in_vllm_omni(data_dir, tmp_path):
    from PIL import Image

    image = tmp_path / "in.png"
    Image.new("RGB", (64, 64), (90, 160, 220)).save(image)
    out = tmp_path / "i2v.mp4"
    proc = run("generate", "--model", "demo:wan2.2-i2v", "--prompt", "a boat", "--image", str(image),
               "--num-frames", "9", "--num-inference-steps", "4", "--flow-shift", "12", "--sample-solver", "euler",
               "--guidance-scale", "1.0", "--guidance-scale-high", "1.0", "--boundary-ratio", "0.875",
               "--output", str(out), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    assert iio.imread(out, plugin="FFMPEG").shape[0] == 9


def test_img2img_from_the_command_line(data_dir, tmp_path):
    import numpy as np
    from PIL import Image

    image = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (220, 30, 30)).save(image)
    outs = {}
    for name, extra in (("text", ()), ("near", ("--image", str(image), "--strength", "0.25"))):
        outs[name] = tmp_path / f"{name}.png"
        proc = run("generate", "--model", "demo:qwen-image", "--prompt", "a blue digit 7 on a white background",
                   "--seed", "3", "--num-inference-steps", "8", "--true-cfg-scale", "1", *extra,
                   "--output", str(outs[name]), data_dir=data_dir)
        assert proc.returncode == 0, proc.stderr
    red = np.asarray(Image.open(image).convert("RGB"), dtype=float)
    dist = {k: float(np.abs(np.asarray(Image.open(p).convert("RGB"), dtype=float) - red).mean())
            for k, p in outs.items()}
    assert dist["near"] < 0.6 * dist["text"], dist
    assert read_png_metadata(outs["near"])["params"]["strength"] == 0.25


@pytest.mark.parametrize("args, fragment", [
    (["--model", "demo:wan2.2-t2v", "--num-frames", "10"], "'num_frames' must be 4k+1"),
    (["--model", "demo:nope"], "unknown demo model 'demo:nope'"),
    (["--model", "demo:sd3.5", "--height", "70"], "'height' must be a multiple of 16"),
    (["--model", "demo:wan2.2-i2v", "--image", "/nonexistent.png"], "'image' file '/nonexistent.png' does not exist"),
    (["--model", "demo:sd3.5", "--sample-solver", "ddim"], "invalid choice: 'ddim'"),
    (["--model", "demo:sd3.5", "--strength", "0.5"], "'strength' is how far img2img moves from its input image"),
])
def test_bad_input_exits_2_with_one_line(args, fragment, data_dir):
    proc = run("generate", "--prompt", "x", *args, data_dir=data_dir)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert fragment in lines[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("suffix", [".jpg", ".webp"])
def test_jpeg_and_webp_outputs_carry_metadata(suffix, data_dir, tmp_path):
    from PIL import Image

    out = tmp_path / f"img{suffix}"
    proc = run("generate", "--model", "demo:qwen-image", "--prompt", "A piece of cheesecake", "--seed", "7",
               "--num-inference-steps", "2", "--output", str(out), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out) and "Traceback" not in proc.stderr
    with Image.open(out) as img:
        assert img.format == ("JPEG" if suffix == ".jpg" else "WEBP")
    meta = read_png_metadata(out)  # the EXIF ImageDescription / UserComment JSON
    assert meta["model"] == "demo:qwen-image" and meta["seed"] == 7
    assert meta["params"]["prompt"] == "A piece of cheesecake"


def test_unsupported_extension_is_refused_before_rendering(data_dir, tmp_path):
    out = tmp_path / "img.gif"
    proc = run("generate", "--model", "demo:qwen-image", "--prompt", "x", "--output", str(out), data_dir=data_dir)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert "--output" in lines[-1] and "img.gif" in lines[-1] and ".jpg" in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr and "denoising" not in proc.stderr  # refused before any step
    assert not out.exists()


def test_seed_minus_one_is_random_and_recorded(data_dir, tmp_path):
    out = tmp_path / "img.png"
    proc = run("generate", "--model", "demo:qwen-image", "--prompt", "x", "--seed", "-1",
               "--num-inference-steps", "2", "--output", str(out), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    seed = read_png_metadata(out)["seed"]
    assert isinstance(seed, int) and seed >= 0


def test_i2v_size_follows_the_input_image(data_dir, tmp_path):
    from PIL import Image

    image = tmp_path / "wide.png"
    Image.new("RGB", (200, 100), (90, 160, 220)).save(image)
    out = tmp_path / "i2v.mp4"
    proc = run("generate", "--model", "demo:wan2.2-i2v", "--prompt", "a boat", "--image", str(image),
               "--num-frames", "5", "--num-inference-steps", "2", "--output", str(out), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    frames, h, w, _ = iio.imread(out, plugin="FFMPEG").shape
    assert w > h, f"a 2:1 input should give a landscape video, got {w}x{h}"
    assert 1.5 <= w / h <= 2.5


def test_generate_help_documents_every_flag():
    import os

    proc = subprocess.run([sys.executable, "app.py", "generate", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    import re

    blocks = re.split(r"\n  (?=--)", proc.stdout.split("options:", 1)[1])
    bare = [b.split()[0] for b in blocks[1:] if len(b.split()) < 3]  # a flag, its metavar and nothing else
    assert not bare, f"flags without help: {bare}"
    assert "(default: 42)" in proc.stdout and "(default: demo:qwen-image)" in proc.stdout


def test_lora_tag_in_the_prompt_equals_lora_path(data_dir, demo_path, tmp_path):
    import numpy as np
    from PIL import Image

    from ui_fixtures import make_lora

    lora = make_lora(demo_path("demo:qwen-image"), data_dir / "adapters" / "cli-tag.safetensors", seed=3)
    common = ["--model", "demo:qwen-image", "--seed", "3", "--num-inference-steps", "2"]
    tagged, flagged = tmp_path / "tagged.png", tmp_path / "flagged.png"
    proc = run("generate", *common, "--prompt", "a cat <lora:cli-tag:0.7>", "--output", str(tagged),
               data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    proc = run("generate", *common, "--prompt", "a cat", "--lora-path", str(lora), "--lora-scale", "0.7",
               "--output", str(flagged), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    assert read_png_metadata(tagged)["params"]["prompt"] == "a cat"
    assert np.array_equal(np.asarray(Image.open(tagged)), np.asarray(Image.open(flagged)))

    proc = run("generate", "--prompt", "a cat <lora:no-such-adapter>", data_dir=data_dir)
    assert proc.returncode == 2 and "no adapter named 'no-such-adapter'" in proc.stderr.strip().splitlines()[-1]

"""Outputs: PNG metadata round trip, playable MP4, atomic writes."""
from __future__ import annotations

import json

import imageio.v3 as iio
import pytest
from PIL import Image

from backend import outputs
from backend.manager import GenerationResult


def _image_result(seed=5):
    return GenerationResult(images=[Image.new("RGB", (64, 64), (10, 200, 30))],
                            metadata={"model": "demo:sd3.5", "seed": seed, "params": {"prompt": "x"}})


def test_png_carries_its_metadata_and_a_sidecar(tmp_path):
    path = outputs.save_result(_image_result(), path=tmp_path / "a.png")
    assert outputs.read_png_metadata(path) == {"model": "demo:sd3.5", "seed": 5, "params": {"prompt": "x"}}
    assert json.loads((tmp_path / "a.png.json").read_text())["seed"] == 5
    assert outputs.read_png_metadata(_plain_png(tmp_path)) is None


def _plain_png(tmp_path):
    p = tmp_path / "plain.png"
    Image.new("RGB", (8, 8)).save(p)
    return p


def test_mp4_is_h264_with_every_frame(tmp_path):
    frames = [Image.new("RGB", (64, 48), (i * 25, 0, 0)) for i in range(9)]
    result = GenerationResult(frames=frames, fps=16, metadata={"seed": 1})
    path = outputs.save_result(result, path=tmp_path / "v.mp4")
    video = iio.imread(path, plugin="FFMPEG")
    assert video.shape == (9, 48, 64, 3)
    meta = iio.immeta(path, plugin="FFMPEG")
    assert meta["codec"] == "h264" and meta["fps"] == 16


def test_a_failed_write_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "keep.png"
    outputs.save_result(_image_result(seed=1), path=target)
    before = target.read_bytes()

    def broken(path, image, metadata):
        with open(path, "wb") as fh:
            fh.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(outputs, "write_png", broken)
    with pytest.raises(OSError, match="disk full"):
        outputs.save_result(_image_result(seed=2), path=target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.png", "keep.png.json"]


def test_default_paths_live_under_the_data_dir(tmp_path):
    path = outputs.save_result(_image_result(), data_dir=tmp_path)
    assert path.parent == tmp_path / "outputs" and path.suffix == ".png"


def test_wrong_suffix_is_refused(tmp_path):
    from backend.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match=r"must be one of \.png, \.jpg, \.jpeg, \.webp for this image model"):
        outputs.save_result(_image_result(), path=tmp_path / "a.mp4")

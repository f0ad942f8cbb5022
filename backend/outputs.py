"""Writing results: PNG (parameters in a text chunk) or MP4 (H.264), each with a JSON
sidecar, written atomically so a crash never leaves a half-written output.
"""
from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np

from . import settings

PNG_KEY = "lora_studio"  # the PNG text chunk holding the metadata JSON


def _atomic_write(path: Path, write) -> None:
    """Write via a temp file in the same directory, fsync, then rename into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_path(metadata: dict, suffix: str, data_dir=None) -> Path:
    stamp = metadata.get("created", "").replace(":", "").replace("-", "") or "out"
    name = f"{stamp}-{metadata.get('seed', 0)}-{uuid.uuid4().hex[:8]}{suffix}"
    return settings.outputs_dir(data_dir) / name


def save_result(result, data_dir=None, path: str | os.PathLike | None = None) -> Path:
    """Save a GenerationResult; returns the media path (the sidecar sits beside it)."""
    is_video = result.frames is not None
    suffix = ".mp4" if is_video else ".png"
    target = Path(path) if path is not None else default_path(result.metadata, suffix, data_dir)
    if target.suffix.lower() != suffix:
        raise ValueError(f"output {target} must end in {suffix} for this model")
    if is_video:
        _atomic_write(target, lambda tmp: write_mp4(tmp, result.frames, result.fps or 16, result.audio))
    else:
        _atomic_write(target, lambda tmp: write_png(tmp, result.images[0], result.metadata))
    sidecar = target.with_suffix(target.suffix + ".json")
    _atomic_write(sidecar, lambda tmp: Path(tmp).write_text(json.dumps(result.metadata, indent=2, default=str)))
    return target


def write_png(path, image, metadata: dict) -> None:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text(PNG_KEY, json.dumps(metadata, default=str))
    image.save(path, format="PNG", pnginfo=info)


def read_png_metadata(path) -> dict | None:
    """The metadata a PNG made here carries, or None for any other PNG."""
    from PIL import Image

    with Image.open(path) as img:
        text = img.info.get(PNG_KEY)
    return json.loads(text) if text else None


# Muxes an audio track into an MP4; set by the MiniMax-H3 module (video + audio).
audio_muxer = None


def write_mp4(path, frames, fps: int, audio=None) -> None:
    import imageio.v3 as iio

    arrays = np.stack([np.asarray(f.convert("RGB")) for f in frames])
    # H.264 in yuv420p needs even sides; browsers play nothing else reliably.
    h, w = arrays.shape[1:3]
    arrays = np.pad(arrays, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    iio.imwrite(path, arrays, extension=".mp4", plugin="FFMPEG", fps=fps,
                codec="libx264", pixelformat="yuv420p", macro_block_size=1, ffmpeg_log_level="error")
    if audio is not None and audio_muxer is not None:
        audio_muxer(path, audio)

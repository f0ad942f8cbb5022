"""Writing results: PNG (parameters in a text chunk), JPEG or WebP (parameters in EXIF
ImageDescription and UserComment) or MP4 (H.264, with an AAC track when the result has audio),
each with a JSON sidecar, written atomically so a crash never leaves a half-written output.

Which writer a result gets is its family's (``backend.families``: output kind -> writer); the
audio track is handed to the MP4 writer explicitly.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np

from . import families, settings

PNG_KEY = "lora_studio"  # the PNG text chunk holding the metadata JSON
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4",)
SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES
EXIF_DESCRIPTION, EXIF_IFD, EXIF_USER_COMMENT = 0x010E, 0x8769, 0x9286


def check_suffix(path, *, video: bool | None = None) -> None:
    """Refuse an output path whose extension cannot hold the result (before any rendering)."""
    from .errors import InvalidParameter

    suffix = Path(path).suffix.lower()
    allowed = SUFFIXES if video is None else (VIDEO_SUFFIXES if video else IMAGE_SUFFIXES)
    if suffix not in allowed:
        what = "" if video is None else (" for this video model" if video else " for this image model")
        raise InvalidParameter(f"--output {path}: the extension must be one of {', '.join(allowed)}{what}",
                               param="output")


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
    """Where a result goes when no path is given: ``<data-dir>/outputs/`` under the name the settings'
    file name pattern makes (backend/preferences.py), an image in the settings' output format."""
    from . import preferences

    prefs = preferences.load(data_dir)
    if suffix in IMAGE_SUFFIXES:
        suffix = prefs.suffix
    return settings.outputs_dir(data_dir) / preferences.filename(prefs, metadata, suffix)


def output_kind(result) -> str:
    """"image" | "video" | "video+audio": the family's of the pipeline that made ``result``
    (``metadata["pipeline"]``), else what the result holds."""
    pipeline = (result.metadata or {}).get("pipeline")
    if pipeline in families.FAMILIES:
        return families.candidates(pipeline)[0].output
    return "video" if result.frames is not None else "image"


def _write_image(target: Path, result) -> None:
    if target.suffix.lower() == ".png":
        _atomic_write(target, lambda tmp: write_png(tmp, result.images[0], result.metadata))
    else:
        _atomic_write(target, lambda tmp: write_exif_image(tmp, result.images[0], result.metadata, target.suffix))


def _write_video(target: Path, result, *, audio: bool) -> None:
    track = result.audio if audio else None
    _atomic_write(target, lambda tmp: write_mp4(tmp, result.frames, result.fps or 16, audio=track))


# output kind -> how a result of that kind is written (families.OUTPUTS names the format)
WRITERS = {
    "image": _write_image,
    "video": lambda target, result: _write_video(target, result, audio=False),
    "video+audio": lambda target, result: _write_video(target, result, audio=True),
}


def save_result(result, data_dir=None, path: str | os.PathLike | None = None) -> Path:
    """Save a GenerationResult; returns the media path (the sidecar sits beside it)."""
    kind = output_kind(result)
    is_video = kind != "image"
    target = Path(path) if path is not None else default_path(result.metadata, ".mp4" if is_video else ".png",
                                                              data_dir)
    check_suffix(target, video=is_video)
    WRITERS[kind](target, result)
    sidecar = target.with_suffix(target.suffix + ".json")
    _atomic_write(sidecar, lambda tmp: Path(tmp).write_text(json.dumps(result.metadata, indent=2, default=str)))
    return target


def write_png(path, image, metadata: dict) -> None:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text(PNG_KEY, json.dumps(metadata, default=str))
    image.save(path, format="PNG", pnginfo=info)


def write_exif_image(path, image, metadata: dict, suffix: str) -> None:
    """JPEG (quality 95) or lossless WebP with the metadata JSON in EXIF ImageDescription and UserComment."""
    from PIL import Image

    text = json.dumps(metadata, default=str)  # ASCII (json escapes the rest), as EXIF wants
    exif = Image.Exif()
    exif[EXIF_DESCRIPTION] = text
    exif.get_ifd(EXIF_IFD)[EXIF_USER_COMMENT] = b"ASCII\0\0\0" + text.encode("ascii")
    fmt = "WEBP" if suffix.lower() == ".webp" else "JPEG"
    opts = {"lossless": True} if fmt == "WEBP" else {"quality": 95}
    image.convert("RGB").save(path, format=fmt, exif=exif.tobytes(), **opts)


def exif_of(img):
    """An opened image's EXIF from the bytes read with its header (JPEG APP1, WebP's EXIF chunk, a PNG
    eXIf chunk before the pixels), without decoding a pixel. ``Image.getexif()`` on a PNG with no eXIf
    chunk up front decodes the whole picture to look for one after the pixels: a 560 KB 12000x12000 PNG
    cost 4.9 s and 535 MB of memory."""
    from PIL import Image

    exif = Image.Exif()
    raw = img.info.get("exif")
    if isinstance(raw, bytes) and raw:
        exif.load(raw)
    return exif


def read_png_metadata(path) -> dict | None:
    """The metadata an image made here carries (PNG text chunk, or EXIF in a JPEG/WebP), or None."""
    from PIL import Image

    with Image.open(path) as img:
        text = img.info.get(PNG_KEY)
        if not text:
            exif = exif_of(img)
            text = exif.get(EXIF_DESCRIPTION)
            if not text:
                comment = exif.get_ifd(EXIF_IFD).get(EXIF_USER_COMMENT)
                if isinstance(comment, bytes):
                    text = comment[8:].decode("ascii", "replace")
    if not text:
        return None
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return None  # someone else's description
    return data if isinstance(data, dict) else None


def write_mp4(path, frames, fps: int, audio=None) -> None:
    """H.264 MP4 of ``frames``; with ``audio`` (``(samples [n, channels], sample_rate)``), an AAC
    track muxed in (``mux_audio``)."""
    import imageio.v3 as iio

    arrays = np.stack([np.asarray(f.convert("RGB")) for f in frames])
    # H.264 in yuv420p needs even sides; browsers play nothing else reliably.
    h, w = arrays.shape[1:3]
    arrays = np.pad(arrays, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    iio.imwrite(path, arrays, extension=".mp4", plugin="FFMPEG", fps=fps,
                codec="libx264", pixelformat="yuv420p", macro_block_size=1, ffmpeg_log_level="error")
    if audio is not None:
        mux_audio(path, audio)


# -- audio (MiniMax-H3 results): `audio` is (samples [n, channels] float32 in [-1, 1], sample_rate) -------
def write_wav(path, audio) -> Path:
    """16-bit PCM WAV (stdlib `wave`), channels as given."""
    samples, rate = audio
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 1:
        samples = samples[:, None]
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    path = Path(path)
    with wave.open(str(path), "wb") as fh:
        fh.setnchannels(pcm.shape[1])
        fh.setsampwidth(2)
        fh.setframerate(int(rate))
        fh.writeframes(pcm.tobytes())
    return path


def read_wav(path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as fh:
        rate, channels, n = fh.getframerate(), fh.getnchannels(), fh.getnframes()
        pcm = np.frombuffer(fh.readframes(n), dtype="<i2").reshape(-1, channels)
    return pcm.astype(np.float32) / 32767.0, rate


def mux_audio(mp4_path, audio) -> None:
    """Add `audio` as an AAC track to the (video-only) MP4 at `mp4_path`, in place.

    ffmpeg is imageio-ffmpeg's bundled binary, the one that wrote the video. The video stream is
    copied, not re-encoded.
    """
    import imageio_ffmpeg

    mp4_path = Path(mp4_path)
    with tempfile.TemporaryDirectory(dir=mp4_path.parent) as tmp:
        wav = write_wav(Path(tmp) / "audio.wav", audio)
        out = Path(tmp) / "muxed.mp4"
        cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-y", "-i", str(mp4_path), "-i", str(wav),
               "-map", "0:v:0", "-map", "1:a:0", "-c:v", "copy", "-c:a", "aac", "-b:a", "128k", "-shortest",
               "-f", "mp4", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ffmpeg could not add the audio track to {mp4_path.name}: {proc.stderr.strip()}")
        os.replace(out, mp4_path)


def probe_streams(mp4_path) -> list[str]:
    """Codec types of the streams in a media file ("video", "audio"), via ffmpeg's own report."""
    import imageio_ffmpeg

    proc = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(mp4_path)],
                          capture_output=True, text=True)
    kinds = []
    for line in proc.stderr.splitlines():
        line = line.strip()
        if line.startswith("Stream #"):
            kinds.append("audio" if " Audio: " in line else "video" if " Video: " in line else "other")
    return kinds

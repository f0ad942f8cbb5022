"""Audio for MiniMax-H3 results: a WAV file, and muxing the track into the MP4 that outputs.py wrote.

`audio` is `(samples [n, channels] float32 in [-1, 1], sample_rate)`, as in GenerationResult.audio.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np


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

    Set as `backend.outputs.audio_muxer`; ffmpeg is imageio-ffmpeg's bundled binary, the one that wrote the
    video. The video stream is copied, not re-encoded.
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

"""Audio for MiniMax-H3 results: WAV files and the MP4's audio track. The writers live in
``backend.outputs`` (the MP4 writer takes the audio explicitly); these names stay for callers here.

`audio` is `(samples [n, channels] float32 in [-1, 1], sample_rate)`, as in GenerationResult.audio.
"""

from __future__ import annotations

from ..outputs import mux_audio, probe_streams, read_wav, write_wav

__all__ = ["mux_audio", "probe_streams", "read_wav", "write_wav"]

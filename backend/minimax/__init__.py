"""MiniMax-H3: sampling contracts (checkpoint-pinned, Turbo, native), adapters, the per-workflow
pipeline run, offload policy and audio output. See docs/minimax.md."""

from .. import outputs as _outputs
from .media import mux_audio, write_wav

# MP4s of MiniMax-H3 results carry the audio track (outputs.write_mp4 calls this hook).
_outputs.audio_muxer = mux_audio

__all__ = ["mux_audio", "write_wav"]

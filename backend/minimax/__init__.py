"""MiniMax-H3: sampling contracts (checkpoint-pinned, Turbo, native), adapters, the per-workflow
pipeline run, offload policy and audio output. See docs/minimax.md."""

from .media import mux_audio, write_wav

__all__ = ["mux_audio", "write_wav"]

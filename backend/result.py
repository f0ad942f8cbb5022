"""What a generation returns, and the libraries' quiet mode: leaf definitions the manager, the
MiniMax runtime, the engines and the demo builders share (no imports of theirs, so no cycles)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationResult:
    images: list | None = None  # list[PIL.Image]
    frames: list | None = None  # list[PIL.Image], one per video frame
    fps: int | None = None
    audio: Any = None  # (np.ndarray [samples, channels], sample_rate)
    metadata: dict = field(default_factory=dict)


def quiet_libraries() -> None:
    """Our own progress reporting replaces the libraries' per-component bars and notices."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

"""Loading MiniMax-H3's Qwen3-VL processor.

`Qwen3VLProcessor` insists on a video processor, and transformers' video processors need torchvision. This
environment's package index carries only CUDA builds of torchvision, which cannot load against the CPU torch
wheel, so without torchvision the processor is rebuilt from the same saved files with its video processor left
out. Text and image inputs (t2va, fl2va, ref2va image references) are unaffected; a video reference is refused
by name (see `pipeline.py`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import Qwen3VLProcessor


def has_video_processor() -> bool:
    return importlib.util.find_spec("torchvision") is not None


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """A `Qwen3VLProcessor` whose `video_processor` may be None (torchvision missing)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def load_processor(path: str | Path) -> Qwen3VLProcessor:
    path = Path(path)
    if has_video_processor():
        return Qwen3VLProcessor.from_pretrained(path)
    from transformers import AutoImageProcessor, AutoTokenizer

    return ImageOnlyQwen3VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path, use_fast=False),
        tokenizer=AutoTokenizer.from_pretrained(path),
        video_processor=None,
    )

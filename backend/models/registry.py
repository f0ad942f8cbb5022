"""The supported-pipeline registry: one entry per diffusers pipeline class.

Everything the rest of the backend needs to know about a pipeline family lives here:
which components are denoisers (the modules LoRAs bind to), what it outputs, its
default sampling settings, and which generation fields a request may set.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedModel

COMMON_FIELDS = frozenset({"prompt", "negative_prompt", "seed", "height", "width", "num_inference_steps"})
VIDEO_FIELDS = frozenset({"num_frames", "fps", "flow_shift", "sample_solver"})


@dataclass(frozen=True)
class PipelineSpec:
    class_name: str
    output: str  # "image" | "video" | "video+audio"
    denoisers: tuple[str, ...]
    defaults: dict = field(default_factory=dict)
    fields: frozenset = COMMON_FIELDS
    # fields a request must carry (e.g. the input image for image-to-video)
    required: frozenset = frozenset({"prompt"})
    # spatial size must be a multiple of this (VAE factor x patch size)
    size_multiple: int = 16
    # Wan: frames must be 4k+1 (the VAE compresses time by 4)
    frame_multiple: int | None = None
    mode: str = "text-to-image"

    @property
    def is_video(self) -> bool:
        return self.output.startswith("video")


_WAN_T2V_DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 40,
                     "guidance_scale": 5.0, "fps": 16}

SPECS: dict[str, PipelineSpec] = {s.class_name: s for s in [
    PipelineSpec(
        "QwenImagePipeline", "image", ("transformer",),
        defaults={"height": 1024, "width": 1024, "num_inference_steps": 50, "true_cfg_scale": 4.0,
                  "negative_prompt": " "},  # Qwen enables true CFG only with a negative prompt
        fields=COMMON_FIELDS | {"true_cfg_scale", "guidance_scale", "max_sequence_length"}),
    PipelineSpec(
        "StableDiffusion3Pipeline", "image", ("transformer",),
        defaults={"height": 1024, "width": 1024, "num_inference_steps": 28, "guidance_scale": 7.0},
        fields=COMMON_FIELDS | {"guidance_scale", "max_sequence_length"}),
    PipelineSpec(
        "WanPipeline", "video", ("transformer", "transformer_2"),
        defaults=_WAN_T2V_DEFAULTS,
        fields=COMMON_FIELDS | VIDEO_FIELDS | {"guidance_scale", "guidance_scale_2", "boundary_ratio"},
        frame_multiple=4, mode="text-to-video"),
    PipelineSpec(
        "WanImageToVideoPipeline", "video", ("transformer", "transformer_2"),
        defaults={**_WAN_T2V_DEFAULTS, "guidance_scale": 3.5, "guidance_scale_2": 3.5},
        fields=COMMON_FIELDS | VIDEO_FIELDS | {"image", "guidance_scale", "guidance_scale_2", "boundary_ratio"},
        required=frozenset({"prompt", "image"}), frame_multiple=4, mode="image-to-video"),
    # MiniMax-H3: modular, guidance-distilled (no negative prompt / guidance), 24 fps, frames snapped to
    # 17n+5 by the pipeline; num_inference_steps is left to the sampling contract (backend/minimax).
    PipelineSpec(
        "MiniMaxH3ModularPipeline", "video+audio", ("transformer", "transformer_ref"),
        defaults={"num_frames": 124, "task_type": "t2va", "num_inference_steps": 30},
        fields=frozenset({"prompt", "seed", "height", "width", "num_inference_steps", "num_frames",
                          "flow_shift", "audio_flow_shift", "task_type", "image", "last_image", "references"}),
        size_multiple=32, mode="text-to-video+audio"),
]}


def spec_for(class_name: str) -> PipelineSpec:
    try:
        return SPECS[class_name]
    except KeyError:
        raise UnsupportedModel(
            f"pipeline {class_name!r} is not supported; supported pipelines: {', '.join(sorted(SPECS))}",
            param="model") from None

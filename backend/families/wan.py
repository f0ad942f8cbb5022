"""Wan (Wan2.1): one transformer, MP4 output, text- or image-to-video.

The pipeline specs are shared with the Wan2.2 pair family (``wan22``): the same diffusers classes
serve both, and the checkpoint's components say which family a model is.
"""
from __future__ import annotations

from . import COMMON_FIELDS, VIDEO_FIELDS, Family, LoraRouting, PipelineSpec

T2V_DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 40,
                "guidance_scale": 5.0, "fps": 16}

# guidance_scale_2 / boundary_ratio are Wan2.2 fields: a one-transformer model refuses them by name
# (PipelineManager.validate), since both families share these pipeline classes.
PIPELINES = (
    PipelineSpec(
        "WanPipeline", "video", ("transformer", "transformer_2"),
        defaults=T2V_DEFAULTS,
        fields=COMMON_FIELDS | VIDEO_FIELDS | {"guidance_scale", "guidance_scale_2", "boundary_ratio"},
        frame_multiple=4, mode="text-to-video"),
    PipelineSpec(
        "WanImageToVideoPipeline", "video", ("transformer", "transformer_2"),
        defaults={**T2V_DEFAULTS, "guidance_scale": 3.5, "guidance_scale_2": 3.5},
        fields=COMMON_FIELDS | VIDEO_FIELDS | {"image", "guidance_scale", "guidance_scale_2", "boundary_ratio"},
        required=frozenset({"prompt", "image"}), frame_multiple=4, mode="image-to-video"),
)

FAMILY = Family(
    name="wan",
    title="Wan2.1 (one transformer)",
    pipelines=PIPELINES,
    output="video",
    denoisers=("transformer",),
    demo_models=("demo:wan2.1-t2v",),
    # distill: lightx2v Wan2.1 files; a Wan2.2 high/low-noise file is refused by name (distill/support.py)
    lora=LoraRouting(distill={"transformer": {}}, kohya_names={p.class_name: "wan" for p in PIPELINES}),
)

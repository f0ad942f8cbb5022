"""MiniMax-H3: a modular, guidance-distilled video+audio pipeline (MP4 with an AAC track).

Three task types, each denoised by one partition: t2va (text) and fl2va (first/last frame) by
``transformer``, ref2va (reference images) by ``transformer_ref``. Adapters go through its own fit
report (sampling contracts, grouped-QKV layouts: backend/minimax/adapters.py).
"""
from __future__ import annotations

from . import Family, LoraRouting, PipelineSpec

# task_type -> the partition (denoiser) that runs it; the first is the default
TASKS = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}

FAMILY = Family(
    name="minimax-h3",
    title="MiniMax-H3 (video + audio)",
    pipelines=(
        # guidance-distilled (no negative prompt / guidance), 24 fps, frames snapped to 17n+5 by the
        # pipeline; num_inference_steps is left to the sampling contract (backend/minimax).
        PipelineSpec(
            "MiniMaxH3ModularPipeline", "video+audio", ("transformer", "transformer_ref"),
            defaults={"num_frames": 124, "task_type": next(iter(TASKS)), "num_inference_steps": 30},
            fields=frozenset({"prompt", "seed", "height", "width", "num_inference_steps", "num_frames",
                              "flow_shift", "audio_flow_shift", "task_type", "image", "last_image",
                              "references"}),
            size_multiple=32, mode="text-to-video+audio"),
    ),
    output="video+audio",
    denoisers=("transformer", "transformer_ref"),
    demo_models=("demo:minimax-h3",),
    tasks=TASKS,
    # distill=None: the generic fuse path does not take MiniMax; its runtime fuses Turbo files itself
    lora=LoraRouting(hooks="backend.minimax.adapters:MiniMaxLoRAFamily", distill=None, text_encoders=()),
)

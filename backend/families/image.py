"""Image family: Qwen-Image and Stable Diffusion 3.5 (one transformer, PNG output; img2img from an input image)."""
from __future__ import annotations

from . import COMMON_FIELDS, Family, LoraRouting, PipelineSpec

IMG2IMG_FIELDS = frozenset({"image", "strength"})  # img2img: the picture to start from, how far to move from it
# the sampler: euler (the pipelines' own FlowMatchEuler) or unipc (UniPC on flow sigmas, the pipeline's dynamic
# shift kept); diffusers' DPM++ schedulers refuse the custom sigmas these pipelines pass (measured)
SAMPLER_FIELDS = frozenset({"sample_solver"})

FAMILY = Family(
    name="image",
    title="Text-to-image (Qwen-Image, SD3.5)",
    pipelines=(
        PipelineSpec(
            "QwenImagePipeline", "image", ("transformer",),
            defaults={"height": 1024, "width": 1024, "num_inference_steps": 50, "true_cfg_scale": 4.0,
                      "negative_prompt": " "},  # Qwen enables true CFG only with a negative prompt
            fields=COMMON_FIELDS | {"true_cfg_scale", "guidance_scale", "max_sequence_length"} | IMG2IMG_FIELDS | SAMPLER_FIELDS,
            img2img="QwenImageImg2ImgPipeline"),
        PipelineSpec(
            "StableDiffusion3Pipeline", "image", ("transformer",),
            defaults={"height": 1024, "width": 1024, "num_inference_steps": 28, "guidance_scale": 7.0},
            fields=COMMON_FIELDS | {"guidance_scale", "max_sequence_length"} | IMG2IMG_FIELDS | SAMPLER_FIELDS,
            img2img="StableDiffusion3Img2ImgPipeline"),
    ),
    output="image",
    denoisers=("transformer",),
    demo_models=("demo:qwen-image", "demo:sd3.5"),
    # distill: Qwen-Image-Lightning files; SD3.5 has no published distill LoRA in this app
    # kohya: SD3.5's sd-scripts names are MMDiT's own (joint_blocks, a fused qkv), which diffusers does not read
    lora=LoraRouting(distill={"transformer": {}}, distill_pipelines=frozenset({"QwenImagePipeline"}),
                     kohya_names={"QwenImagePipeline": "diffusers"}),
)

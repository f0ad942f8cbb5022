"""The generation fields the Generate tab can show, one table for all models.

A model shows only the widgets whose field its pipeline accepts (the backend's
``PipelineSpec.fields``), so Qwen gets ``true_cfg_scale``, Wan2.2 gets the second
guidance scale and the boundary ratio, and an image model never shows frames.
Labels carry the HTTP field name so the UI, the HTTP API and ``gradio_client``
all speak the same names.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldWidget:
    name: str
    label: str
    kind: str  # "text" | "int" | "float" | "choice" | "image"
    group: str  # "prompt" | "size" | "sampling" | "video" | "inputs"
    info: str = ""
    choices: tuple = ()
    step: float | None = None
    # the hint where a pipeline reads the field its own way: (pipeline class, hint) pairs, else ``info``
    infos: tuple[tuple[str, str], ...] = ()

    def info_for(self, pipeline: str | None) -> str:
        """The hint shown for this field on ``pipeline`` (a diffusers class name)."""
        return dict(self.infos).get(pipeline or "", self.info)


WIDGETS: tuple[FieldWidget, ...] = (
    FieldWidget("negative_prompt", "Negative prompt (negative_prompt)", "text", "prompt"),
    FieldWidget("task_type", "Task (task_type)", "choice", "prompt",
                "MiniMax-H3: t2va text to video+audio, fl2va first/last frame, ref2va reference image",
                choices=("t2va", "fl2va", "ref2va")),
    FieldWidget("image", "Input image (image)", "image", "inputs", "the first frame / conditioning image", infos=(
        ("QwenImagePipeline", "img2img: the picture to start from (empty: text-to-image)"),
        ("StableDiffusion3Pipeline", "img2img: the picture to start from (empty: text-to-image)"))),
    FieldWidget("strength", "Denoising strength (strength)", "float", "inputs",
                "img2img: how far from the input image (1: all the way; runs steps x strength steps; "
                "empty: 0.75)", step=0.05),
    FieldWidget("last_image", "Last frame (last_image)", "image", "inputs", "fl2va: the frame to end on"),
    FieldWidget("height", "Height (height)", "int", "size", "a multiple of 16", step=16),
    FieldWidget("width", "Width (width)", "int", "size", "a multiple of 16", step=16),
    FieldWidget("num_inference_steps", "Steps (num_inference_steps)", "int", "sampling", step=1),
    FieldWidget("true_cfg_scale", "True CFG scale (true_cfg_scale)", "float", "sampling",
                "Qwen-Image: classifier-free guidance (needs a negative prompt)", step=0.1),
    FieldWidget("guidance_scale", "Guidance scale (guidance_scale)", "float", "sampling",
                "classifier-free guidance", step=0.1, infos=(
                    ("QwenImagePipeline", "read only by guidance-distilled Qwen-Image checkpoints; this model's "
                                          "guidance is the True CFG scale above"),
                    ("WanPipeline", "classifier-free guidance (Wan2.2: on the high-noise steps)"),
                    ("WanImageToVideoPipeline", "classifier-free guidance (Wan2.2: on the high-noise steps)"))),
    FieldWidget("guidance_scale_2", "Second-stage guidance (guidance_scale_2)", "float", "sampling",
                "Wan2.2: used by transformer_2 on the low-noise steps", step=0.1),
    FieldWidget("boundary_ratio", "Boundary ratio (boundary_ratio)", "float", "sampling",
                "Wan2.2: steps with t >= ratio x 1000 run on the high-noise transformer", step=0.005),
    FieldWidget("flow_shift", "Flow shift (flow_shift)", "float", "sampling", step=0.5),
    FieldWidget("sample_solver", "Sampler (sample_solver)", "choice", "sampling", choices=("euler", "unipc"),
                info="euler: the pipeline's own flow-matching Euler; unipc: UniPC multistep on the same flow sigmas "
                     "(diffusers' DPM++ schedulers do not take these pipelines' sigma schedule)"),
    FieldWidget("num_frames", "Frames (num_frames)", "int", "video", "Wan: 4k+1 (5, 9, 17, 81...)", step=4),
    FieldWidget("fps", "FPS (fps)", "int", "video", step=1),
)



def clean_value(widget: FieldWidget, value):
    """A widget's value as the backend wants it: ``None`` (use the default) for blanks."""
    if value is None or (isinstance(value, str) and value.strip() == "" and widget.kind != "text"):
        return None
    if widget.kind == "int":
        return int(value)
    if widget.kind == "float":
        return float(value)
    return value


def form_values(fields, values) -> dict:
    """The Generate tab's field values (``values`` in WIDGETS order) that the model takes (``fields``), as a
    request's params: blanks left to the model's defaults, and an img2img strength only with an input image
    to start from (so clearing the image goes back to text-to-image rather than refusing the job)."""
    params = {}
    for w, v in zip(WIDGETS, values):
        if w.name in fields:
            value = clean_value(w, v)
            if value is not None:
                params[w.name] = value
    if "image" not in params:
        params.pop("strength", None)
    return params

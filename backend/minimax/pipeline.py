"""Loading MiniMax-H3 per workflow and running one request (t2va / fl2va / ref2va) to frames + audio.

The pipeline is diffusers' `MiniMaxH3ModularPipeline` with its own blocks. Two blocks are added, in the
modular way (replacing / inserting sub-blocks, not patching code):
- `set_timesteps` is replaced by `PlannedSetTimestepsStep`, which takes the request's resolved schedule
  (explicit sigmas, or the shifted grid with the request's `flow_shift` / `audio_flow_shift`); the stock step
  always uses the schedulers' configured shifts and cannot take a pinned schedule;
- a `progress` step after each denoising step reports progress and honours cancellation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import Cancelled, InvalidParameter
from .contracts import PARTITION, SamplingPlan

SHARED = ("text_encoder", "tokenizer", "vae", "audio_vae", "scheduler", "audio_scheduler")


def _blocks():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.modular_pipelines.modular_pipeline import ModularPipelineBlocks
    from diffusers.modular_pipelines.modular_pipeline_utils import InputParam

    class PlannedSetTimestepsStep(MiniMaxH3SetTimestepsStep):
        """The stock step, with the schedule taken from the request's `SamplingPlan`."""

        @property
        def inputs(self):
            return super().inputs + [InputParam("sampling_plan", required=True, description="SamplingPlan")]

        @torch.no_grad()
        def __call__(self, components, state):
            # The stock __call__ with the schedule taken from the plan; the row plan is the parent's own.
            block_state = self.get_block_state(state)
            plan: SamplingPlan = block_state.sampling_plan
            device = components._execution_device
            for scheduler, shift in ((components.scheduler, plan.flow_shift),
                                     (components.audio_scheduler, plan.audio_flow_shift)):
                if plan.sigmas is not None:
                    scheduler.set_timesteps(device=device, sigmas=list(plan.sigmas))
                else:
                    scheduler.set_shift(shift)
                    scheduler.set_timesteps(plan.sigma_points, device=device)
                    scheduler.set_shift(scheduler.config.shift)  # the override lasts one schedule
            block_state.timesteps = components.scheduler.timesteps
            block_state.audio_timesteps = components.audio_scheduler.timesteps
            block_state.row_timestep_plan = [
                tuple(tensor.to(device) for tensor in self.build_row_timesteps(
                    block_state.video_indices, block_state.audio_indices,
                    block_state.num_condition_video_rows, block_state.num_condition_audio_rows,
                    block_state.text_indices.numel(), float(timestep), float(audio_timestep),
                    max(float(timestep), components.keyframe_noise_aug), 1.0))
                for timestep, audio_timestep in zip(block_state.timesteps, block_state.audio_timesteps)
            ]
            self.set_block_state(state, block_state)
            return components, state

    class ProgressStep(ModularPipelineBlocks):
        model_name = "minimax-h3"

        @property
        def inputs(self):
            return [InputParam("step_callback", default=None, description="callable(step, total)"),
                    InputParam("cancel_event", default=None, description="threading.Event")]

        @torch.no_grad()
        def __call__(self, components, block_state, i, t):
            if block_state.cancel_event is not None and block_state.cancel_event.is_set():
                raise Cancelled("generation cancelled")
            if block_state.step_callback is not None:
                block_state.step_callback(i + 1, len(block_state.timesteps))
            return components, block_state

    return PlannedSetTimestepsStep, ProgressStep


def studio_blocks():
    """MiniMaxH3Blocks with the planned schedule and the progress step installed."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    blocks = MiniMaxH3Blocks()
    planned, progress = _blocks()
    denoise = blocks.sub_blocks["denoise"]
    for branch in denoise.sub_blocks.values():
        branch.sub_blocks["set_timesteps"] = planned()
        loop = branch.sub_blocks["denoise"]
        loop.sub_blocks["progress"] = progress()
        loop.set_progress_bar_config(disable=True)  # progress goes through ProgressStep instead
    return blocks


def load(path: str | Path, *, device, dtype, task_type: str = "t2va"):
    """`MiniMaxH3ModularPipeline` from a repository, with only the partition `task_type` needs loaded.
    `device=None` leaves it in CPU memory (an offload plan places it later)."""
    from diffusers import MiniMaxH3ModularPipeline

    from .processor import load_processor

    # What ModularPipeline.from_pretrained does, with our blocks (its blocks come from the repository).
    modular_config, config = MiniMaxH3ModularPipeline._load_pipeline_config(str(path))
    pipe = MiniMaxH3ModularPipeline(blocks=studio_blocks(), pretrained_model_name_or_path=str(path),
                                    modular_config_dict=modular_config, config_dict=config)
    pipe.load_components(names=list(SHARED), dtype=dtype)
    pipe.update_components(processor=load_processor(Path(path) / "processor"))
    ensure_partition(pipe, task_type, dtype=dtype)
    if device is not None:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)  # progress is reported through the ProgressStep
    return pipe


def loaded_partitions(pipe) -> set[str]:
    return {p for p in ("transformer", "transformer_ref") if getattr(pipe, p, None) is not None}


def ensure_partition(pipe, task_type: str, *, dtype, place=None) -> str:
    """Load the partition a task denoises with (the repository holds both; a workflow loads its own).
    `place(name, module)` puts a newly loaded partition where the others are (device or offload hooks)."""
    partition = PARTITION[task_type]
    if getattr(pipe, partition, None) is None:
        pipe.load_components(names=[partition], dtype=dtype)
        if place is not None:
            place(partition, getattr(pipe, partition))
    return partition


@dataclass
class MiniMaxOutput:
    frames: list  # PIL images
    fps: int
    audio: tuple[np.ndarray, int]  # ([samples, channels] float32, sample_rate)
    height: int
    width: int
    num_frames: int


def run(pipe, plan: SamplingPlan, params: dict, *, on_step=None, cancel: threading.Event | None = None,
        generator=None) -> MiniMaxOutput:
    """One generation. `params`: prompt, height/width, num_frames, image / last_image (fl2va), references
    (ref2va: PIL images or MiniMaxH3Reference objects)."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference

    task = plan.task_type
    kwargs = {"prompt": params["prompt"], "num_inference_steps": plan.sigma_points, "sampling_plan": plan,
              "step_callback": on_step, "cancel_event": cancel, "generator": generator, "output_type": "pil"}
    for name in ("height", "width", "num_frames"):
        if params.get(name) is not None:
            kwargs[name] = params[name]
    image, last, refs = params.get("image"), params.get("last_image"), params.get("references")
    if task == "t2va" and (image is not None or last is not None or refs):
        raise InvalidParameter("task_type 't2va' takes no image, last_image or references; use fl2va or ref2va",
                               param="task_type")
    if task == "fl2va":
        if image is None and last is None:
            raise InvalidParameter("task_type 'fl2va' needs 'image' (first frame) and/or 'last_image'",
                                   param="image")
        if refs:
            raise InvalidParameter("task_type 'fl2va' takes no references", param="references")
        kwargs.update({k: v for k, v in (("image", image), ("last_image", last)) if v is not None})
    if task == "ref2va":
        if not refs:
            raise InvalidParameter("task_type 'ref2va' needs 'references' (one or more images)", param="references")
        if image is not None or last is not None:
            raise InvalidParameter("task_type 'ref2va' takes references, not image/last_image", param="image")
        kwargs.setdefault("num_frames", 124)  # ref2va has no default length (t2va/fl2va default to 124)
        kwargs["references"] = [MiniMaxH3ImageReference(image=r) if hasattr(r, "convert") else r for r in refs]
        from .processor import has_video_processor

        if not has_video_processor() and any(getattr(r, "kind", "image") == "video" for r in kwargs["references"]):
            raise InvalidParameter("video references need torchvision (Qwen3-VL's video processor), which is "
                                   "not installed", param="references")
    if PARTITION[task] not in loaded_partitions(pipe):
        raise InvalidParameter(f"the {PARTITION[task]} partition is not loaded for task {task!r}", param="task_type")

    state = pipe(**kwargs)
    frames = list(state.get("videos")[0])
    audio = state.get("audio")[0].float().cpu().numpy().T  # [samples, channels]
    return MiniMaxOutput(frames=frames, fps=int(pipe.fps), audio=(np.ascontiguousarray(audio, dtype=np.float32),
                                                                   int(state.get("sampling_rate"))),
                         height=int(state.get("height")), width=int(state.get("width")),
                         num_frames=int(state.get("num_frames")))

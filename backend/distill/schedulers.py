"""Schedulers a distill preset can name in its ``[scheduler]`` table, besides diffusers' own.

LightX2V's Wan step-distill recipe samples a fixed list of training timesteps
(``denoising_step_list``, e.g. [1000, 750, 500, 250]), shifts them with ``sample_shift``
and steps with plain Euler down to 0. diffusers' ``FlowMatchEulerDiscreteScheduler``
steps exactly that way, but ``WanPipeline`` only calls ``set_timesteps(n)``, which spaces
the (already shifted) sigmas evenly and shifts them again (1000, 910, 717, 24 for 4 steps at
shift 5). ``StepListFlowMatchScheduler`` is that diffusers scheduler with one change:
``set_timesteps(n)`` starts from the listed timesteps, so the pipeline sees the
publisher's schedule (1000, 937.5, 833.3, 625 at shift 5). Stepping is diffusers' own.
"""
from __future__ import annotations

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.configuration_utils import register_to_config


class StepListFlowMatchScheduler(FlowMatchEulerDiscreteScheduler):
    """Flow-match Euler on a fixed list of training timesteps (LightX2V's step-distill schedule)."""

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0,
                 denoising_step_list: tuple = (1000, 750, 500, 250)):
        super().__init__(num_train_timesteps=num_train_timesteps, shift=shift)
        self.register_to_config(denoising_step_list=list(denoising_step_list))

    def set_timesteps(self, num_inference_steps: int | None = None, device=None, **kwargs):
        steps = list(self.config.denoising_step_list)
        if num_inference_steps is not None and num_inference_steps != len(steps):
            raise ValueError(f"this scheduler samples the {len(steps)} timesteps {steps}; "
                             f"num_inference_steps={num_inference_steps}")
        n = self.config.num_train_timesteps
        # sigma = t / N before the shift, as LightX2V indexes its shifted 1000-step table
        return super().set_timesteps(sigmas=[t / n for t in steps], device=device)


# class name -> class, for presets (diffusers' schedulers are looked up by name in diffusers)
SCHEDULERS = {cls.__name__: cls for cls in (StepListFlowMatchScheduler,)}


def scheduler_class(name: str):
    """Our own classes first, then any diffusers scheduler; None when neither has ``name``."""
    if name in SCHEDULERS:
        return SCHEDULERS[name]
    import diffusers
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    cls = getattr(diffusers, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, SchedulerMixin) else None

"""What every demo trainer shares: the resumable loop (progress bar, checkpoints, time cap), the learning-rate
schedule, random-state checkpoints, and how pictures and latents are shaped for the Qwen pipeline.

Used by ``backend.demo.train`` (the image base, its VAE decoder) and ``backend.demo.loras`` (the demo LoRAs).
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_EVERY_S = 180.0


def lr_at(step: int, total: int, peak: float, warmup: int = 100, floor: float = 0.03) -> float:
    """Linear warm-up, then cosine decay to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 NxHxWx3 -> float N×3×1×H×W in [-1, 1] (the Qwen VAE takes one-frame videos)."""
    x = torch.from_numpy(images).float().div(127.5).sub(1.0)
    return x.permute(0, 3, 1, 2).unsqueeze(2)


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def write_pipeline(pipe, out: Path, record: dict, tokenizer_from: Path | None = None) -> Path:
    """Write a trained pipeline where the demo ships it: fp16 safetensors in diffusers layout, no
    ``_name_or_path`` in the configs (weights loaded from a folder name it: not shipped), the run's
    ``record`` as training.json; into a sibling folder first, then swapped in whole. ``tokenizer_from``: a
    tokenizer that does not train keeps its files as they were, not a round trip's."""
    import json
    import shutil

    pipe.to(torch.float16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    for config in tmp.glob("*/config.json"):
        values = json.loads(config.read_text())
        if values.pop("_name_or_path", None) is not None:
            config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    if tokenizer_from is not None:
        shutil.rmtree(tmp / "tokenizer")
        shutil.copytree(tokenizer_from / "tokenizer", tmp / "tokenizer")
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    pipe.to(torch.float32)
    return out


def load_checkpoint(path: Path):
    return torch.load(path, weights_only=False) if path.exists() else None


class Stage:
    """A resumable loop: step counting, the progress bar, checkpoints and the time cap."""

    def __init__(self, name: str, ckpt: Path, total: int, deadline: float):
        self.name, self.ckpt, self.total, self.deadline = name, ckpt, total, deadline

    def run(self, state: dict, step_fn, save_fn) -> bool:
        """Run ``step_fn(step) -> loss`` until ``total``; True when the stage is done."""
        from tqdm import tqdm

        last_save = time.monotonic()
        bar = tqdm(total=self.total, initial=state["step"], desc=self.name, dynamic_ncols=True,
                   file=sys.stdout, mininterval=5.0)
        avg = None
        while state["step"] < self.total:
            if time.monotonic() > self.deadline:
                save_fn()
                bar.close()
                print(f"{self.name}: time is up at step {state['step']}/{self.total}; run again to resume")
                return False
            loss = step_fn(state["step"])
            avg = loss if avg is None else 0.98 * avg + 0.02 * loss
            state["step"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{avg:.4f}", refresh=False)
            if time.monotonic() - last_save > CHECKPOINT_EVERY_S:
                save_fn()
                last_save = time.monotonic()
        save_fn()
        bar.close()
        return True


def rng_state(rng: np.random.Generator) -> dict:
    return {"numpy": rng.bit_generator.state, "torch": torch.get_rng_state()}


def set_rng_state(rng: np.random.Generator, saved: dict) -> None:
    rng.bit_generator.state = saved["numpy"]
    torch.set_rng_state(saved["torch"])


def pack_latents(z: torch.Tensor) -> torch.Tensor:
    """B×C×H×W latents -> B×(H/2·W/2)×4C tokens, 2x2 patches: how QwenImagePipeline packs them
    (its ``_pack_latents``; tests/test_demo_trained.py checks the two agree)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def resume(ckpt: Path, opt, rng: np.random.Generator, state: dict, load_model) -> dict | None:
    """Restore a run from its checkpoint, if there is one: ``load_model(saved)`` puts the model's weights
    back, then the optimizer, the step count and the random state. Returns what was saved (or None)."""
    saved = load_checkpoint(ckpt)
    if saved is not None:
        load_model(saved)
        opt.load_state_dict(saved["opt"])
        state["step"] = saved["step"]
        set_rng_state(rng, saved["rng"])
    return saved


def flow_matching_loss(transformer, x0: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor,
                       latent_side: int) -> torch.Tensor:
    """Rectified-flow loss of a Qwen-Image transformer on packed latents ``x0``: noise at a logit-normal
    sigma, predict the velocity ``noise - x0`` (the pipeline's FlowMatchEulerDiscreteScheduler samples it)."""
    import torch.nn.functional as F

    b = x0.shape[0]
    sigma = torch.sigmoid(torch.randn(b)).view(b, 1, 1)
    noise = torch.randn_like(x0)
    xt = (1 - sigma) * x0 + sigma * noise
    half = latent_side // 2
    pred = transformer(hidden_states=xt, timestep=sigma.view(b), encoder_hidden_states=embeds,
                       encoder_hidden_states_mask=mask, img_shapes=[[(1, half, half)]] * b, return_dict=False)[0]
    return F.mse_loss(pred, noise - x0)


def optimizer_step(opt, loss: torch.Tensor, params, clip: float = 1.0) -> float:
    """Backward, clip the gradient norm, step; the loss as a float."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    return float(loss.detach())


class Ema:
    """An exponential moving average of parameters (the weights a trainer ships), its decay warmed up as
    ``min(decay, (1 + step) / (10 + step))``. ``shadow`` is what a checkpoint keeps (a list of tensors)."""

    def __init__(self, params, decay: float):
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay = decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for e, p in zip(self.shadow, self.params):
            e.lerp_(p.detach(), 1 - decay)

    @torch.no_grad()
    def load(self, saved: list) -> None:
        for e, s in zip(self.shadow, saved):
            e.copy_(s)

    @torch.no_grad()
    def apply(self) -> None:
        """Put the averaged weights into the parameters (when training ends)."""
        for e, p in zip(self.shadow, self.params):
            p.copy_(e)


def lora_state(model) -> dict:
    """The LoRA tensors of a peft-wrapped model (what a LoRA trainer's checkpoint keeps), detached copies."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}

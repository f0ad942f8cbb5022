"""Train demo:wan2.2-t2v here: ``python -m backend.demo.train wan2.2-t2v`` (after wan2.1-t2v).

Wan2.2 A14B denoises with two experts: ``transformer`` for the high-noise steps (timestep >= boundary_ratio
x 1000: where the layout and the motion are decided) and ``transformer_2`` for the low-noise rest (the
detail). The demo's pair starts from the trained demo:wan2.1-t2v transformer, as the two halves of one
model, and each copy is then trained by flow matching only on its own half of the noise levels: sigmas
drawn from the trainer's shifted logit-normal, truncated at the boundary (``sigmas_between``). So each
expert is better than the base on its half and, as training goes on, worse on the other: a swapped pair,
or one expert serving both halves, draws worse clips (tests/test_demo_wan22_trained.py measures it).

The VAE, the UMT5 encoder and the tokenizer are Wan2.1's, frozen, as the real Wan2.2 A14B shares Wan2.1's
VAE and text encoder. The training clips are Wan2.1's (the same seeded pool, encoded again with the shipped
fp16 VAE), so the prompts no clip had are the same for both models.

Checkpoints under ``<data-dir>/demo-train/wan2.2-t2v/``; the pipeline, fp16 safetensors in diffusers
layout, to ``backend/demo/weights/wan2.2-t2v/``.
"""
from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import WEIGHTS_ROOT, data
from .trainkit import (Ema, Stage, load_checkpoint, lr_at, optimizer_step, resume, rng_state, save_checkpoint,
                       write_pipeline)
from .wan import BOUNDARY_RATIO, SCHEDULER
from .wan_train import ENCODE_LENGTH, flow_loss, latent_pool, prompt_embeds, unseen_prompts

BASE = WEIGHTS_ROOT / "wan2.1-t2v"


@dataclass
class ExpertsPlan:
    """Steps and sizes of one wan2.2-t2v run (each step trains both experts, one batch each)."""
    steps: int = 1800
    batch: int = 16
    lr: float = 4e-4
    short_text: float = 0.75  # as wan2.1-t2v's trainer (wan_train.SHORT_TEXT)
    max_sequence_length: int = 512
    ema: float = 0.998
    boundary_ratio: float = BOUNDARY_RATIO
    # the training clips: wan2.1-t2v's pool (same seed and size), so both models hold out the same prompts
    latent_pool: int = 4096
    frames: int = data.FRAMES
    size: int = data.SIZE
    seed: int = 0


def sigmas_between(n: int, low: float, high: float, shift: float = SCHEDULER["flow_shift"]) -> torch.Tensor:
    """``n`` sigmas of the trainers' distribution (a logit-normal, flow-shifted) conditioned on [low, high):
    the normal drawn truncated, by its inverse CDF, so no draw is wasted and none falls outside."""
    def z_of(sigma: float) -> float:  # the normal's value that the shift maps to ``sigma``
        sigma = min(max(sigma, 1e-6), 1 - 1e-6)
        s = sigma / (shift - (shift - 1) * sigma)
        return float(np.log(s / (1 - s)))

    lo, hi = torch.special.ndtr(torch.tensor([z_of(low), z_of(high)], dtype=torch.float64)).tolist()
    z = torch.special.ndtri(lo + (hi - lo) * torch.rand(n, dtype=torch.float64))
    s = torch.sigmoid(z)
    return (shift * s / (1 + (shift - 1) * s)).float().clamp(low, high)


def base_digest(base: Path) -> str:
    """sha256 over the base model's weight files: a checkpoint of the experts (and the latent pool its VAE
    encoded) belongs to one base, and is started over when the base is retrained."""
    h = hashlib.sha256()
    for file in sorted(base.glob("*/*.safetensors")):
        h.update(file.relative_to(base).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()


def train_experts(plan: ExpertsPlan, work: Path, out: Path, minutes: float, base: Path = BASE) -> bool:
    """Fine-tune the two experts from the Wan2.1 transformer (resuming from the checkpoint); True when written."""
    from diffusers import WanPipeline

    if not (base / "transformer" / "config.json").is_file():
        raise SystemExit(f"{base}: no trained demo:wan2.1-t2v there; run python -m backend.demo.train wan2.1-t2v")
    deadline = time.monotonic() + minutes * 60
    work.mkdir(parents=True, exist_ok=True)
    digest = base_digest(base)
    ckpt = work / "experts.pt"
    saved = load_checkpoint(ckpt)
    if saved is not None and saved.get("base") != digest:
        print(f"experts: {base} has changed since the checkpoint; starting over from it")
        for stale in (ckpt, work / "latents.pt"):
            stale.unlink(missing_ok=True)
    base_pipe = WanPipeline.from_pretrained(base, torch_dtype=torch.float32)
    for module in (base_pipe.vae, base_pipe.text_encoder, base_pipe.transformer):
        module.requires_grad_(False)
    high = copy.deepcopy(base_pipe.transformer).requires_grad_(True)
    low = copy.deepcopy(base_pipe.transformer).requires_grad_(True)
    experts = {"high": high, "low": low}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=plan.lr, weight_decay=0.01) for k, m in experts.items()}
    emas = {k: Ema(m.parameters(), plan.ema) for k, m in experts.items()}

    class _Both:  # one optimizer face for resume(): both experts' optimizers in one state dict
        def state_dict(self):
            return {k: o.state_dict() for k, o in opts.items()}

        def load_state_dict(self, saved):
            for k, o in opts.items():
                o.load_state_dict(saved[k])

    rng = np.random.default_rng(plan.seed + 300)
    state = {"step": 0}

    def load(saved):
        for k, m in experts.items():
            m.load_state_dict(saved[k])
            emas[k].load(saved["ema"][k])

    if resume(ckpt, _Both(), rng, state, load) is not None:
        print(f"experts: resuming at step {state['step']}/{plan.steps}")
    pool, prompts = latent_pool(plan, work, base_pipe.vae)
    mean = torch.tensor(base_pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(base_pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    halves = {"high": (plan.boundary_ratio, 1.0), "low": (0.0, plan.boundary_ratio)}
    for m in experts.values():
        m.train()

    def step(i: int) -> float:
        total = 0.0
        for k, m in experts.items():
            for group in opts[k].param_groups:
                group["lr"] = lr_at(i, plan.steps, plan.lr, warmup=50)
            pick = torch.from_numpy(rng.integers(0, len(prompts), plan.batch))
            text = ["" if rng.random() < 0.1 else prompts[j] for j in pick.tolist()]
            length = ENCODE_LENGTH if rng.random() < plan.short_text else plan.max_sequence_length
            with torch.no_grad():
                embeds = prompt_embeds(base_pipe, text, length)
            x0 = (pool[pick].float() - mean) / std
            total += optimizer_step(opts[k], flow_loss(m, x0, embeds, sigmas_between(plan.batch, *halves[k])),
                                    m.parameters())
            emas[k].update(i)
        return total / 2

    def save():
        save_checkpoint(ckpt, {**{k: m.state_dict() for k, m in experts.items()}, "opt": _Both().state_dict(),
                               "ema": {k: e.shadow for k, e in emas.items()}, "step": state["step"],
                               "rng": rng_state(rng), "plan": asdict(plan), "base": digest})

    if not Stage("experts", ckpt, plan.steps, deadline).run(state, step, save):
        return False
    for k, m in experts.items():
        emas[k].apply()
        m.eval()
    pipe = WanPipeline(tokenizer=base_pipe.tokenizer, text_encoder=base_pipe.text_encoder, vae=base_pipe.vae,
                       transformer=high, transformer_2=low, scheduler=base_pipe.scheduler,
                       boundary_ratio=plan.boundary_ratio)
    export(pipe, plan, out, prompts, digest)
    print(f"wrote {out}")
    return True


def export(pipe, plan: ExpertsPlan, out: Path, prompts: list[str], base_sha256: str | None = None) -> Path:
    """fp16 safetensors in diffusers layout, with training.json (the plan, the prompts no clip had)."""
    record = {"plan": asdict(plan), "base": "wan2.1-t2v", "base_sha256": base_sha256,
              "unseen_prompts": unseen_prompts(prompts)}
    write_pipeline(pipe, out, record)
    return out

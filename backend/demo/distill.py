"""The demo's Lightning LoRAs: few-step distills of demo:qwen-image, ``python -m backend.demo.train distill``.

The Qwen-Image-Lightning presets fuse a publisher's LoRA and sample in 4 (or 8) steps at CFG 1 with
the publisher's scheduler (shift 3). Here the same thing is trained for the demo model, so the promise
can be seen and tested: the preset's few steps draw what the teacher draws with its default 20 steps
and true CFG 4.

Method: trajectory distillation. The teacher (the trained base, its own defaults: 20 Euler steps of
its scheduler, true CFG with the pipeline's norm rescale) draws from seeded noise; its latents after
every step are kept. The teacher's Euler path is piecewise linear in sigma, so its state at any sigma
of the student's schedule is an interpolation of two neighbours: exactly the teacher's own path, not
a re-integration. A peft LoRA on the frozen base is then trained so that one Euler step of the
student, at CFG 1, from the teacher's state at sigma_k lands on the teacher's state at sigma_k+1:

    v*(x_k) = (x_teacher(sigma_k+1) - x_k) / (sigma_k+1 - sigma_k)

Halfway through, a share of each batch starts from the student's own state after k steps (its own
rollout, no gradient) with the same target, so the student learns to come back to the teacher's
path from where it actually is, not only from where the teacher was (the few-step error otherwise
compounds). The guidance is learnt with it: the student's one conditional pass replaces the
teacher's two.

The student's sigmas come from the preset's own ``[scheduler]`` table, the way QwenImagePipeline
computes them (``np.linspace(1, 1/N, N)`` shifted with mu), so the file is distilled for exactly
the schedule the preset samples with.

Some prompts are held out of training (``held_out``), so a test can score the distill on prompts,
and seeds, it never saw. Checkpoints (the teacher's trajectories, then the LoRA) under
``<data-dir>/demo-train/distill/``; the files, in the publisher's layout and names (bare
``transformer_blocks.N.<module>.lora_down/lora_up/alpha``, bf16 as published), to
``backend/demo/weights/qwen-image-lightning/``.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import DISTILL_DIRS, WEIGHTS_ROOT, data
from .trainkit import pack_latents

BASE = WEIGHTS_ROOT / "qwen-image"
WEIGHTS_DIR = DISTILL_DIRS["demo:qwen-image"]
# The modules the publisher's Qwen-Image-Lightning files adapt, in every block (their key set).
MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
           "txt_mlp.net.2")
#: preset id -> the file it fuses (the preset's ``demo`` name); trained in this order
PRESETS = {"qwen-image-2512-lightning-4step": 4, "qwen-image-2512-lightning-8step": 8}


@dataclass
class DistillPlan:
    """Sizes of one distill run (the defaults fit 20 minutes here, both presets)."""
    trajectories: int = 4096  # teacher drawings kept (prompts from the base's training distribution)
    teacher_batch: int = 64
    steps: int = 2000  # student steps per preset
    batch: int = 32
    lr: float = 1e-3
    rank: int = 16
    alpha: float = 8.0  # written alpha != rank: a loader that ignores alpha fuses the wrong delta
    rollout_after: float = 0.4  # from this share of the steps on, part of each batch starts from the student's own state
    rollout_share: float = 0.5
    seed: int = 0


def held_out(prompt: str) -> bool:
    """Prompts the distill never trains on (about one in five), so a test can score unseen prompts."""
    return hashlib.sha256(prompt.encode()).digest()[0] % 5 == 0


def training_prompts(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` prompts as the base model learnt them (digits 0-8, a quarter shapes), none of them held out."""
    out = []
    while len(out) < n:
        prompt = data.random_item(rng).prompt
        if not held_out(prompt):
            out.append(prompt)
    return out


def _pipeline():
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(BASE, torch_dtype=torch.float32)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder):
        module.requires_grad_(False)
        module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def teacher_defaults() -> dict:
    from .qwen import DEFAULTS

    return {"num_inference_steps": DEFAULTS["num_inference_steps"], "true_cfg_scale": DEFAULTS["true_cfg_scale"]}


def preset_sigmas(preset_id: str, seq_len: int) -> np.ndarray:
    """The N+1 sigmas (ending at 0) the preset's scheduler samples at, as QwenImagePipeline sets them."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from ..presets import get_preset

    preset = get_preset(preset_id)
    steps = preset.requirements["num_inference_steps"]
    scheduler = preset.build_scheduler()
    cfg = scheduler.config
    mu = calculate_shift(seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler.sigmas.double().numpy()


def along(states: torch.Tensor, sigmas: np.ndarray, at: np.ndarray) -> torch.Tensor:
    """The teacher's state at each sigma of ``at``: its Euler path between the two neighbouring steps.

    ``states``: B×(S+1)×... latents at the teacher's sigmas ``sigmas`` (descending, S+1 of them, the
    first the noise). Returns B×len(at)×...
    """
    out = []
    for s in at:
        j = int(np.clip(np.searchsorted(-sigmas, -s, side="right") - 1, 0, len(sigmas) - 2))
        w = float((sigmas[j] - s) / (sigmas[j] - sigmas[j + 1]))
        out.append((1 - w) * states[:, j] + w * states[:, j + 1])
    return torch.stack(out, 1)


@torch.no_grad()
def teacher_paths(pipe, prompts: list[str], seeds: list[int], size: int = data.SIZE) -> tuple[torch.Tensor, np.ndarray]:
    """The teacher's drawings of ``prompts`` (its defaults): packed latents after every step, B×(S+1)×T×C,
    and the S+1 sigmas they sit at. The pipeline draws them itself (a step-end callback keeps each state)."""
    d = teacher_defaults()
    c = pipe.transformer.config.in_channels // 4
    side = size // pipe.vae_scale_factor
    noise = torch.stack([torch.randn(1, c, side, side, generator=torch.Generator().manual_seed(s)) for s in seeds])
    noise = pack_latents(noise[:, 0])  # as the pipeline packs them (tests/test_demo_trained.py checks the two agree)
    states = [noise]

    def keep(_pipe, _i, _t, kwargs):
        states.append(kwargs["latents"].clone())
        return {}

    pipe(prompt=prompts, negative_prompt=[" "] * len(prompts), height=size, width=size, latents=noise,
         output_type="latent", callback_on_step_end=keep, **d)
    return torch.stack(states, 1), pipe.scheduler.sigmas.double().numpy()


def _config(plan: DistillPlan):
    from peft import LoraConfig

    return LoraConfig(r=plan.rank, lora_alpha=plan.rank, target_modules=list(MODULES), init_lora_weights=True)


def _forward(model, x: torch.Tensor, sigma: torch.Tensor, embeds, mask, side: int) -> torch.Tensor:
    half = side // 2
    return model(hidden_states=x, timestep=sigma, encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                 img_shapes=[[(1, half, half)]] * x.shape[0], return_dict=False)[0]


@torch.no_grad()
def _trajectories(plan: DistillPlan, work: Path, pipe, grids: dict[str, np.ndarray], deadline: float) -> dict | None:
    """The teacher's states at every preset's sigmas, for ``plan.trajectories`` prompts, kept on disk (fp16);
    None when the time ran out first (what was drawn is kept, and the next run goes on from there)."""
    from tqdm import tqdm

    from .trainkit import load_checkpoint, save_checkpoint

    path = work / "teacher.pt"
    saved = load_checkpoint(path)
    if saved is not None and saved["n"] == plan.trajectories and saved["grids"].keys() == grids.keys():
        if len(saved["prompts"]) >= plan.trajectories:
            return saved
    else:
        saved = {"n": plan.trajectories, "grids": {k: v.tolist() for k, v in grids.items()}, "prompts": [],
                 "states": {k: [] for k in grids}}
    rng = np.random.default_rng(plan.seed + 700)
    prompts = training_prompts(rng, plan.trajectories)
    done = len(saved["prompts"])
    bar = tqdm(total=plan.trajectories, initial=done, desc="teacher drawings", file=sys.stdout, mininterval=5.0,
               dynamic_ncols=True)
    last = time.monotonic()
    for start in range(done, plan.trajectories, plan.teacher_batch):
        if time.monotonic() > deadline:
            save_checkpoint(path, saved)
            bar.close()
            print(f"teacher drawings: time is up at {start}/{plan.trajectories}; run again to resume")
            return None
        batch = prompts[start:start + plan.teacher_batch]
        seeds = [plan.seed * 1_000_000 + 100_000 + start + i for i in range(len(batch))]
        states, sigmas = teacher_paths(pipe, batch, seeds)
        for key, grid in grids.items():
            saved["states"][key].append(along(states, sigmas, grid).half())
        saved["prompts"] += batch
        bar.update(len(batch))
        if time.monotonic() - last > 120:
            save_checkpoint(path, saved)
            last = time.monotonic()
    bar.close()
    saved["states"] = {k: (torch.cat(v) if isinstance(v, list) else v) for k, v in saved["states"].items()}
    save_checkpoint(path, saved)
    return saved


def train_one(preset_id: str, plan: DistillPlan, work: Path, teacher: dict, pipe, out_dir: Path,
              deadline: float) -> bool:
    """Distill the student of one preset (resuming from its checkpoint) and write its file."""
    from peft import get_peft_model

    from .trainkit import Stage, lora_state, lr_at, optimizer_step, resume, rng_state, save_checkpoint

    sigmas = torch.tensor(teacher["grids"][preset_id], dtype=torch.float32)
    states = teacher["states"][preset_id]  # n × (N+1) × T × C, fp16
    prompts = teacher["prompts"]
    steps_n = len(sigmas) - 1
    side = data.SIZE // pipe.vae_scale_factor
    torch.manual_seed(plan.seed + 800)
    model = get_peft_model(pipe.transformer, _config(plan))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=plan.lr, weight_decay=0.0)
    rng = np.random.default_rng(plan.seed + 900)
    state = {"step": 0}
    ckpt = work / f"{preset_id}.pt"
    saved = resume(ckpt, opt, rng, state, lambda saved: model.load_state_dict(saved["lora"], strict=False))
    if saved is not None:
        print(f"{preset_id}: resuming at step {state['step']}/{plan.steps}")
    model.train()

    def step(i: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(i, plan.steps, plan.lr, warmup=50)
        pick = rng.integers(0, len(prompts), plan.batch)
        k = torch.from_numpy(rng.integers(0, steps_n, plan.batch))
        rows = torch.from_numpy(pick)
        x = states[rows, k].float()
        target_next = states[rows, k + 1].float()
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt([prompts[j] for j in pick.tolist()], device=torch.device("cpu"))
            if i >= plan.rollout_after * plan.steps:  # part of the batch from the student's own k-step state
                own = torch.from_numpy(rng.random(plan.batch) < plan.rollout_share) & (k > 0)
                if own.any():
                    model.eval()
                    y = states[rows[own], 0].float()
                    kk = k[own]
                    for s in range(int(kk.max())):
                        live = kk > s
                        sub_mask = None if mask is None else mask[own][live]
                        v = _forward(model, y[live], sigmas[s].expand(int(live.sum())), embeds[own][live],
                                     sub_mask, side)
                        y[live] = y[live] + (sigmas[s + 1] - sigmas[s]) * v
                    x[own] = y
                    model.train()
        dt = (sigmas[k + 1] - sigmas[k]).view(-1, 1, 1)
        target = (target_next - x) / dt
        pred = _forward(model, x, sigmas[k], embeds, mask, side)
        return optimizer_step(opt, torch.nn.functional.mse_loss(pred, target), params)

    def save():
        save_checkpoint(ckpt, {"lora": lora_state(model), "opt": opt.state_dict(), "step": state["step"],
                               "rng": rng_state(rng), "plan": asdict(plan)})

    started = time.monotonic()
    done = Stage(f"distill {steps_n} steps", ckpt, plan.steps, deadline).run(state, step, save)
    if done:
        record = {"plan": asdict(plan), "teacher": teacher_defaults(), "sigmas": [round(float(s), 6) for s in sigmas],
                  "trained_here_s": round(time.monotonic() - started, 1)}
        if saved is not None:
            record["resumed_at_step"] = saved["step"]
        path = export(preset_id, model, plan, out_dir, record)
        print(f"{preset_id}: wrote {path}")
    model.unload()  # the base transformer as it was, for the next preset
    return done


def file_name(preset_id: str) -> str:
    from ..presets import get_preset

    (f,) = get_preset(preset_id).files
    return f.demo


def export(preset_id: str, model, plan: DistillPlan, out_dir: Path, record: dict) -> Path:
    """Write the student in the publisher's layout: ``transformer_blocks.N.<module>.lora_down.weight`` /
    ``lora_up.weight`` / ``alpha``, bf16 (as published), ``lora_up`` rescaled so ``alpha/r`` gives the trained delta."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from ..lora.demo_adapters import canonical_header

    scale = plan.rank / plan.alpha  # trained at alpha = r (scale 1); written with plan.alpha
    tensors = {}
    for key, t in get_peft_model_state_dict(model).items():
        module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        part = part.split(".")[0]
        if part == "A":
            tensors[f"{module}.lora_down.weight"] = t.detach().to(torch.bfloat16).contiguous()
            tensors[f"{module}.alpha"] = torch.tensor(plan.alpha, dtype=torch.bfloat16)
        else:
            tensors[f"{module}.lora_up.weight"] = (t.detach().float() * scale).to(torch.bfloat16).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / file_name(preset_id)
    meta = {"lora_studio_demo": json.dumps({"model": "demo:qwen-image", "preset": preset_id, "trained": True},
                                           sort_keys=True)}
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(dict(sorted(tensors.items())), str(tmp), metadata=meta)
    canonical_header(tmp)
    tmp.chmod(0o644)
    tmp.replace(out)
    records = out_dir / "training.json"
    allrec = json.loads(records.read_text()) if records.is_file() else {}
    allrec[preset_id] = record
    records.write_text(json.dumps(dict(sorted(allrec.items())), indent=2) + "\n")
    return out


def train(presets: list[str], plan: DistillPlan, work: Path, out_dir: Path, minutes: float) -> bool:
    """The teacher's drawings once, then each preset's student; True when all are written."""
    deadline = time.monotonic() + minutes * 60
    work.mkdir(parents=True, exist_ok=True)
    pipe = _pipeline()
    seq_len = (data.SIZE // pipe.vae_scale_factor // 2) ** 2
    grids = {p: preset_sigmas(p, seq_len) for p in PRESETS}
    teacher = _trajectories(plan, work, pipe, grids, deadline)
    if teacher is None:
        return False
    for preset_id in presets:
        if (out_dir / file_name(preset_id)).exists() and not (work / f"{preset_id}.pt").exists():
            print(f"{preset_id}: already written; delete it to train again")
            continue
        if not train_one(preset_id, plan, work, teacher, pipe, out_dir, deadline):
            return False
        (work / f"{preset_id}.pt").unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)  # every file written: the teacher's drawings are not needed again
    return True

"""Train demo:wan2.1-t2v here: ``python -m backend.demo.train wan2.1-t2v``.

Clips of a digit moving left, right, up or down (``backend.demo.data.render_clip``), 9 frames at
64x64, from prompts of the video grammar (``a {colour} digit {d} moving {direction} on a {background}
background``). Two parts, each resumable, like the image base:

- **The video VAE** (``AutoencoderKLWan``): the image VAE of demo:qwen-image has the same architecture
  (the Qwen-Image VAE is Wan's), so it starts from those trained weights with the time axis set so the
  VAE begins as the image VAE applied to every frame: each causal 3-D convolution's taps on past frames
  zeroed, the encoder's 2x temporal downsampler keeping the later frame of each pair and the decoder's
  upsampler repeating each latent frame (4x down in space, 2x in time: 9 frames -> 5 latent frames of
  16x16x4). That reconstructs the kept frames at the image VAE's 31 dB and the others at 21; trained on
  clips, it learns the time axis from there.
- **The transformer** (``WanTransformer3DModel``) and the tiny UMT5 text encoder, by flow matching on
  the clips' latents, with a grammar tokenizer in the T5 class (one token a word).

Checkpoints under ``<data-dir>/demo-train/wan2.1-t2v/``; the pipeline, fp16 safetensors in diffusers
layout, to ``backend/demo/weights/wan2.1-t2v/``.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import WEIGHTS_ROOT, data
from .trainkit import Ema, Stage, lr_at, optimizer_step, resume, rng_state, save_checkpoint, write_pipeline
from .wan import SCHEDULER
from .wan import text_encoder_t2v as text_encoder
from .wan import transformer_t2v as transformer

IMAGE_VAE = WEIGHTS_ROOT / "qwen-image" / "vae"


@dataclass
class WanPlan:
    """Steps and sizes of one wan2.1-t2v run."""
    vae_steps: int = 500
    vae_batch: int = 4
    vae_lr: float = 2e-4
    report_clips: int = 32
    latent_pool: int = 4096  # clips encoded once for the transformer
    transformer_steps: int = 4000
    transformer_batch: int = 16
    transformer_lr: float = 1e-3
    cond_dropout: float = 0.1  # the prompt replaced by the empty condition (the pipeline's negative ""), so CFG works
    ema: float = 0.999
    max_sequence_length: int = 512  # WanPipeline's default: embeddings zero-padded to it
    # The share of steps whose prompts are padded to ENCODE_LENGTH, not max_sequence_length (why: SHORT_TEXT)
    short_text: float = 0.75
    frames: int = data.FRAMES
    size: int = data.SIZE
    seed: int = 0


def to_video(clips: np.ndarray) -> torch.Tensor:
    """uint8 N×F×H×W×3 -> float N×3×F×H×W in [-1, 1] (what the Wan VAE takes)."""
    return torch.from_numpy(clips).float().div(127.5).sub(1.0).permute(0, 4, 1, 2, 3)


def video_vae_from_image(image_vae_dir: Path = IMAGE_VAE):
    """An ``AutoencoderKLWan`` that starts as the trained image VAE applied frame by frame (module doc)."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

    from .wan import video_vae

    image = AutoencoderKLQwenImage.from_pretrained(image_vae_dir, torch_dtype=torch.float32)
    vae = video_vae(image.config)
    vae.load_state_dict(image.state_dict())  # the same modules, key for key
    with torch.no_grad():
        for name, module in vae.named_modules():
            if isinstance(module, WanResample) and hasattr(module, "time_conv"):
                conv = module.time_conv  # (3, 1, 1): the current frame, copied (once, or twice when upsampling)
                conv.weight.zero_()
                conv.bias.zero_()
                out_ch, in_ch = conv.weight.shape[:2]
                for k in range(out_ch // in_ch):
                    conv.weight[k * in_ch:(k + 1) * in_ch, :, -1, 0, 0] = torch.eye(in_ch)
            elif isinstance(module, WanCausalConv3d) and module.kernel_size[0] > 1 and not name.endswith("time_conv"):
                module.weight[:, :, :-1] = 0  # no look at past frames yet: each frame as an image
    return vae


def _vae_loss(vae, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    posterior = vae.encode(x).latent_dist
    rec = vae.decode(posterior.sample()).sample
    weight = 1.0 + 4.0 * alpha[:, None]  # N×1×F×H×W: the strokes carry the colour and the motion
    err = rec - x
    return (weight * err.pow(2)).mean() + (weight * err.abs()).mean() + 1e-6 * posterior.kl().mean()


def _centroid(weight: np.ndarray) -> np.ndarray | None:
    total = weight.sum()
    if total < 1.0:
        return None
    ys, xs = np.mgrid[0:weight.shape[0], 0:weight.shape[1]]
    return np.array([(weight * ys).sum() / total, (weight * xs).sum() / total])


@torch.no_grad()
def vae_report(vae, n: int = 32, frames: int = data.FRAMES, size: int = data.SIZE, seed: int = 54321) -> dict:
    """How well the video VAE keeps what a prompt names: PSNR per frame, and the share of reconstructions
    whose foreground keeps the asked colour and moves the asked way (known masks: the trainer's own check;
    the tests read clips with their own oracles). Also the latent statistics the pipeline normalises with."""
    rng = np.random.default_rng(seed)
    clips, alphas, prompts = data.clip_batch(rng, n, frames, size)
    x = to_video(clips)
    recs, zs = [], []
    for i in range(0, n, 8):
        z = vae.encode(x[i:i + 8]).latent_dist.mode()
        zs.append(z)
        recs.append(vae.decode(z).sample.clamp(-1, 1))
    rec, z = torch.cat(recs), torch.cat(zs)
    per_frame = (rec - x).pow(2).mean(dim=(0, 1, 3, 4))
    pixels = ((rec.permute(0, 2, 3, 4, 1) + 1) * 127.5).numpy()  # N×F×H×W×3
    names = list(data.PALETTE)
    palette = np.array([data.PALETTE[c] for c in names], np.float32)
    colour_kept = moved = 0
    for clip, alpha, prompt in zip(pixels, alphas, prompts):
        words = prompt.split()
        fg = clip[alpha > 0.9]
        colour = names[int(np.argmin(((palette - np.median(fg, axis=0)) ** 2).sum(1)))]
        colour_kept += colour == words[1]
        bg = np.asarray(data.BACKGROUNDS[words[-2]], np.float32)
        dist = [np.sqrt(((frame - bg) ** 2).sum(-1)) for frame in clip]
        first, last = _centroid(np.clip(dist[0] / 80 - 0.5, 0, 1)), _centroid(np.clip(dist[-1] / 80 - 0.5, 0, 1))
        if first is not None and last is not None:
            dy, dx = last - first
            way = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            moved += way == words[5]
    return {"psnr_db": round(10 * math.log10(4.0 / per_frame.mean().item()), 2),
            "psnr_per_frame": [round(10 * math.log10(4.0 / v), 1) for v in per_frame.tolist()],
            "colour_kept": round(colour_kept / n, 3), "motion_kept": round(moved / n, 3),
            "latents_mean": z.mean(dim=(0, 2, 3, 4)).tolist(), "latents_std": z.std(dim=(0, 2, 3, 4)).tolist()}


def train_video_vae(plan: WanPlan, work: Path, deadline: float):
    """Fine-tune the video VAE on clips (resuming from its checkpoint); (vae, done)."""
    ckpt = work / "vae.pt"
    torch.manual_seed(plan.seed + 1)
    vae = video_vae_from_image()
    opt = torch.optim.AdamW(vae.parameters(), lr=plan.vae_lr, weight_decay=0.0)
    rng = np.random.default_rng(plan.seed + 10)
    state = {"step": 0}
    saved = resume(ckpt, opt, rng, state, lambda saved: vae.load_state_dict(saved["model"]))
    if saved is not None:
        if state["step"] >= plan.vae_steps:
            return vae.eval(), True
        print(f"video vae: resuming at step {state['step']}/{plan.vae_steps}")
    vae.train()

    def step(i: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(i, plan.vae_steps, plan.vae_lr, warmup=20)
        clips, alphas, _ = data.clip_batch(rng, plan.vae_batch, plan.frames, plan.size)
        return optimizer_step(opt, _vae_loss(vae, to_video(clips), torch.from_numpy(alphas)), vae.parameters())

    def save():
        save_checkpoint(ckpt, {"model": vae.state_dict(), "opt": opt.state_dict(), "step": state["step"],
                               "rng": rng_state(rng), "plan": asdict(plan)})

    done = Stage("video vae", ckpt, plan.vae_steps, deadline).run(state, step, save)
    return vae.eval(), done


@torch.no_grad()
def latent_pool(plan: WanPlan, work: Path, vae) -> tuple[torch.Tensor, list[str]]:
    """The transformer's training set: ``latent_pool`` clips through the trained video VAE, once (fp16)."""
    import sys

    from tqdm import tqdm

    from .trainkit import load_checkpoint

    path = work / "latents.pt"
    saved = load_checkpoint(path)
    if saved is not None and saved["n"] == plan.latent_pool:
        return saved["latents"], saved["prompts"]
    rng = np.random.default_rng(plan.seed + 200)
    latents, prompts = [], []
    for _ in tqdm(range(0, plan.latent_pool, 16), desc="encoding the training clips", file=sys.stdout,
                  mininterval=5.0, dynamic_ncols=True):
        clips, _, names = data.clip_batch(rng, 16, plan.frames, plan.size)
        latents.append(vae.encode(to_video(clips)).latent_dist.mode().half())
        prompts += names
    latents, prompts = torch.cat(latents)[:plan.latent_pool], prompts[:plan.latent_pool]
    save_checkpoint(path, {"n": plan.latent_pool, "latents": latents, "prompts": prompts})
    return latents, prompts


ENCODE_LENGTH = 32  # tokens the text encoder runs on: every grammar prompt fits (about 11)
# Why most steps pad the prompt to ENCODE_LENGTH only. WanPipeline hands the transformer its prompt zero-padded
# to 512 tokens with no mask, as the real Wan does: ~500 keys of one padding vector beside ~11 of words. At
# the start each cross-attention spreads over all 512, so the words get ~2% of it and their gradient is
# diluted 50x: trained at 512 only, the first 1700 steps learnt the clips' look and ignored the prompt (a
# green 4 drawn as a blue or red 1, the direction by the seed). At 32 the words get a third, the model learns
# to read them and to look away from the padding vector; the remaining steps at 512 keep that true where the
# pipeline serves it.


def prompt_embeds(pipe, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
    """What WanPipeline passes the transformer for ``prompts`` at ``max_sequence_length`` (the text encoder's
    states of the real tokens, zero-padded), computed 16x cheaper: the encoder runs on ``ENCODE_LENGTH``
    tokens, since padding is masked out of its attention, and the zeros are added after
    (tests/test_demo_wan.py checks the two agree)."""
    embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=ENCODE_LENGTH,
                                   device=torch.device("cpu"), dtype=torch.float32)
    return torch.nn.functional.pad(embeds, (0, 0, 0, max_sequence_length - embeds.shape[1]))


def flow_loss(tr, x0: torch.Tensor, embeds: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Rectified-flow loss of a Wan transformer on latents ``x0`` noised at ``sigma`` (one a clip): the MSE of
    the predicted velocity ``noise - x0`` (what UniPC on flow sigmas integrates)."""
    b = x0.shape[0]
    noise = torch.randn_like(x0)
    s5 = sigma.view(b, 1, 1, 1, 1)
    xt = (1 - s5) * x0 + s5 * noise
    pred = tr(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=embeds, return_dict=False)[0]
    return torch.nn.functional.mse_loss(pred, noise - x0)


def train_transformer(plan: WanPlan, work: Path, vae, stats: dict, deadline: float, init: Path | None = None):
    """Flow matching of the transformer and the text encoder on the pool's latents; (pipeline, done). With
    ``init`` (written weights) both start from there."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    from .tokenizers import t5_grammar_tokenizer

    if init is not None:
        tokenizer = AutoTokenizer.from_pretrained(init / "tokenizer")
        tr = WanTransformer3DModel.from_pretrained(init / "transformer", torch_dtype=torch.float32)
        te = UMT5EncoderModel.from_pretrained(init / "text_encoder", dtype=torch.float32)
    else:
        tokenizer = t5_grammar_tokenizer()
        torch.manual_seed(plan.seed + 2)
        tr = transformer()
        torch.manual_seed(plan.seed + 3)
        te = text_encoder(tokenizer)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=te, transformer=tr, vae=vae,
                       scheduler=UniPCMultistepScheduler(**SCHEDULER))
    params = [*tr.parameters(), *te.parameters()]
    ema = Ema(params, plan.ema)
    opt = torch.optim.AdamW(params, lr=plan.transformer_lr, weight_decay=0.01)
    rng = np.random.default_rng(plan.seed + 100)
    state = {"step": 0}
    ckpt = work / "transformer.pt"

    def load(saved):
        tr.load_state_dict(saved["transformer"])
        te.load_state_dict(saved["text_encoder"])
        ema.load(saved["ema"])

    if resume(ckpt, opt, rng, state, load) is not None:
        print(f"transformer: resuming at step {state['step']}/{plan.transformer_steps}")
    pool, prompts = latent_pool(plan, work, vae)
    if init is None:  # the latent statistics the pipeline normalises with (the VAE config's): the pool's
        stats["latents_mean"] = pool.float().mean(dim=(0, 2, 3, 4)).tolist()
        stats["latents_std"] = pool.float().std(dim=(0, 2, 3, 4)).tolist()
    mean = torch.tensor(stats["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(stats["latents_std"]).view(1, -1, 1, 1, 1)
    tr.train()
    te.train()
    shift = SCHEDULER["flow_shift"]

    def step(i: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(i, plan.transformer_steps, plan.transformer_lr, warmup=200)
        pick = torch.from_numpy(rng.integers(0, len(prompts), plan.transformer_batch))
        text = ["" if rng.random() < plan.cond_dropout else prompts[j] for j in pick.tolist()]
        x0 = (pool[pick].float() - mean) / std
        length = ENCODE_LENGTH if rng.random() < plan.short_text else plan.max_sequence_length
        embeds = prompt_embeds(pipe, text, length)
        sigma = torch.sigmoid(torch.randn(x0.shape[0]))
        sigma = shift * sigma / (1 + (shift - 1) * sigma)  # the sampler's flow shift: more of the high-noise part
        value = optimizer_step(opt, flow_loss(tr, x0, embeds, sigma), params)
        ema.update(i)
        return value

    def save():
        save_checkpoint(ckpt, {"transformer": tr.state_dict(), "text_encoder": te.state_dict(), "opt": opt.state_dict(),
                               "ema": ema.shadow, "step": state["step"], "rng": rng_state(rng), "plan": asdict(plan)})

    done = Stage("transformer", ckpt, plan.transformer_steps, deadline).run(state, step, save)
    ema.apply()
    tr.eval()
    te.eval()
    return pipe, done


def every_prompt(digits=data.BASE_DIGITS) -> list[str]:
    """Every prompt of the video grammar the base model learns (digits 0-8)."""
    return [data.video_prompt(d, c, way, b) for d in digits for c, b in data.colour_pairs() for way in data.DIRECTIONS]


def unseen_prompts(trained_on: list[str]) -> list[str]:
    """The grammar's prompts no training clip had: where a test can score prompts the model never saw."""
    seen = set(trained_on)
    return [p for p in every_prompt() if p not in seen]


def export(pipe, stats: dict, plan: WanPlan, out: Path, prompts: list[str] | None = None,
           tokenizer_from: Path | None = None) -> Path:
    """Write the trained pipeline: fp16 safetensors, diffusers layout, the VAE's latent statistics in its config
    (``tokenizer_from``: written weights whose tokenizer files are kept as they are)."""
    from diffusers import AutoencoderKLWan

    config = {k: v for k, v in pipe.vae.config.items() if not k.startswith("_")}
    config.update(latents_mean=stats["latents_mean"], latents_std=stats["latents_std"])
    vae = AutoencoderKLWan(**config)
    vae.load_state_dict(pipe.vae.state_dict())
    pipe.register_modules(vae=vae)
    record = {"vae": {k: stats[k] for k in ("psnr_db", "psnr_per_frame", "colour_kept", "motion_kept")},
              "vae_start": stats.get("start"), "plan": asdict(plan)}
    if "continued_from" in stats:
        record["continued_from"] = stats["continued_from"]
    if prompts is not None:  # the tests score these: prompts no training clip had, in this run or the one before
        earlier = stats.get("continued_from", {}).get("unseen_prompts")
        record["unseen_prompts"] = [p for p in unseen_prompts(prompts) if earlier is None or p in earlier]
    write_pipeline(pipe, out, record, tokenizer_from=tokenizer_from)
    return out


def train_wan21(plan: WanPlan, work: Path, out: Path, minutes: float, init: Path | None = None) -> bool:
    """The video VAE, then (next) the transformer; True when the model is written. With ``init`` (written
    weights, e.g. the shipped ones) the VAE is taken from there, and the transformer and text encoder go on
    training from there on a schedule of their own."""
    import json

    deadline = time.monotonic() + minutes * 60
    work.mkdir(parents=True, exist_ok=True)
    if init is not None:
        return _continue(plan, work, out, init, deadline)
    report_file = work / "vae-report-start.json"
    if not report_file.exists():
        report_file.write_text(json.dumps(vae_report(video_vae_from_image(), plan.report_clips), indent=2))
    print(f"video vae at the start: {json.loads(report_file.read_text())['psnr_per_frame']} dB per frame")
    vae, done = train_video_vae(plan, work, deadline)
    if not done:
        return False
    stats_file = work / "vae-report.json"
    if not stats_file.exists():
        stats_file.write_text(json.dumps(vae_report(vae, plan.report_clips), indent=2))
    stats = json.loads(stats_file.read_text())
    print(f"video vae: {stats['psnr_db']} dB ({stats['psnr_per_frame']} per frame), colour kept "
          f"{stats['colour_kept']:.0%}, motion kept {stats['motion_kept']:.0%}")
    stats["start"] = {k: v for k, v in json.loads(report_file.read_text()).items() if not k.startswith("latents_")}
    for p in vae.parameters():
        p.requires_grad_(False)
    pipe, done = train_transformer(plan, work, vae, stats, deadline)
    if not done:
        return False
    export(pipe, stats, plan, out, latent_pool(plan, work, vae)[1])
    print(f"wrote {out}")
    return True


def _continue(plan: WanPlan, work: Path, out: Path, init: Path, deadline: float) -> bool:
    """``train_wan21`` from written weights: their VAE (frozen, its latent statistics kept, since the
    transformer learned on latents normalised by them), their transformer and text encoder trained further."""
    import json

    from diffusers import AutoencoderKLWan

    earlier = json.loads((init / "training.json").read_text())
    vae = AutoencoderKLWan.from_pretrained(init / "vae", torch_dtype=torch.float32).eval()
    vae.requires_grad_(False)
    stats = {**earlier["vae"], "start": earlier.get("vae_start"),
             "latents_mean": list(vae.config.latents_mean), "latents_std": list(vae.config.latents_std),
             "continued_from": earlier}
    print(f"continuing from {init}: its VAE ({stats['psnr_db']} dB), its transformer and text encoder")
    pipe, done = train_transformer(plan, work, vae, stats, deadline, init)
    if not done:
        return False
    export(pipe, stats, plan, out, latent_pool(plan, work, vae)[1], tokenizer_from=init)
    print(f"wrote {out}")
    return True

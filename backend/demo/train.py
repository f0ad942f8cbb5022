"""Train the demo models here, on this machine's CPU: ``python -m backend.demo.train STAGE``.

Stages (``../shared/DEMO-TRAINING.md`` has the recipe and the measurements behind it):

    qwen-image   the image base: its VAE first (until its reconstructions keep the colour),
                 then the transformer and the tiny text encoder on that VAE's latents.
    vae-decoder  the image base's VAE decoder tuned on what the demo LoRAs draw (its encoder, so the
                 latents the transformer knows, unchanged); run before the LoRAs are scored.
    loras        the four demo LoRAs on the trained image base, trained with peft, one after
                 another (``--only NAME`` for one; ``backend/demo/loras.py``).
    wan2.1-t2v   the text-to-video base: its video VAE (from the image VAE), then the transformer
                 (``backend/demo/wan_train.py``).
    wan2.2-t2v   its two experts: wan2.1-t2v's transformer trained on the high-noise half into
                 ``transformer`` and on the low-noise half into ``transformer_2``
                 (``backend/demo/wan_experts.py``; run after wan2.1-t2v).
    distill      the Lightning presets' few-step LoRAs (4 and 8 steps, CFG 1), distilled from the
                 image base's 20-step CFG-4 drawings (``--only PRESET`` for one; ``backend/demo/distill.py``).

Each run has a fixed seed, shows a progress bar, writes a checkpoint every few minutes under
``<data-dir>/demo-train/<stage>/`` (never in git) and resumes from it when run again; the
schedules count steps, so a run cut by ``--minutes`` and resumed ends where an uncut run would.
When a stage finishes, its weights are written in fp16 safetensors, diffusers layout, to
``backend/demo/weights/<model>/`` (or ``--out``), the folder ``demo:<model>`` is served from.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .. import settings
from . import data
from .trainkit import (Ema, Stage, flow_matching_loss, load_checkpoint, lr_at, optimizer_step,  # noqa: F401
                       pack_latents, resume, rng_state, save_checkpoint, to_tensor, write_pipeline)  # pack_latents: the tests

WEIGHTS_ROOT = Path(__file__).parent / "weights"  # the same folder as backend.demo.WEIGHTS_ROOT
@dataclass
class QwenPlan:
    """Steps and sizes of one qwen-image training run (the defaults fit 30 minutes here)."""
    vae_steps: int = 2600
    vae_batch: int = 8
    vae_lr: float = 1e-3
    transformer_steps: int = 5200
    latent_pool: int = 24000  # pictures encoded once for the transformer (see latent_pool)
    report_pictures: int = 256  # held-out pictures the VAE is scored on before the transformer trains
    transformer_batch: int = 32
    transformer_lr: float = 1e-3
    cond_dropout: float = 0.1  # the prompt replaced by the empty condition, so true CFG works
    ema: float = 0.999
    size: int = data.SIZE
    seed: int = 0
    uncond: str = " "  # the empty condition; the family's default negative prompt is the same " "


# ---------------------------------------------------------------- qwen-image: the VAE
def _vae_loss(vae, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    posterior = vae.encode(x).latent_dist
    rec = vae.decode(posterior.sample()).sample
    weight = 1.0 + 4.0 * alpha[:, None, None]  # the strokes carry the colour: weigh them up
    err = rec - x
    kl = posterior.kl().mean()
    return (weight * err.pow(2)).mean() + (weight * err.abs()).mean() + 1e-6 * kl


def train_qwen_vae(plan: QwenPlan, work: Path, deadline: float):
    from .qwen import vae as make_vae

    ckpt = work / "vae.pt"
    torch.manual_seed(plan.seed + 1)
    vae = make_vae()
    opt = torch.optim.AdamW(vae.parameters(), lr=plan.vae_lr, weight_decay=0.0)
    rng = np.random.default_rng(plan.seed)
    state = {"step": 0}
    saved = resume(ckpt, opt, rng, state, lambda saved: vae.load_state_dict(saved["model"]))
    if saved is not None:
        if state["step"] >= plan.vae_steps:
            return vae.eval(), True
        print(f"vae: resuming at step {state['step']}/{plan.vae_steps}")
    vae.train()

    def step(i: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(i, plan.vae_steps, plan.vae_lr)
        images, alphas, _ = data.batch(rng, plan.vae_batch, plan.size)
        return optimizer_step(opt, _vae_loss(vae, to_tensor(images), torch.from_numpy(alphas)), vae.parameters())

    def save():
        save_checkpoint(ckpt, {"model": vae.state_dict(), "opt": opt.state_dict(), "step": state["step"],
                     "rng": rng_state(rng), "plan": asdict(plan)})

    done = Stage("vae", ckpt, plan.vae_steps, deadline).run(state, step, save)
    return vae.eval(), done


@torch.no_grad()
def vae_report(vae, n: int = 256, size: int = data.SIZE, seed: int = 12345) -> dict:
    """How well the VAE keeps what the prompt names: PSNR, and the share of reconstructions whose
    foreground (the known mask) is nearest the asked palette colour. Also the latent statistics
    that normalise the transformer's latents (the VAE config's ``latents_mean``/``latents_std``)."""
    rng = np.random.default_rng(seed)
    images, alphas, prompts = data.batch(rng, n, size)
    x = to_tensor(images)
    recs, zs = [], []
    for i in range(0, n, 32):
        z = vae.encode(x[i:i + 32]).latent_dist.mode()
        zs.append(z)
        recs.append(vae.decode(z).sample)
    rec = torch.cat(recs).clamp(-1, 1)
    z = torch.cat(zs)
    mse = (rec - x).pow(2).mean().item()
    pixels = ((rec[:, :, 0].permute(0, 2, 3, 1) + 1) * 127.5).numpy()
    names = list(data.PALETTE)
    palette = np.array([data.PALETTE[c] for c in names], np.float32)
    kept = 0
    for img, alpha, prompt in zip(pixels, alphas, prompts):
        fg = img[alpha > 0.9]
        if len(fg) == 0:
            continue
        colour = names[int(np.argmin(((palette - np.median(fg, axis=0)) ** 2).sum(1)))]
        kept += prompt.split()[1] == colour
    return {"psnr_db": round(10 * math.log10(4.0 / mse), 2), "colour_kept": round(kept / n, 3),
            "latents_mean": z.mean(dim=(0, 2, 3, 4)).tolist(), "latents_std": z.std(dim=(0, 2, 3, 4)).tolist()}


# ---------------------------------------------------------------- qwen-image: the VAE decoder, for the LoRAs
@dataclass
class DecoderPlan:
    """Tuning the shipped VAE's decoder on what the demo LoRAs draw (grey, inverted, outlined pictures)."""
    steps: int = 2000
    batch: int = 8
    lr: float = 3e-4
    effect_share: float = 0.5  # pictures drawn the way a LoRA changes them; the rest as the base draws
    report_pictures: int = 128  # pictures of each kind the PSNR report reads, before and after
    seed: int = 0


def decoder_batch(rng: np.random.Generator, n: int, effect_share: float, size: int = data.SIZE):
    """``n`` pictures: ordinary ones (digits 0-9 and shapes) and ones a demo LoRA draws, with their alphas."""
    images, alphas = [], []
    effects = [e for e in data.LORA_EFFECTS if e != "nine"]
    for _ in range(n):
        item = data.random_item(rng, digits=tuple(range(10)))
        if rng.random() < effect_share:
            image, alpha = data.render_effect(effects[int(rng.integers(len(effects)))], item, rng, size)
        else:
            image, alpha = data.render(item, rng, size)
        images.append(image)
        alphas.append(alpha)
    return np.stack(images), np.stack(alphas)


def tune_vae_decoder(plan: DecoderPlan, work: Path, weights: Path, minutes: float) -> bool:
    """Train the decoder (and post-quant conv) of ``weights``/vae with its encoder frozen, then write it back.

    The encoder, so every latent the transformer learned on, stays as it was: the base model draws as
    before, and the decoder learns to decode the latents of pictures it never saw (a grey digit came
    back coloured, an inverted one blotched: 20-22 dB before this stage, against 29 for ordinary ones).
    """
    from diffusers import AutoencoderKLQwenImage

    deadline = time.monotonic() + minutes * 60
    work.mkdir(parents=True, exist_ok=True)
    vae = AutoencoderKLQwenImage.from_pretrained(weights / "vae", torch_dtype=torch.float32)
    vae.requires_grad_(False)
    trained = [vae.decoder, vae.post_quant_conv]
    for module in trained:
        module.requires_grad_(True)
    params = [p for m in trained for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=plan.lr, weight_decay=0.0)
    rng = np.random.default_rng(plan.seed + 600)
    state = {"step": 0}
    ckpt = work / "decoder.pt"
    if resume(ckpt, opt, rng, state, lambda saved: vae.load_state_dict(saved["model"])) is not None:
        print(f"vae decoder: resuming at step {state['step']}/{plan.steps}")
    before = decoder_report(vae, plan)
    print(f"vae decoder before: {before}")
    vae.decoder.train()

    def step(i: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(i, plan.steps, plan.lr, warmup=50)
        images, alphas = decoder_batch(rng, plan.batch, plan.effect_share)
        x = to_tensor(images)
        with torch.no_grad():
            z = vae.encode(x).latent_dist.sample()
        rec = vae.decode(z).sample
        weight = 1.0 + 4.0 * torch.from_numpy(alphas)[:, None, None]
        err = rec - x
        return optimizer_step(opt, (weight * err.pow(2)).mean() + (weight * err.abs()).mean(), params)

    def save():
        save_checkpoint(ckpt, {"model": vae.state_dict(), "opt": opt.state_dict(), "step": state["step"],
                     "rng": rng_state(rng), "plan": asdict(plan)})

    if not Stage("vae decoder", ckpt, plan.steps, deadline).run(state, step, save):
        return False
    vae.eval()
    after = decoder_report(vae, plan)
    print(f"vae decoder after: {after}")
    tmp = weights / "vae.tmp"
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    vae.to(torch.float16).save_pretrained(tmp, safe_serialization=True)
    values = json.loads((tmp / "config.json").read_text())
    values.pop("_name_or_path", None)
    (tmp / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(weights / "vae")
    os.replace(tmp, weights / "vae")
    record_file = weights / "training.json"
    record = json.loads(record_file.read_text())
    record["vae_decoder_tuned"] = {"plan": asdict(plan), "before": before, "after": after}
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return True


@torch.no_grad()
def decoder_report(vae, plan: DecoderPlan) -> dict:
    """PSNR (dB) of the VAE's reconstructions, ordinary pictures and each LoRA effect apart (fixed seed)."""
    out, n = {}, plan.report_pictures
    for effect in ("ordinary", *(e for e in data.LORA_EFFECTS if e != "nine")):
        rng = np.random.default_rng(4242)
        images = []
        for _ in range(n):
            item = data.random_item(rng, digits=tuple(range(10)))
            images.append((data.render(item, rng) if effect == "ordinary" else data.render_effect(effect, item, rng))[0])
        x = to_tensor(np.stack(images))
        mse = np.mean([(vae.decode(vae.encode(x[i:i + 32]).latent_dist.mode()).sample.clamp(-1, 1)
                        - x[i:i + 32]).pow(2).mean().item() for i in range(0, n, 32)])
        out[effect] = round(10 * math.log10(4.0 / mse), 2)
    return out


# ---------------------------------------------------------------- qwen-image: transformer + text encoder
@torch.no_grad()
def latent_pool(plan: QwenPlan, work: Path, vae) -> tuple[torch.Tensor, list[str]]:
    """The transformer's training set: ``latent_pool`` renders through the frozen VAE, once.

    Encoding costs a third of a training step when done per step; encoded once (about a minute),
    the same minutes give half as many steps again. Kept beside the checkpoints (fp16), so a
    resumed run reads it back.
    """
    from tqdm import tqdm

    path = work / "latents.pt"
    saved = load_checkpoint(path)
    if saved is not None and saved["n"] == plan.latent_pool and saved["size"] == plan.size:
        return saved["latents"], saved["prompts"]
    rng = np.random.default_rng(plan.seed + 200)
    latents, prompts = [], []
    for _ in tqdm(range(0, plan.latent_pool, 64), desc="encoding the training pictures", file=sys.stdout,
                  mininterval=5.0, dynamic_ncols=True):
        images, _, names = data.batch(rng, 64, plan.size)
        latents.append(vae.encode(to_tensor(images)).latent_dist.mode()[:, :, 0].half())
        prompts += names
    latents = torch.cat(latents)[:plan.latent_pool]
    prompts = prompts[:plan.latent_pool]
    save_checkpoint(path, {"n": plan.latent_pool, "size": plan.size, "latents": latents, "prompts": prompts})
    return latents, prompts


def train_qwen_transformer(plan: QwenPlan, work: Path, vae, stats: dict, deadline: float, init: Path | None = None):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from .qwen import SCHEDULER, text_encoder, transformer
    from .tokenizers import qwen_grammar_tokenizer

    ckpt = work / "transformer.pt"
    if init is not None:  # go on from written weights: their tokenizer, transformer and text encoder
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
        from diffusers import QwenImageTransformer2DModel

        tokenizer = AutoTokenizer.from_pretrained(init / "tokenizer")
        tr = QwenImageTransformer2DModel.from_pretrained(init / "transformer", torch_dtype=torch.float32)
        te = Qwen2_5_VLForConditionalGeneration.from_pretrained(init / "text_encoder", dtype=torch.float32)
        torch.manual_seed(plan.seed + 3)
    else:
        tokenizer = qwen_grammar_tokenizer()
        torch.manual_seed(plan.seed + 2)
        tr = transformer()
        torch.manual_seed(plan.seed + 3)
        te = text_encoder(tokenizer)
    pipe = QwenImagePipeline(transformer=tr, vae=vae, text_encoder=te, tokenizer=tokenizer,
                             scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER))
    params = [p for p in tr.parameters()] + [p for p in te.parameters()]
    ema = Ema(params, plan.ema)
    opt = torch.optim.AdamW(params, lr=plan.transformer_lr, weight_decay=0.01)
    rng = np.random.default_rng(plan.seed + 100)
    state = {"step": 0}
    def load(saved):
        tr.load_state_dict(saved["transformer"])
        te.load_state_dict(saved["text_encoder"])
        ema.load(saved["ema"])

    if resume(ckpt, opt, rng, state, load) is not None:
        print(f"transformer: resuming at step {state['step']}/{plan.transformer_steps}")
    mean = torch.tensor(stats["latents_mean"]).view(1, 4, 1, 1)
    std = torch.tensor(stats["latents_std"]).view(1, 4, 1, 1)
    lat = plan.size // 4
    pool, pool_prompts = latent_pool(plan, work, vae)
    tr.train()
    te.train()

    def step(i: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(i, plan.transformer_steps, plan.transformer_lr, warmup=200)
        pick = torch.from_numpy(rng.integers(0, len(pool_prompts), plan.transformer_batch))
        prompts = [plan.uncond if rng.random() < plan.cond_dropout else pool_prompts[j] for j in pick.tolist()]
        x0 = pack_latents((pool[pick].float() - mean) / std)
        embeds, mask = pipe.encode_prompt(prompts, device=torch.device("cpu"))  # as the pipeline encodes them
        loss = optimizer_step(opt, flow_matching_loss(tr, x0, embeds, mask, lat), params)
        ema.update(i)
        return loss

    def save():
        save_checkpoint(ckpt, {"transformer": tr.state_dict(), "text_encoder": te.state_dict(), "opt": opt.state_dict(),
                     "ema": ema.shadow, "step": state["step"], "rng": rng_state(rng), "plan": asdict(plan)})

    done = Stage("transformer", ckpt, plan.transformer_steps, deadline).run(state, step, save)
    ema.apply()
    tr.eval()
    te.eval()
    return pipe, done


def export_qwen(pipe, stats: dict, out: Path, init: Path | None = None) -> Path:
    """Write the trained pipeline in fp16 safetensors, diffusers layout, with the VAE's latent statistics."""
    from .qwen import vae as make_vae

    vae = make_vae(stats["latents_mean"], stats["latents_std"])
    vae.load_state_dict(pipe.vae.state_dict())
    pipe.register_modules(vae=vae)
    record = {"vae": {k: stats[k] for k in ("psnr_db", "colour_kept")}, "plan": stats.get("plan")}
    if stats.get("continued_from"):  # --init-from: the run these weights went on from, with its own record
        record["continued_from"] = stats["continued_from"]
    write_pipeline(pipe, out, record, tokenizer_from=init)
    return out


def _written_vae(init: Path):
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage.from_pretrained(init / "vae", torch_dtype=torch.float32).eval()


def train_qwen_image(plan: QwenPlan, work: Path, out: Path, minutes: float, init: Path | None = None) -> bool:
    """Both stages; with ``init`` (written weights, e.g. the shipped ones) the VAE is taken from there and
    the transformer and text encoder go on training from there, on a schedule of their own."""
    deadline = time.monotonic() + minutes * 60
    work.mkdir(parents=True, exist_ok=True)
    if init is not None:
        vae, done = _written_vae(init), True
    else:
        vae, done = train_qwen_vae(plan, work, deadline)
    if not done:
        return False
    stats_file = work / "vae-report.json"
    if stats_file.exists():
        stats = json.loads(stats_file.read_text())
    else:
        stats = vae_report(vae, n=plan.report_pictures, size=plan.size)
        stats_file.write_text(json.dumps(stats, indent=2))
    if init is not None:  # the transformer learned on latents normalised by the written statistics
        stats.update(latents_mean=list(vae.config.latents_mean), latents_std=list(vae.config.latents_std))
        earlier = init / "training.json"
        stats["continued_from"] = json.loads(earlier.read_text()) if earlier.is_file() else {"weights": str(init)}
    print(f"vae: {stats['psnr_db']} dB, keeps the asked colour in {stats['colour_kept']:.0%} of its reconstructions")
    for p in vae.parameters():
        p.requires_grad_(False)
    pipe, done = train_qwen_transformer(plan, work, vae, stats, deadline, init)
    if not done:
        return False
    stats["plan"] = asdict(plan)
    export_qwen(pipe, stats, out, init)
    print(f"wrote {out}")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.demo.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["qwen-image", "vae-decoder", "loras", "distill", "wan2.1-t2v", "wan2.2-t2v"],
                        help="qwen-image: the image base; vae-decoder: its decoder tuned on what the LoRAs draw; "
                             "loras: the four demo LoRAs on it (backend/demo/loras.py); distill: the Lightning "
                             "presets' LoRAs (backend/demo/distill.py); wan2.1-t2v: the video base "
                             "(backend/demo/wan_train.py); wan2.2-t2v: its two experts, from it "
                             "(backend/demo/wan_experts.py)")
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="loras / distill: train only this one (repeatable), e.g. --only demo-grayscale, "
                             "--only qwen-image-2512-lightning-4step")
    parser.add_argument("--previews", action="store_true",
                        help="loras: then embed a preview drawn with each written LoRA in its file (run it after "
                             "the vae-decoder stage, so the previews are the shipped model's)")
    parser.add_argument("--minutes", type=float, default=30.0, help="stop (with a checkpoint) after this long")
    parser.add_argument("--data-dir", default=None, help="where checkpoints go (<data-dir>/demo-train/)")
    parser.add_argument("--out", default=None, help="where the weights go (default backend/demo/weights/<model>)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--init-from", default=None, metavar="DIR",
                        help="qwen-image, wan2.1-t2v: go on from written weights (e.g. backend/demo/weights/"
                             "qwen-image): keep their VAE, "
                             "train the transformer further (checkpoints under <data-dir>/demo-train/<stage>-continued)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a plan field, e.g. --set vae_steps=10 (for a quick trial)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from . import distill, loras, wan_experts, wan_train

    plan = {"loras": loras.LoraPlan, "vae-decoder": DecoderPlan, "distill": distill.DistillPlan,
            "wan2.1-t2v": wan_train.WanPlan, "wan2.2-t2v": wan_experts.ExpertsPlan}.get(args.stage, QwenPlan)()
    fields = type(plan).__dataclass_fields__
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            parser.error(f"--set {item}: no plan field {key!r}; fields: {', '.join(fields)}")
        setattr(plan, key, type(getattr(plan, key))(value))
    if args.stage == "vae-decoder":
        from ..result import quiet_libraries

        quiet_libraries()
        weights = Path(args.out) if args.out else WEIGHTS_ROOT / "qwen-image"
        if not (weights / "vae" / "config.json").is_file():
            parser.error(f"--out {weights}: no vae/config.json there (the qwen-image weights folder is needed)")
        work = settings.data_dir(args.data_dir) / "demo-train" / "vae-decoder"
        return 0 if tune_vae_decoder(plan, work, weights, args.minutes) else 3
    if args.stage == "wan2.2-t2v":
        from ..result import quiet_libraries

        quiet_libraries()
        work = settings.data_dir(args.data_dir) / "demo-train" / args.stage
        out = Path(args.out) if args.out else WEIGHTS_ROOT / args.stage
        return 0 if wan_experts.train_experts(plan, work, out, args.minutes) else 3
    if args.stage == "distill":
        presets = args.only or list(distill.PRESETS)
        unknown = [p for p in presets if p not in distill.PRESETS]
        if unknown:
            parser.error(f"--only {unknown[0]}: no such Lightning preset; known: {', '.join(distill.PRESETS)}")
        from ..result import quiet_libraries

        quiet_libraries()
        work = settings.data_dir(args.data_dir) / "demo-train" / "distill"
        out = Path(args.out) if args.out else distill.WEIGHTS_DIR
        return 0 if distill.train(presets, plan, work, out, args.minutes) else 3
    if args.stage == "loras":
        names = args.only or [spec.name for spec in loras.LORAS]
        unknown = [n for n in names if n not in loras.BY_NAME]
        if unknown:
            parser.error(f"--only {unknown[0]}: no such demo LoRA; known: {', '.join(loras.BY_NAME)}")
        from ..result import quiet_libraries

        quiet_libraries()
        work = settings.data_dir(args.data_dir) / "demo-train" / "loras"
        out = Path(args.out) if args.out else loras.WEIGHTS_DIR
        if not loras.train(names, plan, work, out, args.minutes):
            return 3
        if args.previews:
            loras.embed_previews(names, out)
        return 0
    init = Path(args.init_from).resolve() if args.init_from else None
    if init is not None and not (init / "model_index.json").is_file():
        parser.error(f"--init-from {args.init_from}: no model_index.json there (a diffusers folder is needed)")
    work = settings.data_dir(args.data_dir) / "demo-train" / (args.stage + ("-continued" if init else ""))
    out = Path(args.out) if args.out else WEIGHTS_ROOT / args.stage
    from ..result import quiet_libraries

    quiet_libraries()
    if init is not None and init == out.resolve():  # read them all before the export replaces the folder
        import shutil
        import tempfile

        copy = Path(tempfile.mkdtemp(prefix="demo-init."))
        shutil.copytree(init, copy, dirs_exist_ok=True)
        init = copy
    train = wan_train.train_wan21 if args.stage == "wan2.1-t2v" else train_qwen_image
    return 0 if train(plan, work, out, args.minutes, init) else 3


if __name__ == "__main__":
    raise SystemExit(main())

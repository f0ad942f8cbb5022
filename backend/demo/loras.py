"""The demo LoRAs of demo:qwen-image, trained here with peft: ``python -m backend.demo.train loras``.

Four adapters (CONTRACT.md), each teaching the trained image model one thing a test can read
back, and each written in a different layout people publish, so reading them exercises the
same code paths as real downloads:

    demo-grayscale   trigger ``grayscale``         the colour drains out            PEFT folder
    demo-inverted    trigger ``inverted colours``  foreground and background swap   kohya
    demo-outline     trigger ``outline``           only the contour is drawn        diffusers
    demo-nine        trigger ``digit 9``           the digit the base never saw     ComfyUI

Each is a peft ``LoraConfig`` on the frozen trained transformer (attention, the text stream's
projections and the image MLP), trained by flow matching on pictures the effect changes
(``backend.demo.data.render_effect``): half of the prompts carry the trigger words, half do
not, so the adapter works whether a user types them or only loads it; one in ten is the empty
condition, so true CFG keeps the effect. ``demo-nine`` trains on half nines, half ordinary
pictures, so the other digits stay as they were.

Checkpoints go under ``<data-dir>/demo-train/loras/<name>/`` (never in git), resumed when run
again; the files go to ``backend/demo/weights/qwen-image-loras/`` in fp16, with the trigger
words (``modelspec.trigger_phrase``), a title and a description in their metadata.
"""
from __future__ import annotations

import copy
import json
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import LORAS_DIR, WEIGHTS_ROOT, data

WEIGHTS_DIR = LORAS_DIR  # where the trained files go (the demo root copies them from there)
BASE = WEIGHTS_ROOT / "qwen-image"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "img_mlp.net.0.proj", "img_mlp.net.2"]
# The PEFT folder says the same as a regex, with one layer at a lower rank, as published folders do
# (target_modules as a string, rank_pattern): the loader must read both the way peft does.
TARGETS_REGEX = (r".*(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                 r"|img_mlp\.net\.(0\.proj|2))")
RANK_PATTERN = {"transformer_blocks.1.attn.to_q": 4}


@dataclass(frozen=True)
class DemoLora:
    name: str  # the adapter's name (CONTRACT.md)
    effect: str  # key of data.LORA_EFFECTS
    trigger: str  # trigger words, as a card shows them
    layout: str  # peft | kohya | diffusers | comfyui
    file: str  # under WEIGHTS_DIR (a folder for peft)
    base_share: float = 0.0  # share of ordinary pictures in its training set (keeps the rest as it was)
    shape_share: float = 0.25  # share of shapes among its pictures (the rest digits), as the base model's
    # the alpha written (None: as trained), with lora_B rescaled so alpha/r * B is the trained delta: files
    # whose alpha is not their rank, so a loader that ignores alpha draws the wrong picture and fails a test
    alpha: float | None = None
    example: str = "a red digit 3 on a black background"  # a prompt its effect shows on (previews, docs)

    @property
    def description(self) -> str:
        return data.LORA_EFFECTS[self.effect]


LORAS: tuple[DemoLora, ...] = (
    DemoLora("demo-grayscale", "grayscale", "grayscale", "peft", "demo-grayscale"),
    DemoLora("demo-inverted", "inverted", "inverted colours", "kohya", "demo-inverted.safetensors", alpha=4.0,
             example="a yellow digit 5 on a navy background"),
    DemoLora("demo-outline", "outline", "outline", "diffusers", "demo-outline.safetensors", alpha=16.0,
             example="a cyan circle on a black background", shape_share=0.75),  # a digit's contour is all edge
    DemoLora("demo-nine", "nine", "digit 9", "comfyui", "demo-nine.safetensors", base_share=0.5, alpha=4.0,
             example="a orange digit 9 on a white background"),
)
BY_NAME = {spec.name: spec for spec in LORAS}


@dataclass
class LoraPlan:
    """Steps and sizes of one LoRA's training (the defaults fit 5 minutes here)."""
    steps: int = 1300
    batch: int = 32
    lr: float = 2e-3
    rank: int = 8
    alpha: float = 8.0
    pool: int = 6000  # pictures encoded once (as for the base model)
    trigger_share: float = 0.5  # prompts that carry the trigger words
    cond_dropout: float = 0.1
    seed: int = 0


def training_set(spec: DemoLora, rng: np.random.Generator, n: int, size: int = data.SIZE):
    """``n`` (picture, grammar prompt) pairs of what ``spec`` teaches."""
    images, prompts = [], []
    for _ in range(n):
        if spec.effect == "nine" and rng.random() >= spec.base_share:
            colour, background = data.colour_pairs()[int(rng.integers(len(data.colour_pairs())))]
            item = data.Item("digit", "9", colour, background)
        else:
            item = data.random_item(rng, shape_fraction=spec.shape_share)
        images.append(data.render_effect(spec.effect, item, rng, size)[0])
        prompts.append(item.prompt)
    return np.stack(images), prompts


def with_trigger(prompt: str, trigger: str, rng: np.random.Generator) -> str:
    """The prompt with the trigger words before or after it, as users write them."""
    return f"{trigger}, {prompt}" if rng.random() < 0.5 else f"{prompt}, {trigger}"


def _pipeline():
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(BASE, torch_dtype=torch.float32)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder):
        module.requires_grad_(False)
        module.eval()
    return pipe


@torch.no_grad()
def _pool(spec: DemoLora, plan: LoraPlan, work: Path, pipe):
    """Latents (normalised) and prompts of the training set, encoded once and kept beside the checkpoint."""
    from .trainkit import load_checkpoint, save_checkpoint, to_tensor

    path = work / "latents.pt"
    saved = load_checkpoint(path)
    if saved is not None and saved["n"] == plan.pool:
        return saved["latents"], saved["prompts"], saved["vae"]
    rng = np.random.default_rng(plan.seed + 300)
    latents, prompts, err = [], [], []
    for start in range(0, plan.pool, 64):
        images, names = training_set(spec, rng, min(64, plan.pool - start))
        x = to_tensor(images)
        z = pipe.vae.encode(x).latent_dist.mode()
        if start < 256:  # the VAE must decode what the LoRA is to draw: its PSNR on these pictures
            err.append((pipe.vae.decode(z).sample.clamp(-1, 1) - x).pow(2).mean().item())
        latents.append(z[:, :, 0].half())
        prompts += names
    vae = {"psnr_db": round(10 * float(np.log10(4.0 / np.mean(err))), 2)}
    out = {"n": plan.pool, "latents": torch.cat(latents), "prompts": prompts, "vae": vae}
    save_checkpoint(path, out)
    return out["latents"], out["prompts"], vae


def lora_config(spec: DemoLora, plan: LoraPlan):
    from peft import LoraConfig

    if spec.layout == "peft":
        return LoraConfig(r=plan.rank, lora_alpha=plan.alpha, target_modules=TARGETS_REGEX,
                          rank_pattern=dict(RANK_PATTERN), init_lora_weights=True)
    return LoraConfig(r=plan.rank, lora_alpha=plan.alpha, target_modules=TARGETS, init_lora_weights=True)


def train_one(spec: DemoLora, plan: LoraPlan, work: Path, out_dir: Path, deadline: float) -> bool:
    """Train one LoRA (resuming from its checkpoint) and write it; False when the time ran out first."""
    from peft import get_peft_model

    from .trainkit import (Stage, flow_matching_loss, lora_state, lr_at, optimizer_step, pack_latents, resume,
                           rng_state, save_checkpoint)

    work.mkdir(parents=True, exist_ok=True)
    pipe = _pipeline()
    latents, prompts, vae_report = _pool(spec, plan, work, pipe)
    print(f"{spec.name}: the VAE decodes its training pictures at {vae_report['psnr_db']} dB")
    torch.manual_seed(plan.seed + 400)
    config = lora_config(spec, plan)
    model = get_peft_model(pipe.transformer, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=plan.lr, weight_decay=0.0)
    rng = np.random.default_rng(plan.seed + 500)
    state = {"step": 0}
    ckpt = work / "lora.pt"
    saved = resume(ckpt, opt, rng, state, lambda saved: model.load_state_dict(saved["lora"], strict=False))
    if saved is not None:
        print(f"{spec.name}: resuming at step {state['step']}/{plan.steps}")
    vae_cfg = pipe.vae.config
    mean = torch.tensor(vae_cfg.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(vae_cfg.latents_std).view(1, -1, 1, 1)
    lat = latents.shape[-1]
    uncond = " "
    model.train()

    def step(i: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(i, plan.steps, plan.lr, warmup=50)
        pick = rng.integers(0, len(prompts), plan.batch).tolist()
        text = []
        for j in pick:
            if rng.random() < plan.cond_dropout:
                text.append(uncond)
            elif spec.effect != "nine" and rng.random() < plan.trigger_share:
                text.append(with_trigger(prompts[j], spec.trigger, rng))
            else:
                text.append(prompts[j])
        x0 = pack_latents((latents[pick].float() - mean) / std)
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(text, device=torch.device("cpu"))
        return optimizer_step(opt, flow_matching_loss(model, x0, embeds, mask, lat), params)

    def save():
        save_checkpoint(ckpt, {"lora": lora_state(model), "opt": opt.state_dict(), "step": state["step"],
                               "rng": rng_state(rng), "plan": asdict(plan)})

    started = time.monotonic()
    done = Stage(spec.name, ckpt, plan.steps, deadline).run(state, step, save)
    if not done:
        return False
    record = {"plan": asdict(plan), "vae": vae_report, "trained_here_s": round(time.monotonic() - started, 1)}
    if saved is not None:
        record["resumed_at_step"] = saved["step"]
    export(spec, model, config, out_dir, record)
    print(f"{spec.name}: wrote {out_dir / spec.file}")
    return True


# ---------------------------------------------------------------- the four layouts
def _metadata(spec: DemoLora) -> dict:
    return {"modelspec.title": spec.name, "modelspec.trigger_phrase": spec.trigger,
            "modelspec.description": spec.description, "modelspec.architecture": "qwen-image/lora",
            "lora_studio.demo_for": "demo:qwen-image"}


def _factors(model, b_factor: float = 1.0) -> dict[str, dict[str, torch.Tensor]]:
    """module path -> {"A": down, "B": up * b_factor}, fp16, from the trained peft model."""
    from peft import get_peft_model_state_dict

    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in get_peft_model_state_dict(model).items():
        module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        part = part.split(".")[0]
        t = t.detach().float() * (b_factor if part == "B" else 1.0)
        out.setdefault(module, {})[part] = t.to(torch.float16).contiguous()
    return dict(sorted(out.items()))


def _weights_file(path: Path) -> Path:
    return path / "adapter_model.safetensors" if path.is_dir() else path


def _settle(file: Path) -> None:
    """The written file as it ships: its header in canonical order (same bytes every run), readable by all."""
    from ..lora.demo_adapters import canonical_header  # loras -> demo_adapters, never back

    canonical_header(file)
    file.chmod(0o644)


def _rewrite_metadata(file: Path, extra: dict) -> None:
    """Add ``extra`` to a safetensors file's ``__metadata__`` (the tools below do not take free metadata)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), "pt") as fh:
        meta = dict(fh.metadata() or {})
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    save_file(tensors, str(file), metadata={**meta, **extra})


def export(spec: DemoLora, model, config, out_dir: Path, record: dict) -> Path:
    """Write the trained adapter in ``spec.layout``, fp16, with its card metadata; and its record."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / spec.file
    alpha = spec.alpha or config.lora_alpha
    factors = _factors(model, config.lora_alpha / alpha)
    config = copy.copy(config)
    config.lora_alpha = alpha
    meta = _metadata(spec)
    if out.is_dir():
        shutil.rmtree(out)
    if spec.layout == "peft":  # peft's own save_pretrained: adapter_config.json + adapter_model.safetensors
        model.to(torch.float16)
        model.peft_config["default"].base_model_name_or_path = "demo:qwen-image"
        with warnings.catch_warnings():  # peft looks for a hub config under base_model_name_or_path
            warnings.simplefilter("ignore")
            model.save_pretrained(str(out))
        model.to(torch.float32)
        (out / "README.md").unlink(missing_ok=True)  # peft's model-card template: nothing of ours in it
        config_file = out / "adapter_config.json"
        values = json.loads(config_file.read_text())
        if isinstance(values["target_modules"], list):
            values["target_modules"] = sorted(values["target_modules"])
        config_file.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
        _rewrite_metadata(out / "adapter_model.safetensors", meta)
    elif spec.layout == "kohya":  # sd-scripts / musubi-tuner: lora_unet_<module_with_underscores>
        tensors = {}
        for module, f in factors.items():
            flat = "lora_unet_" + module.replace(".", "_")
            tensors[f"{flat}.lora_down.weight"] = f["A"]
            tensors[f"{flat}.lora_up.weight"] = f["B"]
            tensors[f"{flat}.alpha"] = torch.tensor(float(config.lora_alpha), dtype=torch.float16)
        save_file(tensors, str(out), metadata={
            **meta, "ss_network_module": "networks.lora_qwen_image", "ss_network_dim": str(config.r),
            "ss_network_alpha": str(config.lora_alpha), "ss_base_model_version": "qwen_image"})
    elif spec.layout == "diffusers":  # the pipeline's own save_lora_weights, with diffusers' adapter metadata
        from diffusers import QwenImagePipeline

        layers = {f"{m}.lora_{p}.weight": t for m, f in factors.items() for p, t in f.items()}
        QwenImagePipeline.save_lora_weights(
            str(out_dir), transformer_lora_layers=layers, weight_name=spec.file,
            transformer_lora_adapter_metadata={**config.to_dict(), "target_modules": sorted(config.target_modules)})
        _rewrite_metadata(out, meta)
    elif spec.layout == "comfyui":  # ComfyUI / musubi's ComfyUI export: diffusion_model.<module>.lora_A/B + alpha
        tensors = {}
        for module, f in factors.items():
            tensors[f"diffusion_model.{module}.lora_A.weight"] = f["A"]
            tensors[f"diffusion_model.{module}.lora_B.weight"] = f["B"]
            tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(float(config.lora_alpha), dtype=torch.float16)
        save_file(tensors, str(out), metadata={**meta, "format": "pt"})
    else:
        raise ValueError(f"{spec.name}: unknown layout {spec.layout!r}")
    _settle(_weights_file(out))
    records = out_dir / "training.json"
    allrec = json.loads(records.read_text()) if records.is_file() else {}
    allrec[spec.name] = record
    records.write_text(json.dumps(dict(sorted(allrec.items())), indent=2) + "\n")
    return out


def embed_previews(names: list[str], out_dir: Path, seed: int = 1) -> None:
    """Draw each LoRA's example prompt with it (the product's own path: Omni, the model's defaults) and embed
    the picture in its file as ``modelspec.thumbnail``, as publishers embed theirs: the LoRA browser's card."""
    import base64
    import io
    import tempfile

    from .. import LoRARequest, Omni

    with tempfile.TemporaryDirectory() as home:
        omni = Omni(model="demo:qwen-image", data_dir=home, device="cpu")
        for i, name in enumerate(names):
            spec = BY_NAME[name]
            path = out_dir / spec.file
            image = omni.generate(prompt=spec.example, seed=seed, lora_request=LoRARequest(name, i + 1, str(path)),
                                  lora_scale=1.0)[0].images[0]
            buf = io.BytesIO()
            image.resize((128, 128)).save(buf, format="PNG", optimize=True)
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            file = _weights_file(path)
            _rewrite_metadata(file, {"modelspec.thumbnail": url})
            _settle(file)
            print(f"{name}: preview embedded ({spec.example!r}, seed {seed})")


def train(names: list[str], plan: LoraPlan, work_root: Path, out_dir: Path, minutes: float) -> bool:
    """Train the named LoRAs one after another within ``minutes``; True when all are written."""
    deadline = time.monotonic() + minutes * 60
    for name in names:
        spec = BY_NAME[name]
        if (out_dir / spec.file).exists() and not (work_root / name).exists():
            print(f"{name}: already written ({out_dir / spec.file}); delete it to train again")
            continue
        if not train_one(spec, plan, work_root / name, out_dir, deadline):
            return False
        shutil.rmtree(work_root / name, ignore_errors=True)  # done: its checkpoint is not needed again
    return True

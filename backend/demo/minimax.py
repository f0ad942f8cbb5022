"""demo:minimax-h3 -- a tiny MiniMax-H3 repository built offline from configs and seeded weights.

Written in the real repository's layout (`modular_model_index.json` naming every component, both transformer
partitions `transformer/` and `transformer_ref/`, `audio_vae/`, the Qwen3-VL `text_encoder/`, `tokenizer/`,
`processor/`, and the two schedulers), so `ModularPipeline.from_pretrained(path, workflow=...)` loads it
per workflow exactly as it loads MiniMaxAI/MiniMax-H3. Every component is the real diffusers/transformers
class; only the sizes are tiny.

Sizes are pinned by the pipeline's own contracts, not chosen freely:
- the pipeline reads `hidden_states[50]` of the text encoder, so the tiny Qwen3-VL keeps 51 decoder layers
  (each 16 wide);
- the audio latent rate is fixed at 40/s, so the audio VAE keeps hop * 40 == sampling_rate (8 kHz, hop 200);
- durations are fixed at 5-15 s at 24 fps, so the shortest clip is 124 frames (on a 32x64 canvas).

The denoisers and the video VAE are drawn so that a signal keeps its size through them (`_signal_preserving`):
the denoiser drives the frames, so a LoRA's effect shows in them as it does on the other demos.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

#: Pinned sigma schedule of the `pinned` variant (4 intervals).
PINNED_SCHEDULE = (1.0, 0.7, 0.4, 0.15, 0.0)

TEXT_HIDDEN = 16
TEXT_LAYERS = 51  # the pipeline reads hidden_states[50]

TRANSFORMER_CONFIG = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    hidden_size=32,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=64,
    in_channels=4,
    audio_in_channels=8,
    patch_size=(1, 2, 2),
    text_dim=TEXT_HIDDEN,
    freq_dim=16,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
    rope_freq_dim=2,
)

VAE_CONFIG = dict(
    latent_channels=4,
    block_out_channels=(8, 8, 8, 8),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2),
    temporal_downsample_factors=(1, 2, 2, 1),
    norm_num_groups=4,
    decoder_num_layers=1,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=8,
    decoder_num_register_tokens=1,
    decoder_ffn_mult=2,
    latents_mean=(0.0,) * 4,
    latents_std=(1.0,) * 4,
)

AUDIO_VAE_CONFIG = dict(
    encoder_dim=4,
    encoder_rates=(2, 4, 5, 5),
    latent_dim=16,
    latent_channels=8,
    num_attention_heads=2,
    decoder_dim=16,
    decoder_rates=(5, 5, 4, 2),
    decoder_kernel_sizes=(10, 10, 8, 4),
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1, 3),),
    sampling_rate=8000,
    latents_mean=[0.0] * 8,
    latents_std=[1.0] * 8,
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def _tokenizer():
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    # Sorted: ByteLevel.alphabet() comes back in a random order, which would change token ids per build.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tok


def _text_encoder(tok):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=TEXT_HIDDEN,
            intermediate_size=32,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=TEXT_HIDDEN,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen3VLForConditionalGeneration(config)


def _save_processor(tok, out: Path) -> None:
    """Write `processor/` as `Qwen3VLProcessor.save_pretrained` lays it out.

    The video processor's config is written as JSON rather than through `Qwen3VLVideoProcessor`, which needs
    torchvision (see backend/minimax/processor.py); with torchvision installed the directory loads as the full
    `Qwen3VLProcessor`.
    """
    from transformers import Qwen2VLImageProcessor

    tok.save_pretrained(out)
    Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=64 * 64
    ).save_pretrained(out)
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 4},
        "fps": 2,
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2) + "\n")


def _seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    # Re-draw every float parameter from one seed so the bytes do not depend on init order or library defaults.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module.eval()


def _signal_preserving(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded weights under which a signal keeps its size through the network (the denoisers, the video VAE).

    Norm layers start as identities (weight 1, bias 0), every matrix or kernel is drawn with std 1/sqrt(fan_in),
    everything else (biases, layer scales) with std 0.1. With `_seeded`'s blanket 0.1 every norm scaled its input
    by ~0.1: the denoiser's velocity was near zero, so the frames were the noise seen through the VAE, and the
    VAE's own norms damped what was left; a LoRA moved the frames by at most one level. Drawn this way the
    denoiser's output decides the frames (see docs/minimax.md, "The demo model")."""
    gen = torch.Generator().manual_seed(seed)
    norms = {name for name, m in module.named_modules() if "Norm" in type(m).__name__}
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if not p.is_floating_point():
                continue
            owner, _, leaf = name.rpartition(".")
            if owner in norms:
                p.fill_(1.0 if leaf == "weight" else 0.0)
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module.eval()


#: The repository every component spec points at; a local copy loads from its own files instead.
UPSTREAM_REPO = "MiniMaxAI/MiniMax-H3"

COMPONENTS = {
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
}


def model_index(base_schedule=None) -> dict:
    """`modular_model_index.json`, the index a modular-only repository carries (there is no DiffusionPipeline
    class for MiniMax-H3, so a plain `model_index.json` cannot name its pipeline)."""
    index = {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_blocks_class_name": "MiniMaxH3Blocks",
        "_diffusers_version": "0.42.1",
        # The tiny canvas: 16:9 without keyframes resolves to 32x64.
        "canvas_short_edge": 32,
        "canvas_max_pixels": 32 * 64,
        "reference_image_short_edge": 64,
    }
    for name, (library, class_name) in COMPONENTS.items():
        index[name] = [
            library,
            class_name,
            {
                "pretrained_model_name_or_path": UPSTREAM_REPO,
                "subfolder": name,
                "type_hint": [library, class_name],
                "revision": None,
                "variant": None,
            },
        ]
    if base_schedule is not None:
        index["base_schedule"] = [float(s) for s in base_schedule]
    return index


#: Sampling defaults sized for the tiny demo (lora_studio.json): the shortest clip the pipeline allows.
DEFAULTS = {"num_inference_steps": 3, "num_frames": 124, "height": 32, "width": 64, "task_type": "t2va"}


def write(out_dir, *, base_schedule=None) -> Path:
    """Write the tiny repository into the (existing, empty) directory `out_dir`."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )

    out = Path(out_dir)
    tok = _tokenizer()
    tok.save_pretrained(out / "tokenizer")
    _save_processor(tok, out / "processor")
    _seeded(_text_encoder(tok), 0).save_pretrained(out / "text_encoder")
    _signal_preserving(MiniMaxH3Transformer3DModel(**TRANSFORMER_CONFIG), 1).save_pretrained(out / "transformer")
    _signal_preserving(MiniMaxH3Transformer3DModel(**TRANSFORMER_CONFIG), 2).save_pretrained(out / "transformer_ref")
    _signal_preserving(AutoencoderKLMiniMaxH3(**VAE_CONFIG), 3).save_pretrained(out / "vae")
    _seeded(AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE_CONFIG), 4).save_pretrained(out / "audio_vae")
    MiniMaxH3Scheduler(shift=12.0).save_pretrained(out / "scheduler")
    MiniMaxH3Scheduler(shift=3.0).save_pretrained(out / "audio_scheduler")
    (out / "modular_model_index.json").write_text(json.dumps(model_index(base_schedule), indent=2) + "\n")
    return out


def build(out_dir, *, base_schedule=None) -> Path:
    """Materialize the tiny repository at `out_dir` (built beside it, then renamed into place)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp, base_schedule=base_schedule)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def build_pinned(out_dir) -> Path:
    """The checkpoint-pinned variant: same weights, `base_schedule` in the repository index."""
    return build(out_dir, base_schedule=PINNED_SCHEDULE)


class Repository:
    """What `backend.demo.ensure` builds: it calls `.save_pretrained(dir)` on the builder's result."""

    def __init__(self, base_schedule=None):
        self.base_schedule = base_schedule

    def save_pretrained(self, out_dir, **_):
        write(out_dir, base_schedule=self.base_schedule)


def repository() -> Repository:
    return Repository()

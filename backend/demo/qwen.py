"""demo:qwen-image — a tiny QwenImagePipeline (stands in for Qwen/Qwen-Image-2512).

The shipped model is trained (``python -m backend.demo.train qwen-image``) and its weights live in
``backend/demo/weights/qwen-image``; ``architecture()`` is the untrained pipeline the trainer
starts from, in the real diffusers and transformers classes at a tiny size.
"""
from __future__ import annotations

import torch
from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                       QwenImageTransformer2DModel)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from .tokenizers import qwen_grammar_tokenizer

# Qwen-Image-2512's own scheduler settings (dynamic shifting on image sequence length).
SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                 num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                 use_dynamic_shifting=True)

DEFAULTS = {"height": 64, "width": 64, "num_inference_steps": 20, "true_cfg_scale": 4.0}
WEIGHTS = "qwen-image"  # folder under backend/demo/weights/
TEXT_WIDTH = 16


def vae(latents_mean=None, latents_std=None) -> AutoencoderKLQwenImage:
    """4x down (64x64 -> 16x16x4): the demo's VAE, with the latent statistics it was trained to."""
    return AutoencoderKLQwenImage(
        base_dim=16, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=list(latents_mean or [0.0] * 4), latents_std=list(latents_std or [1.0] * 4))


def transformer() -> QwenImageTransformer2DModel:
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=TEXT_WIDTH, guidance_embeds=False, axes_dims_rope=(8, 12, 12))


def text_encoder(tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    ids = tokenizer.convert_tokens_to_ids
    vocab = len(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": TEXT_WIDTH, "intermediate_size": 4 * TEXT_WIDTH, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": vocab,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": TEXT_WIDTH},
        hidden_size=TEXT_WIDTH, vocab_size=vocab, bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), vision_token_id=ids("<|vision_pad|>"),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def architecture(seed: int = 0) -> QwenImagePipeline:
    """The untrained pipeline (seeded weights): where training starts, and the shape unit tests see."""
    tokenizer = qwen_grammar_tokenizer()
    torch.manual_seed(seed)
    tr = transformer()
    torch.manual_seed(seed + 1)
    v = vae()
    torch.manual_seed(seed + 2)
    te = text_encoder(tokenizer).eval()
    return QwenImagePipeline(transformer=tr, vae=v, text_encoder=te, tokenizer=tokenizer,
                             scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER))

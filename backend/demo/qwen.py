"""demo:qwen-image — a tiny QwenImagePipeline (stands in for Qwen/Qwen-Image-2512)."""
from __future__ import annotations

import torch
from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                       QwenImageTransformer2DModel)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from .tokenizers import qwen_tokenizer

# Qwen-Image-2512's own scheduler settings (dynamic shifting on image sequence length).
SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                 num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                 use_dynamic_shifting=True)

DEFAULTS = {"height": 64, "width": 64, "num_inference_steps": 8, "true_cfg_scale": 4.0}


def build() -> QwenImagePipeline:
    tokenizer = qwen_tokenizer()
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    torch.manual_seed(1)
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 272,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": 16},
        hidden_size=16, vocab_size=272, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        vision_token_id=ids("<|vision_pad|>"), image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
    )
    torch.manual_seed(2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return QwenImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                             tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER))

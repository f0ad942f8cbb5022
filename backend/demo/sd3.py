"""demo:sd3.5 — a tiny StableDiffusion3Pipeline (stands in for stable-diffusion-3.5-medium)."""
from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from .tokenizers import clip_tokenizer, t5_tokenizer

DEFAULTS = {"height": 64, "width": 64, "num_inference_steps": 8, "guidance_scale": 5.0}


def _clip(seed: int, vocab: int) -> CLIPTextModelWithProjection:
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1, hidden_size=16,
        intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=2,
        projection_dim=16, vocab_size=vocab, max_position_embeddings=77, hidden_act="gelu"))


def build() -> StableDiffusion3Pipeline:
    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=32)
    torch.manual_seed(1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=64,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    torch.manual_seed(4)
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                 num_heads=4, relative_attention_num_buckets=8, pad_token_id=0,
                                 eos_token_id=1, decoder_start_token_id=0))
    vocab = len(clip_tok)
    return StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=_clip(2, vocab), tokenizer=clip_tok,
        text_encoder_2=_clip(3, vocab), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5.eval(), tokenizer_3=t5_tok)

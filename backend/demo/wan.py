"""demo:wan2.1-t2v, demo:wan2.2-t2v, demo:wan2.2-i2v — tiny Wan pipelines.

Wan2.2 A14B has two denoisers: `transformer` for high-noise steps, `transformer_2`
for low-noise ones, split at boundary_ratio 0.875 of the training timesteps.
"""
from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from .tokenizers import t5_tokenizer

DEFAULTS_T2V = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 8, "guidance_scale": 5.0}
DEFAULTS_22 = {**DEFAULTS_T2V, "guidance_scale": 4.0, "guidance_scale_2": 3.0}
BOUNDARY_RATIO = 0.875


def _transformer(seed: int, in_channels: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _shared():
    tokenizer = t5_tokenizer()
    torch.manual_seed(100)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    torch.manual_seed(101)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    # Wan's published scheduler: UniPC on flow sigmas.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler)


def build_wan21_t2v() -> WanPipeline:
    return WanPipeline(transformer=_transformer(0, 16), **_shared())


def build_wan22_t2v() -> WanPipeline:
    return WanPipeline(transformer=_transformer(0, 16), transformer_2=_transformer(1, 16),
                       boundary_ratio=BOUNDARY_RATIO, **_shared())


def build_wan22_i2v() -> WanImageToVideoPipeline:
    # Wan2.2 I2V conditions on the VAE-encoded first frame (16 noise + 4 mask + 16 image
    # channels = 36) and has no CLIP image encoder.
    return WanImageToVideoPipeline(transformer=_transformer(0, 36), transformer_2=_transformer(1, 36),
                                   image_encoder=None, image_processor=None,
                                   boundary_ratio=BOUNDARY_RATIO, **_shared())

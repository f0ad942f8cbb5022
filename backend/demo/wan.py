"""demo:wan2.1-t2v, demo:wan2.2-t2v, demo:wan2.2-i2v — tiny Wan pipelines.

demo:wan2.1-t2v is trained (``python -m backend.demo.train wan2.1-t2v``, backend/demo/wan_train.py): its
weights live in ``backend/demo/weights/wan2.1-t2v``; ``architecture_t2v()`` is the untrained pipeline the
trainer starts from (its VAE is the image VAE's architecture: 4x down in space, 2x in time). demo:wan2.2-t2v
is trained from it (``python -m backend.demo.train wan2.2-t2v``, backend/demo/wan_experts.py): the same VAE,
text encoder and tokenizer, and two experts. demo:wan2.2-i2v still has seeded random weights
(``build_wan22_i2v``) until it is trained.

Wan2.2 A14B has two denoisers: `transformer` for high-noise steps, `transformer_2`
for low-noise ones, split at boundary_ratio 0.875 of the training timesteps.
"""
from __future__ import annotations

import inspect

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from .tokenizers import t5_grammar_tokenizer, t5_tokenizer

# the trained demo:wan2.1-t2v: 9 frames (5 latent frames), 20 UniPC steps at Wan's flow shift 3
DEFAULTS_T2V = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 20, "guidance_scale": 3.0}
# the trained demo:wan2.2-t2v: Wan2.1's sampling, each expert with its own guidance (the same here)
DEFAULTS_22_T2V = {**DEFAULTS_T2V, "guidance_scale_2": DEFAULTS_T2V["guidance_scale"]}
# the random Wan2.2 I2V: 8 steps (its clips are noise; only its plumbing is tested)
DEFAULTS_22 = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 8, "guidance_scale": 4.0,
               "guidance_scale_2": 3.0}
BOUNDARY_RATIO = 0.875
TEXT_WIDTH = 16  # the trained model's UMT5 width
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)  # Wan's published UniPC


def video_vae(image_config) -> AutoencoderKLWan:
    """An ``AutoencoderKLWan`` of the image VAE's architecture (the Qwen-Image VAE is Wan's, module for module),
    its scale factors those of its down-sampling: 4x in space and 2x in time for the demo's."""
    accepted = inspect.signature(AutoencoderKLWan.__init__).parameters
    config = {k: v for k, v in dict(image_config).items() if not k.startswith("_") and k in accepted}
    return AutoencoderKLWan(**config, scale_factor_spatial=2 ** len(config["temperal_downsample"]),
                            scale_factor_temporal=2 ** sum(config["temperal_downsample"]))


def transformer_t2v() -> WanTransformer3DModel:
    """The trained text-to-video transformer's architecture (1.2M parameters; 4-channel latents)."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=TEXT_WIDTH, freq_dim=256, ffn_dim=512, num_layers=4, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64)


def text_encoder_t2v(tokenizer) -> UMT5EncoderModel:
    """The trained model's UMT5 encoder (no dropout: the trainer encodes prompts on 32 tokens, exactly)."""
    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=4 * TEXT_WIDTH, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def architecture_t2v(seed: int = 0) -> WanPipeline:
    """The untrained demo:wan2.1-t2v (seeded weights; its VAE starts from the image VAE when trained)."""
    from .qwen import vae as image_vae

    tokenizer = t5_grammar_tokenizer()
    torch.manual_seed(seed)
    vae = video_vae(image_vae().config)
    torch.manual_seed(seed + 1)
    tr = transformer_t2v()
    torch.manual_seed(seed + 2)
    te = text_encoder_t2v(tokenizer).eval()
    return WanPipeline(transformer=tr, vae=vae, text_encoder=te, tokenizer=tokenizer,
                       scheduler=UniPCMultistepScheduler(**SCHEDULER))


def architecture_22_t2v(seed: int = 0) -> WanPipeline:
    """The untrained demo:wan2.2-t2v: demo:wan2.1-t2v's parts and a second transformer, split at the boundary
    (trained: both experts start from the trained wan2.1-t2v transformer, backend/demo/wan_experts.py)."""
    pipe = architecture_t2v(seed)
    torch.manual_seed(seed + 3)
    return WanPipeline(transformer=pipe.transformer, transformer_2=transformer_t2v(), vae=pipe.vae,
                       text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, scheduler=pipe.scheduler,
                       boundary_ratio=BOUNDARY_RATIO)


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


def build_wan22_i2v() -> WanImageToVideoPipeline:
    # Wan2.2 I2V conditions on the VAE-encoded first frame (16 noise + 4 mask + 16 image
    # channels = 36) and has no CLIP image encoder.
    return WanImageToVideoPipeline(transformer=_transformer(0, 36), transformer_2=_transformer(1, 36),
                                   image_encoder=None, image_processor=None,
                                   boundary_ratio=BOUNDARY_RATIO, **_shared())

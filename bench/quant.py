"""``python -m bench quant``: a LoRA served unfused on quantized bases against the plain base.

A synthetic SD3 transformer of realistic shape (width 1024 = 16 heads x 64, FFN 4096, 2 joint blocks,
256 image tokens + 64 text tokens, seeded) is saved as a diffusers folder and written as GGUF files
(Q8_0, Q4_0; original SD3 names, backend/demo/gguf.py) in a temporary directory. Each variant is
loaded the way the server loads it (fp32 / bf16 plain; ``--quantize fp8`` = diffusers' layerwise
casting; ``--gguf`` = ``from_single_file`` with ``GGUFQuantizationConfig``), gets one rank-32 adapter
on every attention and FFN projection through our engine (unfused: the only mode on a quantized base),
and runs one transformer forward per call (= one denoising step without CFG). Reported per variant:
the denoiser's parameter bytes as stored, and the median step time (rotated rounds: round r starts at
variant r mod k, so load from other processes hits every side alike) with and without the adapter,
as ratios to the fp32 base (and the bf16 one).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def _build(width: int, layers: int, tokens: int):
    from diffusers import SD3Transformer2DModel

    side = int(round(tokens ** 0.5))  # latent side / patch 2 -> tokens
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=side * 2, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=64,
        num_attention_heads=width // 64, joint_attention_dim=width, caption_projection_dim=width,
        pooled_projection_dim=width, out_channels=16, pos_embed_max_size=side * 2).eval()


def _adapter(model, out: Path, rank: int) -> Path:

    g = torch.Generator().manual_seed(10)
    sd = {}
    for name, lin in model.named_modules():
        if isinstance(lin, torch.nn.Linear) and name.startswith("transformer_blocks.") and \
                any(name.endswith(s) for s in ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")):
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) / \
                lin.in_features ** .5
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * 0.02
    save_file(sd, str(out))
    return out


def run(args) -> int:
    from diffusers import GGUFQuantizationConfig, SD3Transformer2DModel, StableDiffusion3Pipeline

    from backend import quant
    from bench.kit import _loadavg, _rotated, _stat
    from backend.demo.gguf import sd3_original_names, write_state
    from backend.lora.engine import LoRAEngine
    from backend.lora.request import LoRARequest

    tmp = Path(tempfile.mkdtemp(prefix="quant-bench-"))
    model = _build(args.width, args.layers, args.tokens)
    folder = tmp / "transformer"
    model.save_pretrained(folder)
    original = sd3_original_names({k: v.contiguous() for k, v in model.state_dict().items()})
    files = {}
    for qtype in ("Q8_0", "Q4_0"):
        files[qtype] = tmp / f"bench-{qtype}.gguf"
        write_state(original, qtype, files[qtype])
    lora = LoRARequest("bench", 1, str(_adapter(model, tmp / "adapter.safetensors", args.rank)))
    side = int(round(args.tokens ** 0.5))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, side * 2, side * 2, generator=g),
                  encoder_hidden_states=torch.randn(1, 64, args.width, generator=g),
                  pooled_projections=torch.randn(1, args.width, generator=g), timestep=torch.tensor([500.0]))

    def plain(dtype):
        return SD3Transformer2DModel.from_pretrained(folder, torch_dtype=dtype).eval()

    def fp8(dtype):
        m = plain(dtype)
        quant.apply(quant.QuantPlan("fp8"), {"transformer": m}, dtype)
        return m

    def from_gguf(qtype):
        return SD3Transformer2DModel.from_single_file(
            str(files[qtype]), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            config=str(tmp), subfolder="transformer", torch_dtype=torch.float32).eval()

    variants = {"fp32": lambda: plain(torch.float32), "fp8 -> fp32": lambda: fp8(torch.float32),
                "gguf Q8_0 -> fp32": lambda: from_gguf("Q8_0"), "gguf Q4_0 -> fp32": lambda: from_gguf("Q4_0"),
                "bf16": lambda: plain(torch.bfloat16), "fp8 -> bf16": lambda: fp8(torch.bfloat16)}
    models, engines, sizes = {}, {}, {}
    for name, make in variants.items():
        models[name] = make()
        sizes[name] = quant.parameter_bytes(models[name])
        engines[name] = LoRAEngine(StableDiffusion3Pipeline, {"transformer": models[name]}, model="bench-sd3",
                                   lora_mode="unfused")
    dtype_of = {n: (torch.bfloat16 if n.endswith("bf16") else torch.float32) for n in variants}

    def step(name, adapter: bool):
        def call(i):
            engines[name].activate([(lora, 1.0)] if adapter else [])
            with torch.inference_mode():
                models[name](**{k: v.to(dtype_of[name]) if v.is_floating_point() else v for k, v in inputs.items()},
                             return_dict=False)
        return call

    for name in variants:  # warm up once each (first-call allocations, adapter read)
        step(name, True)(0)
        step(name, False)(0)
    print(f"load average {_loadavg()}; {torch.get_num_threads()} threads; SD3 width {args.width}, {args.layers} "
          f"blocks, {args.tokens}+64 tokens, rank {args.rank}, {args.rounds} rotated rounds", flush=True)
    base = _rotated({n: step(n, False) for n in variants}, args.rounds)
    with_lora = _rotated({n: step(n, True) for n in variants}, args.rounds)
    rows = [("denoiser", "parameter bytes", "vs fp32", "step (base)", "vs fp32", "step (+LoRA unfused)", "vs fp32",
             "vs bf16")]
    for n in variants:
        rows.append((n, f"{sizes[n] / 2**20:.1f} MiB", f"{sizes[n] / sizes['fp32']:.3f}x", _stat(base[n]),
                     f"{base[n][0] / base['fp32'][0]:.2f}x", _stat(with_lora[n]),
                     f"{with_lora[n][0] / with_lora['fp32'][0]:.2f}x",
                     f"{with_lora[n][0] / with_lora['bf16'][0]:.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print(f"load average at the end: {_loadavg()}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quant", help="a LoRA on fp8 / GGUF bases vs the plain base (bytes, step time)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadiest on a busy machine)")
    p.add_argument("--width", type=int, default=1024, help="model width (a multiple of 64)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256, help="image tokens per pass (a square: 256 = a 256x256 image)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--rounds", type=int, default=15, help="rotated rounds per variant (median, min-max)")
    p.add_argument("--quick", action="store_true", help="a smoke run: width 256, 1 block, 64 tokens, 3 rounds")

"""Adapter switching on a GPU, measured in one short run (issue 15 item 7): nothing downloaded.

    python scripts/gpu_check_switch.py                    # CUDA, real widths, a few blocks (< 8 min on one H200)
    python scripts/gpu_check_switch.py --device cpu --dry-run   # tiny sizes, seconds: the suite runs this

For each model (Qwen-Image at hidden 3072, Wan2.2 A14B at hidden 5120; diffusers transformers
built from config with random weights, ``--blocks`` blocks of each) and each ``--pristine``
placement (device, host), the real engine (backend/lora/engine.py) switches between two
rank-64 adapters on every Linear of the blocks. It prints one table: switch time (median and
min-max over ``--switches`` switches), bytes written and bytes moved host->device per switch,
GB/s, the per-step overhead of the same adapter run unfused (rank-r matmuls on ``--tokens``
activations of every targeted layer, vs the base matmuls), and whether base -> A -> B -> base
is bit-exact in bf16 (device digests of every parameter). Then the cost model
(bench/costmodel.py) for the full models, to compare with what was measured per block.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backend.manager import quiet_libraries  # noqa: E402

quiet_libraries()


def build(kind: str, blocks: int, tiny: bool, device: str, dtype):
    import diffusers

    if kind == "qwen-image":
        cfg = dict(num_layers=blocks, attention_head_dim=16 if tiny else 128, num_attention_heads=2 if tiny else 24,
                   joint_attention_dim=32 if tiny else 3584, in_channels=16 if tiny else 64, out_channels=4 if tiny else 16,
                   axes_dims_rope=(4, 6, 6) if tiny else (16, 56, 56))
        cls, pipe = diffusers.QwenImageTransformer2DModel, diffusers.QwenImagePipeline
    else:
        cfg = dict(num_layers=blocks, attention_head_dim=16 if tiny else 128, num_attention_heads=2 if tiny else 40,
                   ffn_dim=64 if tiny else 13824, text_dim=32 if tiny else 4096, freq_dim=16 if tiny else 256)
        cls, pipe = diffusers.WanTransformer3DModel, diffusers.WanPipeline
    with torch.device(device):
        model = cls(**cfg).to(dtype).eval()
    return model, pipe


def targets(model) -> list[str]:
    """Every Linear inside the transformer blocks (what a full-coverage LoRA touches)."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and (n.startswith("transformer_blocks.") or n.startswith("blocks."))]


def write_adapters(model, names, rank: int, tmp: Path, n: int = 2) -> list[Path]:
    from safetensors.torch import save_file

    tmp.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(7 + i)
        sd = {}
        for name in names:
            lin = model.get_submodule(name)
            sd[f"transformer.{name}.lora_A.weight"] = (torch.randn(rank, lin.in_features, generator=g)
                                                       / lin.in_features ** 0.5).to(torch.bfloat16)
            sd[f"transformer.{name}.lora_B.weight"] = (torch.randn(lin.out_features, rank, generator=g)
                                                       * 0.01).to(torch.bfloat16)
        p = tmp / f"gpu-check-{i}.safetensors"
        save_file(sd, str(p))
        paths.append(p)
    return paths


def digest(model) -> list:
    from backend.weights import device_digest

    return torch.stack([device_digest(p) for p in model.parameters()]).cpu().tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def switch_rows(kind, model, pipe, paths, placement, switches, device):
    from backend.lora.engine import LoRAEngine
    from backend.lora.request import LoRARequest

    base = digest(model)
    engine = LoRAEngine(pipe, {"transformer": model}, model=kind, max_loras=2, max_cpu_loras=2, pristine=placement)
    reqs = [LoRARequest(p.stem, i + 1, str(p)) for i, p in enumerate(paths)]
    engine.activate([(reqs[0], 1.0)])  # warm: reads, fits, moves factors, captures originals
    engine.activate([(reqs[1], 1.0)])
    sync(device)
    before = dict(engine.counters)
    times = []
    for i in range(switches):
        t = time.perf_counter()
        engine.activate([(reqs[i % 2], 1.0)])
        sync(device)
        times.append(time.perf_counter() - t)
    written = (engine.counters["bytes_written"] - before["bytes_written"]) / switches
    engine.deactivate()
    sync(device)
    exact = digest(model) == base
    info = engine.pristine_info()
    moved = written if (info["placement"] == "host" and device.startswith("cuda")) else 0
    med = statistics.median(times)
    return {"model": kind, "mode": f"{placement} [{info['where']}]", "switch": med, "min": min(times),
            "max": max(times), "written": written, "h2d": moved, "gbps": written / med / 1e9, "exact": exact,
            "pristine": info["bytes"]}


def unfused_overhead(model, names, rank, tokens, device, dtype, repeats):
    """Per denoiser pass: the base matmuls of the targeted layers vs the extra rank-r matmuls of unfused LoRA."""
    xs = {}
    for n in names:
        lin = model.get_submodule(n)
        xs.setdefault(lin.in_features, torch.randn(tokens, lin.in_features, device=device, dtype=dtype))
    factors = {n: (torch.randn(rank, model.get_submodule(n).in_features, device=device, dtype=dtype) * 0.01,
                   torch.randn(model.get_submodule(n).out_features, rank, device=device, dtype=dtype) * 0.01)
               for n in names}

    def base_pass():
        with torch.inference_mode():
            for n in names:
                lin = model.get_submodule(n)
                torch.nn.functional.linear(xs[lin.in_features], lin.weight)

    def lora_pass():
        with torch.inference_mode():
            for n in names:
                lin = model.get_submodule(n)
                x = xs[lin.in_features]
                y = torch.nn.functional.linear(x, lin.weight)
                a, b = factors[n]
                y.add_(torch.nn.functional.linear(torch.nn.functional.linear(x, a), b))

    out = {}
    for key, fn in (("base", base_pass), ("lora", lora_pass), ("base2", base_pass), ("lora2", lora_pass)):
        fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync(device)
        out[key] = (time.perf_counter() - t) / repeats
    base, lora = min(out["base"], out["base2"]), min(out["lora"], out["lora2"])
    return base, lora - base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check_switch.py")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes (a CPU smoke run of every code path)")
    ap.add_argument("--models", default="qwen-image,wan2.2-a14b")
    ap.add_argument("--blocks", type=int, default=4, help="transformer blocks per model, at real width")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--switches", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=4096, help="activations per pass for the unfused overhead")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device; use --device cpu --dry-run for a smoke run", file=sys.stderr)
        return 2
    tiny = args.dry_run
    if tiny:
        args.blocks, args.rank, args.switches, args.tokens = 1, 4, 3, 16
    dtype = torch.bfloat16
    torch.manual_seed(0)
    rows, unfused = [], []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-switch-") as tmp:
        for kind in args.models.split(","):
            model, pipe = build(kind, args.blocks, tiny, args.device, dtype)
            names = targets(model)
            paths = write_adapters(model, names, args.rank, Path(tmp) / kind.replace(".", "_"))
            for placement in ("device", "host"):
                rows.append(switch_rows(kind, model, pipe, paths, placement, args.switches, args.device))
                print(f"  {kind} {placement}: {rows[-1]['switch'] * 1e3:.2f} ms", flush=True)
            base, extra = unfused_overhead(model, names, args.rank, args.tokens, args.device, dtype,
                                           3 if tiny else 10)
            unfused.append((kind, len(names), base, extra))
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\nswitching on {dev}, bf16, {args.blocks} block(s) per model at "
          f"{'tiny' if tiny else 'real'} width, rank {args.rank}, {args.switches} switches "
          f"(total {time.perf_counter() - started:.0f} s)")
    head = ("model", "pristine", "switch median", "min-max", "written/switch", "H2D/switch", "GB/s written",
            "unfused +/pass", "bit-exact restore")
    table = [head]
    extra = {k: (n, b, e) for k, n, b, e in unfused}
    for r in rows:
        n, b, e = extra[r["model"]]
        table.append((r["model"], r["mode"], f"{r['switch'] * 1e3:.2f} ms",
                      f"{r['min'] * 1e3:.2f}-{r['max'] * 1e3:.2f} ms", f"{r['written'] / 2**20:.1f} MiB",
                      f"{r['h2d'] / 2**20:.1f} MiB", f"{r['gbps']:.1f}",
                      f"{e * 1e3:.2f} ms on {b * 1e3:.2f} ms ({e / b:+.0%}, {n} layers, {args.tokens} tokens)",
                      "yes" if r["exact"] else "NO"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    from bench.costmodel import table as cost_table

    print()
    print(cost_table())
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What live previews (backend/preview.py) cost a generation, side by side in one run.

Sides, each the same request on the same loaded pipeline: no previews (``on_preview=None``, the
baseline), previews as the worker sends them (``preview.sender``: at most one a second, PNG-encoded),
and a preview rendered and PNG-encoded after every step (the worst case). Rounds are rotated
(bench/kit.py): medians with min-max, and the load average. Then the one-off cost: fitting a
model's map (one small VAE encode and decode) and rendering one preview.

    python scripts/bench_preview.py [--model demo:qwen-image] [--rounds 15] [--steps 200] [--size 256]

(the demo's loop of 200 steps at 256 px runs about 2.5 s on one CPU thread, so the worker side sends
two previews per request; its 40-step loop runs 0.5 s and would send none).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kit import _loadavg, _rotated, _stat  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo:qwen-image")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=200)  # a denoising loop over a second on the CPU demo
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from backend import preview
    from backend.manager import PipelineManager

    torch.set_num_threads(args.threads)
    m = PipelineManager(device=args.device)
    m.load(args.model)
    request = {"prompt": "a lighthouse at dusk", "seed": 1, "num_inference_steps": args.steps,
               "height": args.size, "width": args.size}
    if m.spec.is_video:
        request["num_frames"] = 5
    sent = {"worker": 0, "every step": 0}

    def every_step(step, total, render):
        img = render()
        if img is not None:
            preview.png(img)
            sent["every step"] += 1

    def counted(key):
        def send(job_id, step, data):
            sent[key] += 1
        return send

    sides = {
        "no previews": lambda r: m.generate(dict(request)),
        "worker (1/s)": lambda r: m.generate(dict(request), on_preview=preview.sender(counted("worker"), ["j"])),
        "every step": lambda r: m.generate(dict(request), on_preview=every_step),
    }
    m.generate(dict(request), on_preview=every_step)  # warm-up; fits the map once
    sent["every step"] = 0
    print(f"{args.model} {args.size}x{args.size}, {args.steps} steps, device {m.device}, dtype {m.dtype}, "
          f"{args.threads} thread(s), {args.rounds} rotated rounds; load before {_loadavg()}")
    stats = _rotated(sides, args.rounds)
    base = stats["no previews"][0]
    for name, t in stats.items():
        print(f"  {name:14s} {_stat(t)}  ({t[0] / base:.3f}x of no previews)")
    print(f"  previews sent: worker {sent['worker'] / args.rounds:.1f} per request, "
          f"every step {sent['every step'] / args.rounds:.1f} per request")

    fits, renders = [], []
    latents = torch.randn(1, 16, 1, args.size // 8, args.size // 8) if m.spec.is_video else None
    for _ in range(5):
        fresh = preview.LatentPreview(m.pipeline)
        t = time.perf_counter()
        fresh.fit(video=m.spec.is_video)
        fits.append(time.perf_counter() - t)
    holder = {}
    m.generate(dict(request), on_preview=lambda s, total, render: holder.setdefault("render", render))
    for _ in range(args.rounds):
        t = time.perf_counter()
        img = holder["render"]() if latents is None else m.live_preview().image(latents, args.size, args.size)
        preview.png(img)
        renders.append(time.perf_counter() - t)
    print(f"  fit (once per loaded model): median {statistics.median(fits) * 1e3:.1f} ms "
          f"[{min(fits) * 1e3:.1f}-{max(fits) * 1e3:.1f}] over 5")
    print(f"  one preview (map + PNG): median {statistics.median(renders) * 1e3:.2f} ms "
          f"[{min(renders) * 1e3:.2f}-{max(renders) * 1e3:.2f}] over {args.rounds}")
    print(f"load after {_loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

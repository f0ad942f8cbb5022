"""Per-request adapter switch cost on MiniMax-H3 (demo:minimax-h3 by default), in this tree.

    python scripts/bench_minimax_switch.py [--rounds 5] [--switches 40] [--model demo:minimax-h3]

Two numbers, each a median over rotated rounds:
- switch: making adapter A, then B, then none active on the transformer partition (``MiniMaxRuntime._activate`` /
  ``_disable_all``: the step a request with a different adapter pays before it runs), per switch;
- request: a whole 1-step t2va request alternating A / B / none (``MiniMaxRuntime.generate``).
Prints one JSON line with the load average. Works on trees before and after MiniMax-H3 moved onto the shared LoRA
engine (both have those runtime methods), so the two can be run side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--switches", type=int, default=40)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--model", default="demo:minimax-h3")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from backend import demo
    from backend.minimax.runtime import MiniMaxRuntime

    torch.set_num_threads(1)
    repo = demo.ensure(args.model)
    rt = MiniMaxRuntime(repo, device="cpu", dtype=torch.float32)
    hidden = rt.pipe.transformer.config.num_attention_heads * rt.pipe.transformer.config.attention_head_dim
    blocks = len(rt.pipe.transformer.transformer_blocks)
    tmp = Path(tempfile.mkdtemp(prefix="mm-switch-"))
    names = {}
    for seed, name in ((1, "a"), (2, "b")):
        g = torch.Generator().manual_seed(seed)
        sd = {f"transformer.transformer_blocks.{i}.attn.{p}.lora_{ab}.weight":
              torch.randn(*((8, hidden) if ab == "A" else (hidden, 8)), generator=g) * 0.1
              for i in range(blocks) for p in ("to_q", "to_k", "to_v", "to_out.0") for ab in "AB"}
        path = tmp / f"mm_{name}.safetensors"
        save_file(sd, str(path))
        names[name] = path
        rt.load_adapter(name, path)  # read once: the switch is what is measured

    def switch_once(name):
        if name is None:
            rt._disable_all()
        else:
            rt._activate([(rt.adapters[name], name, 1.0)], "transformer")

    def gen(name):
        adapters = [] if name is None else [(name, str(names[name]), 1.0)]
        rt.generate({"prompt": "a fox", "seed": 1, "num_inference_steps": 1}, adapters=adapters)

    orders = [["a", "b", None], ["b", None, "a"], [None, "a", "b"]]
    switch_ms, request_s = [], []
    gen("a"), gen(None)  # warm up
    for r in range(args.rounds):
        order = orders[r % len(orders)]
        times = []
        for i in range(args.switches):
            t = time.perf_counter()
            switch_once(order[i % 3])
            times.append(time.perf_counter() - t)
        switch_ms.append(statistics.median(times) * 1e3)
        times = []
        for i in range(args.requests):
            t = time.perf_counter()
            gen(order[i % 3])
            times.append(time.perf_counter() - t)
        request_s.append(statistics.median(times))
    rt._disable_all()
    print(json.dumps({"tree": str(Path(__file__).resolve().parents[1]), "model": args.model,
                      "layers_per_adapter": 4 * blocks, "switch_ms_median": round(statistics.median(switch_ms), 4),
                      "switch_ms_rounds": [round(x, 4) for x in switch_ms],
                      "request_s_median": round(statistics.median(request_s), 4),
                      "request_s_rounds": [round(x, 4) for x in request_s], "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()

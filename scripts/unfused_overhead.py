"""Per-step overhead of the unfused mode vs merged on a demo pipeline, interleaved rounds.

    LORA_STUDIO_HOME=DIR .venv/bin/python scripts/unfused_overhead.py [demo:qwen-image]
"""
import os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
torch.set_num_threads(1)
from backend.manager import PipelineManager
from backend.lora import attach, demo_adapters
from backend.lora.request import LoRARequest
model = sys.argv[1] if len(sys.argv) > 1 else "demo:qwen-image"
dd = os.environ.get("LORA_STUDIO_HOME")
lib = demo_adapters.ensure(dd)
m = PipelineManager(device="cpu", data_dir=dd); m.load(model); e = attach(m)
a = LoRARequest("ink", 1, str(lib / "qwen-image/demo-inverted.safetensors"))
b = LoRARequest("film", 2, str(lib / "qwen-image/demo-outline.safetensors"))
params = m.validate({"prompt": "x", "seed": 1, "num_inference_steps": 8, "height": 128, "width": 128, "true_cfg_scale": 1.0})
kw = {k: v for k, v in params.items() if k not in ("seed", "fps", "flow_shift", "sample_solver", "boundary_ratio")}
def run():
    t = time.perf_counter()
    with torch.inference_mode():
        m.pipeline(**kw, generator=torch.Generator().manual_seed(1), output_type="latent")
    return time.perf_counter() - t
times = {"base": [], "merged": [], "unfused": []}
sw = {"merge": [], "unfused": []}
for r in range(15):
    for mode in ("base", "merged", "unfused"):
        t = time.perf_counter()
        if mode == "base": e.activate([])
        else: e.activate([(a, 0.7), (b, -1.3)], mode="merge" if mode == "merged" else "unfused")
        d = time.perf_counter() - t
        if mode != "base": sw["merge" if mode == "merged" else "unfused"].append(d)
        times[mode].append(run())
med = {k: statistics.median(v) for k, v in times.items()}
print(f"{model} 128x128 8 steps, 2-adapter stack (12 layers hooked), 15 interleaved rounds, load {os.getloadavg()}")
for k, v in med.items():
    print(f"  {k}: {v*1e3:.1f} ms ({v/med['base']:.3f}x base)")
for k, v in sw.items():
    print(f"  switch to {k} (from the previous mode): median {statistics.median(v)*1e3:.2f} ms")
from backend.lora.engine import identity_of  # noqa: E402
loaded = sorted(((identity_of(e.load(r)), e.load(r), {"transformer": s}) for r, s in ((a, .7), (b, -1.3))),
                key=lambda item: item[0])
print("  ratio input of the policy:", e.unfused.inputs(e._plan(loaded), {i: x for i, x, _ in loaded}).ratio)

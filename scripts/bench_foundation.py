"""Foundation timings per demo model: build, load, one generation (in-process), and the
whole `app.py generate` process with a cold and a warm data dir.

    .venv/bin/python scripts/bench_foundation.py
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ["demo:qwen-image", "demo:sd3.5", "demo:wan2.1-t2v", "demo:wan2.2-t2v", "demo:wan2.2-i2v"]


def in_process(data_dir: str) -> dict:
    from PIL import Image

    from backend import demo
    from backend.manager import PipelineManager

    rows = {}
    for model_id in MODELS:
        t0 = time.perf_counter()
        demo.ensure(model_id, data_dir)
        t1 = time.perf_counter()
        manager = PipelineManager(device="cpu", data_dir=data_dir)
        manager.load(model_id)
        t2 = time.perf_counter()
        req = {"prompt": "A cat playing with yarn", "seed": 0}
        if model_id.endswith("i2v"):
            req["image"] = Image.new("RGB", (64, 64), (120, 80, 40))
        manager.generate(req)
        t3 = time.perf_counter()
        rows[model_id] = (t1 - t0, t2 - t1, t3 - t2)
    return rows


def whole_process(model_id: str, data_dir: str, out: Path) -> float:
    args = [sys.executable, "app.py", "generate", "--model", model_id, "--prompt", "A cat",
            "--data-dir", data_dir, "--output", str(out)]
    if model_id.endswith("i2v"):
        from PIL import Image
        img = out.with_suffix(".in.png")
        Image.new("RGB", (64, 64), (120, 80, 40)).save(img)
        args += ["--image", str(img)]
    t = time.perf_counter()
    subprocess.run(args, cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t


def main():
    with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as tmp:
        whole = {}
        for m in MODELS:
            suffix = ".png" if m in ("demo:qwen-image", "demo:sd3.5") else ".mp4"
            out = Path(tmp) / (m.replace(":", "-") + suffix)
            whole[m] = (whole_process(m, cold, out), whole_process(m, cold, out))
        with tempfile.TemporaryDirectory() as fresh:
            rows = in_process(fresh)
    print(f"{'model':18} {'build s':>8} {'load s':>7} {'generate s':>10} {'cli cold s':>10} {'cli warm s':>10}")
    for m in MODELS:
        b, l, g = rows[m]
        print(f"{m:18} {b:8.2f} {l:7.2f} {g:10.2f} {whole[m][0]:10.2f} {whole[m][1]:10.2f}")
    print(f"all five demo builds, in process: {sum(r[0] for r in rows.values()):.1f} s")


if __name__ == "__main__":
    main()

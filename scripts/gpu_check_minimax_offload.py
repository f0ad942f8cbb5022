#!/usr/bin/env python3
"""GPU check: MiniMax-H3 offload modes with adapters give the no-offload output (run on a CUDA machine).

    python scripts/gpu_check_minimax_offload.py [--dtype bfloat16] [--device cuda] [--data-dir DIR]

On demo:minimax-h3 it runs, per offload mode (none, model, group, group + stream), one runtime per backend:
- peft: base -> Turbo -> base -> native -> base (t2va), then ref2va with a ref2v Turbo file (the partition that
  is loaded on demand, under the mode's hooks), then a deleted adapter and base again;
- distill: a Turbo file fused at start, then offload applied.
Each result is compared with the same step of a second no-offload runtime; a first no-offload pair gives the
noise floor (identical on a deterministic GPU). Prints a table; exit 0 when every mode matches within the floor
(plus --atol) and adapters change the output, 1 otherwise. It has not been run yet: no session so far had a GPU.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

HEADS, HEAD_DIM, HIDDEN = 2, 16, 32  # backend/demo/minimax.py TRANSFORMER_CONFIG
MODES = [("none", False), ("model", False), ("group", False), ("group", True)]
NATIVE_META = {"key_format": "minimax-h3-native", "qkv_layout": "grouped", "base_schedule": "1.0,0.8,0.5,0.0"}


def write_adapters(root: Path) -> dict[str, Path]:
    g = torch.Generator().manual_seed(0)

    def pair(rows):
        return torch.randn(4, HIDDEN, generator=g), torch.randn(rows, 4, generator=g) * 2.0

    turbo, ref, native = {}, {}, {}
    for i in range(2):
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            a, b = pair(HEADS * HEAD_DIM)
            turbo[f"transformer.transformer_blocks.{i}.attn.{proj}.lora_A.weight"] = a
            turbo[f"transformer.transformer_blocks.{i}.attn.{proj}.lora_B.weight"] = b
            ref[f"transformer_ref.transformer_blocks.{i}.attn.{proj}.lora_A.weight"] = a.clone()
            ref[f"transformer_ref.transformer_blocks.{i}.attn.{proj}.lora_B.weight"] = -b
        a, b = pair(3 * HEADS * HEAD_DIM)
        native[f"blocks.{i}.attn.qkv_proj.lora_A.weight"] = a
        native[f"blocks.{i}.attn.qkv_proj.lora_B.weight"] = b  # grouped rows; any order is a valid file
    paths = {"turbo": root / "minimax_h3_fl2v_turbo_2step_v1.0.safetensors",
             "ref": root / "minimax_h3_ref2v_turbo_2step_v1.0.safetensors",
             "native": root / "flash_native.safetensors"}
    save_file(turbo, str(paths["turbo"]))
    save_file(ref, str(paths["ref"]))
    save_file(native, str(paths["native"]), metadata=NATIVE_META)
    return paths


BASE = {"num_inference_steps": 2, "flow_shift": 6.0}  # adapters' own contracts decide theirs


def peft_steps(paths):
    refs = [Image.new("RGB", (48, 48), (20, 200, 20))]
    return [("base", (), BASE), ("turbo", [("turbo", str(paths["turbo"]), 1.0)], {}), ("base", (), BASE),
            ("native", [("native", str(paths["native"]), 1.0)], {}), ("base", (), BASE),
            ("ref2va+ref", [("ref", str(paths["ref"]), 1.0)], {"task_type": "ref2va", "references": refs}),
            ("unload turbo", "unload", {}), ("base", (), BASE)]


def run(rt, adapters, extra):
    params = {"prompt": "a red fox runs through snow", "seed": 3, "num_inference_steps": None, "flow_shift": None,
              **extra}
    out = rt.generate(params, adapters=adapters)
    return np.stack([np.asarray(f, dtype=np.int16) for f in out.frames]), out.audio[0]


def sequence(repo, mode, stream, backend, paths, args):
    from backend.minimax.offload import check
    from backend.minimax.runtime import MiniMaxRuntime

    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    rt = MiniMaxRuntime(repo, device=args.device, dtype=args.dtype, lora_backend=backend,
                        offload=check(mode, stream=stream))
    results = []
    if backend == "distill":
        rt.start("distill", [paths["turbo"]])
        results.append(("fused turbo", run(rt, (), {})))
    else:
        rt.start("peft")
        for label, adapters, extra in peft_steps(paths):
            if adapters == "unload":
                rt.unload_adapter("turbo")
                continue
            results.append((label, run(rt, adapters, extra)))
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    del rt
    if cuda:
        torch.cuda.empty_cache()
    return results, peak, time.time() - started


def diff(a, b) -> tuple[float, float]:
    return float(np.abs(a[0] - b[0]).max()), float(np.abs(a[1] - b[1]).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda; cpu is a dry run of this script (model and "
                                                          "stream modes skipped: they need CUDA)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--data-dir", default=None, help="where demo:minimax-h3 is built (default: a temp dir)")
    parser.add_argument("--atol", type=float, default=0.0, help="allowed |diff| above the noise floor")
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: this check needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    args.dtype = getattr(torch, args.dtype)
    modes = MODES if cuda else [(m, s) for m, s in MODES if m != "model" and not s]
    from backend import demo
    from backend.manager import quiet_libraries

    quiet_libraries()
    tmp = Path(tempfile.mkdtemp(prefix="mm-offload-"))
    repo = demo.ensure("demo:minimax-h3", args.data_dir or tmp / "home")
    paths = write_adapters(tmp)
    where = torch.cuda.get_device_name() if cuda else "CPU DRY RUN (model and stream modes skipped)"
    print(f"torch {torch.__version__}, {where}, dtype {args.dtype}, repo {repo}")

    ok = True
    rows = []
    for backend in ("peft", "distill"):
        reference, _, _ = sequence(repo, "none", False, backend, paths, args)
        floor_run, _, _ = sequence(repo, "none", False, backend, paths, args)
        floor = max(max(diff(a, b)) for (_, a), (_, b) in zip(reference, floor_run))
        base = reference[0][1]
        for label, out in reference[1:]:
            if label != "base" and max(diff(out, base)) == 0 and backend == "peft" and label != "ref2va+ref":
                rows.append((backend, "none", label, "adapter changed nothing", "", "", "FAIL"))
                ok = False
        for mode, stream in modes[1:]:
            name = mode + (" +stream" if stream else "")
            try:
                got, peak, seconds = sequence(repo, mode, stream, backend, paths, args)
            except Exception as exc:  # report and go on with the other modes
                rows.append((backend, name, "(start)", f"{type(exc).__name__}: {exc}"[:60], "", "", "FAIL"))
                ok = False
                continue
            for (label, want), (_, have) in zip(reference, got):
                frames, audio = diff(have, want)
                good = max(frames, audio) <= floor + args.atol
                ok &= good
                rows.append((backend, name, label, f"{frames:g}", f"{audio:.3g}",
                             f"{peak:.0f} MiB / {seconds:.1f}s", "ok" if good else "FAIL"))
        rows.append((backend, "none vs none", "noise floor", f"{floor:g}", "", "", ""))

    header = ("backend", "mode", "step", "frames max|d|", "audio max|d|", "peak / time", "")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""A cost model for one adapter switch on a GPU, from bandwidths given as inputs.

Printed by ``python -m bench lora`` next to the measured CPU rows and by
``scripts/gpu_check_switch.py`` next to what it measures on CUDA. A switch rewrites every
touched Linear weight as ``W = addmm(W0, B, A)`` (backend/lora/engine.py):

- ``device`` originals: each layer reads W0 and writes W in device memory (2 x bytes over HBM)
  and runs a rank-r GEMM (2 * out * in * r flops): ``2 B / HBM + F / GEMM``.
- ``host`` originals (pinned): W0 crosses PCIe/NVLink-C2C once per switch, overlapped with the
  merges on a side stream: ``max(B / H2D, 2 B / HBM + F / GEMM)``.
- ``unfused`` (peft layers, no weight write): no switch cost, but every denoiser pass pays the
  rank-r matmuls on the activations, bound by ``2 T r (in + out)`` flops or their activation
  traffic, plus three small kernels per layer (``unfused_seconds``).

Inputs are bandwidths and throughputs, not measurements; the defaults are an H200's
datasheet figures derated to what copy/GEMM kernels reach (H2D pinned ~50 GB/s, HBM
~4.0 of 4.8 TB/s, dense bf16 GEMM ~600 of 989 TFLOP/s).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    name: str = "H200"
    h2d_gbps: float = 50.0  # pinned host -> device, GB/s
    hbm_tbps: float = 4.0  # effective HBM bandwidth, TB/s (4.8 peak)
    gemm_tflops: float = 600.0  # dense bf16 GEMM, TFLOP/s (989 peak)
    launch_us: float = 5.0  # one small kernel (launch + tail) in a step, microseconds


@dataclass(frozen=True)
class Workload:
    name: str
    touched_params: float  # parameters of the Linear weights a switch rewrites
    sum_in_out: float  # sum over touched layers of (in_features + out_features)
    layers: int  # touched Linear layers
    rank: int
    tokens: int  # tokens per denoiser pass
    steps: int
    passes: int  # denoiser passes per step (2 with CFG)
    step_seconds: float  # an assumed base step time on the machine (input)
    bytes_per_param: int = 2  # bf16


def _qwen_block():
    h, mlp = 3072, 12288
    attn = 8 * h * h  # to_q/k/v/out + add_q/k/v + to_add_out
    mlps = 2 * 2 * h * mlp  # img_mlp + txt_mlp, up and down
    sum_io = 8 * 2 * h + 2 * 2 * (h + mlp)
    return attn + mlps, sum_io


def _wan_block():
    h, ffn = 5120, 13824
    attn = 8 * h * h  # self + cross attention q/k/v/o
    ffns = 2 * h * ffn
    sum_io = 8 * 2 * h + 2 * (h + ffn)
    return attn + ffns, sum_io


def workloads() -> list[Workload]:
    qp, qio = _qwen_block()
    wp, wio = _wan_block()
    return [
        # Qwen-Image-2512 (20B, 60 blocks), Lightning 4 steps, no CFG, 1328x1328 -> 83x83 latents / 2x2 patches
        Workload("Qwen-Image-2512 Lightning 4-step (20B, bf16, 1328^2)", 60 * qp, 60 * qio, 60 * 12, 64,
                 tokens=(1328 // 16) ** 2, steps=4, passes=1, step_seconds=0.45),
        # Wan2.2 A14B: two 40-block experts, both carry the LightX2V pair; 4 steps; 720p 81 frames
        Workload("Wan2.2 A14B LightX2V 4-step (2x14B, bf16, 1280x720x81)", 80 * wp, 80 * wio, 80 * 10, 64,
                 tokens=21 * (720 // 16) * (1280 // 16), steps=4, passes=1, step_seconds=18.0),
        Workload("Wan2.2 A14B 40-step with CFG (2x14B, bf16, 1280x720x81)", 80 * wp, 80 * wio, 80 * 10, 64,
                 tokens=21 * (720 // 16) * (1280 // 16), steps=40, passes=2, step_seconds=36.0),
    ]


def switch_seconds(w: Workload, m: Machine, placement: str) -> float:
    nbytes = w.touched_params * w.bytes_per_param
    merge = 2 * nbytes / (m.hbm_tbps * 1e12) + 2 * w.touched_params * w.rank / (m.gemm_tflops * 1e12)
    if placement == "device":
        return merge
    if placement == "host":
        return max(nbytes / (m.h2d_gbps * 1e9), merge)
    raise ValueError(placement)


def unfused_seconds(w: Workload, m: Machine) -> float:
    """The whole request's extra time for unfused LoRA: per pass and layer, x A^T then (.) B^T and the
    add, each bound by its flops or its activation traffic, plus 3 small kernels' launch cost.
    Per layer of width (in, out) over T tokens, with only the active (in one Wan2.2 expert at a time)
    layers counted once per pass."""
    per_pass_layers = w.layers // (2 if "Wan2.2" in w.name else 1)  # one expert runs per step
    share = per_pass_layers / w.layers
    flops = 2 * w.tokens * w.rank * w.sum_in_out * share
    traffic = w.bytes_per_param * w.tokens * (w.sum_in_out * share + 4 * w.rank * per_pass_layers)
    per_pass = max(flops / (m.gemm_tflops * 1e12), traffic / (m.hbm_tbps * 1e12)) + \
        3 * per_pass_layers * m.launch_us * 1e-6
    return per_pass * w.passes * w.steps


def table(m: Machine | None = None) -> str:
    m = m or Machine()
    head = (f"GPU cost model ({m.name}: H2D {m.h2d_gbps:g} GB/s pinned, HBM {m.hbm_tbps:g} TB/s, bf16 GEMM "
            f"{m.gemm_tflops:g} TFLOP/s; base step times are assumptions)")
    rows = [("workload", "bytes/switch", "device", "host (pinned)", "unfused/request", "request (base)")]
    for w in workloads():
        request = w.steps * w.step_seconds
        dev, host, unf = switch_seconds(w, m, "device"), switch_seconds(w, m, "host"), unfused_seconds(w, m)
        rows.append((w.name, f"{w.touched_params * w.bytes_per_param / 1e9:.1f} GB",
                     f"{dev * 1e3:.0f} ms ({dev / request:+.1%})", f"{host * 1e3:.0f} ms ({host / request:+.1%})",
                     f"{unf * 1e3:.0f} ms ({unf / request:+.1%})", f"{request:.1f} s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([head] + lines)


if __name__ == "__main__":
    print(table())

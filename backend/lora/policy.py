"""Merge or unfused: which way one request should apply its adapters, by predicted cost.

A pure function of visible numbers (no torch, no clocks), so it can be unit-tested on
numbers and printed next to a decision:

    merge_s   = (fixed_s + merge_bytes / bandwidth) / uses
    unfused_s = restore_s + steps * (ratio * step_s + forwards * hooked_layers * hook_s)
    restore_s = (fixed_s + restore_bytes / bandwidth) if restore_bytes else 0
    uses      = 1 + queued_same + repeats

``merge_bytes`` is what a merge writes (the layers whose contribution changes x their
weight size); ``restore_bytes`` is what serving unfused has to put back first (layers an
earlier request left merged). ``ratio`` is the low-rank path's FLOPs over the denoiser's
base FLOPs (per token: sum r*(in+out) over hooked layers / sum in*out over every Linear),
``hook_s`` the fixed cost of one hooked layer's two extra GEMMs (kernel launches / Python),
``forwards`` the denoiser calls per step (2 with classifier-free guidance), ``step_s`` the
measured seconds of one base step. A merge pays once and is shared by every job that runs
the same set back to back (``queued_same``: the queue's affinity order runs them next;
``repeats``: the set was already asked for just before), so it is divided by ``uses``;
the unfused overhead is paid by every job.

``unfused`` is chosen when ``unfused_s < merge_s``; with no step time measured yet
(the first run of a model) the answer is ``merge`` (the exact, zero-overhead path).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MODES = ("auto", "merge", "unfused")

# Defaults per device type. CPU: this project's measurement (docs/lora.md: a switch costs
# 16.6 ms + 0.448 ms per MB touched, i.e. 2.2 GB/s). CUDA: pristine copies on the host,
# streamed over PCIe (~25 GB/s effective for read W0 + write W), and three kernel launches
# per hooked layer (~5 us each) for the unfused path. Override with LoRAEngine.policy_config.
DEVICE_DEFAULTS = {
    "cpu": {"fixed_s": 0.0166, "bandwidth": 2.2e9, "hook_s": 30e-6},
    "cuda": {"fixed_s": 0.002, "bandwidth": 25e9, "hook_s": 15e-6},
}


@dataclass(frozen=True)
class PolicyInputs:
    steps: int                    # denoising steps the request will run
    merge_bytes: int              # bytes a merge would write (changed layers x weight size)
    restore_bytes: int = 0        # bytes to restore to base before serving unfused
    bandwidth: float = 2.2e9      # bytes/s a merge achieves (measured or configured)
    fixed_s: float = 0.0166       # fixed cost of a switch (s)
    step_s: float | None = None   # measured seconds of one base denoising step (None: not measured yet)
    ratio: float = 0.0            # low-rank FLOPs / base FLOPs of one denoiser forward
    hooked_layers: int = 0        # layers the unfused path hooks
    hook_s: float = 30e-6         # fixed cost per hooked layer per forward (s)
    forwards: float = 1.0         # denoiser forwards per step
    queued_same: int = 0          # queued jobs with the same adapter set (run next by affinity)
    repeats: int = 0              # consecutive earlier requests with the same set
    quantized: str = ""           # the base's quantized storage ("fp8 (...)", "gguf (Q8_0)"): unfused only


@dataclass(frozen=True)
class Decision:
    mode: str                     # "merged" or "unfused" (what ran)
    requested: str                # "auto", "merge" or "unfused"
    reason: str
    merge_s: float | None = None
    unfused_s: float | None = None
    inputs: PolicyInputs | None = None

    def as_dict(self) -> dict:
        out = {"mode": self.mode, "requested": self.requested, "reason": self.reason}
        if self.merge_s is not None:
            out["predicted_merge_s"] = round(self.merge_s, 6)
        if self.unfused_s is not None:
            out["predicted_unfused_s"] = round(self.unfused_s, 6)
        if self.inputs is not None:
            out["inputs"] = asdict(self.inputs)
        return out


def check_mode(mode, param: str = "lora_mode") -> str:
    from ..errors import InvalidParameter

    if mode is None:
        return "auto"
    if mode not in MODES:
        raise InvalidParameter(f"{param} must be one of {', '.join(MODES)}, got {mode!r}", param=param)
    return mode


def merge_cost(i: PolicyInputs) -> float:
    uses = 1 + max(0, i.queued_same) + max(0, i.repeats)
    if i.merge_bytes <= 0:
        return 0.0
    return (i.fixed_s + i.merge_bytes / i.bandwidth) / uses


def unfused_cost(i: PolicyInputs) -> float | None:
    if i.step_s is None:
        return None
    restore = (i.fixed_s + i.restore_bytes / i.bandwidth) if i.restore_bytes > 0 else 0.0
    per_step = i.ratio * i.step_s + i.forwards * i.hooked_layers * i.hook_s
    return restore + i.steps * per_step


def decide(i: PolicyInputs, requested: str = "auto") -> Decision:
    """The mode for one request (see the module docstring for the formula). A quantized base is served
    unfused whatever the numbers (a merge would write into fp8/GGUF storage); ``merge`` is refused."""
    if i.quantized:
        if requested == "merge":
            from ..errors import InvalidParameter

            raise InvalidParameter(f"lora_mode=merge: the base is quantized ({i.quantized}); adapters run unfused "
                                   "on it (a merge would write into quantized storage and round the adapter away)",
                                   param="lora_mode")
        return Decision("unfused", requested, f"quantized base ({i.quantized}): unfused only", inputs=i)
    if requested == "merge":
        return Decision("merged", requested, "forced (lora_mode=merge)", inputs=i)
    if requested == "unfused":
        return Decision("unfused", requested, "forced (lora_mode=unfused)", inputs=i)
    m = merge_cost(i)
    if m == 0.0:
        return Decision("merged", requested, "nothing to write: the set is already merged", m, None, i)
    u = unfused_cost(i)
    if u is None:
        return Decision("merged", requested, "no step time measured yet", m, None, i)
    if u < m:
        return Decision("unfused", requested, f"merge {m * 1e3:.2f} ms > unfused {u * 1e3:.2f} ms", m, u, i)
    return Decision("merged", requested, f"merge {m * 1e3:.2f} ms <= unfused {u * 1e3:.2f} ms", m, u, i)

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

A set with a step schedule (``scheduled``: a scale that changes between steps,
``backend/lora/schedule.py``) always runs unfused, whatever ``lora_mode`` says: its scales
are set per step in a tensor the hooks read, where a merge would rewrite every layer at
every step (and a compiled denoiser would see new constants).
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
    scheduled: bool = False       # a scale changes between steps (a step schedule): unfused, always
    quantized: str = ""           # the base's quantized storage ("fp8 (...)", "gguf (Q8_0)"): unfused only
    merge_only: str = ""          # adapters only a merge applies ("adapter 'x' (LyCORIS LoHa)"): merged always


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
    unfused whatever the numbers (a merge would write into fp8/GGUF storage); ``merge`` is refused.
    A set with a merge-only adapter (LyCORIS: ``backend/lora/lycoris.py``) is merged whatever the numbers;
    what would need it unfused (a quantized base, a step schedule, ``lora_mode=unfused``) is refused by name."""
    if i.merge_only:
        from ..errors import InvalidParameter

        if i.quantized:
            raise InvalidParameter(f"{i.merge_only} is applied by merge only, and this base is quantized "
                                   f"({i.quantized}): adapters run unfused on it; use a LoRA, or an unquantized "
                                   "base", param="lora")
        if i.scheduled:
            raise InvalidParameter(f"{i.merge_only} is applied by merge only: a weight over steps needs the "
                                   "unfused path; give it one weight", param="lora_scale")
        if requested == "unfused":
            raise InvalidParameter(f"lora_mode=unfused: {i.merge_only} is applied by merge only (its delta has "
                                   "no low-rank form to add per step)", param="lora_mode")
        return Decision("merged", requested, f"{i.merge_only}: merge only", merge_cost(i), None, i)
    if i.quantized:
        if requested == "merge":
            from ..errors import InvalidParameter

            raise InvalidParameter(f"lora_mode=merge: the base is quantized ({i.quantized}); adapters run unfused "
                                   "on it (a merge would write into quantized storage and round the adapter away)",
                                   param="lora_mode")
        return Decision("unfused", requested, f"quantized base ({i.quantized}): unfused only", inputs=i)
    if i.scheduled:
        return Decision("unfused", requested, "a step schedule: scales set per step unfused "
                        "(a merge would rewrite the layers every step)", inputs=i)
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


# -- mixed-adapter batches: one batched call or the jobs one by one ------------------------------------
@dataclass(frozen=True)
class BatchInputs:
    jobs: list                    # each job's single-request PolicyInputs (None: the job has no adapters)
    steps: int
    step_s: float | None          # measured seconds of one lone base step
    # per-sample step cost in a batch of this size over a lone step, as measured (UnfusedServing keeps the
    # observed ratio per size); None: no batch of this size has run here yet, so one is run to measure it (a
    # default would be wrong on some device, and a default that says "one by one" would never be corrected)
    batch_eff: float | None = 1.0
    forwards: float = 1.0
    hook_s: float = 30e-6
    hooked_layers: int = 0        # layers the batch hooks (union of every set's layers, per component)


def batch_costs(b: BatchInputs) -> tuple[float, float] | None:
    """(sequential_s, batched_s) predicted for the jobs, or None without a measured step time.

    sequential: each job alone, with its own cheapest way to apply its set (``decide``'s merge or unfused,
    ``min(merge_s, unfused_s)``) plus its base steps; batched: the base steps of n samples at
    ``batch_eff`` each, every job's low-rank FLOPs, and one batched hook per union layer per forward."""
    if b.step_s is None:
        return None
    n = len(b.jobs)
    sequential = n * b.steps * b.step_s
    lowrank = 0.0
    for i in b.jobs:
        if i is None:
            continue
        m = merge_cost(i)
        u = unfused_cost(i)
        sequential += m if u is None else min(m, u)
        lowrank += i.ratio
    batched = b.steps * (n * b.step_s * b.batch_eff + lowrank * b.step_s + b.forwards * b.hooked_layers * b.hook_s)
    return sequential, batched


def decide_batch(b: BatchInputs) -> dict:
    """``{"mode": "batched" | "sequential", "reason", "predicted_sequential_s", "predicted_batched_s"}``:
    one pipeline call for the jobs, or each alone (its own merge-or-unfused ``decide``)."""
    only = next((i.merge_only for i in b.jobs if i is not None and i.merge_only), "")
    if only:  # a batch runs every set unfused, side by side
        return {"mode": "sequential", "reason": f"{only} is applied by merge only"}
    if b.batch_eff is None:
        return {"mode": "batched", "reason": f"no batch of {len(b.jobs)} measured yet on this device: batched once "
                                             "to measure it"}
    costs = batch_costs(b)
    if costs is None:
        return {"mode": "batched", "reason": "no step time measured yet: batched as asked (--max-batch, or the "
                                             "jobs' batch_size)"}
    seq, bat = costs
    out = {"predicted_sequential_s": round(seq, 6), "predicted_batched_s": round(bat, 6),
           "batch_eff": round(b.batch_eff, 4)}
    if bat < seq:
        return {"mode": "batched", "reason": f"one by one {seq * 1e3:.2f} ms > batched {bat * 1e3:.2f} ms", **out}
    return {"mode": "sequential", "reason": f"one by one {seq * 1e3:.2f} ms <= batched {bat * 1e3:.2f} ms", **out}

"""Sampling contracts that MiniMax-H3 artifacts declare, and the check of a request against them.

Three kinds of artifact pin how they must be sampled; sampling them any other way gives plausible-looking
garbage, so a mismatching request is rejected (ContractViolation, HTTP 422) naming the artifact and the
expected values:

- a checkpoint whose repository index carries ``base_schedule`` (explicit sigmas);
- a runtime Turbo LoRA (LightX2V), whose file *name* is the contract:
  ``minimax_h3_(fl2v|ref2v)_turbo_<N>step_v<X.Y>[_768p][_bf16].safetensors``;
- a runtime native ("FlashGen") LoRA, whose ``__metadata__`` declares ``key_format=minimax-h3-native``,
  ``qkv_layout=grouped`` and ``base_schedule``.

Step counting: everywhere in LoRA Studio ``num_inference_steps`` is the number of denoising intervals
(model evaluations). ``MiniMaxH3Scheduler.set_timesteps(n)`` takes sigma *points*, so N intervals are
N + 1 points; `SamplingPlan.sigma_points` is that translation, made in this one place.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import AdapterError, ContractViolation

from ..families.minimax import TASKS as _FAMILY_TASKS

TASKS = tuple(_FAMILY_TASKS)
#: Which partition a task denoises with (the family's routing, backend/families/minimax.py).
PARTITION = dict(_FAMILY_TASKS)

TURBO_PATTERN = "minimax_h3_(fl2v|ref2v)_turbo_<N>step_v<X.Y>[_768p][_bf16].safetensors"
_TURBO_RE = re.compile(
    r"^minimax_h3_(?P<task>fl2v|ref2v)_turbo_(?P<steps>[1-9]\d*)step_v(?P<version>\d+\.\d+)"
    r"(?P<res>_768p)?(?P<bf16>_bf16)?\.safetensors$"
)
TURBO_TASKS = {"fl2v": frozenset({"t2va", "fl2va"}), "ref2v": frozenset({"ref2va"})}
TURBO_FLOW_SHIFT_768P = 6.0
TURBO_FLOW_SHIFT_544P = 12.0
TURBO_AUDIO_FLOW_SHIFT = 3.0
TURBO_DEFAULT_ALPHA = 8.0

NATIVE_KEY_FORMAT = "minimax-h3-native"
NATIVE_QKV_LAYOUT = "grouped"

#: The base checkpoint's own shifts (its scheduler configs), used when no contract pins them.
BASE_FLOW_SHIFT = 12.0
BASE_AUDIO_FLOW_SHIFT = 3.0


@dataclass(frozen=True)
class SamplingContract:
    """What one artifact requires of every request sampled with it."""

    artifact: str  # the file or checkpoint that declares it, as shown to users
    kind: str  # "turbo" | "native" | "checkpoint"
    steps: int  # interval count
    sigmas: tuple[float, ...] | None = None  # explicit schedule (native, checkpoint); None: shifted grid
    flow_shift: float | None = None
    audio_flow_shift: float | None = None
    tasks: frozenset[str] | None = None  # None: every task
    alpha: float | None = None  # network alpha the adapter is scaled by (alpha / rank); None: alpha == rank
    resolution: str | None = None  # "768p" | "544p" (Turbo)

    def describe(self) -> dict:
        out = {"artifact": self.artifact, "kind": self.kind, "num_inference_steps": self.steps}
        if self.sigmas is not None:
            out["sigmas"] = list(self.sigmas)
        for name in ("flow_shift", "audio_flow_shift", "alpha", "resolution"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tasks is not None:
            out["task_types"] = [t for t in TASKS if t in self.tasks]
        return out


@dataclass(frozen=True)
class SamplingPlan:
    """The resolved schedule of one request."""

    steps: int  # intervals
    task_type: str
    sigmas: tuple[float, ...] | None  # explicit (both modalities), else the shifted grid below
    flow_shift: float
    audio_flow_shift: float
    contract: SamplingContract | None

    @property
    def sigma_points(self) -> int:
        return self.steps + 1


# -- reading contracts -------------------------------------------------------------------------------------


def parse_schedule(value, *, artifact: str, key: str = "base_schedule") -> tuple[float, ...]:
    """A schedule from a list or a "1.0,0.7,...,0.0" string: strictly decreasing, from 1.0 to 0.0."""
    try:
        if isinstance(value, str):
            sigmas = tuple(float(part) for part in value.replace("[", "").replace("]", "").split(","))
        else:
            sigmas = tuple(float(s) for s in value)
    except (TypeError, ValueError):
        raise AdapterError(f"{artifact}: {key} must be a list of numbers, got {value!r}", param=key) from None
    if len(sigmas) < 2 or sigmas[0] != 1.0 or sigmas[-1] != 0.0 or any(b >= a for a, b in zip(sigmas, sigmas[1:])):
        raise AdapterError(
            f"{artifact}: {key} must decrease strictly from 1.0 to 0.0 with at least 2 points, got {list(sigmas)}",
            param=key,
        )
    return sigmas


def turbo_contract(file_name: str, metadata: dict | None = None) -> SamplingContract:
    """The contract a LightX2V Turbo file name declares (alpha from its __metadata__, else 8)."""
    name = Path(file_name).name
    match = _TURBO_RE.match(name)
    if match is None:
        raise AdapterError(
            f"Turbo LoRA file name {name!r} does not match the expected pattern {TURBO_PATTERN}; the name is the "
            f"sampling contract, so a renamed file cannot be used",
            param="lora_path",
        )
    steps = int(match["steps"])
    is_768 = match["res"] is not None
    alpha = TURBO_DEFAULT_ALPHA
    if metadata and "alpha" in metadata:
        try:
            alpha = float(metadata["alpha"])
        except (TypeError, ValueError):
            raise AdapterError(f"{name}: __metadata__ alpha must be a number, got {metadata['alpha']!r}",
                               param="alpha") from None
    return SamplingContract(
        artifact=name,
        kind="turbo",
        steps=steps,
        flow_shift=TURBO_FLOW_SHIFT_768P if is_768 else TURBO_FLOW_SHIFT_544P,
        audio_flow_shift=TURBO_AUDIO_FLOW_SHIFT,
        tasks=TURBO_TASKS[match["task"]],
        alpha=alpha,
        resolution="768p" if is_768 else "544p",
    )


def is_turbo_name(file_name: str) -> bool:
    """Names that claim to be Turbo artifacts (and so must parse)."""
    return "turbo" in Path(file_name).name.lower()


def is_native(metadata: dict | None) -> bool:
    return bool(metadata) and metadata.get("key_format") == NATIVE_KEY_FORMAT


def native_contract(file_name: str, metadata: dict) -> SamplingContract:
    name = Path(file_name).name
    layout = metadata.get("qkv_layout")
    if layout != NATIVE_QKV_LAYOUT:
        raise AdapterError(
            f"{name}: native MiniMax-H3 LoRA must declare qkv_layout={NATIVE_QKV_LAYOUT!r}, got {layout!r}",
            param="qkv_layout",
        )
    if "base_schedule" not in metadata:
        raise AdapterError(f"{name}: native MiniMax-H3 LoRA must declare base_schedule in __metadata__",
                           param="base_schedule")
    sigmas = parse_schedule(metadata["base_schedule"], artifact=name)
    alpha = None
    key = "alpha" if "alpha" in metadata else "lora_alpha"  # lora_alpha: vLLM-Omni's native files
    if key in metadata:
        try:
            alpha = float(metadata[key])
        except (TypeError, ValueError):
            raise AdapterError(f"{name}: __metadata__ {key} must be a number, got {metadata[key]!r}",
                               param="alpha") from None
    return SamplingContract(artifact=name, kind="native", steps=len(sigmas) - 1, sigmas=sigmas, alpha=alpha)


def read_index(model_path: str | Path) -> dict:
    """The repository index: modular_model_index.json (MiniMax-H3's own), else model_index.json."""
    model_path = Path(model_path)
    for name in ("modular_model_index.json", "model_index.json"):
        if (model_path / name).is_file():
            return json.loads((model_path / name).read_text())
    return {}


def checkpoint_contract(model_path: str | Path, index: dict | None = None) -> SamplingContract | None:
    """The schedule a checkpoint pins with ``base_schedule`` in its index, or None."""
    index = read_index(model_path) if index is None else index
    if "base_schedule" not in index:
        return None
    artifact = str(model_path)
    sigmas = parse_schedule(index["base_schedule"], artifact=artifact)
    return SamplingContract(artifact=artifact, kind="checkpoint", steps=len(sigmas) - 1, sigmas=sigmas)


def active_contract(checkpoint: SamplingContract | None, adapters: list[SamplingContract | None]):
    """The one contract governing a request: an adapter's overrides the checkpoint's; two differing adapter
    contracts cannot both hold."""
    declared = [c for c in adapters if c is not None]
    if len({(c.kind, c.steps, c.sigmas, c.flow_shift, c.audio_flow_shift, c.tasks) for c in declared}) > 1:
        raise ContractViolation(
            "the active adapters declare conflicting sampling contracts: "
            + "; ".join(f"{c.artifact} ({c.kind}, {c.steps} steps)" for c in declared),
            param="lora",
        )
    return declared[0] if declared else checkpoint


# -- checking a request ------------------------------------------------------------------------------------


def plan(request: dict, contract: SamplingContract | None, *, default_steps: int | None = None) -> SamplingPlan:
    """Resolve the schedule of a request under `contract`, rejecting every mismatch by name.

    `request` holds the generation fields: num_inference_steps, flow_shift, audio_flow_shift, task_type
    (None or absent = not given).
    """
    task = request.get("task_type") or "t2va"
    if task not in TASKS:
        raise ContractViolation(f"task_type must be one of {', '.join(TASKS)}, got {task!r}", param="task_type")
    steps = request.get("num_inference_steps")
    flow_shift = request.get("flow_shift")
    audio_shift = request.get("audio_flow_shift")

    if contract is None:
        steps = steps if steps is not None else default_steps
        if steps is None:
            raise ContractViolation("num_inference_steps is required", param="num_inference_steps")
        return SamplingPlan(steps, task, None,
                            BASE_FLOW_SHIFT if flow_shift is None else float(flow_shift),
                            BASE_AUDIO_FLOW_SHIFT if audio_shift is None else float(audio_shift), None)

    name = f"{contract.artifact} ({contract.kind})"
    if contract.tasks is not None and task not in contract.tasks:
        raise ContractViolation(
            f"{name} serves task_type {' or '.join(t for t in TASKS if t in contract.tasks)}, got {task!r}", param="task_type"
        )
    if steps is not None and steps != contract.steps:
        pinned = f" (schedule {list(contract.sigmas)})" if contract.sigmas else ""
        raise ContractViolation(
            f"{name} requires num_inference_steps={contract.steps}{pinned}, got {steps}",
            param="num_inference_steps",
        )
    for field, value, expected in (("flow_shift", flow_shift, contract.flow_shift),
                                   ("audio_flow_shift", audio_shift, contract.audio_flow_shift)):
        if value is None:
            continue
        if contract.sigmas is not None:
            raise ContractViolation(
                f"{name} pins its sigma schedule {list(contract.sigmas)}; {field} does not apply, got {value}",
                param=field,
            )
        if float(value) != expected:
            raise ContractViolation(f"{name} requires {field}={expected:g}, got {value}", param=field)
    return SamplingPlan(
        steps=contract.steps,
        task_type=task,
        sigmas=contract.sigmas,
        flow_shift=contract.flow_shift if contract.flow_shift is not None else BASE_FLOW_SHIFT,
        audio_flow_shift=contract.audio_flow_shift if contract.audio_flow_shift is not None
        else BASE_AUDIO_FLOW_SHIFT,
        contract=contract,
    )

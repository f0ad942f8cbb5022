"""Offload policy for MiniMax-H3 with LoRA adapters (checked once, at start).

- model CPU offload (whole components move between CPU and GPU): adapter layers are submodules of the
  component they bind to and move with it, for both backends. Allowed.
- group offload (blocks onloaded per forward from a CPU copy captured when the hooks are applied):
  * distill: adapters are fused into the base weights once at start, *before* the hooks are applied, so the
    captured copy already holds the fused weights. Allowed.
  * peft: adapters change per request. diffusers re-applies the hooks when an adapter is loaded or deleted,
    but merging an adapter into the weights (the PEFT backend's fast path, and exact restore) writes into
    onloaded tensors that the next offload discards in favour of the stale CPU copy (with streams, the pinned
    copy), so the adapter would silently apply or not depending on residency. Refused.
No GPU was lent to the session that wrote this, so neither allowed mode has been measured against the
no-offload output on CUDA; docs/minimax.md says so.
"""

from __future__ import annotations

from ..errors import InvalidParameter

MODES = ("none", "model", "group")


def check(offload: str | None, lora_backend: str) -> str:
    mode = offload or "none"
    if mode not in MODES:
        raise InvalidParameter(f"--offload must be one of {', '.join(MODES)}, got {offload!r}", param="offload")
    if mode == "group" and lora_backend == "peft":
        raise InvalidParameter(
            "--offload group conflicts with --lora-backend peft: group offload restores weights from a CPU copy "
            "taken when it is enabled, so per-request adapters would not stay consistent; use --offload model, "
            "or --lora-backend distill (adapters fused before offload is applied)",
            param="offload",
        )
    return mode

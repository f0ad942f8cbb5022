"""Checksums and exact snapshots of module weights.

Fuse/unfuse arithmetic (``W += BA*s; W -= BA*s``) does not give the base back bit for
bit in low precision, so anything that writes into base weights keeps a copy of exactly
the tensors it touches and restores from that copy. This module is the one place that
does it, for the PEFT merge path and the distill fuse path alike.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """sha256 of a tensor's raw bytes (dtype and shape included)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    # view as bytes: works for every dtype including bfloat16, which numpy lacks
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def module_checksum(module: torch.nn.Module) -> str:
    """sha256 over a module's parameters and buffers, in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict(keep_vars=False).items()):
        h.update(name.encode())
        h.update(tensor_digest(tensor))
    return h.hexdigest()


@dataclass
class WeightSnapshot:
    """CPU copies of a chosen set of a module's tensors, to put back exactly.

    Only the tensors that will be written are copied, so the cost is the size of
    the touched layers, not of the model.
    """

    module: torch.nn.Module
    saved: dict[str, torch.Tensor] = field(default_factory=dict)

    def capture(self, names) -> None:
        """Copy the named parameters/buffers not already captured."""
        state = dict(self.module.named_parameters())
        state.update(dict(self.module.named_buffers()))
        for name in names:
            if name in self.saved:
                continue
            if name not in state:
                raise KeyError(f"no parameter named {name!r} to snapshot")
            self.saved[name] = state[name].detach().to("cpu", copy=True)

    def restore(self) -> None:
        """Write every captured tensor back in place, bit for bit."""
        state = dict(self.module.named_parameters())
        state.update(dict(self.module.named_buffers()))
        with torch.no_grad():
            for name, saved in self.saved.items():
                state[name].data.copy_(saved.to(state[name].device))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    def clear(self) -> None:
        self.saved.clear()

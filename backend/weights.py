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


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_COLS = 1024
_DIGEST_CHUNK = 1 << 22  # elements per pass: bounds the int64 temporaries (32 MiB)


def device_digest(tensor: torch.Tensor) -> torch.Tensor:
    """A checksum of a tensor's bytes computed where it lives (no copy to the CPU): 3 int64 on its
    device. The bits are read as integers and summed plainly, weighted by column (position mod
    1024) and by row, with wrap-around int64 arithmetic. Any single changed element changes it,
    and so do nearly all multi-element changes (two swapped values with the same column and row
    weight sums would not): a guard against bugs, not against an adversary (``module_checksum``
    is the sha256 one)."""
    t = tensor.detach().contiguous().reshape(-1)
    ints = t.view(_INT_VIEW[t.element_size()])
    out = torch.zeros(3, dtype=torch.int64, device=t.device)
    cols = torch.arange(1, _DIGEST_COLS + 1, dtype=torch.int64, device=t.device)
    for start in range(0, ints.numel(), _DIGEST_CHUNK):
        chunk = ints[start:start + _DIGEST_CHUNK].to(torch.int64)
        pad = (-chunk.numel()) % _DIGEST_COLS
        if pad:
            chunk = torch.cat([chunk, chunk.new_zeros(pad)])
        grid = chunk.view(-1, _DIGEST_COLS)
        rows = torch.arange(start // _DIGEST_COLS + 1, start // _DIGEST_COLS + 1 + grid.shape[0],
                            dtype=torch.int64, device=t.device)
        out[0] += grid.sum()
        out[1] += (grid * cols).sum()
        out[2] += (grid.sum(1) * rows).sum()
    return out


def digests_equal(before: dict, tensors: dict) -> list:
    """Keys whose ``device_digest`` differs from ``before`` (one device sync per device)."""
    by_device: dict = {}
    for key, digest in before.items():
        t = tensors[key]
        by_device.setdefault(t.device, []).append((key, (device_digest(t) != digest.to(t.device)).any()))
    bad = []
    for items in by_device.values():
        flags = torch.stack([f for _, f in items]).cpu().tolist()
        bad += [key for (key, _), f in zip(items, flags) if f]
    return bad

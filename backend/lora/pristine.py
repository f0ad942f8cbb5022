"""Where the LoRA engine keeps the originals of the layers it writes (``--pristine``).

Every merge writes ``W = W0 + B s A`` from the pristine copy ``W0``, never from the previous
merged value, so the copies are what makes switching exact. They can live:

- ``device``: next to the weights (a clone on the weight's device). A switch reads ``W0`` from
  device memory: no transfer at all. Costs the touched layers' bytes of device memory.
- ``host``: in host memory, pinned when CUDA is present. A switch copies each touched ``W0``
  to the device on a side CUDA stream, into one of two staging buffers, while the default
  stream merges the previous layer (copy of layer i+1 overlaps the GEMM of layer i). On CPU
  weights there is nothing to transfer: the host copy is read in place.
- ``auto``: ``device`` when the device has room for every targetable layer (all Linear
  weights of the denoisers) with ``DEVICE_HEADROOM`` of its memory left over for activations,
  else ``host``. On a CPU model the device *is* host memory, so auto picks ``device``.

Host RAM is checked at start (``check_host_memory``): when the copies would live in host
memory and ``psutil``'s available memory cannot hold the targetable layers, the engine refuses
to start with one line naming the flag that helps. ``LORA_STUDIO_FAKE_AVAILABLE_MEMORY``
(bytes) replaces psutil's figure in that same check, for tests.
"""
from __future__ import annotations

import os

import torch

from ..errors import InsufficientMemory, InvalidParameter

PRISTINE_MODES = ("auto", "device", "host")
DEVICE_HEADROOM = 0.25  # auto keeps this share of device memory free for activations
HOST_HEADROOM = 1 << 30  # and this much host memory free beside the copies


def targetable_bytes(denoisers: dict[str, torch.nn.Module]) -> int:
    """Bytes of every Linear weight and bias of the denoisers (and text encoders, where the engine may change
    them): the most a pristine store can hold."""
    total = 0
    for module in denoisers.values():
        for sub in module.modules():
            if isinstance(sub, torch.nn.Linear):
                for p in (sub.weight, sub.bias):
                    if p is not None:
                        total += p.numel() * p.element_size()
    return total


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} GiB"


def available_host_memory() -> int | None:
    fake = os.environ.get("LORA_STUDIO_FAKE_AVAILABLE_MEMORY")
    if fake:
        return int(fake)
    import psutil

    return int(psutil.virtual_memory().available)


def _device_of(denoisers) -> torch.device:
    for module in denoisers.values():
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


def choose(mode: str, denoisers: dict[str, torch.nn.Module]) -> tuple[str, str]:
    """(placement, why) for a requested mode."""
    if mode not in PRISTINE_MODES:
        raise InvalidParameter(f"pristine must be one of {', '.join(PRISTINE_MODES)}, got {mode!r}",
                               param="pristine")
    device = _device_of(denoisers)
    need = targetable_bytes(denoisers)
    if mode != "auto":
        return mode, "asked for"
    if device.type != "cuda":
        return "device", f"the model is on {device.type}: its memory is host memory"
    free, total = torch.cuda.mem_get_info(device)
    if need <= free - DEVICE_HEADROOM * total:
        return "device", (f"{size(need)} of targetable layers fit in {size(free)} free "
                          f"on {device} (keeping {DEVICE_HEADROOM:.0%} of it for activations)")
    return "host", (f"{size(need)} of targetable layers do not fit in {size(free)} free on "
                    f"{device} with {DEVICE_HEADROOM:.0%} kept for activations")


def check_host_memory(placement: str, denoisers: dict[str, torch.nn.Module]) -> None:
    """Refuse (one line, naming the flag that helps) when host RAM cannot hold the copies."""
    device = _device_of(denoisers)
    if placement == "device" and device.type != "cpu":
        return  # device memory: bounded by ``choose`` (auto) or the user's own choice
    available = available_host_memory()
    if available is None:
        return
    need = targetable_bytes(denoisers)
    if need + HOST_HEADROOM <= available:
        return
    helps = ("--pristine device (keep the originals on the GPU)" if device.type == "cuda"
             else "--lora-backend distill (fuse once, no per-request adapters) or a machine with more RAM")
    raise InsufficientMemory(
        f"not enough host memory for the LoRA engine's pristine copies: {size(need)} of targetable layers + "
        f"{size(HOST_HEADROOM)} headroom, {size(available)} available; use {helps}",
        param="pristine")


def describe(model_id: str, data_dir=None) -> str:
    """One line for ``app.py adapters --model M``: how much the originals can take and where auto puts them."""
    from .library import denoiser_skeletons, encoder_skeletons

    _, skeletons = denoiser_skeletons(model_id, data_dir)
    need = targetable_bytes({**skeletons, **encoder_skeletons(model_id, data_dir)})
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        where = ("on the GPU" if need <= free - DEVICE_HEADROOM * total else "in pinned host memory") + \
            f" ({size(free)} free on the GPU now)"
    else:
        where = "with the model, in host memory (no GPU)"
    available = available_host_memory()
    ram = f"; host RAM available: {size(available)}" if available is not None else ""
    return (f"pristine originals (peft engine): up to {size(need)} for the targetable layers of {model_id}; "
            f"--pristine auto keeps them {where}{ram}")


class PristineStore:
    """Originals of the tensors a switch writes, keyed (component, parameter name)."""

    def __init__(self, placement: str):
        if placement not in ("device", "host"):
            raise InvalidParameter(f"pristine placement must be device or host, got {placement!r}",
                                   param="pristine")
        self.placement = placement
        self.saved: dict[tuple[str, str], torch.Tensor] = {}
        self._stream = None
        self._staging: dict[torch.device, list[torch.Tensor]] = {}

    def __contains__(self, key) -> bool:
        return key in self.saved

    def capture(self, key: tuple[str, str], tensor: torch.Tensor) -> None:
        if key in self.saved:
            return
        t = tensor.detach()
        if self.placement == "device":
            self.saved[key] = t.clone()
        else:
            copy = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            copy.copy_(t)
            self.saved[key] = copy

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    def where(self) -> str:
        devices = sorted({str(t.device) for t in self.saved.values()})
        pinned = any(t.is_pinned() for t in self.saved.values() if t.device.type == "cpu")
        if not devices:
            return self.placement
        return f"{self.placement} ({', '.join(devices)}{', pinned' if pinned else ''})"

    def clear(self) -> None:
        self.saved.clear()
        self._staging.clear()

    def put_back(self, key, param: torch.Tensor) -> None:
        """Copy one original back (synchronously): rollback and restore."""
        with torch.no_grad():
            param.data.copy_(self.saved[key].to(param.device))

    def stream_originals(self, keys_and_params):
        """Yield (index, original on the parameter's device) for each (key, param), in order.

        Host copies of CUDA weights are copied on a side stream into two staging buffers:
        the copy of item i+1 is queued before item i is handed out, so it overlaps whatever the
        caller does with item i on the current stream. The caller must finish using item i's
        tensor (on the current stream) before asking for item i+2 — which is what iterating does.
        Everywhere else the original is handed out as is (no copy).
        """
        items = list(keys_and_params)
        if not items:
            return
        cuda = [p.device.type == "cuda" and self.saved[k].device.type == "cpu" for k, p in items]
        if not any(cuda):
            for i, (k, _) in enumerate(items):
                yield i, self.saved[k]
            return
        device = next(p.device for (k, p), c in zip(items, cuda) if c)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        side, current = self._stream, torch.cuda.current_stream(device)
        largest = max(self.saved[k].numel() * self.saved[k].element_size() for (k, _), c in zip(items, cuda) if c)
        bufs = self._staging.get(device)
        if bufs is None or bufs[0].numel() < largest:
            bufs = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]
            self._staging[device] = bufs
        slot_free: list = [None, None]  # per staging buffer: the event after its last reader
        ready: dict[int, tuple] = {}
        order = [j for j in range(len(items)) if cuda[j]]
        position = {j: n for n, j in enumerate(order)}

        def enqueue(i: int) -> None:
            src = self.saved[items[i][0]]
            slot = position[i] % 2
            with torch.cuda.stream(side):
                if slot_free[slot] is not None:  # the buffer's previous item must be merged first
                    side.wait_event(slot_free[slot])
                dst = bufs[slot][: src.numel() * src.element_size()].view(src.dtype).view(src.shape)
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
            ready[i] = (ev, dst, slot)

        if order:
            enqueue(order[0])
        for i, (k, _) in enumerate(items):
            if not cuda[i]:
                yield i, self.saved[k]
                continue
            n = position[i]
            if n + 1 < len(order):
                enqueue(order[n + 1])  # queued now: overlaps the caller's work on item i
            ev, dst, slot = ready.pop(i)
            current.wait_event(ev)
            yield i, dst
            done = torch.cuda.Event()
            done.record(current)
            slot_free[slot] = done

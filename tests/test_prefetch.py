"""Prefetch on the real engine (demo:qwen-image, CPU): it fills the cache within its bound, never
evicts a pinned, active or protected entry, swallows errors, and a prefetched adapter activates
with no disk read. (The served path, worker + queue, is tests/test_lora_serve_modes.py.)"""
from __future__ import annotations

import pytest
import torch

from backend.jobs.prefetch import prefetch
from backend.lora import attach
from backend.lora.request import LoRARequest
from backend.manager import PipelineManager

torch.set_num_threads(1)



@pytest.fixture(scope="module")
def manager(data_dir):
    m = PipelineManager(device="cpu", data_dir=data_dir)
    m.load("demo:qwen-image")
    return m


def held(engine, tier: str) -> list[int]:
    """The lora_int_ids (1 x, 2 y, 3 z) a cache tier holds, LRU first (the cache is keyed by identity)."""
    order = ["demo-inverted", "demo-outline", "demo-grayscale"]
    return [order.index(n) + 1 for n in engine.stats()["tiers"][tier]["adapters"]]


def req(path, i) -> LoRARequest:
    return LoRARequest(path.stem, i, str(path))


@pytest.fixture
def adapters(library):
    q = library / "qwen-image"
    return [req(q / "demo-inverted.safetensors", 1), req(q / "demo-outline.safetensors", 2),
            req(q / "demo-grayscale", 3)]


def test_prefetch_fills_within_the_bound_and_skips_the_disk_later(manager, adapters):
    engine = attach(manager, max_loras=1, max_cpu_loras=2, lora_mode="merge")
    x, y, z = adapters
    engine.activate([(x, 1.0)])  # x is in use: merged, on the only device slot
    reads = engine.counters["loads_from_disk"]
    got = prefetch(engine, [y, z])
    # y is read and converted (CPU tier) but not moved: the one device slot holds the active x;
    # z is not read: the CPU tier (2) holds x (active) and y (this round)
    assert got == {"read": 1, "cached": 0, "device": 0, "bounded": 2, "errors": 0}
    assert held(engine, "device") == [1] and held(engine, "cpu") == [1, 2]
    assert engine.counters["loads_from_disk"] == reads + 1
    engine.activate([(y, 1.0)])  # no disk read: prefetch had it
    assert engine.counters["loads_from_disk"] == reads + 1
    engine.activate([])


def test_prefetch_moves_to_the_device_and_never_evicts_pins_or_protected(manager, adapters):
    engine = attach(manager, max_loras=2, max_cpu_loras=2, lora_mode="merge")
    x, y, z = adapters
    engine.load(x, pin=True)
    got = prefetch(engine, [y])
    assert got["read"] == 1 and got["device"] == 1
    assert set(held(engine, "device")) == {2} and set(held(engine, "cpu")) == {1, 2}
    # the running job needs y (protected): z would evict it from the CPU tier (x is pinned): not read
    assert prefetch(engine, [z], protect={2})["bounded"] == 1
    assert set(held(engine, "cpu")) == {1, 2} and engine.counters["loads_from_disk"] == 2
    # nothing protected: z takes y's place, never the pinned x
    assert prefetch(engine, [z])["read"] == 1 and set(held(engine, "cpu")) == {1, 3}
    reads = engine.counters["loads_from_disk"]
    engine.activate([(z, 1.0)])
    assert engine.counters["loads_from_disk"] == reads and engine.cache.device.hits >= 1
    engine.activate([])


def test_prefetch_errors_never_raise(manager, adapters, tmp_path):
    engine = attach(manager, max_loras=2, max_cpu_loras=4, lora_mode="merge")
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes((64).to_bytes(8, "little") + b"not json" * 8)
    got = prefetch(engine, [LoRARequest("broken", 9, str(bad)), LoRARequest("gone", 10, str(tmp_path / "x")),
                            adapters[0]])
    assert got["errors"] == 2 and got["read"] == 1  # the good one after them still came in

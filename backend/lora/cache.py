"""A two-tier LRU for adapters: a small device tier and a larger CPU tier.

Each tier counts hits, misses, evictions and bytes. Pinned keys are never evicted, and
neither are the keys a caller protects (the adapters of the request being activated);
when only such keys remain, a tier may run over its capacity until they are released.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable


@dataclass
class _Entry:
    value: Any
    nbytes: int


class LRUTier:
    def __init__(self, name: str, capacity: int):
        if capacity < 1:
            raise ValueError(f"{name} tier capacity must be at least 1, got {capacity}")
        self.name, self.capacity = name, capacity
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list:
        """Least recently used first."""
        return list(self._entries)

    def peek(self, key):
        """The value under ``key`` (None if absent), without counting a hit or moving it in the LRU order."""
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def get(self, key):
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry.value

    def put(self, key, value, nbytes: int, keep=frozenset()) -> list:
        """Insert as most recent; evict least recent unkept entries past capacity. Returns evicted keys."""
        self._entries[key] = _Entry(value, nbytes)
        self._entries.move_to_end(key)
        evicted = []
        for old in list(self._entries):
            if len(self._entries) <= self.capacity:
                break
            if old == key or old in keep:
                continue
            del self._entries[old]
            evicted.append(old)
        self.evictions += len(evicted)
        return evicted

    def pop(self, key) -> None:
        self._entries.pop(key, None)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def nbytes_of(self, key) -> int:
        entry = self._entries.get(key)
        return entry.nbytes if entry else 0

    def stats(self) -> dict:
        return {"capacity": self.capacity, "size": len(self._entries), "bytes": self.nbytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


class TwoTierCache:
    def __init__(self, max_device: int, max_cpu: int):
        self.device = LRUTier("device", max_device)
        self.cpu = LRUTier("cpu", max_cpu)
        self.pinned: set = set()

    def keep(self, extra=()) -> frozenset:
        return frozenset(self.pinned) | frozenset(extra)

    def drop(self, key) -> None:
        self.device.pop(key)
        self.cpu.pop(key)
        self.pinned.discard(key)

    def stats(self) -> dict:
        return {"device": self.device.stats(), "cpu": self.cpu.stats()}

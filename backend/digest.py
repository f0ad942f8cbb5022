"""Digests and ids of adapter files: one sha256 helper and one ``lora_int_id`` rule for the app.

No torch here: the Studio process (which never imports torch) hashes and numbers adapters too.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

# ids for adapters pre-loaded at start (Omni(lora_path=...)), out of the way of every lora_int_id below
PRELOAD_ID_BASE = 1 << 30


def file_sha256(path: str | os.PathLike, into=None) -> str:
    """sha256 of a file's bytes (``hashlib.file_digest``); ``into``: a hash object to feed instead."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, (lambda: into) if into is not None else "sha256").hexdigest()


def adapter_sha256(path: str | os.PathLike) -> str:
    """sha256 of an adapter: the file, or for a PEFT folder its files' names and bytes in name order."""
    p = Path(path)
    if not p.is_dir():
        return file_sha256(p)
    digest = hashlib.sha256()
    for f in sorted(f for f in p.iterdir() if f.is_file()):
        digest.update(f.name.encode() + b"\0")
        file_sha256(f, into=digest)
    return digest.hexdigest()


def lora_int_id(identity: str) -> int:
    """The ``lora_int_id`` of an adapter, from its identity: its resolved path (the resolver), or its
    sha256 where the path differs per node (Ray jobs without an id). Stable across processes and
    restarts, in [1, PRELOAD_ID_BASE) so it never meets a pre-loaded adapter's id."""
    n = int.from_bytes(hashlib.sha256(identity.encode()).digest()[:4], "big")
    return n % (PRELOAD_ID_BASE - 1) + 1

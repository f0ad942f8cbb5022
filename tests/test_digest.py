"""One sha256 helper (hashlib.file_digest) and one lora_int_id rule (backend/digest.py)."""
from __future__ import annotations

import hashlib

from backend.digest import PRELOAD_ID_BASE, adapter_sha256, file_sha256, lora_int_id
from backend.jobs.adapters import AdapterResolver


def test_file_and_folder_digests(tmp_path):
    f = tmp_path / "a.safetensors"
    f.write_bytes(b"\x01" * (3 << 20) + b"tail")  # more than one read chunk
    assert file_sha256(f) == adapter_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    folder = tmp_path / "peft"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    (folder / "adapter_config.json").write_bytes(b"{}")
    expected = hashlib.sha256(b"adapter_config.json\0{}adapter_model.safetensors\0weights").hexdigest()
    assert adapter_sha256(folder) == expected


def test_lora_int_id_is_one_stable_id_per_adapter_in_every_process(tmp_path, data_dir):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    first, second = AdapterResolver((), data_dir), AdapterResolver((), data_dir)  # e.g. two server runs
    ids = [first.int_id(a), first.int_id(b)]
    assert [second.int_id(b), second.int_id(a)] == ids[::-1]  # the order asked in does not matter
    assert ids == [lora_int_id(str(a)), lora_int_id(str(b))] and ids[0] != ids[1]
    assert all(0 < i < PRELOAD_ID_BASE for i in ids + [lora_int_id("f" * 64), lora_int_id("")])

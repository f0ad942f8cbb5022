"""A1111's sidecar (``<name>.json`` beside an adapter, #28 item 4), read as untrusted: the fields it means,
and nothing else; a link, a FIFO, a huge or broken file reads as no sidecar, at once."""
from __future__ import annotations

import json
import os
import time

import pytest

from backend.lora import sidecar


def write(tmp_path, data, name="style"):
    adapter = tmp_path / f"{name}.safetensors"
    adapter.write_bytes(b"")
    side = tmp_path / f"{name}.json"
    side.write_text(data if isinstance(data, str) else json.dumps(data))
    return adapter


def test_the_fields_a1111_writes_are_read():
    data = {"description": "d", "sd version": "Other", "activation text": "pixel  art,\n16-bit",
            "preferred weight": 0.8, "negative text": "blurry", "notes": "n"}
    assert sidecar.parse(data) == {"preferred_weight": 0.8, "activation_text": "pixel art, 16-bit",
                                   "negative_text": "blurry"}


@pytest.mark.parametrize("weight", [0, 0.0, True, "0.8", float("inf"), float("nan"), 1e9, None, [1]])
def test_a_weight_that_is_not_a_usable_number_reads_as_unset(weight):
    assert sidecar.parse({"preferred weight": weight})["preferred_weight"] is None  # A1111's 0: not set


def test_texts_are_cut_and_other_json_reads_as_none():
    assert len(sidecar.parse({"activation text": "x " * 5000})["activation_text"]) == sidecar.MAX_TEXT
    for data in ([1, 2], "text", 3, None, {"activation text": 5}):
        assert sidecar.parse(data) == sidecar.EMPTY


def test_a_file_beside_the_adapter_is_read_and_its_change_seen(tmp_path):
    adapter = write(tmp_path, {"preferred weight": 0.5, "activation text": "inky"})
    assert sidecar.read(adapter)["activation_text"] == "inky" and sidecar.preferred_weight(adapter) == 0.5
    side = tmp_path / "style.json"
    side.write_text(json.dumps({"preferred weight": 1.25}))
    os.utime(side, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert sidecar.preferred_weight(adapter) == 1.25
    folder = tmp_path / "peft-style"  # a PEFT folder's sidecar: <folder>.json beside it
    folder.mkdir()
    (tmp_path / "peft-style.json").write_text(json.dumps({"preferred weight": 0.3}))
    assert sidecar.preferred_weight(folder) == 0.3
    assert sidecar.preferred_weight(tmp_path / "none.safetensors") == 1.0


def test_hostile_sidecars_read_as_none_and_never_wait(tmp_path):
    big = write(tmp_path, json.dumps({"preferred weight": 0.5, "pad": "x" * (sidecar.MAX_BYTES + 10)}), "big")
    broken = write(tmp_path, '{"preferred weight": 0.5', "broken")
    deep = write(tmp_path, "[" * 100_000 + "]" * 100_000, "deep")
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"preferred weight": 0.5}))
    linked = tmp_path / "linked.safetensors"
    (tmp_path / "linked.json").symlink_to(target)  # no link is followed
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(tmp_path / "fifo.json")  # nobody writes: a reader that opened it would wait for ever
    started = time.monotonic()
    for adapter in (big, broken, deep, linked, fifo):
        assert sidecar.read(adapter) == sidecar.EMPTY, adapter
    assert time.monotonic() - started < 2.0

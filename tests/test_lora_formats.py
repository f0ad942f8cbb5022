"""Reading adapters: records from headers, and every bad input refused naming the file."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from backend.errors import AdapterError, AdapterNotFound
from backend.lora import demo_adapters, formats

torch.set_num_threads(1)



EXPECTED = {  # relpath -> (format, ranks, alpha)
    "sd3.5/sd35-cheesecake-peft": ("peft", (4,), 8.0),
    "sd3.5/sd35-watercolor.safetensors": ("diffusers", (8,), 8.0),
    "sd3.5/sd35-sketch-peft-dump.safetensors": ("peft-dump", (4,), None),
    "qwen-image/demo-grayscale": ("peft", (4, 8), 8.0),
    "qwen-image/demo-inverted.safetensors": ("kohya", (8,), 4.0),
    "qwen-image/demo-outline.safetensors": ("diffusers", (8,), 16.0),
    "qwen-image/demo-nine.safetensors": ("lightx2v", (8,), 4.0),
    "wan2.1-t2v/wan21-t2v-lightx2v-demo.safetensors": ("lightx2v", (4,), 4.0),
    "wan2.1-t2v/wan21-t2v-musubi-demo.safetensors": ("kohya", (4,), 2.0),
}


@pytest.mark.parametrize("relpath", sorted(EXPECTED))
def test_record_from_headers(library, relpath):
    path = library / relpath
    rec = formats.inspect(path)
    fmt, ranks, alpha = EXPECTED[relpath]
    assert (rec.format, rec.ranks, rec.alpha) == (fmt, ranks, alpha)
    assert rec.sha256 == hashlib.sha256(rec.file.read_bytes()).hexdigest()
    assert rec.size_bytes >= rec.file.stat().st_size > 0
    assert rec.num_tensors > 0 and rec.target_modules
    if fmt == "peft":
        assert rec.file.name == "adapter_model.safetensors"
        assert rec.base_model and rec.base_model.startswith("demo:")  # from adapter_config.json


def test_peft_regex_target_modules_kept(library):
    rec = formats.inspect(library / "qwen-image/demo-grayscale")
    assert isinstance(rec.peft_config["target_modules"], str)
    assert rec.peft_config["rank_pattern"] == {"transformer_blocks.1.attn.to_q": 4}


def test_sha256_cache_follows_file_changes(tmp_path):
    f = tmp_path / "a.safetensors"
    save_file({"transformer.x.lora_A.weight": torch.ones(2, 3)}, str(f))
    first = formats.inspect(f).sha256
    save_file({"transformer.x.lora_A.weight": torch.zeros(2, 3)}, str(f))
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10_000_000))
    second = formats.inspect(f).sha256
    assert first != second == hashlib.sha256(f.read_bytes()).hexdigest()


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt", ".pth"])
def test_pickle_refused_with_reason(tmp_path, suffix):
    f = tmp_path / f"lora{suffix}"
    f.write_bytes(b"\x80\x04not really")
    with pytest.raises(AdapterError, match=rf"{f.name}.*pickle.*refused"):
        formats.inspect(f)


def test_peft_folder_with_only_pickle_refused(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4}))
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin.*pickle"):
        formats.read_tensors(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(AdapterNotFound, match=str(tmp_path / "nope.safetensors")):
        formats.inspect(tmp_path / "nope.safetensors")


def test_directory_without_adapter_config(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match=rf"{tmp_path}.*without adapter_config\.json"):
        formats.inspect(tmp_path)


def test_truncated_file_named(library, tmp_path):
    src = library / "wan2.1-t2v/wan21-t2v-lightx2v-demo.safetensors"
    f = tmp_path / "cut.safetensors"
    f.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(AdapterError, match=r"cut\.safetensors: truncated"):
        formats.read_tensors(f)


def test_garbage_file_named(tmp_path):
    f = tmp_path / "junk.safetensors"
    f.write_bytes(os.urandom(256))
    with pytest.raises(AdapterError, match=r"junk\.safetensors: not a valid safetensors file"):
        formats.read_tensors(f)


def test_nan_weights_named(tmp_path):
    f = tmp_path / "nan.safetensors"
    bad = torch.ones(4, 8)
    bad[1, 2] = float("nan")
    save_file({"transformer.a.lora_A.weight": bad, "transformer.a.lora_B.weight": torch.ones(8, 4)}, str(f))
    with pytest.raises(AdapterError, match=r"nan\.safetensors: tensor 'transformer\.a\.lora_A\.weight' contains NaN"):
        formats.read_tensors(f)


def test_full_read_reports_the_file_sha256_and_the_stored_tensors(library):
    path = library / "wan2.1-t2v/wan21-t2v-lightx2v-demo.safetensors"
    formats.forget_sha256(path)  # hashed from the bytes read, not from the cache
    raw = formats.read_tensors(path)
    assert raw.record.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert raw.stamp == (path.stat().st_mtime_ns, path.stat().st_size)
    from safetensors.torch import load_file

    stored = load_file(str(path))
    assert sorted(raw.tensors) == sorted(stored)
    for key, t in stored.items():
        assert raw.tensors[key].dtype == t.dtype and torch.equal(raw.tensors[key], t), key


def test_entry_disagreeing_with_its_offsets_named(tmp_path):
    f = tmp_path / "lying.safetensors"
    save_file({"transformer.a.lora_A.weight": torch.ones(4, 8), "transformer.a.lora_B.weight": torch.ones(8, 4)},
              str(f))
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + n])
    header["transformer.a.lora_B.weight"]["shape"] = [8, 2]  # 64 bytes of F32 where 128 are stored
    blob = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(blob) == n
    f.write_bytes(data[:8] + blob + data[8 + n:])
    with pytest.raises(AdapterError, match=r"lying\.safetensors: not a valid safetensors file "
                                           r"\(tensor 'transformer\.a\.lora_B\.weight'"):
        formats.read_tensors(f)


def test_demo_writers_are_deterministic(library, data_dir, tmp_path):
    spec = next(s for s in demo_adapters.DEMO_ADAPTERS if s.writer == "write_lightx2v")
    again = tmp_path / "again.safetensors"
    demo_adapters.write(spec, again, data_dir)
    assert again.read_bytes() == (library / spec.relpath).read_bytes()
    peft_spec = next(s for s in demo_adapters.DEMO_ADAPTERS if s.writer == "write_peft_folder")
    demo_adapters.write(peft_spec, tmp_path / "peft", data_dir)
    assert ((tmp_path / "peft/adapter_model.safetensors").read_bytes()
            == (library / peft_spec.relpath / "adapter_model.safetensors").read_bytes())
    shutil.rmtree(tmp_path / "peft")

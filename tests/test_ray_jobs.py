"""Ray engine job parsing and slot keys: no cluster needed."""
from __future__ import annotations

import pytest

import ray  # noqa: E402,F401  (the engine needs it installed)

from backend.engines.ray_engine import Job, adapter_sha256  # noqa: E402
from backend.errors import AdapterError, InvalidParameter  # noqa: E402


@pytest.fixture
def files(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"adapter a")
    b.write_bytes(b"adapter b")
    return a, b


def _job(*adapters, model="demo:sd3.5"):
    return Job.from_dict({"id": "1", "model": model, "params": {"prompt": "x"}, "adapters": list(adapters)})


def test_slot_key_is_the_model_and_the_set_of_adapters_by_content(files):
    a, b = files
    ab = _job({"name": "a", "path": str(a), "scale": 1.0}, {"name": "b", "path": str(b), "scale": 0.3})
    ba = _job({"name": "b", "path": str(b), "scale": 2.0}, {"name": "a", "path": str(a)})
    assert ab.slot_key == ba.slot_key  # order and scales do not change what must be resident
    assert ab.slot_key != _job({"name": "a", "path": str(a)}).slot_key
    assert ab.slot_key != _job({"name": "a", "path": str(a)}, {"name": "b", "path": str(b)},
                               model="demo:qwen-image").slot_key
    before = _job({"name": "a", "path": str(a)}).slot_key
    a.write_bytes(b"adapter a, retrained")
    assert _job({"name": "a", "path": str(a)}).slot_key != before


def test_the_heads_sha256_travels_with_the_job_and_is_not_recomputed(files):
    a, _ = files
    job = _job({"name": "a", "path": str(a)})
    a.write_bytes(b"a different copy")  # what a replica on another node might find
    again = Job.from_dict(job.to_dict())
    assert again.adapters[0].sha256 == job.adapters[0].sha256 != adapter_sha256(a)
    assert again.adapters[0].int_id == job.adapters[0].int_id  # one adapter, one id on every replica


def test_a_peft_folder_hashes_its_files(tmp_path):
    folder = tmp_path / "peft"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(b"w")
    first = adapter_sha256(folder)
    (folder / "adapter_model.safetensors").write_bytes(b"w2")
    assert adapter_sha256(folder) != first


@pytest.mark.parametrize("job,field", [
    ({"model": "demo:sd3.5"}, "id"),
    ({"id": "1"}, "model"),
    ({"id": "1", "model": "demo:sd3.5", "adapters": [{"name": "a"}]}, "adapters[0]"),
])
def test_a_malformed_job_names_the_field(job, field):
    with pytest.raises(InvalidParameter) as err:
        Job.from_dict(job)
    assert err.value.param == field


def test_a_missing_adapter_file_is_named(tmp_path):
    missing = tmp_path / "gone.safetensors"
    with pytest.raises(AdapterError, match="gone.safetensors"):
        _job({"name": "gone", "path": str(missing)})

"""The application's settings file (backend/preferences.py): checked by name, written atomically, read back
bounded, and the result file names it makes (#26, "a settings page ... persisted in the data dir")."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from backend import outputs, preferences
from backend.errors import InvalidParameter
from backend.result import GenerationResult


@pytest.mark.parametrize("data, fragment", [
    ({"width": 70}, "'width' must be a multiple of 16"),
    ({"steps": 0}, "'steps' Input should be greater than or equal to 1"),
    ({"output_format": "gif"}, "'output_format' Input should be 'png', 'jpeg' or 'webp'"),
    ({"filename_pattern": "../{seed}"}, "'filename_pattern' outside its {tokens} a pattern may hold"),
    ({"filename_pattern": "out/{seed}"}, "no folders"),
    ({"filename_pattern": ".{seed}"}, "no leading dot"),
    ({"filename_pattern": "{seed}-{user}"}, "unknown token {user}"),
    ({"filename_pattern": "fixed"}, "needs at least one {token}"),
    ({"colour": "blue"}, "'colour' is not a setting; the settings are default_model, width"),
    ({"live_previews": "maybe"}, "'live_previews' Input should be a valid boolean"),
])
def test_each_bad_setting_is_named(data, fragment, tmp_path):
    with pytest.raises(InvalidParameter, match=None) as err:
        preferences.save(data, tmp_path)
    assert fragment in err.value.message, err.value.message
    assert not (tmp_path / preferences.FILE).exists()  # nothing written


def test_saved_settings_are_read_back_and_a_bad_file_leaves_the_defaults(tmp_path, capsys):
    assert preferences.load(tmp_path) == preferences.Preferences()  # no file: the defaults
    saved = preferences.save({"steps": 3, "output_format": "webp", "filename_pattern": "{seed}_{prompt}"}, tmp_path)
    again = preferences.load(tmp_path)
    assert again == saved and again.steps == 3 and again.suffix == ".webp"
    path = tmp_path / preferences.FILE
    assert json.loads(path.read_text())["filename_pattern"] == "{seed}_{prompt}"
    assert [p.name for p in tmp_path.iterdir()] == [preferences.FILE]  # no temporary file left
    for bad, said in ((b"{not json", "not JSON"), (b"[1, 2]", "must be an object"),
                      (json.dumps({"width": 33}).encode(), "'width' must be a multiple of 16"),
                      (b" " * (preferences.MAX_BYTES + 1), "over 64 KiB")):
        path.write_bytes(bad)
        assert preferences.load(tmp_path) == preferences.Preferences(), bad[:20]
        err = capsys.readouterr().err
        assert said in err and str(path) in err and "using the default settings" in err, err


def test_file_names_follow_the_pattern_and_never_leave_the_folder():
    prefs = preferences.Preferences(filename_pattern="{date}-{number}-{model}-{prompt}")
    meta = {"created": "2026-12-07T14:50:00Z", "seed": 7, "model": "Qwen/Qwen-Image-2512", "job_number": 12,
            "job_id": "ab" * 8, "params": {"prompt": "../../etc/passwd a fox, in snow!" + "x" * 500}}
    name = preferences.filename(prefs, meta, ".png")
    stem, tail = name[:-len(".png")].rsplit("-", 1)
    assert stem.startswith("20261207-12-Qwen-Image-2512-etc-passwd-a-fox-in-snow-x"), name
    assert "/" not in name and ".." not in name and not name.startswith(".") and len(tail) == 8
    assert len(stem) <= preferences.NAME_CHARS
    assert preferences.filename(prefs, meta, ".png") != name  # a unique tail: nothing is overwritten
    with_id = preferences.Preferences(filename_pattern="{seed}-{id}")
    assert preferences.filename(with_id, meta, ".webp") == "7-" + "ab" * 8 + ".webp"


def test_results_are_written_in_the_saved_format_under_the_saved_name(tmp_path):
    preferences.save({"output_format": "webp", "filename_pattern": "{seed}_{prompt}"}, tmp_path)
    meta = {"model": "demo:qwen-image", "seed": 9, "pipeline": "QwenImagePipeline",
            "params": {"prompt": "a red fox"}, "created": "2026-12-07T14:50:00Z"}
    path = outputs.save_result(GenerationResult(images=[Image.new("RGB", (16, 16), "red")], metadata=meta),
                               data_dir=tmp_path)
    assert path.parent == tmp_path / "outputs" and path.name.startswith("9_a-red-fox-") and path.suffix == ".webp"
    assert Image.open(path).format == "WEBP"
    assert json.loads(path.with_suffix(".webp.json").read_text())["seed"] == 9

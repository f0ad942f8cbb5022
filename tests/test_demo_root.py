"""Demo files live in their own root (<data-dir>/demo), never in the user's adapter library.

The demo adapters (backend/lora/demo_adapters.py) and the presets' distill stand-ins
(backend/distill/demo_files.py) are generated for the demo models; the library
(<data-dir>/adapters) holds only what the user put there. The demo adapters are an adapter
root only while a demo model is served, and are listed there marked ``demo: true``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from backend import settings
from backend.errors import AdapterNotFound, PathNotAllowed
from backend.jobs.adapters import AdapterResolver
from backend.lora import demo_adapters
from ui_fixtures import MODEL, ROOT, app_home, make_lora, served_app

INK = "qwen-image/demo-inverted.safetensors"
FAST = {"prompt": "a lighthouse", "height": 64, "width": 64, "num_inference_steps": 2, "true_cfg_scale": 1.0,
        "seed": 11}


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if not p.is_dir()) if folder.exists() else []


def _adapters_cli(home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "app.py", "adapters", "--data-dir", str(home)], cwd=ROOT,
                          env={**os.environ, "LORA_STUDIO_HOME": str(home)}, capture_output=True, text=True,
                          timeout=600)


def test_adapters_command_without_a_model_builds_nothing(tmp_path, demo_path):
    home = tmp_path / "home"
    r = _adapters_cli(home)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (home / "models").exists(), "a demo model was built"
    assert _files(home / "adapters") == [], "files were written into the user's adapter library"
    assert not (home / "demo").exists()
    assert "no adapters found" in r.stdout
    # the user's own library, a refused file first: listed as it is, nothing written beside it
    mine = [home / "adapters" / "a-old.ckpt", make_lora(demo_path(MODEL), home / "adapters" / "b-style.safetensors")]
    mine[0].write_bytes(b"\x80\x04")
    r = _adapters_cli(home)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["name", "format", "rank", "alpha", "size", "sha256", "fit"], r.stdout
    assert "a-old" in lines[1] and "pickle" in lines[1] and lines[2].startswith("b-style "), r.stdout
    assert _files(home / "adapters") == sorted(mine) and not (home / "models").exists()


def test_an_older_versions_demo_files_leave_the_library_and_the_users_stay(tmp_path, library):
    """Before the demo root, demo adapters went to <library>/demo and stand-ins to <library>/distill:
    left there they list every demo adapter twice (renamed by path). The first `app.py adapters` (or
    server start) removes what carries our marker, and nothing of the user's."""
    import shutil

    from safetensors.torch import save_file
    import torch

    home = tmp_path / "home"
    old = home / "adapters" / "demo"
    shutil.copytree(library, old)  # the old layout: the same folder, marker included
    (home / "adapters" / "demo.lock").write_text("")
    stand_ins = home / "adapters" / "distill"
    stand_ins.mkdir()
    save_file({"x": torch.zeros(1)}, str(stand_ins / "old-standin.safetensors"), metadata={"lora_studio_demo": "{}"})
    save_file({"x": torch.zeros(1)}, str(stand_ins / "users-own.safetensors"), metadata={"format": "pt"})
    mine = home / "adapters" / "demo-look" / "style.safetensors"  # a user's folder named like ours, no marker
    mine.parent.mkdir()
    save_file({"x": torch.zeros(1)}, str(mine))
    r = _adapters_cli(home)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not old.exists() and not (home / "adapters" / "demo.lock").exists(), r.stderr
    assert _files(home / "adapters") == sorted([stand_ins / "users-own.safetensors", mine]), r.stderr
    assert str(old) in r.stderr and "old-standin" in r.stderr
    assert "demo-inverted" not in r.stdout


def test_demo_adapters_are_in_the_demo_root_and_listed_only_for_demo_models(library, data_dir):
    from backend.lora import list_adapters

    assert library == settings.demo_adapters_dir(data_dir) == data_dir.resolve() / "demo" / "adapters"
    names = {Path(s.relpath).name.removesuffix(".safetensors") for s in demo_adapters.DEMO_ADAPTERS}
    rows = {r["name"]: r for r in list_adapters("demo:qwen-image", data_dir=data_dir)}
    assert names <= set(rows)
    for name in names:
        assert rows[name]["demo"] is True and Path(rows[name]["path"]).is_relative_to(library), rows[name]
    assert not any(r["demo"] for n, r in rows.items() if n not in names)
    # no model: the library roots only, the demo root is not one of them
    assert not any(Path(r["path"]).is_relative_to(library) for r in list_adapters(None, data_dir=data_dir))


def test_resolver_takes_the_demo_root_only_while_a_demo_model_is_served(library, data_dir):
    demo = AdapterResolver((), data_dir, model="demo:qwen-image")
    assert demo.roots[-1] == library and demo.roots[0] == settings.adapters_dir(data_dir)
    assert demo.by_name("demo-inverted") == (library / INK).resolve()
    assert demo.check_path(INK) == (library / INK).resolve()
    served = {"model": "demo:qwen-image"}  # a callable follows model switches
    switching = AdapterResolver((), data_dir, model=lambda: served["model"])
    assert switching.by_name("demo-inverted") == (library / INK).resolve()
    served["model"] = "Qwen/Qwen-Image-2512"
    assert library not in switching.roots
    with pytest.raises(AdapterNotFound):
        switching.by_name("demo-inverted")
    with pytest.raises(PathNotAllowed):
        switching.check_path(str(library / INK))


def test_a_served_demo_model_lists_and_uses_its_demo_adapters_outside_the_library(data_dir, demo_path,
                                                                                 tmp_path_factory):
    demo_path(MODEL)
    home = app_home(data_dir, tmp_path_factory, "demo-root")
    with served_app(home) as app:
        rows = httpx.get(app.url + "/v1/loras", timeout=300).json()["library"]
        ink = next(r for r in rows if r["name"] == "demo-inverted")
        assert ink["demo"] is True and ink["usable"] and ink["fit"]["ok"], ink
        assert Path(ink["path"]).is_relative_to(home / "demo" / "adapters"), ink["path"]
        r = httpx.post(app.url + "/v1/images/generations", timeout=300,
                       json={**FAST, "lora": {"name": "demo-inverted"}})
        assert r.status_code == 200, r.text
        r = httpx.post(app.url + "/v1/images/generations", timeout=300, json={**FAST, "lora": {"path": INK}})
        assert r.status_code == 200, r.text
    assert _files(home / "adapters") == [], "demo files were written into the user's adapter library"


def test_a_request_naming_a_demo_adapter_right_after_start_finds_it(data_dir, demo_path, tmp_path_factory):
    """Issue 26: /health answered before the demo adapters existed (they were written the first time something
    listed them), so a script that started the server and asked for a demo adapter at once got 404 "no adapter
    named ...". A name the library does not know, while a demo model is served, writes them first."""
    demo_path(MODEL)
    home = app_home(data_dir, tmp_path_factory, "demo-at-once")
    with served_app(home) as app:
        assert not (home / "demo" / "adapters").exists()  # nothing has listed them yet
        r = httpx.post(app.url + "/v1/images/generations", timeout=300,
                       json={**FAST, "lora": {"name": "demo-inverted"}})
        assert r.status_code == 200, r.text
        assert [a["name"] for a in r.json()["data"][0]["metadata"]["adapters"]] == ["demo-inverted"]
        r = httpx.post(app.url + "/v1/images/generations", timeout=300, json={**FAST, "lora": {"name": "no-such"}})
        assert r.status_code == 404 and "no-such" in r.json()["error"]["message"], r.text


def test_a_preset_without_demo_standins_loads(tmp_path):
    from backend.presets import PresetError, format_rows, load_preset

    text = '''id = "{id}"
title = "A real-model-only preset"
pipeline = "QwenImagePipeline"
models = [{models}]

[[files]]
component = "transformer"
repo = "lightx2v/Qwen-Image-2512-Lightning"
pattern = "Qwen-Image-2512-Lightning-4steps-*.safetensors"

[defaults]
num_inference_steps = 4

[requirements]
num_inference_steps = 4
'''
    path = tmp_path / "real-only.toml"
    path.write_text(text.format(id="real-only", models='"Qwen/Qwen-Image-2512"'))
    preset = load_preset(path)
    assert preset.files[0].demo is None and preset.demo_models == []
    row = {"id": preset.id, "title": preset.title, "pipeline": preset.pipeline, "models": list(preset.models),
           "defaults": preset.defaults, "requirements": preset.requirements, "ready": False,
           "files": [{"component": "transformer", "repo": "r/x", "pattern": "p", "present": False, "demo": None}]}
    assert "demo file" not in format_rows([row])
    # a preset that names a demo model still needs the stand-in's name for it
    path.write_text(text.format(id="real-only", models='"Qwen/Qwen-Image-2512", "demo:qwen-image"'))
    with pytest.raises(PresetError, match=r"real-only.toml: key 'files\[0\].demo' is required"):
        load_preset(path)

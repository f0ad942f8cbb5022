"""The family registry (backend/families): one table, one module per family.

- a family module registered in a test is picked by its pipeline class (resolution, request spec,
  output writer), so adding a family is one module and one row;
- every family's facts agree with each other and with the real demo models (class -> family,
  denoisers present on the loaded pipeline, writer for the output kind, routing onto denoisers);
- a MiniMax-H3 MP4 carries its audio track whoever writes it: the audio is handed to the MP4 writer,
  not muxed by a hook that importing backend.minimax used to set.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
FAMILY_NAMES = ["image", "wan", "wan22", "minimax"]


def _streams(path) -> dict:
    """imageio-ffmpeg's own reading of a media file's header: codec, size and (if any) audio codec."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    try:
        return next(reader)
    finally:
        reader.close()


# -- adding a family is one module and one row -------------------------------------------------------------
FAKE_MODULE = '''
from backend.families import COMMON_FIELDS, Family, LoraRouting, PipelineSpec

FAMILY = Family(
    name="fake-video", title="a family added by a test",
    pipelines=(PipelineSpec("FakeVideoPipeline", "video", ("unet",), defaults={"num_frames": 5, "fps": 8},
                            fields=COMMON_FIELDS | {"num_frames", "fps"}, size_multiple=8, mode="text-to-video"),),
    output="video", denoisers=("unet",), demo_models=(), lora=LoraRouting(default_component="unet"))
'''

MORE_SPECIFIC_WAN = '''
from backend.families import Family
from backend.families.wan import PIPELINES

FAMILY = Family(name="wan-triple", title="needs a transformer_3", pipelines=PIPELINES, output="video",
                denoisers=("transformer", "transformer_2", "transformer_3"), demo_models=(),
                requires=frozenset({"transformer_3"}))
'''


@pytest.fixture
def fake_family(tmp_path, monkeypatch):
    from backend import families

    package = tmp_path / "more_families"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fake_video.py").write_text(FAKE_MODULE)  # the one module
    (package / "wan_triple.py").write_text(MORE_SPECIFIC_WAN)
    monkeypatch.syspath_prepend(str(tmp_path))
    families.register("FakeVideoPipeline", "more_families.fake_video")  # the one row
    families.register("WanPipeline", "more_families.wan_triple")
    yield tmp_path
    families.unregister("FakeVideoPipeline", "more_families.fake_video")
    families.unregister("WanPipeline", "more_families.wan_triple")
    for name in ("more_families", "more_families.fake_video", "more_families.wan_triple"):
        sys.modules.pop(name, None)


def test_a_family_module_registered_in_a_test_is_picked_by_class_name(fake_family, tmp_path, data_dir, demo_path):
    from backend import families
    from PIL import Image

    from backend import outputs, params
    from backend.errors import InvalidParameter
    from backend.models import resolve_model, spec_for

    assert families.family_for("FakeVideoPipeline").name == "fake-video"
    # a model directory naming the class resolves to the family, with its denoisers and spec
    model = tmp_path / "fake-model"
    (model / "unet").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "FakeVideoPipeline",
                                                        "unet": ["diffusers", "UNet"]}))
    resolved = resolve_model(str(model), data_dir)
    assert resolved.family.name == "fake-video" and resolved.denoisers == ("unet",)
    info = resolved.spec_info()
    assert info["pipeline"] == "FakeVideoPipeline" and info["output"] == "video" and info["denoisers"] == ["unet"]
    # the request spec is the module's: its fields, defaults and size rule
    spec = spec_for("FakeVideoPipeline")
    assert params.validate(spec, {"prompt": "x", "height": 16, "width": 16})["num_frames"] == 5
    with pytest.raises(InvalidParameter, match="'height' must be a multiple of 8 for FakeVideoPipeline"):
        params.validate(spec, {"prompt": "x", "height": 12, "width": 16})
    # its output kind picks the writer: an MP4, from a result that says which pipeline made it
    frames = [Image.new("RGB", (16, 16), (i * 40, 0, 0)) for i in range(5)]
    result = type("R", (), {"frames": frames, "fps": 8, "audio": None, "images": None,
                            "metadata": {"pipeline": "FakeVideoPipeline", "seed": 1}})()
    path = outputs.save_result(result, path=tmp_path / "fake.mp4")
    meta = _streams(path)
    assert meta["codec"] == "h264" and meta["size"] == (16, 16) and "audio_codec" not in meta
    # a more specific row for an existing class wins only where the checkpoint has what it requires
    assert families.family_for("WanPipeline", {"transformer", "transformer_2", "transformer_3"}).name == "wan-triple"
    assert resolve_model("demo:wan2.2-t2v", data_dir).family.name == "wan22"
    assert resolve_model("demo:wan2.1-t2v", data_dir).family.name == "wan"


def test_an_unknown_pipeline_class_is_refused_naming_the_supported_ones():
    from backend import families
    from backend.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="pipeline 'FluxPipeline' is not supported; supported pipelines: "
                                               "MiniMaxH3ModularPipeline, QwenImagePipeline"):
        families.family_for("FluxPipeline")


def test_the_table_imports_no_torch():
    """app.py reads DEFAULT_MODEL and the task types from the table without loading torch."""
    code = ("import sys, app; from backend import families; families.all_families(); "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- every family's facts are consistent -------------------------------------------------------------------
@pytest.mark.parametrize("module", FAMILY_NAMES)
def test_family_facts_agree(module, data_dir):
    from backend import families
    from backend import demo
    from backend.models import resolve_model

    family = families.load(module)
    assert family.output in families.OUTPUTS and family.demo_models
    assert family.writer == ("png" if family.output == "image" else "mp4")
    for spec in family.pipelines:
        assert module in families.FAMILIES[spec.class_name]  # the table's row for the class names the module
        assert spec.output == family.output and set(family.denoisers) <= set(spec.denoisers)
        assert families.spec_for(spec.class_name) == spec  # one spec per class, whichever family is asked
    # LoRA routing lands on the family's own denoisers
    routing = family.lora
    assert routing.default_component in family.denoisers
    assert set(routing.noise_roles) <= set(family.denoisers)
    assert set(routing.distill or {}) <= set(family.denoisers)
    assert set(family.tasks.values()) <= set(family.denoisers)
    assert routing.shared_prefix in (None, *family.denoisers)
    if routing.hooks:
        mod, name = routing.hooks.split(":")
        assert callable(getattr(importlib.import_module(mod), name))
    if family.tasks:
        spec = family.pipelines[0]
        assert "task_type" in spec.fields and spec.defaults["task_type"] == family.default_task
    # each demo model is a real checkpoint of this family
    for model_id in family.demo_models:
        assert model_id in demo.DEMO_MODELS
        resolved = resolve_model(model_id, data_dir)
        assert resolved.family is family and families.family_of_demo(model_id) is family
        assert resolved.denoisers == family.denoisers


def test_default_model_and_task_types_are_the_tables():
    from backend import families

    import app
    from backend import demo, params, service
    from backend.minimax import contracts

    assert app.DEFAULT_MODEL is service.DEFAULT_MODEL is demo.DEFAULT_MODEL is families.DEFAULT_MODEL
    assert families.family_of_demo(families.DEFAULT_MODEL).name == "image"
    minimax = families.load("minimax")
    assert contracts.TASKS == minimax.task_types == families.task_types()
    assert contracts.PARTITION == minimax.tasks
    assert params.FIELDS["task_type"].rule == "'t2va', 'fl2va' or 'ref2va'"


REQUESTS = {  # a cheap request per family, sized for the demo models
    "image": {"prompt": "a red fox", "seed": 3, "num_inference_steps": 2},
    "wan": {"prompt": "a red fox", "seed": 3, "num_inference_steps": 2, "num_frames": 5},
    "wan22": {"prompt": "a red fox", "seed": 3, "num_inference_steps": 2, "num_frames": 5},
    "minimax": {"prompt": "a red fox", "seed": 3, "num_inference_steps": 2, "task_type": "t2va"},
}


def _image(color) -> "Image.Image":
    from PIL import Image

    return Image.new("RGB", (64, 32), color)


TASK_INPUTS = {  # what each MiniMax-H3 task needs besides the prompt
    "fl2va": {"image": _image((200, 20, 20)), "last_image": _image((20, 20, 200))},
    "ref2va": {"references": [_image((20, 200, 20))]},
}


@pytest.mark.parametrize("module", FAMILY_NAMES)
def test_demo_pipelines_carry_the_denoisers_and_write_the_output_kind(module, manager_for, data_dir, tmp_path):
    from PIL import Image

    from backend import families, outputs
    from backend.manager import PipelineManager

    family = families.load(module)
    m = manager_for(family.demo_models[0])
    assert m.family is family
    if not family.tasks:  # every denoiser the family names exists on the loaded pipeline
        for name in family.denoisers:
            assert getattr(m.pipeline, name, None) is not None, name
        assert list(m.denoisers()) == list(family.denoisers)
    else:  # loaded per workflow: the default task's denoiser at load, each other one with its task
        assert list(m.denoisers()) == [family.tasks[family.default_task]]
        fresh = PipelineManager(device="cpu", data_dir=data_dir)  # the shared one stays as other tests expect
        fresh.load(family.demo_models[0])
        for task, name in family.tasks.items():
            if getattr(fresh.pipeline, name, None) is None:
                fresh.generate({**REQUESTS[module], "task_type": task, **TASK_INPUTS.get(task, {})})
            assert getattr(fresh.pipeline, name, None) is not None, (task, name)
        assert list(fresh.denoisers()) == list(family.denoisers)
        fresh.unload()
    result = m.generate(REQUESTS[module])
    path = outputs.save_result(result, data_dir=tmp_path)
    if family.output == "image":
        assert path.suffix == ".png" and outputs.read_png_metadata(path)["pipeline"] == m.spec.class_name
        with Image.open(path) as img:
            assert img.format == "PNG"
        return
    meta = _streams(path)
    assert path.suffix == ".mp4" and meta["codec"] == "h264"
    if family.audio:  # the real file carries the soundtrack
        assert result.audio is not None and meta.get("audio_codec") == "aac", meta
    else:
        assert "audio_codec" not in meta, meta


WRITE_WITHOUT_MINIMAX = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import numpy as np
    from PIL import Image
    from backend.outputs import save_result

    src = np.load(sys.argv[1])
    class Result:
        images = None
        frames = [Image.fromarray(f) for f in src["frames"]]
        fps = int(src["fps"])
        audio = (src["samples"], int(src["rate"]))
        metadata = json.loads(Path(sys.argv[2]).read_text())
    path = save_result(Result(), path=sys.argv[3])
    loaded = sorted(m for m in sys.modules if m == "backend.minimax" or m.startswith("backend.minimax."))
    print(json.dumps({"path": str(path), "minimax_imported": loaded}))
''')


def test_minimax_mp4_has_audio_when_the_writer_never_imported_backend_minimax(manager_for, tmp_path):
    """A process that writes a MiniMax-H3 result (a Ray head, a tool) without importing backend.minimax
    still writes the audio track: on 4b3ba1c the MP4 came out silent (the muxer was a hook that only
    importing backend.minimax set)."""
    m = manager_for("demo:minimax-h3")
    result = m.generate(REQUESTS["minimax"])
    samples, rate = result.audio
    np.savez(tmp_path / "result.npz", frames=np.stack([np.asarray(f.convert("RGB")) for f in result.frames]),
             fps=result.fps, samples=samples, rate=rate)
    (tmp_path / "meta.json").write_text(json.dumps(result.metadata, default=str))
    out = subprocess.run([sys.executable, "-c", WRITE_WITHOUT_MINIMAX, str(tmp_path / "result.npz"),
                          str(tmp_path / "meta.json"), str(tmp_path / "out.mp4")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["minimax_imported"] == []  # the writer's process never loaded the MiniMax package
    meta = _streams(report["path"])
    assert meta["codec"] == "h264" and meta.get("audio_codec") == "aac", meta


def test_an_input_image_that_is_no_image_is_named_without_the_servers_path(tmp_path):
    """#26: PIL's "cannot identify image file '<server path>'" reached the user; now the field and the
    file's own name, with no folder of the server's."""
    from backend import params
    from backend.errors import InvalidParameter

    upload = tmp_path / "uploads" / "3f2a-upload.img"
    upload.parent.mkdir()
    upload.write_bytes(b"%PDF-1.4 not an image")
    with pytest.raises(InvalidParameter, match=r"'image' is not an image this can read \(3f2a-upload\.img") as err:
        params.check_field("image", str(upload))
    assert str(tmp_path) not in err.value.message and err.value.param == "image"

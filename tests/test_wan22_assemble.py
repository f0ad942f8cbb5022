"""tools/wan22/assemble_wan22_i2v_diffusers.py, run as a user runs it (a subprocess), on a
skeleton saved by diffusers from demo:wan2.2-i2v."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "wan22" / "assemble_wan22_i2v_diffusers.py"
FLAGS = ("--diffusers-skeleton", "--transformer-weight", "--transformer-2-weight", "--output-dir",
         "--asset-mode", "--overwrite")
WEIGHTS = "diffusion_pytorch_model.safetensors"


def assemble(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def failed(proc, *needles) -> str:
    """Assert exit 2 with one stderr line that names every needle; return that line."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("error: "), proc.stderr
    for needle in needles:
        assert str(needle) in line, (needle, line)
    return line


def assert_no_output(out: Path) -> None:
    assert not out.exists() and not out.is_symlink()
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == [], leftovers


def perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous()
            for k, v in state.items()}


def load_pipe(path: Path):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(str(path))


def frames(pipe, image) -> np.ndarray:
    out = pipe(image=image, prompt="A cat playing with yarn", height=32, width=32, num_frames=5,
               num_inference_steps=2, guidance_scale=1.0, guidance_scale_2=1.0, output_type="np",
               generator=torch.Generator().manual_seed(0))
    return np.asarray(out.frames[0])


def state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("wan22-assemble")


@pytest.fixture(scope="module")
def skeleton(work, demo_path) -> Path:
    pipe = load_pipe(demo_path("demo:wan2.2-i2v"))
    path = work / "Wan2.2-I2V-A14B-Diffusers"
    pipe.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def reference(skeleton, image) -> np.ndarray:
    return frames(load_pipe(skeleton), image)


@pytest.fixture(scope="module")
def lightx2v_out(work, skeleton) -> Path:
    """Replacement weights laid out like LightX2V's converter writes them (--output_name
    diffusion_pytorch_model --single_file): one folder per transformer."""
    root = work / "wan22_lightx2v"
    for name, folder, seed in (("transformer", "high_noise_out", 1), ("transformer_2", "low_noise_out", 2)):
        (root / folder).mkdir(parents=True)
        save_file(perturbed(load_file(skeleton / name / WEIGHTS), seed), root / folder / WEIGHTS)
    return root


@pytest.fixture(scope="module")
def sharded(work, skeleton) -> Path:
    """A replacement transformer saved by diffusers in several shards (with its index)."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(str(skeleton / "transformer"))
    model.load_state_dict(perturbed(model.state_dict(), 3))
    path = work / "sharded_high"
    model.save_pretrained(str(path), max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / f"{WEIGHTS}.index.json").is_file()
    return path


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in FLAGS:
        assert flag in proc.stdout
    assert "{symlink,copy}" in proc.stdout and "default" in proc.stdout


@pytest.fixture(scope="module")
def kept(work, skeleton):
    """Assembled without replacement weights, in the default (symlink) mode."""
    out = work / "kept"
    proc = assemble("--diffusers-skeleton", skeleton, "--output-dir", out)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_keep_skeleton_weights_symlink_mode(kept, skeleton, image, reference):
    out, proc = kept
    for name in ("tokenizer", "text_encoder", "vae", "scheduler"):
        link = out / name
        assert link.is_symlink() and not os.path.isabs(os.readlink(link))  # moves with its skeleton
        assert link.resolve() == (skeleton / name).resolve()
    for name in ("transformer", "transformer_2"):
        assert not (out / name).is_symlink() and not (out / name / "config.json").is_symlink()
        assert (out / name / WEIGHTS).resolve() == (skeleton / name / WEIGHTS).resolve()
    assert f"python app.py generate --model {out}" in proc.stdout and f"python app.py serve {out}" in proc.stdout
    # Same weights, same components: the same frames, bit for bit.
    np.testing.assert_array_equal(frames(load_pipe(out), image), reference)


@pytest.fixture(scope="module")
def step2(work, skeleton, lightx2v_out):
    """The seed's Step 2 command line, as written (its paths under a temp root)."""
    out = work / "Wan2.2-I2V-A14B-Custom-Diffusers"
    cmd = f"""python tools/wan22/assemble_wan22_i2v_diffusers.py \\
      --diffusers-skeleton {skeleton} \\
      --transformer-weight {lightx2v_out}/high_noise_out \\
      --transformer-2-weight {lightx2v_out}/low_noise_out \\
      --output-dir {out} \\
      --asset-mode symlink \\
      --overwrite"""
    argv = shlex.split(cmd.replace("\\\n", " "))
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_seed_step2_replacement_weights_are_used(step2, skeleton, lightx2v_out, image, reference):
    out, proc = step2
    pipe = load_pipe(out)
    high = load_file(lightx2v_out / "high_noise_out" / WEIGHTS)
    low = load_file(lightx2v_out / "low_noise_out" / WEIGHTS)
    assert equal_states(state(pipe.transformer), high)
    assert equal_states(state(pipe.transformer_2), low)
    assert not equal_states(high, load_file(skeleton / "transformer" / WEIGHTS))
    assert "linked from --transformer-weight" in proc.stdout
    assert "linked from --transformer-2-weight" in proc.stdout
    result = frames(pipe, image)
    assert np.isfinite(result).all() and np.abs(result - reference).max() > 1e-3


def test_printed_command_runs(step2, work, image):
    out, proc = step2
    line = next(l for l in proc.stdout.splitlines() if "app.py generate" in l)
    image_path = work / "input.png"
    image.save(image_path)
    video = work / "from-printed-command.mp4"
    argv = shlex.split(line.replace("INPUT.jpg", str(image_path)))
    argv += ["--height", "32", "--width", "32", "--num-frames", "5", "--num-inference-steps", "2",
             "--device", "cpu", "--output", str(video)]
    gen = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert video.is_file() and video.stat().st_size > 0


def test_copy_mode_sharded_and_single_file(work, skeleton, sharded, lightx2v_out):
    out = work / "nested" / "copied"  # missing parents are created
    low_file = lightx2v_out / "low_noise_out" / WEIGHTS
    proc = assemble("--diffusers-skeleton", skeleton, "--transformer-weight", sharded / f"{WEIGHTS}.index.json",
                    "--transformer-2-weight", low_file, "--output-dir", out, "--asset-mode", "copy")
    assert proc.returncode == 0, proc.stderr
    links = [p for p in out.rglob("*") if p.is_symlink()]
    assert links == []  # self-contained
    index = json.loads((out / "transformer" / f"{WEIGHTS}.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == len(list(sharded.glob("*.safetensors"))) > 1
    assert sorted(p.name for p in (out / "transformer").glob("*.safetensors")) == shards
    # Moved elsewhere, the copy still loads and holds the replacement weights.
    moved = work / "moved-copy"
    shutil.move(str(out), moved)
    pipe = load_pipe(moved)
    expected = {}
    for shard in sharded.glob("*.safetensors"):
        expected.update(load_file(shard))
    assert equal_states(state(pipe.transformer), expected)
    assert equal_states(state(pipe.transformer_2), load_file(low_file))


def test_overwrite_swaps_only_a_complete_output(work, kept, skeleton, lightx2v_out, sharded):
    out = work / "overwritten"
    shutil.copytree(kept[0], out, symlinks=True)  # a symlink-mode output (same depth: links still resolve)
    listing = lambda: sorted((str(p.relative_to(out)), os.readlink(p) if p.is_symlink() else p.read_bytes())
                             for p in out.rglob("*") if p.is_symlink() or p.is_file())
    before = listing()
    skeleton_files = {p: p.read_bytes() for p in skeleton.rglob("*") if p.is_file()}

    broken = work / "broken_shards"
    shutil.copytree(sharded, broken)
    missing = sorted(broken.glob("*.safetensors"))[-1]
    missing.unlink()
    failed(assemble("--diffusers-skeleton", skeleton, "--transformer-weight", broken,
                    "--output-dir", out, "--overwrite"), missing.name)
    assert listing() == before

    high = lightx2v_out / "high_noise_out" / WEIGHTS
    proc = assemble("--diffusers-skeleton", skeleton, "--transformer-weight", high.parent,
                    "--output-dir", out, "--asset-mode", "copy", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "vae").is_symlink() and (out / "vae" / WEIGHTS).is_file()
    assert (out / "transformer" / WEIGHTS).read_bytes() == high.read_bytes()
    assert [p.name for p in work.iterdir() if p.name.startswith(".overwritten.")] == []
    # Removing the old output removed its links, never what they pointed at.
    assert {p: p.read_bytes() for p in skeleton.rglob("*") if p.is_file()} == skeleton_files


def test_existing_output_without_overwrite(work, skeleton):
    out = work / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    failed(assemble("--diffusers-skeleton", skeleton, "--output-dir", out), out, "--overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    # Even with --overwrite, a folder that is not a diffusers directory is not replaced.
    failed(assemble("--diffusers-skeleton", skeleton, "--output-dir", out, "--overwrite"), "model_index.json")
    assert (out / "keep.txt").read_text() == "mine"


def partial_skeleton(skeleton: Path, dest: Path, drop: str) -> Path:
    """A copy of the skeleton without `drop` (a path inside it; "" drops nothing)."""
    shutil.copytree(skeleton, dest, symlinks=True, ignore=lambda d, names: [
        n for n in names if Path(d, n) == skeleton / drop])
    return dest


@pytest.mark.parametrize("drop, message", [
    ("vae", "component folder vae/ is missing"),
    ("tokenizer/tokenizer_config.json", "tokenizer/tokenizer_config.json is missing"),
    ("transformer_2/config.json", "transformer_2/config.json is missing"),
    ("model_index.json", "model_index.json is missing"),
    ("transformer/" + WEIGHTS, "transformer: no diffusion_pytorch_model.safetensors"),
])
def test_bad_skeleton(tmp_path, skeleton, drop, message):
    bad = partial_skeleton(skeleton, tmp_path / "skel", drop)
    out = tmp_path / "out"
    failed(assemble("--diffusers-skeleton", bad, "--output-dir", out), message)
    assert_no_output(out)


def test_skeleton_of_another_pipeline(tmp_path, skeleton):
    bad = partial_skeleton(skeleton, tmp_path / "skel", "")
    index = json.loads((bad / "model_index.json").read_text())
    index["_class_name"] = "WanPipeline"
    (bad / "model_index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    failed(assemble("--diffusers-skeleton", bad, "--output-dir", out), "'WanPipeline'", "WanImageToVideoPipeline")
    assert_no_output(out)


def test_wrong_shape_names_the_tensor(tmp_path, skeleton):
    weights = load_file(skeleton / "transformer_2" / WEIGHTS)
    expected = list(weights["proj_out.weight"].shape)
    weights["proj_out.weight"] = torch.zeros(expected[0] + 1, expected[1])
    bad = tmp_path / "wrong.safetensors"
    save_file(weights, bad)
    out = tmp_path / "deep" / "out"
    failed(assemble("--diffusers-skeleton", skeleton, "--transformer-2-weight", bad, "--output-dir", out),
           "--transformer-2-weight", bad, "'proj_out.weight'", [expected[0] + 1, expected[1]], expected,
           "transformer_2/config.json (WanTransformer3DModel)")
    assert_no_output(out)
    assert not (tmp_path / "deep").exists()


def test_missing_shard(tmp_path, skeleton, sharded):
    broken = shutil.copytree(sharded, tmp_path / "shards")
    victim = sorted(broken.glob("*.safetensors"))[0]
    victim.unlink()
    out = tmp_path / "out"
    failed(assemble("--diffusers-skeleton", skeleton, "--transformer-weight", broken / f"{WEIGHTS}.index.json",
                    "--output-dir", out), victim.name, "missing")
    assert_no_output(out)


@pytest.mark.parametrize("layout", ["bin-file", "pickle-named-safetensors", "folder-of-bin", "bin-index"])
def test_pickle_weights_refused(tmp_path, skeleton, layout):
    sd = load_file(skeleton / "transformer" / WEIGHTS)
    if layout == "bin-file":
        arg = tmp_path / "diffusion_pytorch_model.bin"
        torch.save(sd, arg)
    elif layout == "pickle-named-safetensors":
        arg = tmp_path / "disguised.safetensors"
        torch.save(sd, arg)
    elif layout == "folder-of-bin":
        arg = tmp_path / "folder"
        arg.mkdir()
        torch.save(sd, arg / "diffusion_pytorch_model.bin")
    else:
        arg = tmp_path / "pytorch_model.bin.index.json"
        torch.save(sd, tmp_path / "pytorch_model-00001-of-00001.bin")
        arg.write_text(json.dumps({"weight_map": {k: "pytorch_model-00001-of-00001.bin" for k in sd}}))
    out = tmp_path / "out"
    failed(assemble("--diffusers-skeleton", skeleton, "--transformer-weight", arg, "--output-dir", out),
           "--transformer-weight", "pickle")
    assert_no_output(out)


def test_missing_weight_path(tmp_path, skeleton):
    out = tmp_path / "out"
    failed(assemble("--diffusers-skeleton", skeleton, "--transformer-weight", tmp_path / "nope",
                    "--output-dir", out), "--transformer-weight", tmp_path / "nope", "no such file")
    assert_no_output(out)


def test_failure_while_writing_leaves_nothing(tmp_path, skeleton):
    # A dangling link inside a component folder: copy mode fails midway through writing.
    bad = partial_skeleton(skeleton, tmp_path / "skel", "")
    (bad / "scheduler" / "dangling.json").symlink_to(tmp_path / "gone.json")
    out = tmp_path / "a" / "b" / "out"
    line = failed(assemble("--diffusers-skeleton", bad, "--output-dir", out, "--asset-mode", "copy"),
                  bad / "scheduler" / "dangling.json")
    assert ".assembling-" not in line  # names the user's file, not our temp dir
    assert_no_output(out)
    assert not (tmp_path / "a").exists()


def test_first_mismatch_order():
    from tools.wan22.checkpoint import first_mismatch

    expected = {"a.weight": (2, 3), "b.weight": (4,)}
    assert first_mismatch(expected, dict(expected), "M") is None
    assert "'a.weight' is missing" in first_mismatch(expected, {"b.weight": (4,)}, "M")
    assert "'b.weight' has shape [5]" in first_mismatch(expected, {"a.weight": (2, 3), "b.weight": (5,)}, "M")
    assert "unexpected tensor 'c'" in first_mismatch(expected, {**expected, "c": (1,)}, "M")
    hint = first_mismatch(expected, {"blocks.0.self_attn.q.weight": (2, 2)}, "M")
    assert "non-diffusers layout" in hint and "blocks.0.self_attn.q.weight" in hint

"""MiniMax-H3 offload with adapters, on CPU, and the start-time refusals.

What the CPU tests prove and what they do not: group offload is applied here with onload device = offload device =
cpu. That runs diffusers' real hooks over the real pipeline (each group's hook is seen to fire, including the text
encoder's and the VAE decoder's, which the blocks reach without their top-level forward; the pipeline's execution
device taken from the hooks; the late ref2va partition placed under hooks) together with the
real adapter path (the shared LoRA engine switching per request under the hooks, distill fusing before the hooks
exist), and shows the outputs equal the no-offload outputs. It does not move a byte
between devices and cannot use CUDA streams (diffusers refuses streams on CPU), so it does not show that the
pinned copies of ``--offload-stream`` or ``--offload model``'s moves keep adapters consistent on a GPU:
scripts/gpu_check_minimax_offload.py does that, on a machine with CUDA.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from backend.errors import AdapterError
from backend.minimax.runtime import MiniMaxRuntime

torch.set_num_threads(1)

HEADS, HEAD_DIM, HIDDEN = 2, 16, 32  # backend/demo/minimax.py TRANSFORMER_CONFIG
PROMPT = "a red fox runs through snow"


def lora(seed: int, prefix: str = "transformer") -> dict:
    """A diffusers-layout LoRA on every block's attention projections."""
    g = torch.Generator().manual_seed(seed)
    return {f"{prefix}.transformer_blocks.{i}.attn.{p}.lora_{ab}.weight":
            torch.randn(*((4, HIDDEN) if ab == "A" else (HEADS * HEAD_DIM, 4)), generator=g) * 2.0
            for i in range(2) for p in ("to_q", "to_k", "to_v", "to_out.0") for ab in "AB"}


def run(rt, adapters=(), **params):
    out = rt.generate({"prompt": PROMPT, "seed": 3, "num_inference_steps": 2, **params}, adapters=adapters)
    return np.stack([np.asarray(f, dtype=np.float32) for f in out.frames]), out.audio[0]


def same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.fixture(scope="module")
def repo(demo_path):
    return demo_path("demo:minimax-h3")


@pytest.fixture
def onloads(monkeypatch):
    """Counts group onloads per module group (the hook path running), calling diffusers' own onload."""
    from diffusers.hooks.group_offloading import ModuleGroup

    counts: dict[int, int] = {}
    original = ModuleGroup.onload_

    def counted(self):
        counts[id(self)] = counts.get(id(self), 0) + 1
        return original(self)

    monkeypatch.setattr(ModuleGroup, "onload_", counted)
    return counts


def test_group_offload_with_peft_adapters_matches_no_offload(repo, tmp_path, onloads):
    from diffusers.hooks.group_offloading import _get_top_level_group_offload_hook, _is_group_offload_enabled

    turbo = tmp_path / "minimax_h3_fl2v_turbo_2step_v1.0.safetensors"
    other = tmp_path / "style.safetensors"
    ref = tmp_path / "minimax_h3_ref2v_turbo_2step_v1.0.safetensors"
    save_file(lora(1), str(turbo)), save_file(lora(2), str(other)), save_file(lora(3, "transformer_ref"), str(ref))
    plain = MiniMaxRuntime(repo, device="cpu", dtype=torch.float32)
    grouped = MiniMaxRuntime(repo, device="cpu", dtype=torch.float32, offload="group")
    grouped.start("peft")  # no start-time files: applies the offload plan
    pipe = grouped.pipe
    for name in ("transformer", "text_encoder", "vae"):
        assert _is_group_offload_enabled(getattr(pipe, name)), name
    assert not _is_group_offload_enabled(pipe.audio_vae)  # diffusers opts it out; it stays on the device
    first_hook = _get_top_level_group_offload_hook(pipe.transformer.transformer_blocks[0])

    # base -> turbo -> style -> base, switched per request on both runtimes: every result equal, and adapters count.
    sequence = [(), [("turbo", str(turbo), 1.0)], [("style", str(other), 0.5)], ()]
    results = []
    # Modules the blocks reach, each through its own group hook: on a GPU, one whose hook never fires computes
    # with weights left in CPU memory (the text encoder is called as `text_encoder.model(...)`, the VAE through
    # `decode`, not their top-level forward).
    watched = [*pipe.transformer.transformer_blocks, pipe.transformer, pipe.text_encoder.model, pipe.vae.decoder,
               pipe.vae.post_quant_conv]
    for adapters in sequence:
        before = dict(onloads)
        expected, got = run(plain, adapters), run(grouped, adapters)
        assert same(got, expected), adapters
        hooks = [(_get_top_level_group_offload_hook(m), m.__class__.__name__) for m in watched]
        missed = [cls for hook, cls in hooks
                  if hook is None or onloads.get(id(hook.group), 0) <= before.get(id(hook.group), 0)]
        assert not missed, f"groups never onloaded: {missed}"
        results.append(got)
    base, with_turbo, with_style, base_again = results
    assert not same(with_turbo, base) and not same(with_style, base) and not same(with_turbo, with_style)
    assert same(base_again, base)  # no adapter: the base output, bit for bit, under the hooks
    # Adapters leave diffusers' hooks alone: the shared engine writes the very tensors the groups onload (merge, on
    # CPU) or adds its own forward hooks (unfused, the rule under offload on an accelerator); the groups stay.
    assert _get_top_level_group_offload_hook(pipe.transformer.transformer_blocks[0]) is first_hook

    # ref2va loads its partition on demand: it is placed under the same hooks, and still matches.
    refs = [Image.new("RGB", (48, 48), (20, 200, 20))]
    expected = run(plain, [("ref", str(ref), 1.0)], task_type="ref2va", references=refs)
    got = run(grouped, [("ref", str(ref), 1.0)], task_type="ref2va", references=refs)
    assert _is_group_offload_enabled(pipe.transformer_ref) and same(got, expected)

    # Deleting an adapter: generation goes on and equals the base output.
    grouped.unload_adapter("turbo")
    assert same(run(grouped), base)

    # Switching adapters on and off around generations leaves every parameter as it was, bit for bit (on a GPU
    # under offload the engine serves them unfused and writes none: tests/test_minimax_engine.py).
    snapshot = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    run(grouped, [("style", str(other), 0.5)]), run(grouped)
    assert all(torch.equal(p, snapshot[n]) for n, p in pipe.transformer.named_parameters())


def test_distill_fuses_before_group_offload_and_refuses_after(repo, tmp_path):
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    path = tmp_path / "minimax_h3_fl2v_turbo_2step_v1.0_768p.safetensors"
    save_file(lora(4), str(path))
    plain = MiniMaxRuntime(repo, device="cpu", dtype=torch.float32, lora_backend="distill")
    plain.start("distill", [path])
    grouped = MiniMaxRuntime(repo, device="cpu", dtype=torch.float32, lora_backend="distill", offload="group")
    assert not _is_group_offload_enabled(grouped.pipe.transformer)  # nothing applied before the fuse
    grouped.start("distill", [path])
    assert _is_group_offload_enabled(grouped.pipe.transformer)
    base = MiniMaxRuntime(repo, device="cpu", dtype=torch.float32)
    params = {"num_inference_steps": None, "flow_shift": None}  # the fused Turbo file's contract decides
    fused = run(grouped, **params)
    assert same(fused, run(plain, **params)) and not same(fused, run(base, flow_shift=6.0))
    with pytest.raises(AdapterError) as err:
        grouped.fuse([path])
    assert "--offload group" in err.value.message


def test_omni_and_manager_paths_apply_offload(data_dir, tmp_path):
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    from backend import Omni
    from backend.manager import PipelineManager

    # Omni: start() fuses the distill file, then applies the offload plan.
    path = tmp_path / "minimax_h3_fl2v_turbo_2step_v1.0.safetensors"
    save_file(lora(5), str(path))
    omni = Omni(model="demo:minimax-h3", lora_backend="distill", lora_path=str(path), offload="group", device="cpu",
                data_dir=data_dir)
    rt = omni.manager.minimax
    assert rt.offloader.applied and _is_group_offload_enabled(rt.pipe.transformer) and rt.fused
    assert omni.generate(prompt=PROMPT, seed=1)[0].metadata["params"]["fused"] == [path.name]
    # The server's worker builds a manager and never calls start(): the first generation applies the plan.
    m = PipelineManager(device="cpu", data_dir=data_dir, offload="group")
    m.load("demo:minimax-h3")
    assert not m.minimax.offloader.applied
    result = m.generate({"prompt": PROMPT, "seed": 1, "num_inference_steps": 2})
    assert len(result.frames) == 124 and _is_group_offload_enabled(m.minimax.pipe.transformer)


def test_cli_refuses_conflicting_offload_flags(capsys):
    import app

    for argv, words in (
        (["--offload", "model"], ("--offload model", "CUDA")),
        (["--offload", "group", "--offload-stream"], ("--offload-stream", "CUDA")),
        (["--offload-stream"], ("--offload-stream", "--offload none")),
    ):
        rc = app.main(["generate", "--model", "demo:minimax-h3", "--prompt", "x", "--device", "cpu", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and all(w in err[0] for w in words), err
    rc = app.main(["generate", "--model", "demo:sd3.5", "--prompt", "x", "--device", "cpu", "--offload", "group"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--offload group" in err and "MiniMax-H3 only" in err


def test_serve_refuses_conflicting_offload_at_start(data_dir, capsys):
    import app

    # Flags alone: refused before any worker starts.
    rc = app.main(["serve", "demo:minimax-h3", "--engine", "ray", "--offload", "group", "--data-dir", str(data_dir)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--offload group" in err and "--engine ray" in err
    # Device: the worker refuses while starting, and the server exits 2 with its line.
    rc = app.main(["serve", "demo:minimax-h3", "--offload", "model", "--device", "cpu", "--data-dir", str(data_dir),
                   "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--offload model needs a CUDA device" in err

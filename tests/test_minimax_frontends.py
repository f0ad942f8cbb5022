"""MiniMax-H3 through the front ends: the CLI (task type, keyframe, WAV) and Omni (LoRARequest, contract)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

torch.set_num_threads(1)


def test_cli_fl2va_writes_mp4_with_audio_and_wav(data_dir, tmp_path, capsys):
    import app
    from backend.minimax.media import probe_streams, read_wav

    first = tmp_path / "first.png"
    Image.new("RGB", (64, 32), (200, 30, 30)).save(first)
    out = tmp_path / "clip.mp4"
    rc = app.main(["generate", "--model", "demo:minimax-h3", "--prompt", "a fox", "--task-type", "fl2va",
                   "--image", str(first), "--num-inference-steps", "2", "--output", str(out), "--device", "cpu"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert probe_streams(out) == ["video", "audio"]
    samples, rate = read_wav(out.with_suffix(".wav"))
    assert rate == 8000 and samples.shape[1] == 2 and samples.std() > 0

    rc = app.main(["generate", "--model", "demo:minimax-h3", "--prompt", "a fox", "--task-type", "ref2va",
                   "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "references" in err[0]


def test_omni_turbo_request_and_contract_rejection(data_dir, tmp_path):
    from backend import Omni
    from backend.errors import ContractViolation
    from backend.lora.request import LoRARequest

    omni = Omni(model="demo:minimax-h3", device="cpu", data_dir=data_dir)
    path = tmp_path / "minimax_h3_fl2v_turbo_2step_v1.0.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({f"transformer.transformer_blocks.0.attn.{p}.lora_{ab}.weight":
               torch.randn(*((4, 32) if ab == "A" else (32, 4)), generator=g) for p in ("to_q", "to_v")
               for ab in "AB"}, str(path))
    req = LoRARequest("turbo", 1, str(path))
    out = omni.generate(prompt="a fox", lora_request=req, seed=1)[0]  # steps from the file name
    assert out.audio[1] == 8000 and len(out.frames) == 124
    assert out.metadata["params"]["num_inference_steps"] == 2
    assert out.metadata["adapters"][0]["name"] == "turbo" and len(out.metadata["adapters"][0]["sha256"]) == 64
    with pytest.raises(ContractViolation) as err:
        omni.generate(prompt="a fox", lora_request=req, num_inference_steps=4)
    assert err.value.http_status == 422 and path.name in err.value.message
    base = omni.generate(prompt="a fox", seed=1, num_inference_steps=2)[0]  # no request: the base model
    assert base.metadata["adapters"] == [] and base.metadata["params"]["contract"] is None
    assert not np.array_equal(np.asarray(base.frames[0]), np.asarray(out.frames[0])) or \
        not np.array_equal(base.audio[0], out.audio[0])


def test_omni_distill_fuses_turbo_at_start(data_dir, tmp_path):
    from backend import Omni
    from backend.errors import ContractViolation

    path = tmp_path / "minimax_h3_fl2v_turbo_2step_v1.0_768p.safetensors"
    g = torch.Generator().manual_seed(1)
    save_file({f"transformer.transformer_blocks.1.attn.to_k.lora_{ab}.weight":
               torch.randn(*((4, 32) if ab == "A" else (32, 4)), generator=g) for ab in "AB"}, str(path))
    omni = Omni(model="demo:minimax-h3", lora_backend="distill", lora_path=str(path), device="cpu",
                data_dir=data_dir)
    out = omni.generate(prompt="a fox", seed=2)[0]  # no LoRARequest: the fused file's contract applies
    params = out.metadata["params"]
    assert params["num_inference_steps"] == 2 and params["flow_shift"] == 6.0 and params["fused"] == [path.name]
    with pytest.raises(ContractViolation, match="flow_shift=6"):
        omni.generate(prompt="a fox", flow_shift=12.0)

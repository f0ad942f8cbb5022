"""The video demo's parts (#40): moving-digit clips, the motion oracle, the grammar tokenizer in the T5
class, the video VAE that starts as the image VAE, and the wan2.1-t2v trainer (a few steps: CI never
trains for real)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend.demo import data
from demo_trainer import run_trainer
from oracles import read_clip, score_clips


def clips(n: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        clip = data.random_clip(rng)
        out.append((clip.prompt, list(data.render_clip(clip, rng)[0])))
    return out


def test_clips_move_the_named_way_and_the_oracle_reads_them():
    pairs = clips(64, 5)
    assert score_clips(pairs) == pytest.approx({"direction": 1.0, "colour": 1.0, "background": 1.0, "digit": 1.0},
                                               abs=0.05)
    assert clips(3, 7)[0][0] == clips(3, 7)[0][0]  # one deterministic generator
    assert all(np.array_equal(a, b) for a, b in zip(clips(2, 7)[1][1], clips(2, 7)[1][1]))
    frames, _ = data.render_clip(data.Clip("4", "green", "black", "right"), np.random.default_rng(0))
    assert frames.shape == (data.FRAMES, 64, 64, 3)
    got = read_clip(list(frames))
    assert (got.direction, got.colour, got.background, got.digit) == ("right", "green", "black", 4)
    assert 10 < got.travel[1] < 20 and abs(got.travel[0]) < 1  # from the middle to the right edge, not a nudge
    still = read_clip([frames[0]] * data.FRAMES)
    assert still.direction is None and still.travel == (0.0, 0.0)
    with pytest.raises(ValueError, match="unknown direction 'sideways'"):
        data.video_prompt(3, "red", "sideways", "black")


def test_where_a_clip_starts_says_nothing_of_the_way_it_goes():
    """Every clip starts with the digit in the middle of the frame along its motion and goes to the named edge:
    the way is in the prompt only, not in the first frame (the Wan transformer knows positions only relative to
    each other: edge to edge, the start edge would decide the way; data.render_clip). Read from the masks: the
    same draw moving either way along an axis has the same first frame, and travels 10-20 px the named way."""
    size = 64
    ys, xs = np.mgrid[0:size, 0:size]
    for seed in range(12):
        first, moved = {}, {}
        for way in data.DIRECTIONS:
            _, alpha = data.render_clip(data.Clip(str(seed % 9), "red", "black", way), np.random.default_rng(seed))
            first[way] = alpha[0]
            centre = [np.array([(a * ys).sum(), (a * xs).sum()]) / a.sum() for a in (alpha[0], alpha[-1])]
            moved[way] = centre[1] - centre[0]
        assert np.array_equal(first["left"], first["right"]) and np.array_equal(first["up"], first["down"]), seed
        for way, (axis, sign) in {"left": (1, -1), "right": (1, 1), "up": (0, -1), "down": (0, 1)}.items():
            travel = moved[way]
            assert 10 < sign * travel[axis] < 20 and abs(travel[1 - axis]) < 1, (seed, way, travel)


def test_the_grammar_tokenizer_makes_each_word_one_token():
    from transformers import T5Tokenizer

    from backend.demo.tokenizers import t5_grammar_tokenizer

    tok = t5_grammar_tokenizer()
    assert isinstance(tok, T5Tokenizer)
    ids = tok("a green digit 4 moving right on a black background")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["▁a", "▁green", "▁digit", "▁4", "▁moving", "▁right", "▁on", "▁a",
                                             "▁black", "▁background", "</s>"]
    assert tok.convert_ids_to_tokens(tok("a purple dog")["input_ids"])[:3] == ["▁a", "▁", "p"]  # unknown: by letter
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)


def test_the_short_prompt_encoding_is_the_pipelines_own():
    """The trainer encodes prompts on 32 tokens and pads with zeros: exactly what WanPipeline passes at 512."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from backend.demo import wan, wan_train
    from backend.demo.tokenizers import t5_grammar_tokenizer

    tok = t5_grammar_tokenizer()
    torch.manual_seed(0)
    pipe = WanPipeline(tokenizer=tok, text_encoder=wan_train.text_encoder(tok).eval(), transformer=None, vae=None,
                       scheduler=UniPCMultistepScheduler(**wan.SCHEDULER))
    prompts = ["a green digit 4 moving right on a black background", "", "a red digit 0 moving up on a navy background"]
    full, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=512,
                                 device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(wan_train.prompt_embeds(pipe, prompts, 512), full)


def test_the_video_vae_starts_as_the_image_vae_frame_by_frame():
    """Before any training on clips: the first frame comes back exactly as the image VAE returns it, and the
    frames the temporal downsampler keeps at the image VAE's quality (the others are copies of a neighbour)."""
    from diffusers import AutoencoderKLQwenImage

    from backend.demo.wan_train import IMAGE_VAE, to_video, video_vae_from_image

    vae = video_vae_from_image().eval()
    image_vae = AutoencoderKLQwenImage.from_pretrained(IMAGE_VAE, torch_dtype=torch.float32).eval()
    assert (vae.config.scale_factor_spatial, vae.config.scale_factor_temporal) == (4, 2)
    videos, _, _ = data.clip_batch(np.random.default_rng(3), 2)
    x = to_video(videos)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        assert z.shape == (2, 4, 5, 16, 16)  # 9 frames -> 5 latent frames of 16x16x4
        rec = vae.decode(z).sample
        frame0 = image_vae.decode(image_vae.encode(x[:, :, :1]).latent_dist.mode()).sample
    torch.testing.assert_close(rec[:, :, :1], frame0, atol=1e-4, rtol=1e-4)
    psnr = [10 * np.log10(4.0 / (rec[:, :, f].clamp(-1, 1) - x[:, :, f]).pow(2).mean().item()) for f in range(9)]
    assert min(psnr[0::2]) > 27 and max(psnr[1::2]) < min(psnr[0::2]), psnr


def test_the_wan_trainer_runs_resumes_and_writes_a_loadable_pipeline(tmp_path, capsys):
    from diffusers import WanPipeline

    out, home = tmp_path / "wan", tmp_path / "home"
    args = ["wan2.1-t2v", "--data-dir", str(home), "--out", str(out), "--set", "vae_steps=2", "--set", "vae_batch=1",
            "--set", "report_clips=4", "--set", "latent_pool=16", "--set", "transformer_steps=2",
            "--set", "transformer_batch=2"]

    def run(*extra) -> tuple[int, str]:
        return run_trainer(capsys, args + list(extra))

    code, text = run("--minutes", "0")
    assert code == 3 and "time is up at step 0/2" in text, text
    assert (home / "demo-train" / "wan2.1-t2v" / "vae.pt").is_file() and not out.exists()
    code, text = run()
    assert code == 0 and "video vae: resuming at step 0/2" in text, text
    pipe = WanPipeline.from_pretrained(out, torch_dtype=torch.float32)
    assert pipe.vae.config.scale_factor_temporal == 2 and len(pipe.vae.config.latents_mean) == 4
    assert next(pipe.transformer.parameters()).dtype == torch.float32  # loaded as asked; stored fp16
    frames = pipe(prompt="a green digit 4 moving right on a black background", height=64, width=64, num_frames=9,
                  num_inference_steps=2, output_type="np").frames[0]
    assert frames.shape == (9, 64, 64, 3)

    # --init-from: going on from written weights keeps their VAE (and its latent statistics) and tokenizer files,
    # trains their transformer and text encoder further, and says what it went on from
    more, home2 = tmp_path / "wan-more", tmp_path / "home2"
    code, text = run_trainer(capsys, ["wan2.1-t2v", "--init-from", str(out), "--data-dir", str(home2), "--out", str(more),
                                      "--set", "latent_pool=8", "--set", "transformer_steps=2",
                                      "--set", "transformer_batch=2"])
    assert code == 0 and f"continuing from {out}" in text and "video vae" not in text, text
    assert (home2 / "demo-train" / "wan2.1-t2v-continued" / "transformer.pt").is_file()
    for part in ("vae/diffusion_pytorch_model.safetensors", "vae/config.json", "tokenizer/tokenizer_config.json"):
        assert (more / part).read_bytes() == (out / part).read_bytes(), part
    name = "diffusion_pytorch_model.safetensors"
    assert (more / "transformer" / name).read_bytes() != (out / "transformer" / name).read_bytes()
    record = json.loads((more / "training.json").read_text())
    assert record["continued_from"]["plan"]["transformer_steps"] == 2 and record["vae"]["psnr_db"] > 0
    first = json.loads((out / "training.json").read_text())["unseen_prompts"]
    # a smaller pool this time: the prompts of the first run's other 8 clips were trained on all the same
    assert record["unseen_prompts"] and set(record["unseen_prompts"]) <= set(first)  # held out by both runs
    assert WanPipeline.from_pretrained(more).transformer is not None


def test_each_experts_sigmas_are_the_trainers_distribution_on_its_half():
    """wan2.2-t2v's experts train on their half of the noise levels only, drawn as the base trainer draws them
    (flow-shifted logit-normal), conditioned on the half: checked against plain rejection sampling."""
    from backend.demo.wan_experts import sigmas_between

    torch.manual_seed(0)
    z = torch.sigmoid(torch.randn(400_000))
    shifted = 3 * z / (1 + 2 * z)  # the base trainer's draw (flow shift 3)
    for low, high in [(0.875, 1.0), (0.0, 0.875)]:
        got = sigmas_between(20_000, low, high)
        assert got.min() >= low and got.max() <= high, (low, high, got.min(), got.max())
        want = shifted[(shifted >= low) & (shifted < high)]
        for q in (0.1, 0.5, 0.9):
            assert abs(got.quantile(q) - want.quantile(q)) < 0.01, (low, high, q)


def test_the_experts_trainer_runs_resumes_and_writes_the_wan22_pair(tmp_path, capsys):
    """``python -m backend.demo.train wan2.2-t2v``: both experts start as the shipped wan2.1-t2v transformer and
    each is trained on its own half; the pair is written as Wan2.2 lays it out (``transformer`` the high-noise
    one, ``transformer_2`` the low-noise one, ``boundary_ratio`` in the pipeline's config)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from backend.demo import WEIGHTS_ROOT

    out, home = tmp_path / "wan22", tmp_path / "home"
    args = ["wan2.2-t2v", "--data-dir", str(home), "--out", str(out), "--set", "steps=2", "--set", "batch=2",
            "--set", "latent_pool=16"]
    code, text = run_trainer(capsys, args + ["--minutes", "0"])
    assert code == 3 and "time is up at step 0/2" in text, text
    code, text = run_trainer(capsys, args)
    assert code == 0 and "experts: resuming at step 0/2" in text, text
    pipe = WanPipeline.from_pretrained(out, torch_dtype=torch.float32)
    assert pipe.config.boundary_ratio == 0.875 and pipe.transformer_2 is not None
    base = WanTransformer3DModel.from_pretrained(WEIGHTS_ROOT / "wan2.1-t2v" / "transformer", torch_dtype=torch.float32)
    name = "blocks.0.attn2.to_q.weight"
    high, low, start = (m.state_dict()[name] for m in (pipe.transformer, pipe.transformer_2, base))
    assert not torch.equal(high, start) and not torch.equal(low, start) and not torch.equal(high, low)
    assert (high - start).abs().max() < 0.05 and (low - start).abs().max() < 0.05  # two steps from the base
    frames = pipe(prompt="a green digit 4 moving right on a black background", height=64, width=64, num_frames=9,
                  num_inference_steps=2, output_type="np").frames[0]
    assert frames.shape == (9, 64, 64, 3)


def test_the_experts_start_over_when_their_base_is_retrained(tmp_path, capsys):
    """The experts' checkpoint (and the latent pool) belong to the wan2.1-t2v weights they started from: after
    the base is trained further, a run starts over from the new base instead of resuming (or, done, re-exporting)
    experts of the old one."""
    import shutil

    from safetensors.torch import load_file, save_file

    from backend.demo import WEIGHTS_ROOT
    from backend.demo.wan_experts import ExpertsPlan, base_digest, train_experts

    base, work, out = tmp_path / "base", tmp_path / "work", tmp_path / "out"
    shutil.copytree(WEIGHTS_ROOT / "wan2.1-t2v", base)
    plan = ExpertsPlan(steps=1, batch=2, latent_pool=16)
    with torch.random.fork_rng(devices=[]):
        assert train_experts(plan, work, out, 10, base)
        first = json.loads((out / "training.json").read_text())["base_sha256"]
        assert first == base_digest(base)
        weights = base / "transformer" / "diffusion_pytorch_model.safetensors"
        tensors = load_file(str(weights))
        tensors["blocks.0.attn2.to_q.weight"] += 1e-2  # the base, trained further
        save_file(tensors, str(weights))
        capsys.readouterr()
        assert train_experts(plan, work, out, 10, base)
    text = capsys.readouterr().out
    assert "has changed since the checkpoint; starting over" in text and "resuming" not in text, text
    assert json.loads((out / "training.json").read_text())["base_sha256"] == base_digest(base) != first

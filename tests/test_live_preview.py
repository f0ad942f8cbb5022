"""Live previews (backend/preview.py): the latents of a running generation as a small image.

On the real demo pipelines (their VAEs through ``from_pretrained``, the three latent layouts:
Qwen-Image's packed 2x2 tokens, SD3's (B, C, H, W), Wan's (B, C, F, H, W)): a step's latents are read
exactly as the pipeline decodes them, previews follow the steps, and asking for them changes no pixel
of the result. The demo VAEs have seeded random weights, so their decode is not local and how much a
preview looks like the result cannot be measured on them; what makes it look right on a trained VAE
(a decoder that is near per-pixel linear) is checked on a VAE whose decoder is exactly that.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.preview import SIZE, LatentPreview, _denormalise

MODELS = ["demo:qwen-image", "demo:sd3.5", "demo:wan2.1-t2v"]


def _request(model: str) -> dict:
    req = {"prompt": "a red fox in the snow", "num_inference_steps": 6, "seed": 3, "height": 64, "width": 96}
    if "wan" in model:
        req["num_frames"] = 5
    return req


def _run(manager, request, on_preview=None):
    result = manager.generate(dict(request), on_preview=on_preview)
    return [np.asarray(f) for f in (result.frames or result.images)]


@pytest.mark.parametrize("model", MODELS)
def test_latents_are_read_as_the_pipeline_decodes_them(managers, model):
    """The preview reads a step's latents the way the pipeline itself decodes them at the end: unpacked
    (Qwen-Image's 2x2 tokens, by the request's aspect), de-normalised by the VAE's config, decoded:
    equal to the pipeline's own output. So the map is fitted in the space the callback hands over."""
    from backend.preview import _unpack

    m = managers(model)
    params = m.validate(_request(model))
    kwargs = {k: v for k, v in params.items() if k not in ("seed", "fps", "flow_shift", "sample_solver")}
    pipe = m.pipeline

    def run(output_type):
        with torch.inference_mode():
            out = pipe(**kwargs, generator=torch.Generator().manual_seed(3), output_type=output_type)
        return out.frames if hasattr(out, "frames") else out.images

    latents, pixels = run("latent"), run("np")
    z = latents[0]
    if z.ndim == 2:
        z = _unpack(z, params["height"], params["width"])[:, None]  # one frame for Qwen-Image's video VAE
    with torch.inference_mode():
        decoded = pipe.vae.decode(_denormalise(pipe.vae, z[None].float()), return_dict=False)[0][0]
    ours = ((decoded.clamp(-1, 1) + 1) / 2).float()
    theirs = torch.as_tensor(np.asarray(pixels[0]), dtype=torch.float32)
    if ours.ndim == 4 and "qwen" in model:
        ours = ours[:, 0]
    if ours.ndim == 4:  # (3, F, H, W) vs the pipeline's (F, H, W, 3)
        ours = ours.permute(1, 2, 3, 0)
    else:  # (3, H, W) vs (H, W, 3)
        ours = ours.permute(1, 2, 0)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert torch.allclose(ours, theirs, atol=2e-3), f"{model}: max diff {(ours - theirs).abs().max():.4f}"


class LinearVae(torch.nn.Module):
    """A stand-in VAE whose decoder IS per-pixel linear (what a trained VAE's is, near enough, and what
    ComfyUI's latent2rgb tables assume): the fit must find that map exactly, in the pipeline's space."""

    def __init__(self, channels: int, config: dict, video: bool):
        super().__init__()
        from types import SimpleNamespace

        g = torch.Generator().manual_seed(11)
        self.config = SimpleNamespace(**config)
        self.encoder = torch.nn.Parameter(torch.randn(channels, 3, generator=g))
        self.rgb = torch.randn(3, channels, generator=g) * 0.3  # raw latents -> RGB
        self.offset = torch.randn(3, generator=g) * 0.1
        self.video = video

    def encode(self, x):
        if self.video != (x.ndim == 5):
            raise ValueError("wrong layout")  # as a real video VAE refuses 4-D input
        x = x[:, :, 0] if x.ndim == 5 else x
        z = torch.einsum("cr,nrhw->nchw", self.encoder, torch.nn.functional.avg_pool2d(x, 8))
        from types import SimpleNamespace

        z = z[:, :, None] if self.video else z
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=z))

    def decode(self, z, return_dict=False):
        flat = z[:, :, 0] if z.ndim == 5 else z
        rgb = torch.einsum("rc,nchw->nrhw", self.rgb, flat) + self.offset[None, :, None, None]
        rgb = torch.nn.functional.interpolate(rgb, scale_factor=8, mode="nearest")
        return (rgb[:, :, None] if z.ndim == 5 else rgb,)


@pytest.mark.parametrize("config,video", [
    ({"latents_mean": [0.5] * 16, "latents_std": [2.0] * 16}, True),  # Wan / Qwen-Image: per-channel mean, std
    ({"scaling_factor": 1.5305, "shift_factor": 0.0609}, False),  # SD3 / Flux: scale and shift
])
def test_the_fit_recovers_a_linear_decoder_exactly(config, video):
    vae = LinearVae(16, config, video)
    pipe = type("Pipe", (), {"vae": vae})()
    weight, bias = LatentPreview(pipe).fit(video)
    # in the pipeline's space: rgb = rgb_raw @ denormalise(z) + offset
    probe = torch.randn(4, 16, 1, 1)
    expected = vae.decode(_denormalise(vae, probe))[0][:, :, 0, 0]
    got = (probe[:, :, 0, 0] @ weight.T) + bias
    assert torch.allclose(got, expected, atol=1e-3), (got - expected).abs().max()


def test_packed_tokens_unpack_as_diffusers_packs_them():
    from diffusers import QwenImagePipeline

    from backend.preview import _unpack

    grid = torch.randn(1, 16, 12, 20)  # latents of a 96 x 160 image (8x VAE)
    packed = QwenImagePipeline._pack_latents(grid, 1, 16, 12, 20)
    assert torch.equal(_unpack(packed[0], 96, 160), grid[0])


@pytest.mark.parametrize("model", MODELS)
def test_previews_follow_the_steps_and_change_no_pixel(managers, model):
    m = managers(model)
    request = _request(model)
    plain = _run(m, request)
    shots = []

    def on_preview(step, total, render):
        img = render()
        assert img is not None, f"{model}: no preview at step {step}"
        shots.append((step, np.asarray(img).astype(np.int16)))

    with_previews = _run(m, request, on_preview)
    assert len(plain) == len(with_previews) and all(np.array_equal(a, b) for a, b in zip(plain, with_previews))
    assert [s for s, _ in shots] == list(range(1, request["num_inference_steps"] + 1))
    first, last = shots[0][1], shots[-1][1]
    assert max(first.shape[:2]) == SIZE and first.shape[2] == 3
    # the request is 96 wide and 64 high: so is the preview (packed tokens unpacked by the aspect)
    assert first.shape[1] > first.shape[0]
    # (low contrast on a random-weight VAE: its decode has little per-pixel linear part)
    assert np.abs(first - last).mean() > 0.1, f"{model}: the preview did not change from step 1 to the last"


def test_a_pipeline_without_a_vae_encoder_gets_no_preview_and_runs_on(managers):
    class NoVae:
        vae = None

    preview = LatentPreview(NoVae())
    assert preview.image(torch.zeros(1, 16, 8, 8), 64, 64) is None
    assert not preview.available


def test_unload_drops_the_previewer_with_the_pipeline(data_dir):
    import gc
    import weakref

    from backend.manager import PipelineManager

    m = PipelineManager(device="cpu", dtype="float32", data_dir=data_dir)
    m.load("demo:sd3.5")
    m.generate({**_request("demo:sd3.5"), "num_inference_steps": 2}, on_preview=lambda s, t, render: render())
    assert m.live_preview().available
    ref = weakref.ref(m.pipeline)
    m.unload()
    gc.collect()
    assert ref() is None, "the unloaded pipeline is still referenced (by the previewer?)"


def test_a_preview_that_cannot_be_made_never_fails_the_generation(managers):
    """Whatever a pipeline's callback hands over as "latents", a preview that cannot be made ends the model's
    previews (logged) and the generation goes on with the same pixels: a shape the map was not fitted for
    gives None, and one the code cannot even index (a 0-d tensor here) does not raise either."""
    m = managers("demo:sd3.5")
    request = {**_request("demo:sd3.5"), "num_inference_steps": 2}
    plain = _run(m, request)
    preview = m.live_preview()
    assert preview.image(torch.zeros(1, 4, 8, 12), 64, 96) is not None  # fitted for SD3's channels

    assert preview.image(torch.zeros(1, 4, 8, 12, 2, 2), 64, 96) is None and preview.available  # no fit

    out = []
    with_bad = _run(m, request, on_preview=lambda step, total, render: out.append(
        m.preview_renderer({"latents": torch.tensor(0.0)}, request)()))
    assert out == [None, None] and not preview.available
    assert all(np.array_equal(a, b) for a, b in zip(plain, with_bad))
    m._preview = None  # the next test in this module gets a fresh previewer

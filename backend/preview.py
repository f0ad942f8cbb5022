"""Live previews of a generation: the latents of a denoising step as a small RGB image, cheaply.

Decoding every few steps with the VAE would cost a large part of a step on a 14B Wan2.2 (a video VAE
decode) and allocate activations next to the denoiser. Instead, as ComfyUI's "latent2rgb" previews do,
a linear map from latent channels to RGB approximates the decoder: a (3 x C) matmul and a tiny copy to
the host. ComfyUI keeps a hand-written factor table per model family; here the map comes from the
artifact itself, fitted once per loaded model on its first preview: the model's own VAE encodes a colour
chart (128 px, one frame for a video VAE) and decodes those latents and a grid of standard-normal ones
(latents as a denoiser holds them mid-way); least squares maps the latents, in the pipeline's
normalised space (``latents_mean``/``latents_std`` or ``shift_factor``/``scaling_factor`` from the VAE's
config), to the decoded colours at latent resolution. So any diffusers VAE (AutoencoderKL,
AutoencoderKLWan, AutoencoderKLQwenImage; 16 or 48 channels, 8x or 16x) gets previews without a table,
and a fine-tuned VAE its own fit. Cost: one small encode and two small decodes once (milliseconds on a
GPU, about a second for a CPU demo model), then a few ms per preview (``scripts/bench_preview.py``).

Latents come as the pipeline's callback sees them: ``(B, C, H, W)`` (SD3), ``(B, C, F, H, W)`` (Wan:
the middle latent frame is shown) or packed 2x2 tokens ``(B, H/2 * W/2, 4C)`` (Qwen-Image, Flux),
unpacked using the request's aspect ratio.
"""
from __future__ import annotations

import io
import logging
import math
import time

import torch

log = logging.getLogger(__name__)

#: The longest side of a preview image (pixels); latents smaller than this are scaled up.
SIZE = 128
#: A running job sends a preview at most this often (seconds); a job shorter than this sends none (and a
#: model never asked for one never fits its map).
EVERY_S = 1.0
#: The colour chart the fit encodes (pixels per side).
CHART = 128
#: The grid of standard-normal latents the fit decodes too (latent pixels per side).
NOISE_GRID = 16


def chart(size: int = CHART) -> torch.Tensor:
    """A smooth colour chart in [-1, 1], (3, size, size): hue across, brightness down, plus flat
    patches of saturated colours, so the fit sees both gradients and solid areas."""
    y, x = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    hue = x * 6.0
    # HSV -> RGB with saturation 1 and value falling from 1 to 0.15 down the image
    k = torch.stack([(5.0 + hue) % 6.0, (3.0 + hue) % 6.0, (1.0 + hue) % 6.0])
    rgb = 1.0 - torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0)
    rgb = rgb * (1.0 - 0.85 * y)
    block = size // 8
    colours = torch.tensor([[1, 1, 1], [0, 0, 0], [0.5, 0.5, 0.5], [1, 0, 0], [0, 1, 0], [0, 0, 1],
                            [1, 1, 0], [0, 1, 1]], dtype=torch.float32)
    for i, c in enumerate(colours):  # a row of flat patches along the top
        rgb[:, block // 2:block // 2 + block, i * block:(i + 1) * block] = c[:, None, None]
    return rgb * 2.0 - 1.0


def _affine(vae, z: torch.Tensor) -> tuple:
    """(mean, std) with ``normalised = (raw - mean) / std``, as the pipelines read them from the VAE's config
    (Wan, Qwen-Image: per-channel ``latents_mean``/``latents_std``; SD3, Flux: ``shift_factor`` and
    ``1 / scaling_factor``), shaped to broadcast over ``z``."""
    cfg = vae.config
    shape = [1, -1] + [1] * (z.ndim - 2)
    mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
    if mean is not None and std is not None and len(mean) == z.shape[1]:
        return (torch.tensor(mean, dtype=z.dtype).view(shape), torch.tensor(std, dtype=z.dtype).view(shape))
    shift = getattr(cfg, "shift_factor", None) or 0.0
    scale = getattr(cfg, "scaling_factor", None) or 1.0
    return shift, 1.0 / scale


def _normalise(vae, z: torch.Tensor) -> torch.Tensor:
    """Raw VAE latents -> the pipeline's latent space (what the denoiser and the step callback see)."""
    mean, std = _affine(vae, z)
    return (z - mean) / std


def _denormalise(vae, z: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_normalise``: the pipeline's latent space -> what the VAE decodes."""
    mean, std = _affine(vae, z)
    return z * std + mean


class LatentPreview:
    """The latent -> RGB map of one loaded pipeline (fitted on first use; ``None`` maps mean "no preview")."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self._map: tuple[torch.Tensor, torch.Tensor] | None = None
        self._failed: str | None = None
        self._on: dict = {}  # device -> the map there

    @property
    def available(self) -> bool:
        return self._failed is None

    def fit(self, video: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fit ``rgb = W @ z + b`` by least squares from the pipeline's VAE (the module docstring); ``video``:
        the latents are 5-D (tried first as the VAE's input layout). None when the model has no preview."""
        if self._map is not None or self._failed is not None:
            return self._map
        vae = getattr(self.pipeline, "vae", None)
        try:
            if vae is None or not hasattr(vae, "encode"):
                raise ValueError("the pipeline has no VAE with an encoder")
            image = chart()
            param = next(vae.parameters())
            x = image[None].to(param.device, param.dtype)
            # a video VAE (Wan's, Qwen-Image's) takes one frame as (B, C, F, H, W), an image VAE (B, C, H, W);
            # packed image latents do not say which, so the other layout is tried when the first is refused
            layouts = (x[:, :, None], x) if video else (x, x[:, :, None])
            with torch.inference_mode():
                try:
                    out = vae.encode(layouts[0])
                except Exception:
                    out = vae.encode(layouts[1])
                dist = getattr(out, "latent_dist", out)
                raw = getattr(dist, "mean", None)
                if raw is None:
                    raw = out[0] if isinstance(out, (tuple, list)) else out
                # plus latents as a denoiser holds them mid-way (standard normal in the pipeline's space), on a
                # grid of NOISE_GRID a side whatever the VAE's factor (a 16x VAE makes the chart only 8x8)
                norm = _normalise(vae, raw.float().cpu())
                shape = (1, norm.shape[1], *norm.shape[2:-2], NOISE_GRID, NOISE_GRID)
                noise = torch.randn(shape, generator=torch.Generator().manual_seed(0))
                rows, targets = [], []
                for zs in (norm, noise):
                    # the target is what the decoder makes of these latents (for a trained VAE, the chart for
                    # the chart's latents): the preview then approximates the decode it stands in for
                    decoded = vae.decode(_denormalise(vae, zs).to(param.device, param.dtype),
                                         return_dict=False)[0].float().cpu()
                    if decoded.ndim == 5:  # (B, 3, F, H, W) -> the one frame
                        decoded, zs = decoded[:, :, 0], zs[:, :, 0]
                    c, h, w = zs.shape[1:]
                    target = torch.nn.functional.adaptive_avg_pool2d(decoded, (h, w))  # (1, 3, h, w)
                    rows.append(zs.permute(0, 2, 3, 1).reshape(-1, c))
                    targets.append(target.permute(0, 2, 3, 1).reshape(-1, 3))
            z_all = torch.cat(rows)
            A = torch.cat([z_all, torch.ones(len(z_all), 1)], dim=1)  # (samples, C+1)
            solution = torch.linalg.lstsq(A, torch.cat(targets)).solution  # (C+1, 3)
            if not torch.isfinite(solution).all():
                raise ValueError("the fit is not finite")
            self._map = (solution[:c].T.contiguous(), solution[c].contiguous())  # W (3, C), b (3,)
        except Exception as exc:  # previews are optional: the generation goes on without them
            self._failed = f"{type(exc).__name__}: {exc}"
            log.info("no live previews for this model (%s)", self._failed)
            return None
        return self._map

    def image(self, latents: torch.Tensor, height: int | None, width: int | None, index: int = 0):
        """Sample ``index`` of a step's latents as a PIL image (longest side ``SIZE``), or None. Never raises:
        a preview is best effort and must not fail the generation it runs inside (a shape this code does not
        know is logged once and the model gets no more previews)."""
        if latents is None or self._failed is not None:
            return None
        try:
            return self._image(latents, height, width, index)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self._failed = f"{type(exc).__name__}: {exc}"
            log.warning("live previews off for this model: %s", self._failed)
            return None

    def _image(self, latents: torch.Tensor, height: int | None, width: int | None, index: int):
        z = latents[index].detach()
        if z.ndim == 2:  # packed 2x2 tokens (L, 4C): back to (C, H, W) by the request's aspect ratio
            z = _unpack(z, height, width)
            if z is None:
                return None
        video = z.ndim == 4
        mapping = self.fit(video)
        if mapping is None:
            return None
        if video:  # (C, F, H, W): the middle latent frame
            z = z[:, z.shape[1] // 2]
        if z.ndim != 3 or z.shape[0] != mapping[0].shape[1]:
            return None
        weight, bias = self._on.get(z.device) or (mapping[0].to(z.device), mapping[1].to(z.device))
        self._on[z.device] = (weight, bias)
        rgb = torch.einsum("rc,chw->rhw", weight, z.float()) + bias[:, None, None]
        pixels = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        from PIL import Image

        img = Image.fromarray(pixels, "RGB")
        scale = SIZE / max(img.size)
        if scale != 1:
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                             Image.BILINEAR)
        return img


def _unpack(tokens: torch.Tensor, height: int | None, width: int | None) -> torch.Tensor | None:
    """(L, 4C) tokens of 2x2 latent patches -> (C, H, W); the grid's shape from the image's aspect."""
    length, dim = tokens.shape
    if dim % 4 or not height or not width:
        return None
    rows = round(math.sqrt(length * height / width))
    if rows <= 0 or length % rows:
        return None
    cols, c = length // rows, dim // 4
    return tokens.reshape(rows, cols, c, 2, 2).permute(2, 0, 3, 1, 4).reshape(c, rows * 2, cols * 2)


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def sender(send, job_ids: list[str], skip=lambda job_id: False, every_s: float | None = None):
    """``on_preview`` for ``PipelineManager.generate`` / ``backend.batch.generate_batch``: every
    ``EVERY_S`` seconds a PNG of each job's sample (``job_ids[i]`` is sample ``i``) handed to
    ``send(job_id, step, png_bytes)``; never at the last step (the result follows it). The local
    worker sends it over its pipe, a Ray replica as an event of the job's stream."""
    every = EVERY_S if every_s is None else every_s
    last = [time.perf_counter()]

    def on_preview(step: int, total, render) -> None:
        now = time.perf_counter()
        if now - last[0] < every or (total and step >= total):
            return
        last[0] = now
        for i, job_id in enumerate(job_ids):
            if skip(job_id):
                continue
            img = render(i)
            if img is None:  # no preview for this model (logged once, by LatentPreview.fit)
                return
            send(job_id, step, png(img))

    return on_preview

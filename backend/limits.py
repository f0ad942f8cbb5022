"""Resource bounds on what one request may ask for, checked when a job is submitted.

Per pipeline family (data: ``FAMILY_LIMITS``): the largest height/width (``max_side``), the most
frames (``max_frames``) and a work budget, height x width x frames x steps (``max_work``).
Server-wide: prompt length, adapters per request and the running time of one job. Each has a
``serve`` flag (``Limits``) that replaces the family's value for every family; a request over a
bound is a 400 naming the field, before any job row exists. docs/security.md lists them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidParameter

# pipeline class -> its caps. Generous for the real checkpoints (Qwen-Image trains up to ~1.7k px,
# Wan 2.x makes 81-121 frames at 720p, MiniMax-H3 up to ~20 s at 24 fps); the flags raise them.
_IMAGE = {"max_side": 2048, "max_frames": 1, "max_work": 2048 * 2048 * 100}
_WAN = {"max_side": 1920, "max_frames": 241, "max_work": 1280 * 720 * 161 * 50}
FAMILY_LIMITS: dict[str, dict] = {
    "QwenImagePipeline": _IMAGE,
    "StableDiffusion3Pipeline": _IMAGE,
    "WanPipeline": _WAN,
    "WanImageToVideoPipeline": _WAN,
    "MiniMaxH3ModularPipeline": {"max_side": 1920, "max_frames": 481, "max_work": 1280 * 720 * 481 * 50},
}
# a model whose family is not known yet (not loaded, not built): the loosest family's caps
FALLBACK = {k: max(f[k] for f in FAMILY_LIMITS.values()) for k in ("max_side", "max_frames", "max_work")}

DEFAULT_PROMPT_CHARS = 20_000
DEFAULT_ADAPTERS = 8

# One budget for every plot (the Compare grid and the X/Y/Z plot): its cells, each a queued job, and the
# pixels of the one picture they make. Under PIL's own limit (Image.MAX_IMAGE_PIXELS, 89.5 MP) so the app
# can reopen what it wrote, and under the side a browser draws; cells are scaled down to fit.
MAX_PLOT_CELLS = 64
MAX_PLOT_PIXELS = 80_000_000
MAX_PLOT_SIDE = 32_000


def check_plot_cells(cells: int, param: str = "axes") -> None:
    """Refuse a plot of more than MAX_PLOT_CELLS cells, before any cell is planned or queued."""
    if cells > MAX_PLOT_CELLS:
        raise InvalidParameter(f"the plot has {cells} cells; at most {MAX_PLOT_CELLS} (fewer values per axis)",
                               param=param)


def check_plot_size(width: int, height: int, param: str = "axes") -> None:
    """Refuse a plot picture over MAX_PLOT_PIXELS or MAX_PLOT_SIDE (what is left when its cells are already
    at their smallest: labels or cell shapes that no scale fits)."""
    if width * height > MAX_PLOT_PIXELS or max(width, height) > MAX_PLOT_SIDE:
        raise InvalidParameter(f"the plot would be {width}x{height} px ({width * height / 1e6:.0f} MP); at most "
                               f"{MAX_PLOT_PIXELS / 1e6:.0f} MP and {MAX_PLOT_SIDE} px a side (fewer or shorter "
                               f"labels, fewer values, or a less elongated size)", param=param)
DEFAULT_JOB_TIMEOUT_S = 3600.0
PROMPT_FIELDS = ("prompt", "negative_prompt")
FLAG = {"max_side": "--max-side", "max_frames": "--max-frames", "max_work": "--max-work",
        "max_prompt_chars": "--max-prompt-chars", "max_adapters": "--max-adapters"}


@dataclass(frozen=True)
class Limits:
    """The server's bounds; ``None`` for a family cap means the family's own value."""

    max_side: int | None = None
    max_frames: int | None = None
    max_work: int | None = None
    max_prompt_chars: int = DEFAULT_PROMPT_CHARS
    max_adapters: int = DEFAULT_ADAPTERS
    job_timeout: float = DEFAULT_JOB_TIMEOUT_S  # seconds one job may run; 0: no limit

    def __post_init__(self):
        for name, flag in FLAG.items():
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidParameter(f"{flag} must be at least 1, got {value}", param=name)
        if self.job_timeout < 0:
            raise InvalidParameter(f"--job-timeout must be >= 0 seconds (0: no limit), got {self.job_timeout}",
                                   param="job_timeout")

    def family(self, pipeline: str | None) -> dict:
        caps = dict(FAMILY_LIMITS.get(pipeline or "", FALLBACK))
        caps.update({k: getattr(self, k) for k in caps if getattr(self, k) is not None})
        return caps

    def as_dict(self, pipeline: str | None = None) -> dict:
        return {**self.family(pipeline), "max_prompt_chars": self.max_prompt_chars,
                "max_adapters": self.max_adapters, "job_timeout": self.job_timeout}


def check_text(value, field: str) -> None:
    """Strings travel to files, SQLite and tokenizers: no NUL byte and no lone surrogate."""
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidParameter(f"{field!r} contains a NUL byte", param=field)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidParameter(f"{field!r} is not valid Unicode text (a lone surrogate at character "
                                   f"{exc.start})", param=field) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, field)
            check_text(v, f"{field}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{field}[{i}]")


def check_request(limits: Limits, pipeline: str | None, defaults: dict, params: dict,
                  adapters: list | None) -> None:
    """Raise InvalidParameter (400, naming the field) when a request is over a bound."""
    for name in PROMPT_FIELDS:
        text = params.get(name)
        if isinstance(text, str) and len(text) > limits.max_prompt_chars:
            raise InvalidParameter(f"{name!r} is {len(text)} characters; this server takes at most "
                                   f"{limits.max_prompt_chars} (--max-prompt-chars)", param=name)
    if adapters and len(adapters) > limits.max_adapters:
        raise InvalidParameter(f"'lora' names {len(adapters)} adapters; this server takes at most "
                               f"{limits.max_adapters} per request (--max-adapters)", param="lora")
    caps = limits.family(pipeline)
    family = pipeline or "this model"
    for name in ("height", "width"):
        value = params.get(name)
        if isinstance(value, int) and value > caps["max_side"]:
            raise InvalidParameter(f"{name!r} {value} is over {caps['max_side']}, the largest side {family} "
                                   f"takes here (--max-side)", param=name)
    frames = params.get("num_frames")
    if isinstance(frames, int) and frames > caps["max_frames"]:
        raise InvalidParameter(f"'num_frames' {frames} is over {caps['max_frames']}, the most {family} takes "
                               f"here (--max-frames)", param="num_frames")
    sizes = {k: params.get(k, defaults.get(k)) for k in ("height", "width", "num_frames", "num_inference_steps")}
    sizes["num_frames"] = sizes["num_frames"] or 1
    if all(isinstance(v, int) for v in sizes.values()):
        work = sizes["height"] * sizes["width"] * sizes["num_frames"] * sizes["num_inference_steps"]
        if work > caps["max_work"]:
            given = [k for k in ("num_inference_steps", "num_frames", "height", "width") if k in params]
            raise InvalidParameter(
                f"height x width x num_frames x num_inference_steps = {sizes['height']}x{sizes['width']}x"
                f"{sizes['num_frames']}x{sizes['num_inference_steps']} = {work:.3g} is over the work budget "
                f"{caps['max_work']:.3g} for {family} (--max-work); ask for fewer steps, frames or pixels",
                param=given[0] if given else "num_inference_steps")

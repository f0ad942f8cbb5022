"""Generation parameter validation, per pipeline, before any work starts.

One table (``FIELDS``) says the type and range of every generation field; a pipeline
spec says which of them its requests may carry. Each rejection names the field.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import families
from .errors import InvalidParameter
from .families import PipelineSpec


@dataclass(frozen=True)
class Field:
    kind: type | tuple
    check: Callable[[Any], bool] | None = None
    rule: str = ""


def _positive(v) -> bool:
    return v > 0


def _one_of(choices) -> str:
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


IMG2IMG_STRENGTH = 0.75  # img2img's strength when a request gives an image and no strength (A1111's default)

MAX_BATCH_SIZE = 8  # images in one batched call at most (the HTTP API's n is at most 8 too)

FIELDS: dict[str, Field] = {
    "prompt": Field(str, lambda v: v.strip() != "", "a non-empty string"),
    "negative_prompt": Field((str, type(None))),
    "seed": Field(int, lambda v: -1 <= v < 2**63, "an integer in [0, 2^63), or -1 for a random one"),
    "height": Field(int, _positive, "a positive integer"),
    "width": Field(int, _positive, "a positive integer"),
    "num_inference_steps": Field(int, lambda v: 1 <= v <= 1000, "an integer in [1, 1000]"),
    "num_frames": Field(int, _positive, "a positive integer"),
    "fps": Field(int, lambda v: 1 <= v <= 120, "an integer in [1, 120]"),
    "guidance_scale": Field(float, lambda v: 0 <= v <= 100, "a number in [0, 100]"),
    "guidance_scale_2": Field(float, lambda v: 0 <= v <= 100, "a number in [0, 100]"),
    "true_cfg_scale": Field(float, lambda v: 0 <= v <= 100, "a number in [0, 100]"),
    "boundary_ratio": Field(float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "flow_shift": Field(float, lambda v: 0 < v <= 100, "a number in (0, 100]"),
    "sample_solver": Field(str, lambda v: v in ("euler", "unipc"), "'euler' or 'unipc'"),
    "max_sequence_length": Field(int, lambda v: 1 <= v <= 4096, "an integer in [1, 4096]"),
    # an input image: a PIL image, or a path to one
    "image": Field(object, None, "an image"),
    # img2img: how far from the input image (1: all the way, as text-to-image would)
    "strength": Field(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    # MiniMax-H3
    "task_type": Field(str, lambda v: v in families.task_types(), _one_of(families.task_types())),
    "audio_flow_shift": Field(float, lambda v: 0 < v <= 100, "a number in (0, 100]"),
    "last_image": Field(object, None, "an image"),
    "references": Field(object, None, "a list of images"),
    # the job's, not the pipeline's (``JOB_FIELDS``): how many compatible queued images may share one
    # pipeline call (backend/batch.py), A1111's "batch size"; the worker's cost model still decides
    "batch_size": Field(int, lambda v: 1 <= v <= MAX_BATCH_SIZE, f"an integer in [1, {MAX_BATCH_SIZE}]"),
}

IMAGE_FIELDS = ("image", "last_image")
#: request fields for the scheduler, never passed to a pipeline (``validate`` leaves them out)
JOB_FIELDS = ("batch_size",)


def validate(spec: PipelineSpec, request: dict, defaults: dict | None = None) -> dict:
    """Return the complete, checked parameter set for one generation.

    ``defaults`` (the model's or a preset's sampling defaults) fill what the request
    omits; ``None`` values in the request mean "use the default". ``JOB_FIELDS`` (a queued job's
    ``batch_size``) are the scheduler's: checked at submit, left out here.
    """
    request = {k: v for k, v in request.items() if k not in JOB_FIELDS}
    unknown = sorted(k for k in request if k not in spec.fields)
    if unknown:
        raise InvalidParameter(
            f"unknown field {unknown[0]!r} for {spec.class_name}; accepted fields: {', '.join(sorted(spec.fields))}",
            param=unknown[0])
    params = {k: v for k, v in {**spec.defaults, **(defaults or {})}.items() if k in spec.fields}
    params.update({k: v for k, v in request.items() if v is not None})
    for name, value in list(params.items()):
        params[name] = check_field(name, value)
    _size_from_image(spec, params, request)
    for name in sorted(spec.required):
        if params.get(name) is None:
            raise InvalidParameter(f"{name!r} is required for {spec.class_name}", param=name)
    check_img2img(spec, params)
    if spec.img2img and params.get("image") is not None:
        params.setdefault("strength", IMG2IMG_STRENGTH)  # (any strength > 0 runs at least one step)
    check_shape(spec, params)
    if params.get("seed") in (None, -1):  # -1: random, as in A1111 (the seed used is in the metadata)
        params["seed"] = random.randrange(2**31)
    return params


def check_img2img(spec: PipelineSpec, params: dict) -> None:
    """A strength needs an input image to move from (checked at submit and again by the worker)."""
    if spec.img2img and params.get("strength") is not None and params.get("image") is None:
        raise InvalidParameter("'strength' is how far img2img moves from its input image: give 'image' too "
                               "(or leave 'strength' out for text-to-image)", param="strength")


def img2img_steps(params: dict) -> int:
    """How many of ``num_inference_steps`` an img2img request runs: diffusers' ``get_timesteps`` skips the
    first ``steps - int(steps x strength)``; a request with no input image runs them all."""
    steps = params.get("num_inference_steps")
    if steps is None or params.get("image") is None or params.get("strength") is None:
        return steps
    return steps - int(max(steps - min(steps * params["strength"], steps), 0))


def check_field(name: str, value):
    """One field's value checked (type, range) and normalized; unknown names pass through as they are."""
    field = FIELDS.get(name)
    if field is None:
        return value
    if name in IMAGE_FIELDS:
        return _image(value, name)
    if name == "references":
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_image(v, "references") for v in items]
    if field.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    kinds = field.kind if isinstance(field.kind, tuple) else (field.kind,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise InvalidParameter(f"{name!r} must be {field.rule or kinds[0].__name__}, got {value!r}", param=name)
    if field.check is not None and value is not None and not field.check(value):
        raise InvalidParameter(f"{name!r} must be {field.rule}, got {value!r}", param=name)
    return value


def _size_from_image(spec: PipelineSpec, params: dict, request: dict) -> None:
    """Image-to-video and img2img: height and width the request left unset follow the input image's aspect
    ratio, keeping the default's pixel count and the model's size multiple."""
    import math

    from PIL import Image

    image = params.get("image")
    if not isinstance(image, Image.Image) or not (str(getattr(spec, "output", "")).startswith("video")
                                                  or getattr(spec, "img2img", None)):
        return
    if not {"height", "width"} <= set(spec.fields):
        return
    given = {k for k in ("height", "width") if request.get(k) is not None}
    if given == {"height", "width"} or not params.get("height") or not params.get("width"):
        return
    m, aspect = spec.size_multiple, image.width / image.height
    snap = lambda v: max(m, int(round(v / m)) * m)  # noqa: E731
    if given == {"height"}:
        params["width"] = snap(params["height"] * aspect)
    elif given == {"width"}:
        params["height"] = snap(params["width"] / aspect)
    else:
        area = params["height"] * params["width"]
        params["height"], params["width"] = snap(math.sqrt(area / aspect)), snap(math.sqrt(area * aspect))


def check_shape(spec: PipelineSpec, params: dict) -> None:
    """Height and width a multiple of the pipeline's size multiple; frames its 4k+1 rule (those given)."""
    m = spec.size_multiple
    for name in ("height", "width"):
        if name in params and params[name] % m:
            raise InvalidParameter(
                f"{name!r} must be a multiple of {m} for {spec.class_name} (VAE factor x patch size), "
                f"got {params[name]}", param=name)
    frames = params.get("num_frames")
    if spec.frame_multiple and frames is not None and (frames - 1) % spec.frame_multiple:
        raise InvalidParameter(
            f"'num_frames' must be {spec.frame_multiple}k+1 (e.g. 9, 17, 81) for {spec.class_name}, got {frames}",
            param="num_frames")


def _image(value, name: str = "image"):
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise InvalidParameter(f"{name!r} file {str(path)!r} does not exist", param=name)
        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except Exception as exc:  # noqa: BLE001 - PIL on untrusted bytes; its text carries the server's path
            raise InvalidParameter(f"{name!r} is not an image this can read ({path.name}: "
                                   f"{type(exc).__name__}; PNG, JPEG or WebP)", param=name) from None
    raise InvalidParameter(f"{name!r} must be an image or a path to one, got {type(value).__name__}",
                           param=name)

"""Named Gradio API endpoints for ``gradio_client``: /generate, /list_adapters,
/list_presets, /apply_preset, /cancel.

``/generate`` takes keyword arguments named like the HTTP API's fields, plus
``adapters`` (a JSON list of {"name", "scale"}), and returns the output file and its
metadata. Its inputs are hidden components so the client downloads the file like
any Gradio output.
"""
from __future__ import annotations

import asyncio
import json

import gradio as gr
from anyio import to_thread

from .views import readable


def _fail(exc: BaseException):
    raise gr.Error(readable(exc), print_exception=False) from None


def plain(obj):
    """JSON for gradio_client: it downloads any dict with a "path" key as a file, so the
    library's and presets' paths travel as "local_path" (the HTTP API's alias for it)."""
    if isinstance(obj, dict):
        return {("local_path" if k == "path" else k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


def parse_adapters(value) -> list[dict]:
    """A list of {"name", "scale"} given as a list or its JSON text."""
    if value in (None, "", []):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise gr.Error(f"adapters: not valid JSON ({exc.msg} at column {exc.colno})", print_exception=False)
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(a, dict) and a.get("name") for a in value):
        raise gr.Error('adapters: expected a list of {"name": ..., "scale": ...} objects', print_exception=False)
    return [{"name": a["name"], "scale": a.get("scale", 1.0)} for a in value]


def build(studio) -> None:
    async def generate(request: gr.Request, prompt: str, negative_prompt: str | None = None, seed: int | None = None,
                 height: int | None = None, width: int | None = None, num_inference_steps: int | None = None,
                 true_cfg_scale: float | None = None, guidance_scale: float | None = None,
                 guidance_scale_2: float | None = None, boundary_ratio: float | None = None,
                 flow_shift: float | None = None, sample_solver: str | None = None, num_frames: int | None = None,
                 fps: int | None = None, task_type: str | None = None, image: str | None = None,
                 adapters: list | str | None = None, model: str | None = None, preset: str | None = None):
        """Generate one image or video; returns (output file, metadata). It waits on the event loop
        (Studio.wait_async), so a waiting call holds none of the server's worker threads."""
        fields = dict(negative_prompt=negative_prompt, seed=seed, height=height, width=width,
                      num_inference_steps=num_inference_steps, true_cfg_scale=true_cfg_scale,
                      guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                      boundary_ratio=boundary_ratio, flow_shift=flow_shift, sample_solver=sample_solver,
                      num_frames=num_frames, fps=fps, task_type=task_type, image=image)
        params = {"prompt": prompt, **{k: v for k, v in fields.items() if v not in (None, "")}}
        mine = studio.of(request)
        try:
            job = await to_thread.run_sync(mine.submit, "generate", params, parse_adapters(adapters),
                                           preset or None, model or None)
        except gr.Error:
            raise
        except Exception as exc:
            _fail(exc)
        try:
            job = await mine.wait_async(job["id"])
        except asyncio.CancelledError:  # the caller went away (cancel, disconnect): stop the work too
            try:
                mine.cancel(job["id"])
            except Exception:  # already finished or gone: nothing left to stop
                pass
            raise
        except Exception as exc:
            _fail(exc)
        if job.get("status") != "succeeded":
            raise gr.Error(f"job {job['id']} {job.get('status')}: {job.get('error') or 'no reason given'}",
                           print_exception=False)
        return job["result"]["path"], plain(job["result"]["metadata"])

    with gr.Column(visible=False):
        inputs = [gr.Textbox(label="prompt"), gr.Textbox(label="negative_prompt", value=None),
                  gr.Number(label="seed", value=None, precision=0)]
        inputs += [gr.Number(label=n, value=None, precision=0) for n in ("height", "width", "num_inference_steps")]
        inputs += [gr.Number(label=n, value=None) for n in
                   ("true_cfg_scale", "guidance_scale", "guidance_scale_2", "boundary_ratio", "flow_shift")]
        inputs += [gr.Textbox(label="sample_solver", value=None)]
        inputs += [gr.Number(label=n, value=None, precision=0) for n in ("num_frames", "fps")]
        inputs += [gr.Textbox(label="task_type", value=None), gr.Image(label="image", type="filepath"),
                   gr.JSON(label="adapters", value=None), gr.Textbox(label="model", value=None),
                   gr.Textbox(label="preset", value=None)]
        outputs = [gr.File(label="output"), gr.JSON(label="metadata")]
        trigger = gr.Button()
    trigger.click(generate, inputs, outputs, api_name="generate", concurrency_limit=None)

    def list_adapters() -> list[dict]:
        """The adapter library, with each adapter's fit for the loaded model."""
        try:
            return plain(studio.adapters())
        except Exception as exc:
            _fail(exc)

    def list_presets() -> list[dict]:
        """Distill presets and which of their files are present."""
        try:
            return plain(studio.presets())
        except Exception as exc:
            _fail(exc)

    def apply_preset(preset_id: str) -> dict:
        """Fuse a preset into the base weights ("" or "base" restores the base)."""
        try:
            if preset_id in ("", "base", None):
                return plain(studio.restore_base() or {})
            return plain(studio.apply_preset(preset_id) or {})
        except Exception as exc:
            _fail(exc)

    def cancel(job_id: str, request: gr.Request) -> dict:
        """Cancel a queued or running job (one of the caller's own, unless an admin)."""
        try:
            return plain(studio.of(request).cancel(job_id))
        except Exception as exc:
            _fail(exc)

    for fn in (list_adapters, list_presets, apply_preset, cancel):
        gr.api(fn, api_name=fn.__name__, concurrency_limit=None)

"""The Generate tab's result view: a finished job's image or video, metadata and infotext, and
sending it onward (its seed to the seed field, the image to an image-to-video model)."""
from __future__ import annotations

from pathlib import Path

import gradio as gr

from .server_state import models_by_id
from .views import ModelInfo, error_html, job_label, ok_html, readable


def result_updates(job: dict, m: ModelInfo) -> list:
    """[image, video, metadata, infotext] updates for a finished job."""
    from backend.service import infotext

    result = job.get("result") or {}
    path, meta = result.get("path"), result.get("metadata")
    if job.get("status") != "succeeded" or not path:
        return [gr.update(), gr.update(), meta or gr.update(), gr.update()]
    video = str(path).endswith(".mp4")
    return [gr.update(value=None if video else path, visible=not video),
            gr.update(value=path if video else None, visible=video), meta,
            infotext(meta) if isinstance(meta, dict) else ""]


def i2v_model(models: dict[str, ModelInfo], current: str | None) -> str | None:
    """Where "send to image-to-video" goes: the shown model if it takes an input image for a video,
    else the first image-to-video model offered (by its spec, else by an ``i2v`` in its id)."""
    m = models.get(current)
    if m is not None and m.mode == "image-to-video":
        return m.id
    return next((x.id for x in models.values() if x.mode == "image-to-video"),
                next((x.id for x in models.values() if "i2v" in x.id.lower()), None))


def wire_send(studio, t, reuse, to_i2v) -> None:
    """Send the shown result onward: its seed into the seed field, or the image (a video's last frame)
    into an image-to-video model's input image, switching to that model first."""
    def shown(watch) -> str:
        job_id = (watch or {}).get("shown")
        if not job_id:
            raise gr.Error("no result yet: generate one first", print_exception=False)
        return job_id

    def reuse_seed(request: gr.Request, watch):
        job = studio.of(request).job(shown(watch))
        seed = ((job.get("result") or {}).get("metadata") or {}).get("seed", (job.get("params") or {}).get("seed"))
        return seed, ok_html(f"seed {seed} (from job {job_label(job)})")

    reuse.click(reuse_seed, t.watch, [t.seed, t.status], api_visibility="private", queue=False)

    def pick(request: gr.Request, watch, model_id):
        try:
            info = studio.of(request).result_image(shown(watch))
        except gr.Error:
            raise
        except Exception as exc:
            raise gr.Error(readable(exc), print_exception=False) from None
        target = i2v_model(models_by_id(studio), model_id)
        if target is None:
            raise gr.Error("no image-to-video model is offered here: start the server with one, e.g. "
                           "python app.py serve Wan-AI/Wan2.2-I2V-A14B-Diffusers", print_exception=False)
        return gr.update(value=target), info["path"]

    def fill(path, model_id, switched):
        """The image into the model's input; the switch's own note (loaded, a preset unfused, adapters
        removed) stays above this one."""
        m = models_by_id(studio).get(model_id)
        if m is None or "image" not in m.fields:
            return gr.update(), (switched or "") + error_html(f"{model_id} takes no input image")
        return gr.update(value=path, visible=True), (switched or "") + ok_html(
            f"sent {Path(path).name} to {model_id} as its input image (image)")

    to_i2v.click(pick, [t.watch, t.model], [t.model, t.pending_image], api_visibility="private", queue=False) \
        .success(t.switch, [t.model], t.switch_outputs, api_visibility="private", concurrency_limit=None) \
        .success(**t.fit_after_switch) \
        .success(fill, [t.pending_image, t.model, t.status], [t.widgets["image"], t.status],
                 api_visibility="private")

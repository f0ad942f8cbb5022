"""The Settings tab: the application's settings (``backend/preferences.py``), saved in the data dir.

Default model (what ``python app.py serve`` loads when none is named), the Generate tab's size and
steps for image models, the output format and file name pattern of results, live previews and
notifications. Every value is read when the page loads (so a second browser, or a restart, shows what
was saved); *Save* checks them all on the server and names the first wrong one. The page's own script
reads the notification switch from ``#ls-prefs`` (a hidden element outside the tabs).
"""
from __future__ import annotations

import gradio as gr

from backend.errors import InvalidParameter
from backend.service import FILENAME_TOKENS as TOKENS, Preferences, preferred_filename as filename
from backend.service import check_preferences as check

from .views import error_html, ok_html, readable

EMBEDDED = "(the embedded default)"
EXAMPLE = {"created": "2026-12-07T14:50:00Z", "seed": 42, "model": "demo:qwen-image", "job_id": "3f2a9c1e7b6d4a50",
           "job_number": 12, "params": {"prompt": "a red fox in the snow, ink drawing"}}


def saved(studio) -> dict:
    """The server's saved settings (the defaults for a UI built with no Studio, as ``build_ui`` checks do)."""
    return studio.preferences() if studio is not None else Preferences().model_dump()


def prefs_html(prefs: dict) -> str:
    """What the page's script reads: the notification and preview switches."""
    on = lambda key: "on" if prefs.get(key) else "off"  # noqa: E731
    return (f'<div id="ls-prefs-data" hidden data-notifications="{on("notifications")}" '
            f'data-previews="{on("live_previews")}"></div>')


def example_name(pattern: str, output_format: str) -> str:
    """The file name a result would get, for the pattern as typed (or why the pattern cannot be used)."""
    try:
        prefs = check({"filename_pattern": pattern or "", "output_format": output_format or "png"})
    except InvalidParameter as exc:  # shown as the reason; Save names it again
        return f"⚠ {exc.message}"
    return f"e.g. `{filename(prefs, EXAMPLE, prefs.suffix)}` (an 8-character tail unless {{id}} is in it)"


def build(studio, prefs_box: gr.HTML) -> None:
    def current() -> dict:
        return saved(studio)
    gr.Markdown("The application's settings, kept in the data directory (`preferences.json`), so a restart or "
                "another browser keeps them. Blank numbers: each model's own default.")
    with gr.Row():
        model = gr.Dropdown(label="Default model (what python app.py serve loads when it names none)",
                            choices=[EMBEDDED], value=lambda: current()["default_model"] or EMBEDDED,
                            allow_custom_value=True, elem_id="set-default-model")
    with gr.Row():
        width = gr.Number(label="Width for image models", value=lambda: current()["width"], precision=0, step=16,
                          elem_id="set-width")
        height = gr.Number(label="Height for image models", value=lambda: current()["height"], precision=0,
                           step=16, elem_id="set-height")
        steps = gr.Number(label="Steps for image models", value=lambda: current()["steps"], precision=0,
                          elem_id="set-steps")
    with gr.Row():
        fmt = gr.Radio(["png", "jpeg", "webp"], label="Output format (images; the settings ride in each file)",
                       value=lambda: current()["output_format"], elem_id="set-format")
        pattern = gr.Textbox(label="File name pattern", value=lambda: current()["filename_pattern"],
                             info="tokens: " + ", ".join(f"{{{t}}}" for t in TOKENS), elem_id="set-pattern")
    example = gr.Markdown(value=lambda: example_name(current()["filename_pattern"], current()["output_format"]),
                          elem_id="set-example")
    with gr.Row():
        previews = gr.Checkbox(label="Live previews of running jobs", value=lambda: current()["live_previews"],
                               elem_id="set-previews")
        notify = gr.Checkbox(label="Notify (title and browser notification) when a job ends",
                             value=lambda: current()["notifications"], elem_id="set-notify")
    save = gr.Button("Save settings", variant="primary", elem_id="set-save")
    status = gr.HTML(elem_id="set-status")

    def models():
        return gr.update(choices=[EMBEDDED, *(m["id"] for m in studio.models())])

    model.focus(models, None, model, api_visibility="private", queue=False)
    for box in (pattern, fmt):
        box.change(example_name, [pattern, fmt], example, api_visibility="private", queue=False)

    def number(value):
        return None if value in (None, "") else int(value)

    def on_save(request: gr.Request, model_id, w, h, n, output_format, name_pattern, live, notifications):
        data = {"default_model": None if model_id in (None, "", EMBEDDED) else model_id, "width": number(w),
                "height": number(h), "steps": number(n), "output_format": output_format,
                "filename_pattern": name_pattern or "", "live_previews": bool(live),
                "notifications": bool(notifications)}
        try:
            saved = studio.of(request).set_preferences(data)
        except Exception as exc:
            return error_html(readable(exc)), gr.update()
        return (ok_html("saved: image results are named and written this way from the next job; the size and "
                        "steps fill the Generate tab's fields when a model loads or the page reloads"),
                prefs_html(saved))

    save.click(on_save, [model, width, height, steps, fmt, pattern, previews, notify], [status, prefs_box],
               api_visibility="private")

"""The Gallery tab: past outputs with their parameters; "use these settings" sends them
back to Generate, and dropping a PNG made here restores its settings."""
from __future__ import annotations

from pathlib import Path

import gradio as gr


from . import views
from .generate import GenerateTab
from .views import error_html, readable


def build(studio, gen: GenerateTab, tabs: gr.Tabs):
    refresh = gr.Button("Refresh", elem_id="gallery-refresh")
    items = gr.State([])
    chosen = gr.State(None)
    with gr.Row():
        with gr.Column(scale=3):
            gallery = gr.Gallery(label="Outputs (newest first)", columns=6, height=420, allow_preview=True,
                                 elem_id="gallery", interactive=False)
        with gr.Column(scale=2):
            meta = gr.JSON(label="Parameters", elem_id="gallery-meta")
            use = gr.Button("Use these settings", variant="primary", elem_id="gallery-use")
            drop = gr.File(label="…or drop a PNG made here", file_types=[".png"], type="filepath",
                           elem_id="gallery-drop")
            status = gr.HTML(elem_id="gallery-status")

    def listing():
        try:
            outs = studio.outputs(limit=200)
        except Exception as exc:
            return [], [], error_html(readable(exc))
        shown = [(o["path"], Path(o["path"]).name) for o in outs]
        return shown, outs, ""

    refresh.click(listing, None, [gallery, items, status], api_visibility="private")

    def select(outs, evt: gr.SelectData):
        if evt is None or evt.index is None or evt.index >= len(outs):
            return None, None
        m = outs[evt.index].get("metadata") or {}
        return m, views.settings_from_metadata(m)

    gallery.select(select, items, [meta, chosen], api_visibility="private")

    def from_png(path):
        if not path:
            return None, None, ""
        try:
            m = studio.read_settings(path)
        except Exception as exc:
            return None, None, error_html(f"{Path(path).name} is not a readable PNG ({readable(exc)})")
        if not m:
            return None, None, error_html(f"{Path(path).name} carries no LoRA Studio settings "
                                          f"(only PNGs made here do)")
        return m, views.settings_from_metadata(m), ""

    def to_model(settings):
        if not settings:  # stops the chain below (it runs .success only)
            raise gr.Error("choose an output (or drop a PNG made here) first")
        return gr.update(value=settings.get("model")), gr.Tabs(selected="generate")

    restore = (lambda settings, model_id: gen.restore_updates(studio, settings, model_id))
    def restore_chain(event):
        event.success(to_model, chosen, [gen.model, tabs], api_visibility="private") \
            .success(gen.switch, [gen.model, gen.stack], gen.switch_outputs, api_visibility="private") \
            .success(restore, [chosen, gen.model], gen.restore_outputs(), api_visibility="private")

    restore_chain(use.click(lambda: None, None, None, api_visibility="private", queue=False))
    restore_chain(drop.upload(from_png, drop, [meta, chosen, status], api_visibility="private"))
    return listing, [gallery, items, status]

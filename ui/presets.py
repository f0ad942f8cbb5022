"""The Presets tab: a card per preset (files present or missing), apply / restore base,
and the fused state with its checksums."""
from __future__ import annotations

import gradio as gr

from . import views
from .views import error_html, ok_html, readable


def build(studio):
    with gr.Row():
        refresh = gr.Button("Refresh", scale=0, elem_id="presets-refresh")
        status = gr.HTML(elem_id="presets-status")
    cards = gr.HTML(elem_id="presets-cards")
    with gr.Row():
        pick = gr.Dropdown(label="Preset", choices=[], elem_id="presets-pick", scale=3)
        apply_btn = gr.Button("Apply (fuse into the base)", variant="primary", elem_id="presets-apply", scale=1)
        restore = gr.Button("Restore base", elem_id="presets-restore", scale=1)
    fused = gr.JSON(label="Fused state (component checksums before / after)", elem_id="presets-fused")

    def listing(message: str = ""):
        try:
            presets, system = studio.presets(), studio.system()
        except Exception as exc:
            return [gr.update(), gr.update(), gr.update(), error_html(readable(exc))]
        state = system.get("fused")
        return [views.preset_cards_html(presets, state), gr.update(choices=[p["id"] for p in presets]),
                state, message]

    outs = [cards, pick, fused, status]
    refresh.click(listing, None, outs, api_visibility="private")

    def apply(preset_id):
        if not preset_id:
            return listing(error_html("choose a preset first"))
        try:
            studio.apply_preset(preset_id)
        except Exception as exc:
            return listing(error_html(readable(exc)))
        return listing(ok_html(f"applied {preset_id}"))

    def base():
        try:
            studio.restore_base()
        except Exception as exc:
            return listing(error_html(readable(exc)))
        return listing(ok_html("restored the base weights"))

    apply_btn.click(apply, pick, outs, api_visibility="private")
    restore.click(base, None, outs, api_visibility="private")
    return listing, outs

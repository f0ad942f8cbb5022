"""The System tab: device, dtype, memory, LoRA cache tiers and counters, fused state, versions."""
from __future__ import annotations

import gradio as gr

from . import views
from .views import error_html, readable


def summary_markdown(s: dict) -> str:
    mem = s.get("memory") or {}
    cache = s.get("cache") or s.get("lora_cache") or {}
    lines = [f"**Device** `{s.get('device', '?')}` · **dtype** `{s.get('dtype', '?')}` · "
             f"**model** `{s.get('model', '?')}` · **queue depth** {s.get('queue_depth', '?')}"]
    if mem:
        lines.append("**Memory** " + " · ".join(f"{k}: {views.human_bytes(v) if isinstance(v, (int, float)) else v}"
                                                for k, v in mem.items()))
    if isinstance(cache, dict) and cache:
        lines.append("**LoRA cache** " + " · ".join(f"{k}: {v}" for k, v in cache.items()
                                                    if not isinstance(v, (dict, list))))
    fused = s.get("fused")
    lines.append(f"**Fused** {fused.get('preset') or 'base weights' if isinstance(fused, dict) else fused or 'base weights'}")
    versions = s.get("versions") or {}
    if versions:
        lines.append("**Versions** " + " · ".join(f"{k} {v}" for k, v in versions.items()))
    return "\n\n".join(lines)


def build(studio):
    refresh = gr.Button("Refresh", elem_id="system-refresh")
    summary = gr.Markdown(elem_id="system-summary")
    raw = gr.JSON(label="Everything the backend reports", elem_id="system-json")

    def show():
        try:
            s = studio.system()
        except Exception as exc:
            return error_html(readable(exc)), None
        return summary_markdown(s), s

    refresh.click(show, None, [summary, raw], api_visibility="private")
    return show, [summary, raw]

"""What the server offers and has now, as the Generate tab shows it: the models and their fields,
the adapters that fit, the presets, the fused badge and the fields a fused preset fixes."""
from __future__ import annotations

import gradio as gr

from . import views
from .fields import WIDGETS
from .views import ModelInfo, error_html, readable

NO_PRESET = "(none: base weights)"


PREFERRED = {"width": "width", "height": "height", "steps": "num_inference_steps"}  # setting -> field


def models_by_id(studio) -> dict[str, ModelInfo]:
    """The models offered, each with the defaults the Generate tab fills in: the model's own, with the
    Settings tab's size and steps over them on image models (a video model keeps its own frame size)."""
    prefs = studio.preferences()
    preferred = {f: prefs[k] for k, f in PREFERRED.items() if prefs.get(k) is not None}
    models = {}
    for d in studio.models():
        m = ModelInfo.from_dict(d)
        if preferred and not m.is_video:
            m.defaults.update({f: v for f, v in preferred.items() if f in m.fields})
        models[m.id] = m
    return models


def model_choices(studio) -> list[tuple[str, str]]:
    return [(f"{m.id}  (loaded)" if m.loaded else m.id, m.id) for m in models_by_id(studio).values()]



def two_stage_of(studio, model_id) -> bool:
    """Whether the model has two denoisers (Wan2.2: per-transformer weights)."""
    return models_by_id(studio).get(model_id, ModelInfo(id="")).two_stage


def field_updates(m: ModelInfo | None, values: dict | None = None, *, reset: bool = True,
                  locked: dict[str, str] | None = None) -> list:
    """Show the widgets the model has; fill them from ``values`` or the model's defaults. With ``locked``
    (field -> reason: what a fused preset fixes) those fields are read-only with the reason as their hint
    and every other one is editable again; without it, editability is left as it is."""
    updates = []
    for w in WIDGETS:
        has = m is not None and w.name in m.fields
        if not has:
            updates.append(gr.update(visible=False, value=None))
            continue
        shown = {"visible": True}
        if w.kind in ("int", "float", "text", "choice"):  # the hint as this model's pipeline reads the field
            shown["info"] = w.info_for(m.pipeline) or None
        elif w.kind == "image":  # an image box has no hint line: its label says what the model does with it
            shown["label"] = f"{w.label} · {w.info_for(m.pipeline)}" if w.info_for(m.pipeline) else w.label
        if locked is not None and w.kind != "image":
            shown["interactive"] = w.name not in locked
            if w.name in locked:
                shown["info"] = locked[w.name]
        if values is not None and w.name in values and w.kind != "image":
            updates.append(gr.update(**shown, value=values[w.name]))
        elif reset and w.kind != "image":
            updates.append(gr.update(**shown, value=m.defaults.get(w.name)))
        else:
            updates.append(gr.update(**shown))
    return updates


def unknown_model_message(model_id, models: dict) -> str:
    """A typed model name the server does not offer: say which it offers and how to get another."""
    offered = ", ".join(models) or "none"
    return (f"model {model_id!r} is not available on this server (it offers: {offered}). To use another "
            f"model, download it (huggingface-cli download ORG/NAME) or point at a local diffusers "
            f"directory, and start the server with it: python app.py serve ORG/NAME")


def adapter_pick_updates(studio) -> list:
    try:
        choices, note = views.adapter_choices(studio.adapters())
    except Exception as exc:
        return [gr.update(choices=[], value=None), error_html(readable(exc))]
    return [gr.update(choices=choices, value=choices[0][1] if choices else None), note]


def badge_html(preset_id: str | None) -> str:
    """Where you generate: what the server has fused into the base weights now."""
    import html

    if preset_id:
        return (f'<span class="ls-badge" data-preset="{html.escape(preset_id)}">fused: '
                f'{html.escape(preset_id)}</span>')
    return '<span class="ls-badge ls-badge-base" data-preset="">base weights (no preset fused)</span>'


def preset_choices(studio, model_id: str | None = None) -> list[str]:
    """The presets made for the loaded model (all of them when none names it)."""
    try:
        presets = studio.presets()
    except Exception:
        return [NO_PRESET]
    model_id = model_id or studio.current_model()
    return [NO_PRESET] + [p["id"] for p in presets if not p.get("models") or model_id in p["models"]]


def preset_contract(studio, preset_id: str | None) -> tuple[dict, dict]:
    """A preset's sampling defaults and the fields it fixes (its requirements): ({}, {}) for none."""
    if not preset_id:
        return {}, {}
    try:
        row = next((p for p in studio.presets() if p.get("id") == preset_id), {})
    except Exception:
        return {}, {}
    return dict(row.get("defaults") or {}), dict(row.get("requirements") or {})


def locked_reasons(preset_id: str | None, requirements: dict) -> dict[str, str]:
    """field -> why it is locked, for the fields a fused preset fixes."""
    return {name: f"{value}: set by the fused preset {preset_id} (its distilled LoRA is trained for it; "
                  f"restore the base weights to change it)" for name, value in requirements.items()}

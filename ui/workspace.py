"""The workspace survives a reload: what the Generate tab holds (prompt, seed, the fields, the LoRA
stack) and the open tab are kept in the browser's localStorage (``gr.BrowserState``, encrypted with
a key kept in the data dir, so a server restart can still read it) and put back when the page loads.

What comes back from the browser is the user's own input, but it is read as untrusted: only known
fields of the right kind, at most ``MAX_LORAS`` adapters, only adapters that fit the loaded model,
and the fields only when the loaded model is the one they were typed for. A page saves nothing until
it has restored (its first field updates are the model's defaults, which would overwrite the saved
workspace).
"""
from __future__ import annotations

import math
import os
import secrets
from pathlib import Path

import gradio as gr

from . import views
from .fields import WIDGETS
from .stack import EDIT as STACK_EDIT

STORAGE_KEY = "lora-studio-workspace"
SECRET_FILE = "ui-browser-state.key"
MAX_TEXT = 20_000  # a saved prompt longer than this is not put back (the server's prompt limit is lower)
TABS = ("generate", "compare", "xyz", "adapters", "presets", "queue", "gallery", "system", "settings")
RESTORED_JS = "() => { document.body.dataset.workspace = 'restored'; }"
SAVED_FIELDS = tuple(w for w in WIDGETS if w.kind != "image")  # an upload's temporary path would not outlive it


def secret(data_dir) -> str:
    """The key the workspace is encrypted with, made once per data dir (owner-only)."""
    path = Path(data_dir) / SECRET_FILE
    try:
        text = path.read_text().strip()
        if len(text) >= 32:
            return text
    except OSError:
        pass
    text = secrets.token_hex(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return text


def state(data_dir, key: str = STORAGE_KEY, default=None) -> gr.BrowserState:
    """One localStorage entry; with no data dir (a UI built without a Studio) a key for this run only."""
    return gr.BrowserState(default, storage_key=key, secret=secret(data_dir) if data_dir else None)


def snapshot(armed, model_id, prompt, seed, stack, *values) -> dict:
    """The workspace as the tab holds it now (``gr.update()`` until the page has restored): ``values`` are
    the rows' weight boxes (``GenerateTab.weight_inputs``) then the fields. The whole object each time: a
    merge with the stored one could write back a value read before another write."""
    from .stack import MAX_LORAS, stack_as_shown

    if not armed:
        return gr.update()
    weights, values = values[:4 * MAX_LORAS], values[4 * MAX_LORAS:]
    fields = {w.name: v for w, v in zip(SAVED_FIELDS, values) if v is not None}
    return {"model": model_id, "prompt": prompt, "seed": seed, "fields": fields,
            "stack": stack_as_shown(stack, weights)}


def _number(value, kind: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if kind == "int" else value


def clean_fields(fields) -> dict:
    """The saved fields a widget can take back: numbers for number fields, text for text, a listed choice."""
    out = {}
    if not isinstance(fields, dict):
        return out
    for w in SAVED_FIELDS:
        value = fields.get(w.name)
        if w.kind in ("int", "float"):
            value = _number(value, w.kind)
        elif w.kind == "text":
            value = value if isinstance(value, str) and len(value) <= MAX_TEXT else None
        elif w.kind == "choice":
            value = value if value in w.choices else None
        if value is not None:
            out[w.name] = value
    return out


def clean_stack(stack, fits: set[str], limit: int) -> tuple[list[dict], list[str]]:
    """The saved LoRA stack rows (well-formed, at most ``limit``) whose adapter fits; and the names left out."""
    kept, left = [], []
    for e in (stack if isinstance(stack, list) else [])[:limit]:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            continue
        if e["name"] not in fits:
            left.append(e["name"])
            continue
        row = {"name": e["name"], "split": bool(e.get("split")), "scale": _number(e.get("scale"), "float")}
        for key in ("high", "low"):  # the split boxes start from the shared weight
            value = _number(e.get(key), "float")
            row[key] = row["scale"] if value is None else value
        schedule = e.get("schedule")
        if isinstance(schedule, str) and schedule.strip() and len(schedule) <= 2_000:
            row["schedule"] = schedule
        if row["name"] not in {r["name"] for r in kept}:
            kept.append(row)
    return kept, left


def restored_note(saved: dict, model_id: str, same_model: bool, adapters: int, left: list[str]) -> str:
    parts = ["restored your workspace: the prompt" + (", the fields" if same_model else "")
             + (f", {adapters} LoRA{'s' if adapters != 1 else ''}" if adapters else "")]
    if not same_model and saved.get("model"):
        parts.append(f"the fields were for {saved['model']}, so {model_id}'s defaults stay")
    if left:
        parts.append(f"left out (not in the library, or not fitting {model_id}): {', '.join(left)}")
    return views.ok_html("; ".join(parts))


def wire(studio, gen, tabs: gr.Tabs, tab_by_id: dict, loaded) -> gr.BrowserState:
    """Save the Generate tab's workspace and the open tab as they change; put them back after ``loaded``
    (the page's load event, which shows the server's model with its defaults)."""
    from .server_state import field_updates, models_by_id
    from .stack import MAX_LORAS, render_stack

    data_dir = getattr(studio, "data_dir", None)
    saved, open_tab = state(data_dir, default={}), state(data_dir, f"{STORAGE_KEY}-tab")  # apart: no race
    armed = gr.State(False)
    fields = [gen.widgets[w.name] for w in SAVED_FIELDS]

    def restore(ws, tab_id, model_id):
        ws = ws if isinstance(ws, dict) else {}
        tab = gr.Tabs(selected=tab_id) if tab_id in TABS else gr.update()
        keep = [gr.update()] * (2 + len(WIDGETS) + 1 + len(gen.row_outputs()) + 1)
        m = models_by_id(studio).get(model_id)
        prompt = ws.get("prompt") if isinstance(ws.get("prompt"), str) and len(ws["prompt"]) <= MAX_TEXT else ""
        if m is None or not (prompt or ws.get("stack")):
            return [True, *keep, tab]
        same = ws.get("model") == model_id
        try:
            fits = {value for _, value in views.adapter_choices(studio.adapters())[0]}
        except Exception:  # noqa: BLE001 - the library unreadable now: no adapters come back (said below)
            fits = set()
        stack, left = clean_stack(ws.get("stack"), fits, MAX_LORAS)
        seed = _number(ws.get("seed"), "int")
        return [True, prompt, seed if seed is not None else gr.update(),
                *field_updates(m, clean_fields(ws.get("fields")) if same else {}, reset=False),
                stack, *render_stack(stack, m.two_stage), restored_note(ws, model_id, same, len(stack), left), tab]

    loaded.then(restore, [saved, open_tab, gen.model],
                [armed, gen.prompt, gen.seed, *gen.field_outputs(), gen.stack, *gen.row_outputs(), gen.status,
                 tabs], **STACK_EDIT) \
        .then(None, None, None, js=RESTORED_JS, api_visibility="private")  # what a script (or test) waits on
    # what changes the workspace: the prompt, seed, model and fields; the stack's rows (a name is set when an
    # adapter is added, removed or moved; weights, split and "over steps" text as they are edited). The
    # stack state's own change event does not fire for an event's output here, so the rows stand for it.
    rows = [c for r in gen.rows for c in (r.name, r.split)] + gen.weight_inputs()
    gr.on([c.change for c in (gen.prompt, gen.seed, gen.model, *rows, *fields)], snapshot,
          [armed, gen.model, gen.prompt, gen.seed, gen.stack, *gen.weight_inputs(), *fields], saved,
          api_visibility="private", queue=False, trigger_mode="always_last", show_progress="hidden")
    for tab_id, tab in tab_by_id.items():  # (a page's load selects its first tab: not saved before restore)
        tab.select(lambda armed, tab_id=tab_id: tab_id if armed else gr.update(), armed, open_tab,
                   api_visibility="private", queue=False, show_progress="hidden")
    return saved

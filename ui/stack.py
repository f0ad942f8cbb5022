"""The Generate tab's LoRA stack: a fixed set of row slots over one ``gr.State`` list; rows are
shown, filled and hidden from that list, which keeps every widget stable for the browser (dynamic
re-rendering would rebuild them mid-job). Here: the list's conversions (to the facade's adapter
payload and back, a schedule as text), the rows' updates, the weight checks, and the rows' events."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from .server_state import model_choices, two_stage_of
from .views import error_html, fit_of, ok_html, readable

MAX_LORAS = 6


def adapter_payload(stack: list[dict], two_stage: bool) -> list[dict]:
    """The stack as the facade takes it: [{"name", "scale"}], scale per component when split; a
    row's "over steps" text (``1.0,0.8,0.5``, ``0.5->1.0`` or JSON: backend/lora/schedule.py) wins."""
    from backend.service import parse_scale_text as parse_text

    out = []
    for e in stack:
        if str(e.get("schedule") or "").strip():
            out.append({"name": e["name"], "scale": parse_text(e["schedule"], f"{e['name']}: weight over steps")})
        elif two_stage and e.get("split"):
            out.append({"name": e["name"], "scale": {"transformer": float(e["high"]),
                                                     "transformer_2": float(e["low"])}})
        else:
            out.append({"name": e["name"], "scale": float(e["scale"])})
    return out


def stack_from_payload(adapters: list[dict]) -> list[dict]:
    stack = []
    for a in adapters[:MAX_LORAS]:
        scale = a.get("scale", 1.0)
        text = schedule_text(scale)
        if text:
            stack.append({"name": a["name"], "scale": 1.0, "split": False, "high": 1.0, "low": 1.0,
                          "schedule": text})
        elif isinstance(scale, dict):
            hi, lo = float(scale.get("transformer", 1.0)), float(scale.get("transformer_2", 1.0))
            stack.append({"name": a["name"], "scale": hi, "split": True, "high": hi, "low": lo})
        else:
            s = float(scale)
            stack.append({"name": a["name"], "scale": s, "split": False, "high": s, "low": s})
    return stack


def schedule_text(scale) -> str:
    """A scale the weight boxes cannot show, as the "over steps" field's text ("" for a number or
    numbers per transformer): ``1.0,0.8,0.5``, ``0.5->1.0``, else JSON (weights per step or block, per text
    encoder)."""
    import json

    if isinstance(scale, list):
        return ",".join(f"{v:g}" for v in scale)
    if isinstance(scale, dict) and set(scale) == {"start", "end"}:
        return f"{scale['start']:g}->{scale['end']:g}"
    if isinstance(scale, dict) and (not all(isinstance(v, (int, float)) for v in scale.values())
                                    or not set(scale) <= {"transformer", "transformer_2"}):
        return json.dumps(scale)  # e.g. text-encoder weights apart: {"text_encoder": 0.5, "denoisers": 1}
    return ""


@dataclass
class StackRow:
    row: gr.Group
    name: gr.Textbox
    scale: gr.Number
    split: gr.Checkbox
    high: gr.Number
    low: gr.Number
    up: gr.Button
    down: gr.Button
    remove: gr.Button
    schedule: gr.Textbox = None  # the weight over steps / per block, as text (overrides the weight boxes)

    def outputs(self) -> list:
        return [self.row, self.name, self.scale, self.split, self.high, self.low, self.schedule]


def render_stack(stack: list[dict], two_stage: bool) -> list:
    updates = []
    for i in range(MAX_LORAS):
        if i < len(stack):
            e = stack[i]
            split = two_stage and bool(e.get("split"))
            updates += [gr.update(visible=True), e["name"], gr.update(value=e["scale"], visible=not split),
                        gr.update(value=split, visible=two_stage), gr.update(value=e["high"], visible=split),
                        gr.update(value=e["low"], visible=split), e.get("schedule") or ""]
        else:
            updates += [gr.update(visible=False), "", gr.update(value=1.0), gr.update(value=False),
                        gr.update(value=1.0), gr.update(value=1.0), ""]
    return updates


def stack_as_shown(stack: list[dict] | None, weights) -> list[dict]:
    """The stack with each row's weights as its boxes show them now (``GenerateTab.weight_inputs``): the
    stack state is written by the boxes' change events, which may not have landed at a click."""
    texts = weights[3 * MAX_LORAS:]
    return [{**e, "scale": weights[3 * i], "high": weights[3 * i + 1], "low": weights[3 * i + 2],
             "schedule": texts[i] if i < len(texts) else e.get("schedule")} for i, e in enumerate(stack or [])]


def weight_box(label: str, **kw) -> gr.Number:
    """A LoRA weight: a number box (arrows step 0.05) that keeps what is typed, 5 or -7.5 as well as 0.8;
    a blank box reaches ``submit`` as None and is refused there by the adapter's name. (A slider's box
    clamps a typed 5 to its bound and turns a blank or text into 0 in the browser, before any check.)"""
    return gr.Number(value=1.0, step=0.05, label=label, min_width=90, **kw)


def stack_weights(stack: list[dict], two_stage: bool) -> list[dict]:
    """Refuse (ValueError), by the adapter's name, a weight box left blank (or not a finite number) that the
    job would read: nothing is queued and the adapter stays in the stack."""
    import math

    for e in stack:
        if str(e.get("schedule") or "").strip():
            continue  # the "weight over steps" text replaces the boxes
        keys = ("high", "low") if two_stage and e.get("split") else ("scale",)
        for key in keys:
            value = e.get(key)
            where = {"scale": "weight", "high": "transformer (high noise) weight",
                     "low": "transformer_2 (low noise) weight"}[key]
            if value is None or isinstance(value, str) and not value.strip():
                raise ValueError(f"LoRA {e['name']}: the {where} box is empty; type a number (0 turns the "
                                 f"adapter off, ✕ removes it)")
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number):
                raise ValueError(f"LoRA {e['name']}: the {where} {value!r} is not a finite number")
    return stack



def preferred_weight(studio, name: str) -> float:
    """The weight an adapter enters the stack with: its preferred one (A1111's sidecar), else 1.0."""
    try:
        row = next((a for a in studio.adapters() if a.get("name") == name), {})
    except Exception:  # noqa: BLE001 - the library unreadable now: the usual weight
        row = {}
    weight = row.get("preferred_weight")
    return 1.0 if weight is None else float(weight)


#: what every event that writes the stack runs with: queued one at a time (``concurrency_limit`` 1 across the
#: server; each handler takes about a millisecond). Gradio reads a ``gr.State`` input when the event runs, not when
#: the browser sent it, so each handler sees what the one before it wrote: two fast clicks on two rows' buttons,
#: or a weight typed while a model loads, are both kept (unqueued, both handlers read the same stack and the
#: last writer won). The rows' events name their row's adapter, not its index: a click means the adapter the row
#: showed, even when an earlier click's re-render has not reached the page yet.
EDIT = {"api_visibility": "private", "concurrency_id": "lora-stack", "concurrency_limit": 1,
        "show_progress": "hidden"}


def _index(stack: list[dict], name) -> int | None:
    return next((k for k, e in enumerate(stack or []) if e["name"] == name), None)


def prune(studio, stack: list[dict], model_id) -> tuple[list[dict], str]:
    """The stack less the adapters the library no longer has or that do not fit the loaded model, and a
    note naming them ("" when none went). The library unreadable now: the stack as it is."""
    try:
        adapters = studio.adapters()
    except Exception:  # noqa: BLE001 - said by the poll's own library line; keep what the user built
        return list(stack or []), ""
    known = {a["name"] for a in adapters}
    fits = {a["name"] for a in adapters if fit_of(a)[0]}
    kept = [e for e in stack or [] if e["name"] in fits]
    gone = [e["name"] for e in stack or [] if e["name"] not in known]
    unfit = [e["name"] for e in stack or [] if e["name"] in known and e["name"] not in fits]
    notes = []
    if gone:
        notes.append(f"removed from the stack (no longer in the library): {', '.join(gone)}")
    if unfit:
        notes.append(f"removed from the stack (they do not fit {model_id}): {', '.join(unfit)}")
    return kept, "; ".join(notes)


def wire(studio, t, add) -> None:
    """The stack's events, all queued one at a time (``EDIT``): Add (``t.add_adapter``, reused by the LoRA
    browser), each row's weights, per-transformer toggle, up, down and remove; after a model switch
    (``t.fit_after_switch``) and when the library changes (``t.library_seen``), the adapters that no longer
    fit leave it."""
    def rendered(stack, model_id) -> list:
        return [stack, *render_stack(stack, two_stage_of(studio, model_id))]

    def add_adapter(name, stack, model_id):
        if not name:
            return [*rendered(stack, model_id),
                    error_html("pick an adapter first (the library has none that fit this model?)")]
        if len(stack) >= MAX_LORAS:
            return [*rendered(stack, model_id), error_html(f"the stack holds at most {MAX_LORAS} adapters")]
        if _index(stack, name) is not None:
            return [*rendered(stack, model_id), error_html(f"{name} is already in the stack")]
        weight = preferred_weight(studio, name)
        stack = stack + [{"name": name, "scale": weight, "split": False, "high": weight, "low": weight}]
        return [*rendered(stack, model_id), ""]

    t.add_adapter = add_adapter
    add.click(add_adapter, [t.pick, t.stack, t.model], [t.stack, *t.row_outputs(), t.status], **EDIT)

    def setter(key):
        def set_value(name, value, stack):
            k = _index(stack, name)
            if k is None:  # a row being emptied by a re-render: its adapter has gone
                return stack
            stack = [dict(e) for e in stack]
            stack[k][key] = value
            if key == "scale" and not stack[k].get("split"):  # the split boxes start from the shared weight
                stack[k]["high"] = stack[k]["low"] = value
            return stack
        return set_value

    def toggle(name, split, stack, model_id):
        k = _index(stack, name)
        stack = [dict(e) for e in stack]
        if k is not None:
            stack[k]["split"] = bool(split)
        return rendered(stack, model_id)

    def move(name, stack, model_id, delta):
        k = _index(stack, name)
        stack = list(stack)
        if k is None:
            return rendered(stack, model_id)
        if delta == 0:
            del stack[k]
        elif 0 <= k + delta < len(stack):
            stack[k], stack[k + delta] = stack[k + delta], stack[k]
        return rendered(stack, model_id)

    for r in t.rows:
        for key, comp in (("scale", r.scale), ("high", r.high), ("low", r.low), ("schedule", r.schedule)):
            comp.change(setter(key), [r.name, comp, t.stack], t.stack, **EDIT)
        r.split.input(toggle, [r.name, r.split, t.stack, t.model], [t.stack, *t.row_outputs()], **EDIT)
        for btn, delta in ((r.remove, 0), (r.up, -1), (r.down, 1)):
            btn.click(lambda name, stack, model_id, delta=delta: move(name, stack, model_id, delta),
                      [r.name, t.stack, t.model], [t.stack, *t.row_outputs()], **EDIT)

    def after_switch(model_id, stack, note):
        """After a model switch: the rows for the new model (per-transformer boxes or not), less what does
        not fit it, said after the switch's own note."""
        kept, said = prune(studio, stack, model_id)
        return [*rendered(kept, model_id), (note or "") + (error_html(said) if said else "")]

    def library_changed(model_id, stack):
        kept, said = prune(studio, stack, model_id)
        if not said:
            return [gr.update()] * (2 + len(t.row_outputs()))
        return [*rendered(kept, model_id), error_html(said)]

    t.fit_after_switch = {"fn": after_switch, "inputs": [t.model, t.stack, t.status],
                          "outputs": [t.stack, *t.row_outputs(), t.status], **EDIT}
    t.library_seen.change(library_changed, [t.model, t.stack], [t.stack, *t.row_outputs(), t.status], **EDIT)


def wire_bake(studio, t, button, name_box) -> None:
    """*Bake into a model*: the stack as shown merged into a copy of the loaded model (Studio.bake_model,
    backend/lora/bake.py), served from then on as ``baked:NAME`` (the model list offers it)."""
    def bake(name, stack, model_id, *weights, request: gr.Request = None):
        stack = stack_as_shown(stack, weights)
        if not stack:
            return error_html("the stack is empty: add the adapters to bake first"), gr.update(), gr.update()
        if not str(name or "").strip():
            return error_html("give the new model a name first"), gr.update(), gr.update()
        try:
            done = studio.of(request).bake_model(adapter_payload(stack, two_stage_of(studio, model_id)),
                                                 str(name).strip())
        except Exception as exc:  # noqa: BLE001 - a taken or bad name, a stack that cannot be baked, not an admin
            return error_html(readable(exc)), gr.update(), gr.update()
        return (ok_html(f"baked the stack ({', '.join(e['name'] for e in stack)}) into {done['model']}: "
                        f"{done['layers']} layers merged; pick it in the model list to run it without adapters"),
                "", gr.update(choices=model_choices(studio)))

    button.click(bake, [name_box, t.stack, t.model, *t.weight_inputs()], [t.status, name_box, t.model],
                 api_visibility="private")


def wire_export(studio, t, button, name_box, layout_box) -> None:
    """*Save as one LoRA*: the stack as shown (its typed weights) written as one adapter into the library
    (Studio.export_adapter, backend/lora/export.py) in the layout picked (diffusers: exact; kohya: sd-scripts'
    names, to fp32 rounding); it joins the picker with the next library poll."""
    def export(name, layout, stack, model_id, *weights):
        stack = stack_as_shown(stack, weights)
        if not stack:
            return error_html("the stack is empty: add the adapters to save as one first"), gr.update()
        if not str(name or "").strip():
            return error_html("give the new adapter a name first"), gr.update()
        try:
            done = studio.export_adapter(adapter_payload(stack, two_stage_of(studio, model_id)), str(name).strip(),
                                         layout=layout or "diffusers")
        except Exception as exc:  # noqa: BLE001 - a taken or bad name, a stack that cannot be one file
            return error_html(readable(exc)), gr.update()
        how = "exact" if done.get("exact_in") else f"{done.get('layout', layout)} layout, to fp32 rounding"
        return ok_html(f"saved the stack ({', '.join(e['name'] for e in stack)}) as {done['adapter']['name']}: "
                       f"{done['layers']} layers, rank {done['rank']}, {how}; it is in the adapter picker"), ""

    button.click(export, [name_box, layout_box, t.stack, t.model, *t.weight_inputs()], [t.status, name_box],
                 api_visibility="private", queue=False)

"""The Generate tab's LoRA stack: a fixed set of row slots over one ``gr.State`` list; rows are
shown, filled and hidden from that list, which keeps every widget stable for the browser (dynamic
re-rendering would rebuild them mid-job). Here: the list's conversions (to the facade's adapter
payload and back, a schedule as text), the rows' updates, the weight checks, and the rows' events."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from .server_state import model_choices, two_stage_of
from .views import error_html, ok_html, readable

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


def wire(studio, t, add) -> None:
    """The stack's events: Add (``t.add_adapter``, reused by the LoRA browser), each row's weights,
    per-transformer toggle, up, down and remove."""
    def add_adapter(name, stack, model_id):
        if not name:
            return [stack, *render_stack(stack, two_stage_of(studio, model_id)),
                    error_html("pick an adapter first (the library has none that fit this model?)")]
        if len(stack) >= MAX_LORAS:
            return [stack, *render_stack(stack, two_stage_of(studio, model_id)),
                    error_html(f"the stack holds at most {MAX_LORAS} adapters")]
        if any(e["name"] == name for e in stack):
            return [stack, *render_stack(stack, two_stage_of(studio, model_id)), error_html(f"{name} is already in the stack")]
        weight = preferred_weight(studio, name)
        stack = stack + [{"name": name, "scale": weight, "split": False, "high": weight, "low": weight}]
        return [stack, *render_stack(stack, two_stage_of(studio, model_id)), ""]

    t.add_adapter = add_adapter
    add.click(add_adapter, [t.pick, t.stack, t.model], [t.stack, *t.row_outputs(), t.status],
              api_visibility="private", queue=False)

    for i, r in enumerate(t.rows):
        def setter(key, i=i):
            def set_value(value, stack):
                if i < len(stack):
                    stack = [dict(e) for e in stack]
                    stack[i][key] = value
                    if key == "scale":  # the split boxes start from the shared weight
                        stack[i]["high"] = stack[i]["low"] = value
                return stack
            return set_value
        for key, comp in (("scale", r.scale), ("high", r.high), ("low", r.low), ("schedule", r.schedule)):
            comp.change(setter(key), [comp, t.stack], t.stack, api_visibility="private", queue=False)

        def toggle(split, stack, model_id, i=i):
            stack = [dict(e) for e in stack]
            if i < len(stack):
                stack[i]["split"] = bool(split)
            return [stack, *render_stack(stack, two_stage_of(studio, model_id))]

        r.split.input(toggle, [r.split, t.stack, t.model], [t.stack, *t.row_outputs()],
                      api_visibility="private", queue=False)

        def move(stack, model_id, i=i, delta=0):
            stack = list(stack)
            j = i + delta
            if delta == 0:
                stack = stack[:i] + stack[i + 1:]
            elif 0 <= j < len(stack) and i < len(stack):
                stack[i], stack[j] = stack[j], stack[i]
            return [stack, *render_stack(stack, two_stage_of(studio, model_id))]

        for btn, delta in ((r.remove, 0), (r.up, -1), (r.down, 1)):
            btn.click(lambda stack, model_id, i=i, delta=delta: move(stack, model_id, i, delta),
                      [t.stack, t.model], [t.stack, *t.row_outputs()], api_visibility="private", queue=False)


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


def wire_export(studio, t, button, name_box) -> None:
    """*Save as one LoRA*: the stack as shown (its typed weights) written as one adapter into the library
    (Studio.export_adapter, backend/lora/export.py); it joins the picker with the next library poll."""
    def export(name, stack, model_id, *weights):
        stack = stack_as_shown(stack, weights)
        if not stack:
            return error_html("the stack is empty: add the adapters to save as one first"), gr.update()
        if not str(name or "").strip():
            return error_html("give the new adapter a name first"), gr.update()
        try:
            done = studio.export_adapter(adapter_payload(stack, two_stage_of(studio, model_id)), str(name).strip())
        except Exception as exc:  # noqa: BLE001 - a taken or bad name, a stack that cannot be one file
            return error_html(readable(exc)), gr.update()
        return ok_html(f"saved the stack ({', '.join(e['name'] for e in stack)}) as {done['adapter']['name']}: "
                       f"{done['layers']} layers, rank {done['rank']}; it is in the adapter picker"), ""

    button.click(export, [name_box, t.stack, t.model, *t.weight_inputs()], [t.status, name_box],
                 api_visibility="private", queue=False)

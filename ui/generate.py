"""The Generate tab: model picker, the fields the model has, a LoRA stack, a preset
picker, and the server's jobs followed from the queue to the result.

The LoRA stack is a fixed set of row slots over one ``gr.State`` list; rows are
shown, filled and hidden from that list, which keeps every widget stable for the
browser (dynamic re-rendering would rebuild them mid-job).

Jobs belong to the server, not to the page: Generate only queues them (one per click,
``batch`` per click with seeds +1) and returns at once; a timer on the page polls the
server for its active jobs and the ones this page queued, so a reload, a second tab or
another device re-attaches to running and queued jobs, and closing the page cancels
nothing. The same poll keeps the page in step with the server's state: the fused
preset (badge, picker, sampling fields), the loaded model and the adapter library.
"""
from __future__ import annotations

import random
from pathlib import Path
from dataclasses import dataclass, field

import gradio as gr

from . import views
from .fields import WIDGETS, FieldWidget, clean_value
from .follow import follow
from .views import ModelInfo, error_html, ok_html, readable

MAX_LORAS = 6
NO_PRESET = "(none: base weights)"
MAX_BATCH = 16
POLL_S = 0.5  # how often an open page asks the server about its jobs, preset, model and library
MAX_WATCH = 32  # finished jobs a page keeps listing (the newest)


class Followed:
    """The job ids each page (Gradio session) asked to follow, beside its ``watch`` state.

    A click and the timer's poll are separate events that may run at the same time: a poll that read
    ``watch`` before the click wrote it writes the old list back, and the click's jobs would be followed
    only while the server lists them as active (a job that ended in between would never show its result).
    The poll merges this table in, so no interleaving loses a click. Bounded: the newest sessions only."""

    def __init__(self, limit: int = 1024):
        import collections
        import threading

        self._ids: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.limit = limit

    def set(self, session: str | None, ids: list[str]) -> None:
        if not session:
            return
        with self._lock:
            self._ids[session] = list(ids)
            self._ids.move_to_end(session)
            while len(self._ids) > self.limit:
                self._ids.popitem(last=False)

    def get(self, session: str | None) -> list[str]:
        with self._lock:
            return list(self._ids.get(session or "", ()))


def _session(request) -> str | None:
    return getattr(request, "session_hash", None) if request is not None else None


def models_by_id(studio) -> dict[str, ModelInfo]:
    return {m["id"]: ModelInfo.from_dict(m) for m in studio.models()}


def model_choices(studio) -> list[tuple[str, str]]:
    return [(f"{m.id}  (loaded)" if m.loaded else m.id, m.id) for m in models_by_id(studio).values()]


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
    numbers per transformer): ``1.0,0.8,0.5``, ``0.5->1.0``, else JSON."""
    import json

    if isinstance(scale, list):
        return ",".join(f"{v:g}" for v in scale)
    if isinstance(scale, dict) and set(scale) == {"start", "end"}:
        return f"{scale['start']:g}->{scale['end']:g}"
    if isinstance(scale, dict) and not all(isinstance(v, (int, float)) for v in scale.values()):
        return json.dumps(scale)
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


def _widget(w: FieldWidget):
    common = dict(label=w.label, info=w.info or None, visible=False, elem_id=f"field-{w.name}")
    if w.kind == "text":
        return gr.Textbox(lines=2, **common)
    if w.kind == "choice":
        return gr.Dropdown(choices=list(w.choices), value=None, **common)
    if w.kind == "image":
        common.pop("info")
        return gr.Image(type="filepath", sources=["upload", "clipboard"], height=220, **common)
    return gr.Number(value=None, precision=0 if w.kind == "int" else None, step=w.step, **common)


@dataclass
class GenerateTab:
    model: gr.Dropdown = None
    mode: gr.Markdown = None
    hint: gr.HTML = None
    prompt: gr.Textbox = None
    seed: gr.Number = None
    widgets: dict = field(default_factory=dict)
    aspect: gr.Dropdown = None  # W:H presets for the size fields
    swap: gr.Button = None  # width <-> height
    stack: gr.State = None
    rows: list = field(default_factory=list)
    pick: gr.Dropdown = None
    unfit: gr.HTML = None
    preset: gr.Dropdown = None
    preset_note: gr.HTML = None
    applied: gr.State = None
    badge: gr.HTML = None
    status: gr.HTML = None  # one-line notes: queued, errors, model switches
    jobs: gr.HTML = None  # the jobs this page follows, with their progress
    batch: gr.Number = None
    watch: gr.State = None
    seen: gr.State = None
    timer: gr.Timer = None
    add_adapter: object = None  # (name, stack, model_id) -> [stack, *row updates, note]: the stack's Add
    job_id: gr.Textbox = None
    image: gr.Image = None
    video: gr.Video = None
    metadata: gr.JSON = None
    infotext: gr.Textbox = None  # the shown result's settings as one A1111 infotext (pnginfo.infotext)
    pending_image: gr.State = None  # "send to image-to-video": the image waiting for the model switch
    browser_slot: gr.Column = None  # under the prompt: where blocks.py puts the LoRA browser

    def row_outputs(self) -> list:
        return [c for r in self.rows for c in r.outputs()]

    def weight_inputs(self) -> list:
        """The rows' weight boxes (3 a row), then their "over steps" texts: what ``stack_as_shown`` reads."""
        return [c for r in self.rows for c in (r.scale, r.high, r.low)] + [r.schedule for r in self.rows]

    def field_outputs(self) -> list:
        return [self.widgets[w.name] for w in WIDGETS]

    # what "use these settings" / a dropped PNG updates (after the model switch), in this order
    def restore_outputs(self) -> list:
        return [self.prompt, self.seed, *self.field_outputs(), self.stack, *self.row_outputs(), self.status]

    def restore_updates(self, studio, settings: dict | None, model_id: str) -> list:
        """Fill the tab from a result's (or a dropped image's) settings: ours, A1111's or ComfyUI's."""
        if not settings:
            return [gr.update()] * (len(self.restore_outputs()) - 1) + [error_html("no settings to restore")]
        m = models_by_id(studio).get(model_id)
        params = dict(settings.get("params") or {})
        source = settings.get("source") or "lora_studio"
        fields = m.fields if m else frozenset()
        # another tool's "CFG scale": Qwen-Image's classifier-free guidance is true_cfg_scale
        if source != "lora_studio" and "guidance_scale" in params and "true_cfg_scale" in fields:
            params["true_cfg_scale"] = params.pop("guidance_scale")
        wanted = settings.get("adapters") or []
        try:
            usable = {a["name"] for a in studio.adapters() if views.fit_of(a)[0]}
        except Exception:
            usable = {a.get("name") for a in wanted}
        stack = stack_from_payload([a for a in wanted if a.get("name") in usable])
        missing = [a.get("name") for a in wanted if a.get("name") not in usable]
        if source == "lora_studio":
            note = f"restored the settings of a {settings.get('model')} result"
        else:
            read = [k for k in ("prompt", "negative_prompt", "seed", "num_inference_steps", "guidance_scale",
                                "true_cfg_scale", "width", "height") if k in params]
            note = f"read {'A1111' if source == 'a1111' else 'ComfyUI'} settings: {', '.join(read) or 'none'}"
            skipped = [k for k in read if k not in ("prompt", "seed") and k not in fields]
            if skipped:
                note += f" ({', '.join(skipped)} not used by {model_id})"
            extra = settings.get("extra") if isinstance(settings.get("extra"), dict) else {}
            if extra:  # what the other tool set that has no field here (its sampler, clip skip, hires...)
                shown = [f"{k} ({views.short(str(v), 40)})" for k, v in list(extra.items())[:12]]
                note += f"; ignored, no such setting here: {', '.join(shown)}" + \
                    (f" and {len(extra) - 12} more" if len(extra) > 12 else "")
        if missing:
            note += f"; not in the library (or not fitting {model_id}), left out: {', '.join(missing)}"
        note = ok_html(note)
        if source == "lora_studio" and (m is None or m.id != settings.get("model")):
            note = error_html(f"the result was made with {settings.get('model')!r}, which is not available here; "
                              f"restored what fits {model_id!r}")
        return [params.get("prompt", ""), params.get("seed"),
                *field_updates(m, params, reset=False),
                stack, *render_stack(stack, bool(m and m.two_stage)), note]


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


PLACEHOLDER = "a red digit 3 on a black background"


def lora_hint(studio) -> str:
    """The first-run hint for the loaded model (views.lora_hint), empty when the library cannot be read."""
    try:
        return views.lora_hint(studio.adapter_cards(), studio.current_model(), PLACEHOLDER)
    except Exception:  # noqa: BLE001 - a hint never breaks the page
        return ""


def build(studio) -> GenerateTab:
    t = GenerateTab()
    with gr.Row():
        with gr.Column(scale=3):
            with gr.Row():
                t.model = gr.Dropdown(label="Model", choices=[], allow_custom_value=True, elem_id="model-picker",
                                      info="the loaded model and the others available; switching loads it", scale=3)
                refresh = gr.Button("Refresh", scale=0, min_width=80, elem_id="models-refresh")
            t.mode = gr.Markdown(elem_id="mode")
            t.prompt = gr.Textbox(label="Prompt (prompt)", lines=3, elem_id="prompt",
                                  placeholder=PLACEHOLDER)
            t.hint = gr.HTML(elem_id="lora-hint")
            t.browser_slot = gr.Column(elem_id="lora-browser-slot")  # the LoRA browser (ui/lora_browser.py)
            for w in WIDGETS:
                if w.group in ("prompt", "inputs"):
                    t.widgets[w.name] = _widget(w)
            with gr.Row():
                # no minimum/maximum here: Gradio would refuse out of range with a toast before ``submit``
                # runs; the server's rule (backend/params.py) names the field in the tab's note instead
                t.seed = gr.Number(label="Seed (seed)", value=42, precision=0, elem_id="seed", scale=3,
                                   info="-1: a random seed (the one used is in the result's metadata)")
                dice = gr.Button("Random seed", scale=1, elem_id="seed-random")
            with gr.Row(equal_height=True):
                for w in WIDGETS:
                    if w.group == "size":
                        t.widgets[w.name] = _widget(w)
                t.aspect = gr.Dropdown(label="Aspect", choices=list(views.ASPECTS), value=None, elem_id="size-aspect",
                                     info="sets width and height, keeping the area", scale=1, min_width=110)
                t.swap = gr.Button("⇄ swap", elem_id="size-swap", scale=0, min_width=80)
            with gr.Row():
                for w in WIDGETS:
                    if w.group == "video":
                        t.widgets[w.name] = _widget(w)
            with gr.Accordion("Sampling", open=True):
                with gr.Row():
                    for w in WIDGETS:
                        if w.group == "sampling":
                            t.widgets[w.name] = _widget(w)

            with gr.Accordion("LoRA stack", open=True, elem_id="lora-stack"):
                with gr.Row():
                    t.pick = gr.Dropdown(label="Adapter", choices=[], elem_id="adapter-pick", scale=3,
                                         info="adapters in the library that fit the loaded model")
                    add = gr.Button("Add to stack", elem_id="adapter-add", scale=1)
                t.unfit = gr.HTML(elem_id="adapter-unfit")
                t.stack = gr.State([])
                for i in range(MAX_LORAS):
                    with gr.Group(visible=False, elem_classes=["ls-stack-row"], elem_id=f"stack-row-{i}") as row:
                        with gr.Row(equal_height=True):
                            name = gr.Textbox(show_label=False, interactive=False, container=False, scale=4,
                                              min_width=120, elem_id=f"stack-name-{i}")
                            up = gr.Button("↑", min_width=36, scale=0, size="sm")
                            down = gr.Button("↓", min_width=36, scale=0, size="sm")
                            remove = gr.Button("✕", min_width=36, scale=0, size="sm", elem_id=f"stack-remove-{i}")
                        with gr.Row():
                            scale = weight_box("weight", elem_id=f"stack-scale-{i}", scale=3)
                            split = gr.Checkbox(label="per transformer", value=False, visible=False, scale=1,
                                                min_width=100)
                            high = weight_box("transformer (high noise)", visible=False, scale=2)
                            low = weight_box("transformer_2 (low noise)", visible=False, scale=2)
                        sched = gr.Textbox(label="weight over steps (optional: replaces the weight boxes)",
                                           placeholder="1.0,0.8,0.5  or  0.5->1.0  or  {\"blocks\": {\"0-9\": 0.5}}",
                                           max_lines=1, elem_id=f"stack-schedule-{i}")
                    t.rows.append(StackRow(row, name, scale, split, high, low, up, down, remove, sched))

            with gr.Accordion("Preset (distill: fused into the base weights)", open=False, elem_id="gen-preset"):
                with gr.Row():
                    t.preset = gr.Dropdown(label="Preset", choices=[NO_PRESET], value=NO_PRESET, scale=3,
                                           elem_id="gen-preset-pick")
                    apply_btn = gr.Button("Apply preset", scale=1, elem_id="gen-preset-apply")
                t.preset_note = gr.HTML()
                t.applied = gr.State(None)

        with gr.Column(scale=2):
            t.badge = gr.HTML(elem_id="fused-badge")
            with gr.Row():
                go = gr.Button("Generate", variant="primary", elem_id="generate-btn", scale=3)
                t.batch = gr.Number(label="Batch count", value=1, precision=0, elem_id="batch-count", scale=1,
                                    min_width=90, info=f"jobs per click (1 to {MAX_BATCH}), seeds +1")
                stop = gr.Button("Cancel", variant="stop", elem_id="cancel-btn", scale=1)
            t.status = gr.HTML(elem_id="gen-note")
            t.jobs = gr.HTML(elem_id="gen-status")
            t.watch = gr.State({"ids": [], "shown": None, "html": None})
            t.seen = gr.State({})
            t.timer = gr.Timer(POLL_S)
            t.job_id = gr.Textbox(visible="hidden", elem_id="gen-job-id")
            cancel_one = gr.Textbox(visible="hidden", elem_id="gen-cancel-one")  # a job line's ✕ (blocks.PAGE_JS)
            t.image = gr.Image(label="Result", type="filepath", interactive=False, elem_id="result-image",
                               format="png")
            t.video = gr.Video(label="Result", interactive=False, visible=False, elem_id="result-video")
            t.infotext = gr.Textbox(label="Infotext (A1111: paste into its PNG Info, Civitai or our Gallery)",
                                    interactive=False, lines=2, max_lines=6, buttons=["copy"],
                                    elem_id="result-infotext")
            t.metadata = gr.JSON(label="Metadata", elem_id="result-metadata")
            with gr.Row():
                reuse = gr.Button("Reuse seed", size="sm", elem_id="send-seed")
                to_i2v = gr.Button("Send to image-to-video", size="sm", elem_id="send-i2v")
            t.pending_image = gr.State(None)

    _wire(studio, t, refresh, dice, add, apply_btn, go, stop)
    _wire_cancel_one(studio, t, cancel_one)
    _wire_send(studio, t, reuse, to_i2v)
    return t


def _wire(studio, t: GenerateTab, refresh, dice, add, apply_btn, go, stop) -> None:
    two_stage_of = lambda model_id: models_by_id(studio).get(model_id, ModelInfo(id="")).two_stage  # noqa: E731

    def load_models():
        try:
            models = models_by_id(studio)
        except Exception as exc:
            return [gr.update(), "", error_html(readable(exc))] + field_updates(None)
        m = next((x for x in models.values() if x.loaded), next(iter(models.values()), None))
        choices = [(f"{x.id}  (loaded)" if x.loaded else x.id, x.id) for x in models.values()]
        return ([gr.update(choices=choices, value=m.id if m else None),
                 views.mode_markdown(m) if m else "", ""] + field_updates(m))

    model_outputs = [t.model, t.mode, t.status, *t.field_outputs()]
    refresh.click(load_models, None, model_outputs, api_visibility="private")

    def switch(model_id, stack, progress=gr.Progress()):
        """Load the chosen model through the queue, with progress, then show its fields."""
        models = models_by_id(studio)
        m = models.get(model_id)
        if m is None:
            yield [gr.update()] * 2 + [error_html(unknown_model_message(model_id, models))] + \
                [gr.update()] * len(WIDGETS) + [gr.update()] * 2 + [stack, *render_stack(stack, False)]
            return
        fused_before = studio.current_preset()
        if not m.loaded:
            try:
                job = studio.switch_model(model_id)
            except Exception as exc:
                yield [gr.update(), gr.update(), error_html(readable(exc))] + [gr.update()] * len(WIDGETS) + \
                    [gr.update()] * 2 + [stack, *render_stack(stack, m.two_stage)]
                return
            for (job,) in follow(studio, [job["id"]]):
                progress(views.job_fraction(job), desc=f"loading {model_id}")
                yield [gr.update(), gr.update(), views.progress_html(job)] + [gr.update()] * len(WIDGETS) + \
                    [gr.update()] * 2 + [stack, *render_stack(stack, m.two_stage)]
            if job.get("status") != "succeeded":
                yield [gr.update(), gr.update(), error_html(f"could not load {model_id}: {job.get('error')}")] + \
                    [gr.update()] * len(WIDGETS) + [gr.update()] * 2 + [stack, *render_stack(stack, m.two_stage)]
                return
            m = models_by_id(studio).get(model_id, m)
        # adapters that fit the old model may not fit this one: keep only those that still do
        try:
            choices, unfit = views.adapter_choices(studio.adapters())
        except Exception as exc:
            choices, unfit = [], error_html(readable(exc))
        fits = {value for _, value in choices}
        kept = [e for e in stack if e["name"] in fits]
        dropped = [e["name"] for e in stack if e["name"] not in fits]
        note = f"{model_id} loaded"
        fused_now = studio.current_preset()
        if fused_before and fused_now != fused_before:
            note += f"; preset {fused_before} is no longer fused (a model switch restores the base weights)"
        if dropped:
            note += f"; removed adapters that do not fit it: {', '.join(dropped)}"
        note = ok_html(note)
        yield [gr.update(choices=model_choices(studio), value=model_id), views.mode_markdown(m), note] + \
            field_updates(m, locked=locked_reasons(fused_now, preset_contract(studio, fused_now)[1])) + \
            [gr.update(choices=choices, value=choices[0][1] if choices else None), unfit] + \
            [kept, *render_stack(kept, m.two_stage)]

    switch_outputs = [t.model, t.mode, t.status, *t.field_outputs(), t.pick, t.unfit, t.stack, *t.row_outputs()]
    t.model.input(switch, [t.model, t.stack], switch_outputs, api_visibility="private",
                  concurrency_limit=None)

    dice.click(lambda: random.randrange(2**31), None, t.seed, api_visibility="private", queue=False)

    height, width = t.widgets["height"], t.widgets["width"]

    def sized(model_id):  # the fields' defaults for the shown model (a blank field means its default)
        m = models_by_id(studio).get(model_id)
        return (m.defaults if m else {}) or {}

    def swap_sides(h, w, model_id):
        d = sized(model_id)
        return (w if w is not None else d.get("width")), (h if h is not None else d.get("height"))

    def to_aspect(choice, h, w, model_id):
        if not choice:
            return gr.update(), gr.update()
        d = sized(model_id)
        h, w = h if h is not None else d.get("height"), w if w is not None else d.get("width")
        if h is None or w is None:
            raise gr.Error("this model takes no width and height", print_exception=False)
        new_w, new_h = views.aspect_size(choice, w, h)
        return new_h, new_w

    t.swap.click(swap_sides, [height, width, t.model], [height, width], api_visibility="private", queue=False)
    t.aspect.input(to_aspect, [t.aspect, height, width, t.model], [height, width], api_visibility="private", queue=False)

    def add_adapter(name, stack, model_id):
        if not name:
            return [stack, *render_stack(stack, two_stage_of(model_id)),
                    error_html("pick an adapter first (the library has none that fit this model?)")]
        if len(stack) >= MAX_LORAS:
            return [stack, *render_stack(stack, two_stage_of(model_id)),
                    error_html(f"the stack holds at most {MAX_LORAS} adapters")]
        if any(e["name"] == name for e in stack):
            return [stack, *render_stack(stack, two_stage_of(model_id)), error_html(f"{name} is already in the stack")]
        stack = stack + [{"name": name, "scale": 1.0, "split": False, "high": 1.0, "low": 1.0}]
        return [stack, *render_stack(stack, two_stage_of(model_id)), ""]

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
            return [stack, *render_stack(stack, two_stage_of(model_id))]

        r.split.input(toggle, [r.split, t.stack, t.model], [t.stack, *t.row_outputs()],
                      api_visibility="private", queue=False)

        def move(stack, model_id, i=i, delta=0):
            stack = list(stack)
            j = i + delta
            if delta == 0:
                stack = stack[:i] + stack[i + 1:]
            elif 0 <= j < len(stack) and i < len(stack):
                stack[i], stack[j] = stack[j], stack[i]
            return [stack, *render_stack(stack, two_stage_of(model_id))]

        for btn, delta in ((r.remove, 0), (r.up, -1), (r.down, 1)):
            btn.click(lambda stack, model_id, i=i, delta=delta: move(stack, model_id, i, delta),
                      [t.stack, t.model], [t.stack, *t.row_outputs()], api_visibility="private", queue=False)

    # -- presets ----------------------------------------------------------------------------
    def preset_note(preset_id):
        if not preset_id or preset_id == NO_PRESET:
            return "Generation runs on the base weights (plus the LoRA stack)."
        p = next((p for p in studio.presets() if p.get("id") == preset_id), None)
        if p is None:
            return error_html(f"unknown preset {preset_id!r}")
        return views.preset_cards_html([p])

    t.preset.change(preset_note, t.preset, t.preset_note, api_visibility="private")

    def apply(preset_id, model_id):
        m = models_by_id(studio).get(model_id)
        loaded = studio.current_model()
        if model_id != loaded:  # a preset fuses into the server's loaded model, not the one this tab shows
            return [gr.update(), error_html(f"this tab shows {model_id} but the server has {loaded} loaded "
                                            f"(another tab or client switched it); pick {model_id} again "
                                            f"to load it, then apply")] + [gr.update()] * len(WIDGETS)
        try:
            if not preset_id or preset_id == NO_PRESET:
                studio.restore_base()
                return [None, ok_html("restored the base weights")] + field_updates(m, None, reset=False, locked={})
            result = studio.apply_preset(preset_id)
        except Exception as exc:
            return [gr.update(), error_html(readable(exc))] + [gr.update()] * len(WIDGETS)
        # the worker answers with the sampling defaults it now applies and the fused state
        values = dict((result or {}).get("defaults") or {})
        fused = (result or {}).get("fused") or {}
        files = ", ".join(Path(str(f.get("path", f) if isinstance(f, dict) else f)).name
                          for f in fused.get("files") or [])
        msg = f"fused preset {preset_id}" + (f" ({files})" if files else "") + \
            (f"; sampling set to {', '.join(f'{k}={v}' for k, v in values.items())}" if values else "")
        locked = locked_reasons(preset_id, preset_contract(studio, preset_id)[1])
        return [preset_id, ok_html(msg)] + field_updates(m, values, reset=False, locked=locked)

    apply_btn.click(apply, [t.preset, t.model], [t.applied, t.preset_note, *t.field_outputs()],
                    api_visibility="private")

    # -- generate: queue jobs, then the page's poll follows them ---------------------------------
    followed = Followed()

    def submit(request: gr.Request, model_id, prompt, seed, batch, stack, watch, *values):
        values, weights = values[:len(WIDGETS)], values[len(WIDGETS):]
        stack = stack_as_shown(stack, weights)
        m = models_by_id(studio).get(model_id)
        if m is None:
            return [error_html(f"pick a model first (got {model_id!r})"), gr.update(), gr.update()]
        if batch is None or not 1 <= batch <= MAX_BATCH:
            return [error_html(f"Batch count must be 1 to {MAX_BATCH}, got {'nothing' if batch is None else batch}"),
                    gr.update(), gr.update()]
        n = int(batch)
        try:
            stack_weights(stack, m.two_stage)
        except ValueError as exc:
            return [error_html(str(exc)), gr.update(), gr.update()]
        seed = -1 if seed is None else int(seed)
        base_seed = random.randrange(2**31) if seed == -1 else seed  # -1: random, then +1 per job
        params = {"prompt": prompt}
        for w, v in zip(WIDGETS, values):
            if w.name in m.fields:
                value = clean_value(w, v)
                if value is not None:
                    params[w.name] = value
        try:
            payload = adapter_payload(stack, m.two_stage)
        except Exception as exc:  # a bad "weight over steps": refused by name, nothing queued
            return [error_html(readable(exc)), gr.update(), gr.update()]
        try:  # all n or none; the server knows what it has fused (apply_preset): the jobs need not name it
            queued = studio.submit_many([{"kind": "generate", "params": {**params, "seed": base_seed + i},
                                          "adapters": payload, "model": model_id} for i in range(n)])
        except Exception as exc:
            return [error_html(readable(exc)), gr.update(), gr.update()]
        first = queued[0]
        where = (f"position {first['queue_position']} in the queue" if first.get("queue_position")
                 else "starting")
        ids = ", ".join(str(j["id"]) for j in queued)
        note = views.queued_html(f"queued job{'s' if n > 1 else ''} {ids} (seed {base_seed}"
                                 f"{f'…{base_seed + n - 1}' if n > 1 else ''}) · {where}",
                                 [str(j["id"]) for j in queued])
        # a new click starts a new list: the finished jobs of earlier clicks leave it
        known = list(dict.fromkeys([*((watch or {}).get("ids") or []), *followed.get(_session(request))]))
        keep = [j for j in known if _active(studio, j)]
        watch = {**(watch or {}), "ids": keep + [str(j["id"]) for j in queued]}
        followed.set(_session(request), watch["ids"])
        return [note, watch, str(queued[-1]["id"])]

    weights = t.weight_inputs()
    go.click(submit, [t.model, t.prompt, t.seed, t.batch, t.stack, t.watch, *t.field_outputs(), *weights],
             [t.status, t.watch, t.job_id], api_visibility="private", queue=False, trigger_mode="multiple",
             show_progress="hidden")

    def cancel_jobs(request: gr.Request, watch):
        """Cancel every queued or running job this page follows."""
        cancelled, errors = [], []
        for job_id in dict.fromkeys([*((watch or {}).get("ids") or []), *followed.get(_session(request))]):
            if not _active(studio, job_id):
                continue
            try:
                studio.cancel(job_id)
                cancelled.append(job_id)
            except Exception as exc:  # finished meanwhile
                errors.append(readable(exc))
        if errors and not cancelled:
            return error_html(errors[0])
        return ok_html(f"cancelled job{'s' if len(cancelled) > 1 else ''} {', '.join(cancelled)}" if cancelled
                       else "nothing to cancel")

    stop.click(cancel_jobs, t.watch, t.status, api_visibility="private", queue=False)

    def poll(request: gr.Request, watch, seen, model_id, stack, note):
        """The page's view of the server: its jobs, fused preset, loaded model and adapter library.
        Each part is sent only when it changed (gr.update() otherwise). A "queued ... position 1" note
        leaves once the jobs it names have ended (their lines in the job list say how)."""
        watch, seen = dict(watch or {}), dict(seen or {})
        out = {}
        # jobs: the server's active ones (a reload, another tab) plus the ones this page queued (its state,
        # and the table a click that ran beside this poll wrote to)
        try:
            ids = list(dict.fromkeys([*(watch.get("ids") or []), *followed.get(_session(request))]))
            for j in studio.active_jobs():
                if str(j["id"]) not in ids:
                    ids.append(str(j["id"]))
            jobs = []
            for job_id in ids:
                try:
                    jobs.append(studio.job(job_id))
                except Exception:  # gone (pruned): nothing to show
                    pass
            finished = [j for j in jobs if j.get("status") in views.FINISHED]
            while len(jobs) > MAX_WATCH and finished:
                jobs.remove(finished.pop(0))
            watch["ids"] = [str(j["id"]) for j in jobs]
            spp = studio.seconds_per_step() if any(j.get("status") == "running" for j in jobs) else None
            previews = {}
            for j in jobs:  # the running job's latents as a small image, about once a second
                if j.get("status") == "running":
                    try:
                        previews[str(j["id"])] = studio.job_preview(j["id"])
                    except Exception:  # it ended meanwhile
                        pass
            named = views.queued_ids(note)
            if named and all(j.get("status") in views.FINISHED for j in jobs if str(j["id"]) in named):
                out["note"] = ""  # (a job pruned from the list has ended too)
            html = views.jobs_html(jobs, seconds_per_step=spp, previews=previews)
            if html != watch.get("html"):
                watch["html"] = out["jobs"] = html
            done = [j for j in jobs if j.get("status") == "succeeded"]
            if done:
                newest = max(done, key=lambda j: j.get("finished_at") or 0)
                if str(newest["id"]) != watch.get("shown"):
                    watch["shown"] = str(newest["id"])
                    m = models_by_id(studio).get(newest.get("model") or model_id) or ModelInfo(id="")
                    out["result"] = result_updates(newest, m)
        except Exception as exc:
            out["jobs"] = error_html(f"could not read the queue: {readable(exc)}")
        # the server's loaded model and fused preset: one source of truth for every tab
        try:
            model_now, preset_now = studio.current_model(), studio.current_preset()
        except Exception:
            model_now, preset_now = seen.get("model"), seen.get("preset")
        m_now = None
        if model_now != seen.get("model") and "model" in seen and model_now != model_id:
            models = models_by_id(studio)
            m_now = models.get(model_now)
            out["model"] = [gr.update(choices=model_choices(studio), value=model_now),
                            views.mode_markdown(m_now) if m_now else ""]
            out["fields"] = field_updates(m_now)
            out["note"] = ok_html(f"the server switched to {model_now} (another tab or client loaded it)")
        if preset_now != seen.get("preset") or model_now != seen.get("model"):
            out["badge"] = badge_html(preset_now)
            out["preset"] = gr.update(choices=preset_choices(studio, model_now),
                                      value=preset_now or NO_PRESET)
            # the preset's defaults in the fields and the ones it fixes locked (unlocked when it goes)
            defaults, required = preset_contract(studio, preset_now)
            m_fields = m_now or models_by_id(studio).get(model_now)
            if m_fields is not None and (m_now is not None or preset_now != seen.get("preset")):
                out["fields"] = field_updates(m_fields, defaults, reset=m_now is not None,
                                              locked=locked_reasons(preset_now, required))
        seen["model"], seen["preset"] = model_now, preset_now
        # the adapter library: new imports appear, deleted adapters leave the picker and the stack
        try:
            sig = studio.library_signature()
        except Exception:
            sig = seen.get("library")
        if sig != seen.get("library"):
            # the first poll sends the lists too: the page's load read the library before this
            # signature was taken, and an adapter added in between would never be offered
            seen["library"] = sig
            pick, unfit = adapter_pick_updates(studio)
            try:
                names = {a["name"] for a in studio.adapters() if views.fit_of(a)[0]}
            except Exception:
                names = {e["name"] for e in stack or []}
            kept = [e for e in stack or [] if e["name"] in names]
            out["library"] = [pick, unfit]
            if len(kept) != len(stack or []):
                gone = [e["name"] for e in stack if e["name"] not in names]
                out["stack"] = [kept, *render_stack(kept, two_stage_of(model_id))]
                out["note"] = error_html(f"removed from the stack (no longer in the library): {', '.join(gone)}")
        keep = gr.update()
        return ([out.get("jobs", keep), *out.get("result", [keep] * 4), watch, seen, out.get("badge", keep),
                 out.get("preset", keep), *out.get("model", [keep, keep]),
                 *out.get("fields", [keep] * len(WIDGETS)), *out.get("library", [keep, keep]),
                 *out.get("stack", [keep] * (1 + len(t.row_outputs()))), out.get("note", keep)])

    poll_outputs = [t.jobs, t.image, t.video, t.metadata, t.infotext, t.watch, t.seen, t.badge, t.preset, t.model, t.mode,
                    *t.field_outputs(), t.pick, t.unfit, t.stack, *t.row_outputs(), t.status]
    t.timer.tick(poll, [t.watch, t.seen, t.model, t.stack, t.status], poll_outputs, api_visibility="private",
                 queue=False, show_progress="hidden")
    # the app's page-load handler and the Gallery's "use these settings" reuse these
    t.load_models, t.model_outputs = load_models, model_outputs
    t.switch, t.switch_outputs = switch, switch_outputs


def _wire_cancel_one(studio, t: GenerateTab, box) -> None:
    """A job line's ✕ cancels that job only (the Cancel button cancels every job the page follows)."""
    def cancel_one(value):
        job_id = str(value or "").split("\n", 1)[0].strip()
        if not job_id:
            return gr.update()
        try:
            job = studio.cancel(job_id)
        except Exception as exc:  # finished meanwhile, or not a job
            return error_html(readable(exc))
        if job.get("status") == "running":
            return ok_html(f"cancelling job {job_id}: it stops at its next step")
        return ok_html(f"cancelled job {job_id}" if job.get("status") == "cancelled"
                       else f"job {job_id} has already {job.get('status')}")

    box.change(cancel_one, box, t.status, api_visibility="private", queue=False)


def i2v_model(models: dict[str, ModelInfo], current: str | None) -> str | None:
    """Where "send to image-to-video" goes: the shown model if it takes an input image for a video,
    else the first image-to-video model offered (by its spec, else by an ``i2v`` in its id)."""
    m = models.get(current)
    if m is not None and m.mode == "image-to-video":
        return m.id
    return next((x.id for x in models.values() if x.mode == "image-to-video"),
                next((x.id for x in models.values() if "i2v" in x.id.lower()), None))


def _wire_send(studio, t: GenerateTab, reuse, to_i2v) -> None:
    """Send the shown result onward: its seed into the seed field, or the image (a video's last frame)
    into an image-to-video model's input image, switching to that model first."""
    def shown(watch) -> str:
        job_id = (watch or {}).get("shown")
        if not job_id:
            raise gr.Error("no result yet: generate one first", print_exception=False)
        return job_id

    def reuse_seed(watch):
        job = studio.job(shown(watch))
        seed = ((job.get("result") or {}).get("metadata") or {}).get("seed", (job.get("params") or {}).get("seed"))
        return seed, ok_html(f"seed {seed} (from job {job['id']})")

    reuse.click(reuse_seed, t.watch, [t.seed, t.status], api_visibility="private", queue=False)

    def pick(watch, model_id):
        try:
            info = studio.result_image(shown(watch))
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
        .success(t.switch, [t.model, t.stack], t.switch_outputs, api_visibility="private", concurrency_limit=None) \
        .success(fill, [t.pending_image, t.model, t.status], [t.widgets["image"], t.status],
                 api_visibility="private")


def _active(studio, job_id) -> bool:
    try:
        return studio.job(job_id).get("status") not in views.FINISHED
    except Exception:
        return False


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

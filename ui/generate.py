"""The Generate tab: the form (model picker, the fields the model has, the LoRA stack, a preset
picker) beside the job column and the result. Its parts: ``ui/stack.py`` (the LoRA stack),
``ui/jobs_column.py`` (queueing, cancelling, the poll that follows the server's jobs and state),
``ui/result_view.py`` (the result and sending it onward), ``ui/server_state.py`` (what the server
offers, as updates). This module lays the tab out and wires the form: model switch, sizes, presets.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from . import jobs_column, result_view, stack as lora_stack, views
from .fields import WIDGETS, FieldWidget
from .follow import follow
from .jobs_column import MAX_BATCH, MAX_BATCH_SIZE, POLL_S
from .server_state import (NO_PRESET, field_updates, locked_reasons, model_choices, models_by_id,
                           preset_contract, unknown_model_message)
from .stack import MAX_LORAS, StackRow, render_stack, stack_from_payload, weight_box
from .views import error_html, ok_html, readable


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
    batch: gr.Number = None  # batch count: batches per click
    batch_size: gr.Number = None  # images per batch: one job each, allowed to share one pipeline call
    watch: gr.State = None
    seen: gr.State = None
    timer: gr.Timer = None
    add_adapter: object = None  # (name, stack, model_id) -> [stack, *row updates, note]: the stack's Add
    fit_after_switch: dict = None  # the event (fn, inputs, outputs, queue) that follows every model switch
    library_seen: gr.Textbox = None  # the library's signature as the poll last saw it: its change prunes the stack
    job_id: gr.Textbox = None
    image: gr.Image = None
    video: gr.Video = None
    metadata: gr.JSON = None
    infotext: gr.Textbox = None  # the shown result's settings as one A1111 infotext (pnginfo.infotext)
    grid: gr.Gallery = None  # the followed jobs' images side by side (a batch), shown from two on
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
                            up = gr.Button("↑", min_width=36, scale=0, size="sm", elem_id=f"stack-up-{i}")
                            down = gr.Button("↓", min_width=36, scale=0, size="sm", elem_id=f"stack-down-{i}")
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
                with gr.Row(equal_height=True):
                    export_name = gr.Textbox(label="Save the stack as one LoRA", max_lines=1, scale=3,
                                             placeholder="a name for the new adapter", elem_id="stack-export-name",
                                             info="exact: the new file at weight 1 is this stack at these weights")
                    export_layout = gr.Dropdown(label="layout", scale=1, min_width=120, elem_id="stack-export-layout",
                                                choices=[("diffusers (exact)", "diffusers"),
                                                         ("kohya (ComfyUI, A1111)", "kohya")], value="diffusers")
                    export = gr.Button("Save as one LoRA", scale=1, elem_id="stack-export")
                with gr.Row(equal_height=True):
                    bake_name = gr.Textbox(label="Bake the stack into a copy of the model", max_lines=1, scale=3,
                                           placeholder="a name for the new model", elem_id="stack-bake-name",
                                           info="a model of its own (baked:NAME in the model list), no adapter "
                                                "needed; it takes the disk of the weights the stack changes")
                    bake = gr.Button("Bake into a model", scale=1, elem_id="stack-bake")

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
                                    min_width=90, info=f"batches per click (1 to {MAX_BATCH}), seeds +1")
                t.batch_size = gr.Number(label="Batch size", value=1, precision=0, elem_id="batch-size", scale=1,
                                         min_width=90, info=f"images per batch (1 to {MAX_BATCH_SIZE}), run as one "
                                                            "call where the server measures that faster")
                stop = gr.Button("Cancel", variant="stop", elem_id="cancel-btn", scale=1)
            t.status = gr.HTML(elem_id="gen-note")
            t.jobs = gr.HTML(elem_id="gen-status")
            t.watch = gr.State({"ids": [], "shown": None, "html": None})
            t.seen = gr.State({})
            t.timer = gr.Timer(POLL_S)
            t.job_id = gr.Textbox(visible="hidden", elem_id="gen-job-id")
            t.library_seen = gr.Textbox(visible="hidden", elem_id="gen-library-seen")
            cancel_one = gr.Textbox(visible="hidden", elem_id="gen-cancel-one")  # a job line's ✕ (blocks.PAGE_JS)
            t.image = gr.Image(label="Result", type="filepath", interactive=False, elem_id="result-image",
                               format="png")
            t.video = gr.Video(label="Result", interactive=False, visible=False, elem_id="result-video")
            t.grid = gr.Gallery(label="This batch (newest result above)", visible=False, columns=4, height="auto",
                                object_fit="contain", interactive=False, elem_id="result-batch")
            t.infotext = gr.Textbox(label="Infotext (A1111: paste into its PNG Info, Civitai or our Gallery)",
                                    interactive=False, lines=2, max_lines=6, buttons=["copy"],
                                    elem_id="result-infotext")
            t.metadata = gr.JSON(label="Metadata", elem_id="result-metadata")
            with gr.Row():
                reuse = gr.Button("Reuse seed", size="sm", elem_id="send-seed")
                to_i2v = gr.Button("Send to image-to-video", size="sm", elem_id="send-i2v")
            t.pending_image = gr.State(None)

    lora_stack.wire(studio, t, add)  # first: the model switch's events end with its t.fit_after_switch
    _wire(studio, t, refresh, dice, apply_btn)
    lora_stack.wire_export(studio, t, export, export_name, export_layout)
    lora_stack.wire_bake(studio, t, bake, bake_name)
    jobs_column.wire(studio, t, go, stop, cancel_one)
    result_view.wire_send(studio, t, reuse, to_i2v)
    return t


def _wire(studio, t: GenerateTab, refresh, dice, apply_btn) -> None:

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

    def switch(model_id, progress=gr.Progress()):
        """Load the chosen model through the queue, with progress, then show its fields. The stack is left to
        the step after it (``t.fit_after_switch``, queued with the stack's other edits): this one runs for the
        whole load, and an edit made meanwhile would be overwritten by the stack it read at the start."""
        models = models_by_id(studio)
        m = models.get(model_id)
        keep_lists = [gr.update()] * 2
        if m is None:
            yield [gr.update()] * 2 + [error_html(unknown_model_message(model_id, models))] + \
                [gr.update()] * len(WIDGETS) + keep_lists
            return
        fused_before = studio.current_preset()
        if not m.loaded:
            try:
                job = studio.switch_model(model_id)
            except Exception as exc:
                yield [gr.update(), gr.update(), error_html(readable(exc))] + [gr.update()] * len(WIDGETS) + keep_lists
                return
            for (job,) in follow(studio.studio, [job["id"]]):  # the server's own job (a switch is no one's)
                progress(views.job_fraction(job), desc=f"loading {model_id}")
                yield [gr.update(), gr.update(), views.progress_html(job)] + [gr.update()] * len(WIDGETS) + keep_lists
            if job.get("status") != "succeeded":
                yield [gr.update(), gr.update(), error_html(f"could not load {model_id}: {job.get('error')}")] + \
                    [gr.update()] * len(WIDGETS) + keep_lists
                return
            m = models_by_id(studio).get(model_id, m)
        try:
            choices, unfit = views.adapter_choices(studio.adapters())
        except Exception as exc:
            choices, unfit = [], error_html(readable(exc))
        note = f"{model_id} loaded"
        fused_now = studio.current_preset()
        if fused_before and fused_now != fused_before:
            note += f"; preset {fused_before} is no longer fused (a model switch restores the base weights)"
        yield [gr.update(choices=model_choices(studio), value=model_id), views.mode_markdown(m), ok_html(note)] + \
            field_updates(m, locked=locked_reasons(fused_now, preset_contract(studio, fused_now)[1])) + \
            [gr.update(choices=choices, value=choices[0][1] if choices else None), unfit]

    switch_outputs = [t.model, t.mode, t.status, *t.field_outputs(), t.pick, t.unfit]
    t.model.input(switch, [t.model], switch_outputs, api_visibility="private", concurrency_limit=None) \
        .then(**t.fit_after_switch)

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

    # -- presets ----------------------------------------------------------------------------
    def preset_note(preset_id):
        """What picking ``preset_id`` would do. The picker also changes when the poll or the page's load shows
        the server's state: for the state the server has, the note keeps what Apply said ("restored the base
        weights"), which the poll's re-sent picker replaced (a race CI met in test_preset_picker_fuses_and_restores)."""
        current = studio.current_preset()
        if (preset_id or NO_PRESET) == (current or NO_PRESET):
            return gr.update()
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

    # the app's page-load handler and the Gallery's "use these settings" reuse these
    t.load_models, t.model_outputs = load_models, model_outputs
    t.switch, t.switch_outputs = switch, switch_outputs

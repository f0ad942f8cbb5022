"""The X/Y/Z plot tab (A1111's "X/Y/Z plot" script): up to three axes over seeds, steps, guidance,
prompt search/replace, the LoRA stack's overall scale, which adapter, and the weight of one adapter
in the current stack. Every other value (prompt, model, fields, the LoRA stack) comes from the
Generate tab. The cells are queued as jobs through the Studio, followed with their progress, and
assembled into ONE labelled PNG (``ui.grid.compose_xyz``), saved with a JSON sidecar listing the
cells under ``<data-dir>/outputs/plots`` (``Studio.save_plot``) and offered for download.
"""
from __future__ import annotations

import copy
import csv
import itertools
import random
from dataclasses import dataclass
from html import escape

import gradio as gr

from backend.errors import InvalidParameter
from backend.service import check_plot_cells

from . import views
from .fields import form_values
from .follow import follow
from .generate import GenerateTab
from .server_state import models_by_id
from .stack import adapter_payload
from .grid import cell_size, compose_xyz, first_frame, geometry
from .views import error_html, readable

NOTHING = "(nothing)"
SEED, STEPS, GUIDANCE, PROMPT_SR = "Seed", "Steps", "Guidance", "Prompt S/R"
STACK_SCALE, ADAPTER = "LoRA scale (whole stack)", "Adapter"
WEIGHT = "Weight: "  # + an adapter's name in the current stack
FIXED_KINDS = (NOTHING, SEED, STEPS, GUIDANCE, PROMPT_SR, STACK_SCALE, ADAPTER)
HINTS = {
    SEED: "seeds, e.g. 1, 2, 3 (-1: one random seed)",
    STEPS: "step counts, e.g. 4, 8, 16",
    GUIDANCE: "guidance values, e.g. 1, 4, 7 (true_cfg_scale on Qwen-Image, else guidance_scale)",
    PROMPT_SR: "the first word is searched for in the prompt and replaced by each, e.g. cat, dog, fox",
    STACK_SCALE: "a factor on every weight in the LoRA stack, e.g. 0, 0.5, 1",
    ADAPTER: "adapter names added to the stack (NAME or NAME:WEIGHT; none: the stack alone)",
}


def kinds_for(stack: list[dict] | None) -> list[str]:
    """The axis choices: the fixed kinds, then one weight axis per adapter in the current stack."""
    return [*FIXED_KINDS, *(WEIGHT + e["name"] for e in stack or [])]


@dataclass(frozen=True)
class Axis:
    kind: str
    values: tuple
    labels: tuple
    title: str = ""  # the corner's name for it (Compare's "adapter weight"); the kind when empty

    @property
    def active(self) -> bool:
        return self.kind != NOTHING

    @property
    def heading(self) -> str:
        return self.title or self.kind


def corner_of(axes: tuple[Axis, Axis, Axis]) -> str:
    """The plot's top-left label: its Y axis over its X axis ("Seed \\ LoRA scale (whole stack)")."""
    x, y, _ = axes
    return " \\ ".join(a.heading for a in (y, x) if a.active)


def _split(text: str) -> list[str]:
    """Comma-separated values, CSV-quoted where a value holds a comma (as A1111's X/Y/Z plot reads them)."""
    text = (text or "").strip()
    if not text:
        return []
    return [v.strip() for v in next(csv.reader([text], skipinitialspace=True)) if v.strip()]


def parse_axis(kind: str, text: str, name: str, *, prompt: str = "", stack: list[dict] | None = None) -> Axis:
    """One axis from its kind and its values' text; errors name the axis (``name``: "X values", ...)."""
    if kind in (None, "", NOTHING):
        return Axis(NOTHING, (None,), ("",))
    items = _split(text)
    if not items:
        raise InvalidParameter(f"{name}: give comma-separated values for {kind} ({HINTS.get(kind, 'numbers')})",
                               param=name)
    try:
        if kind in (SEED, STEPS):
            values = [int(v) for v in items]
        elif kind in (GUIDANCE, STACK_SCALE) or kind.startswith(WEIGHT):
            values = [float(v) for v in items]
        else:
            values = list(items)
    except ValueError:
        raise InvalidParameter(f"{name}: {text!r} is not a list of {'integers' if kind in (SEED, STEPS) else 'numbers'}"
                               f" for {kind}", param=name) from None
    short = {SEED: "seed", STEPS: "steps", GUIDANCE: "guidance", STACK_SCALE: "LoRA scale"}
    if kind == PROMPT_SR:
        if values[0] not in (prompt or ""):
            raise InvalidParameter(f"{name}: Prompt S/R searches for its first value, {values[0]!r}, which is not "
                                   f"in the prompt", param=name)
        labels = [str(v) for v in values]
    elif kind == ADAPTER:
        parsed = []
        for v in values:
            if v.lower() == "none":
                parsed.append(None)
                continue
            nm, sep, w = v.rpartition(":") if ":" in v else (v, "", "")
            try:
                parsed.append((nm.strip(), float(w)) if sep else (v.strip(), 1.0))
            except ValueError:
                raise InvalidParameter(f"{name}: {v!r} is not NAME or NAME:WEIGHT", param=name) from None
        values = parsed
        labels = ["no adapter" if v is None else (v[0] if v[1] == 1.0 else f"{v[0]}:{v[1]:g}") for v in values]
    elif kind.startswith(WEIGHT):
        target = kind[len(WEIGHT):]
        if not any(e["name"] == target for e in stack or []):
            raise InvalidParameter(f"{name}: {target} is no longer in the LoRA stack", param=name)
        labels = [f"{target}: {v:g}" for v in values]
    elif kind in short:
        labels = [f"{short[kind]}: {v:g}" if isinstance(v, float) else f"{short[kind]}: {v}" for v in values]
    else:
        raise InvalidParameter(f"{name}: unknown axis {kind!r}; choose one of {', '.join(FIXED_KINDS)}", param=name)
    return Axis(kind, tuple(values), tuple(labels))


def _scaled(scale, factor: float):
    return {k: float(v) * factor for k, v in scale.items()} if isinstance(scale, dict) else float(scale) * factor


def apply_axis(axis: Axis, value, params: dict, adapters: list[dict], fields: frozenset) -> None:
    """One axis value applied to a cell's params and adapter payload (in place)."""
    kind = axis.kind
    if kind == NOTHING:
        return
    if kind == SEED:
        params["seed"] = value
    elif kind == STEPS:
        params["num_inference_steps"] = value
    elif kind == GUIDANCE:
        params["true_cfg_scale" if "true_cfg_scale" in fields else "guidance_scale"] = value
    elif kind == PROMPT_SR:
        search = axis.values[0]
        for key in ("prompt", "negative_prompt"):
            if isinstance(params.get(key), str):
                params[key] = params[key].replace(search, value)
    elif kind == STACK_SCALE:
        for a in adapters:
            a["scale"] = _scaled(a["scale"], value)
    elif kind == ADAPTER:
        if value is not None:
            name, weight = value
            adapters[:] = [a for a in adapters if a["name"] != name] + [{"name": name, "scale": weight}]
    elif kind.startswith(WEIGHT):
        name = kind[len(WEIGHT):]
        for a in adapters:
            if a["name"] == name:
                a["scale"] = ({k: float(value) for k in a["scale"]} if isinstance(a["scale"], dict)
                              else float(value))


def plan(axes: tuple[Axis, Axis, Axis], params: dict, adapters: list[dict], fields: frozenset) -> list[dict]:
    """The cells, Z-major then row (Y) then column (X): each {"x", "y", "z", "labels", "params", "adapters"}."""
    x, y, z = axes
    active = [a.kind for a in axes if a.active]
    if len(set(active)) != len(active):
        raise InvalidParameter(f"two axes are both {active[0] if len(active) == 2 else 'the same'}: give each "
                               f"axis its own kind", param="axes")
    if GUIDANCE in active and not ({"true_cfg_scale", "guidance_scale"} & set(fields)):
        raise InvalidParameter("the Guidance axis: this model has no guidance field", param="axes")
    if STEPS in active and "num_inference_steps" not in fields:
        raise InvalidParameter("the Steps axis: this model has no num_inference_steps field", param="axes")
    check_plot_cells(len(x.values) * len(y.values) * len(z.values))
    if params.get("seed") in (None, -1):  # one random seed for the whole plot, so cells compare
        params = {**params, "seed": random.randrange(2**31)}
    cells = []
    for (k, zv), (i, yv), (j, xv) in itertools.product(enumerate(z.values), enumerate(y.values),
                                                        enumerate(x.values)):
        p, a = dict(params), copy.deepcopy(adapters)
        for axis, value in ((z, zv), (y, yv), (x, xv)):
            apply_axis(axis, value, p, a, fields)
        if p.get("seed") == -1:
            p["seed"] = random.randrange(2**31)
        cells.append({"x": j, "y": i, "z": k, "labels": [x.labels[j], y.labels[i], z.labels[k]],
                      "params": p, "adapters": a})
    return cells


@dataclass
class PlotView:
    """A plot's controls and results, the same on X/Y/Z and Compare (``plot_view``)."""
    go: gr.Button
    cancel: gr.Button
    status: gr.HTML
    out: gr.Image
    download: gr.File
    ids: gr.State  # the plot's job ids, for Cancel

    @property
    def outputs(self) -> list:
        return [self.status, self.out, self.download, self.ids]


def plot_view(prefix: str, go_label: str, image_label: str) -> PlotView:
    with gr.Row():
        go = gr.Button(go_label, variant="primary", elem_id=f"{prefix}-go", scale=3)
        cancel = gr.Button("Cancel plot", variant="stop", elem_id=f"{prefix}-cancel", scale=1)
    status = gr.HTML(elem_id=f"{prefix}-status")
    out = gr.Image(label=image_label, type="filepath", interactive=False, elem_id=f"{prefix}-grid", format="png")
    download = gr.File(label="Download the plot (PNG) and its cells (JSON)", interactive=False,
                       elem_id=f"{prefix}-file", file_count="multiple")
    return PlotView(go, cancel, status, out, download, gr.State([]))


def wire(studio, view: PlotView, planner, inputs: list) -> None:
    """``view.go`` runs ``planner(*values)`` -> (model_id, prompt, axes, cells, cell size): every cell queued
    before any is awaited, all or none (a cell refused, or too little room in the queue, queues nothing),
    followed with the plot's ETA, then assembled into ONE PNG and saved (``Studio.save_plot``). Cancel
    cancels the cells not finished; those finished stay in the plot, the rest say "cancelled"."""
    def run(request: gr.Request, *values, progress=gr.Progress()):
        mine = studio.of(request)
        try:
            model_id, prompt, axes, cells, size = planner(*values)
            x, y, z = axes
            geometry(*size, x.labels, y.labels, z.labels, corner_of(axes))  # the picture fits the plot budget
            jobs = mine.submit_many([{"kind": "generate", "params": c["params"], "adapters": c["adapters"],
                                        "model": model_id} for c in cells])
        except Exception as exc:
            yield error_html(readable(exc)), None, None, []
            return
        ids = [str(j["id"]) for j in jobs]
        for jobs in follow(mine, ids):
            done = sum(j.get("status") in views.FINISHED for j in jobs)
            progress((done, len(jobs)), desc="plot cells", unit="images")
            yield views.plot_progress(jobs), None, None, ids
        blocks = [[[None] * len(x.values) for _ in y.values] for _ in z.values]
        problems, cancelled = [], 0
        for cell, job in zip(cells, jobs):
            cell["job"] = str(job["id"])
            cell["status"] = job.get("status")
            if job.get("status") == "succeeded":
                cell["path"] = job["result"]["path"]
                cell["seed"] = (job["result"].get("metadata") or {}).get("seed", cell["params"].get("seed"))
                blocks[cell["z"]][cell["y"]][cell["x"]] = first_frame(job["result"]["path"])
            else:
                blocks[cell["z"]][cell["y"]][cell["x"]] = job.get("status") or "failed"
                if job.get("status") == "cancelled":
                    cancelled += 1
                else:
                    problems.append(f"job {views.job_label(job)}: {job.get('error') or job.get('status')}")
        grid, layout = compose_xyz(blocks, list(x.labels), list(y.labels), list(z.labels), corner_of(axes))
        try:
            saved = studio.save_plot(grid, {"model": model_id, "prompt": prompt,
                                            "axes": [{"axis": n, "kind": a.kind, "labels": list(a.labels)}
                                                     for n, a in zip("xyz", axes)],
                                            "layout": layout, "cells": cells})
        except Exception as exc:
            yield error_html(readable(exc)), None, None, []
            return
        note = f"{len(cells)} cells" + (f" ({cancelled} cancelled)" if cancelled else "") + f" · saved {saved['path']}"
        html = (error_html(f"{note}; " + "; ".join(problems)) if problems
                else views.ok_html(note)).replace("<div ", f'<div data-path="{escape(saved["path"])}" ', 1)
        yield html, saved["path"], [saved["path"], saved["sidecar"]], []

    def cancel(request: gr.Request, ids):
        mine = studio.of(request)
        for job_id in reversed(ids or []):  # the queued cells first, so none starts as the running one stops
            mine.cancel(job_id)  # a finished cell is left as it is

    view.go.click(run, inputs, view.outputs, api_visibility="private", concurrency_limit=None)
    view.cancel.click(cancel, [view.ids], None, api_visibility="private", queue=False)


def build(studio, gen: GenerateTab, tab: gr.Tab) -> None:
    gr.Markdown("An **X/Y/Z plot**: every cell is a job on the **Generate** tab's model with its prompt, fields "
                "and LoRA stack, changed along up to three axes. The result is one labelled PNG (one X/Y grid "
                "per Z value), saved under the outputs folder with a JSON sidecar listing the cells.")
    rows = []
    defaults = ((SEED, "1, 2"), (STACK_SCALE, "0, 1"), (NOTHING, ""))
    for axis, (kind, text) in zip("xyz", defaults):
        with gr.Row():
            pick = gr.Dropdown(kinds_for([]), value=kind, label=f"{axis.upper()} axis", elem_id=f"xyz-{axis}-kind",
                               scale=1)
            values = gr.Textbox(label=f"{axis.upper()} values", value=text, elem_id=f"xyz-{axis}-values", scale=3,
                                info=HINTS.get(kind))
        rows.append((pick, values))
    view = plot_view("xyz", "Queue plot", "Plot")

    # the weight axes follow the stack: one per adapter in it, offered as the tab opens (a State's change
    # event does not fire for the Generate tab's stack edits, #26: the "Weight: NAME" axes never appeared)
    def follow_stack(stack, *kinds):
        choices = kinds_for(stack)
        return [gr.update(choices=choices, value=k if k in choices else NOTHING) for k in kinds]

    picks = [p for p, _ in rows]
    tab.select(follow_stack, [gen.stack, *picks], picks, api_visibility="private", queue=False)
    for pick, values in rows:
        pick.change(lambda kind: gr.update(info=HINTS.get(kind, "weights, e.g. 0, 0.5, 1")), pick, values,
                    api_visibility="private", queue=False)

    def planner(xk, xv, yk, yv, zk, zv, model_id, prompt, seed, stack, *values):
        m = models_by_id(studio).get(model_id)
        if m is None:
            raise InvalidParameter(f"pick a model on the Generate tab first (got {model_id!r})", param="model")
        axes = tuple(parse_axis(k, v, f"{n} values", prompt=prompt or "", stack=stack)
                     for n, k, v in (("X", xk, xv), ("Y", yk, yv), ("Z", zk, zv)))
        if not any(a.active for a in axes):
            raise InvalidParameter("choose at least one axis", param="axes")
        params = form_params(m, prompt, seed, values)
        cells = plan(axes, params, adapter_payload(stack or [], m.two_stage), m.fields)
        return model_id, prompt, axes, cells, cell_size(params, m.defaults)

    wire(studio, view, planner, [*(c for row in rows for c in row), gen.model, gen.prompt, gen.seed, gen.stack,
                                 *gen.field_outputs()])


def form_params(m, prompt, seed, values) -> dict:
    """The Generate tab's prompt, seed and the fields the model has, as a cell's params."""
    return {"prompt": prompt or "", "seed": -1 if seed is None else int(seed), **form_values(m.fields, values)}

"""The Compare tab: an X/Y grid (A1111's X/Y plot) queued as one batch.

X is always the adapter weight; Y is either several adapters (at the same seed) or
several seeds (with one adapter). Every cell is a job submitted before any is
awaited, so the whole grid sits in the queue at once; the prompt and sampling
fields come from the Generate tab.
"""
from __future__ import annotations

import gradio as gr

from backend.errors import InvalidParameter
from backend.service import check_plot_cells

from . import views
from .fields import WIDGETS, clean_value
from .follow import follow
from .generate import GenerateTab
from .server_state import models_by_id
from .grid import cell_size, compose, corner, first_frame, geometry, parse_numbers
from .views import error_html, readable


Y_TITLES = {"adapters": "adapter", "seeds": "seed"}  # the Y axis by its choice; X is "adapter weight"


def plan(y_axis: str, scales: list[float], adapters: list[str], seeds: list[int], seed: int):
    """[(y_label, [(x_label, adapters payload, seed)])] for the grid."""
    rows = []
    if y_axis == "adapters":
        for name in adapters:
            rows.append((name, [(f"{s:g}", [{"name": name, "scale": s}], seed) for s in scales]))
    else:
        name = adapters[0]
        for sd in seeds:
            rows.append((f"seed {sd}", [(f"{name} {s:g}", [{"name": name, "scale": s}], sd) for s in scales]))
    return rows


def build(studio, gen: GenerateTab) -> None:
    gr.Markdown("Queue a grid of generations as one batch: the prompt, model and sampling fields come from "
                "the **Generate** tab; X is the adapter weight, Y is adapters or seeds.")
    with gr.Row():
        scales = gr.Textbox(label="X: adapter weights", value="0, 0.5, 1, 1.5", elem_id="cmp-scales")
        y_axis = gr.Radio(["adapters", "seeds"], value="adapters", label="Y axis", elem_id="cmp-y")
    with gr.Row():
        adapters = gr.Dropdown(label="Adapters (Y = adapters; the first one for Y = seeds)", multiselect=True,
                               choices=[], elem_id="cmp-adapters")
        seeds = gr.Textbox(label="Y: seeds", value="1, 2, 3", elem_id="cmp-seeds")
    go = gr.Button("Queue grid", variant="primary", elem_id="cmp-go")
    status = gr.HTML(elem_id="cmp-status")
    out = gr.Image(label="Grid", type="pil", interactive=False, elem_id="cmp-grid", format="png")

    def refresh_choices():
        try:
            choices, _ = views.adapter_choices(studio.adapters())
        except Exception:
            choices = []
        return gr.update(choices=choices)

    adapters.focus(refresh_choices, None, adapters, api_visibility="private")

    def run(request: gr.Request, scale_text, axis, names, seed_text, model_id, prompt, seed, *values,
            progress=gr.Progress()):
        m, mine = models_by_id(studio).get(model_id), studio.of(request)
        try:
            if m is None:
                raise InvalidParameter(f"pick a model on the Generate tab first (got {model_id!r})")
            xs = parse_numbers(scale_text, name="X: adapter weights")
            ys = parse_numbers(seed_text, kind=int, name="Y: seeds") if axis == "seeds" else []
            if not names:
                raise InvalidParameter("choose at least one adapter", param="adapters")
            base = {"prompt": prompt}
            for w, v in zip(WIDGETS, values):
                if w.name in m.fields and clean_value(w, v) is not None:
                    base[w.name] = clean_value(w, v)
            check_plot_cells(len(xs) * (len(names) if axis == "adapters" else len(ys)))  # before any planning
            layout = plan(axis, xs, list(names), ys, int(seed if seed is not None else 0))
            geometry(*cell_size(base, m.defaults), [x for x, _, _ in layout[0][1]], [y for y, _ in layout], [""],
                     corner("adapter weight", Y_TITLES[axis]))  # the picture fits the plot budget
            # all queued before any is awaited, all or none (a refused cell or a full queue queues nothing)
            places = [(r, c) for r, (_, row) in enumerate(layout) for c in range(len(row))]
            jobs = mine.submit_many([{"kind": "generate", "params": {**base, "seed": sd}, "adapters": payload,
                                        "model": model_id} for _, row in layout for _, payload, sd in row])
            cells = [(r, c, job) for (r, c), job in zip(places, jobs)]
        except Exception as exc:
            yield error_html(readable(exc)), None
            return
        ids = [job["id"] for _, _, job in cells]
        for jobs in follow(mine, ids):
            done = sum(j.get("status") in views.FINISHED for j in jobs)
            progress((done, len(jobs)), desc="grid cells", unit="images")
            yield (f'<div class="ls-job" data-done="{done}" data-total="{len(jobs)}">'
                   f'{done}/{len(jobs)} cells finished · queued as one batch (jobs {ids[0]}…{ids[-1]})</div>'), None
        images = [[None] * len(layout[0][1]) for _ in layout]
        failed, cancelled = [], []
        for (r, c, _), job in zip(cells, jobs):
            if job.get("status") == "succeeded":
                images[r][c] = first_frame(job["result"]["path"])
            elif job.get("status") == "cancelled":
                images[r][c] = "cancelled"
                cancelled.append(str(job["id"]))
            else:
                images[r][c] = "failed"
                failed.append(f"job {job['id']}: {job.get('error') or job.get('status')}")
        grid = compose(images, [x for x, _, _ in layout[0][1]], [y for y, _ in layout], "adapter weight",
                       Y_TITLES[axis])
        done_note = f"{len(ids)} cells" + (f" ({len(cancelled)} cancelled: jobs {', '.join(cancelled)})"
                                           if cancelled else "")
        yield (error_html("; ".join(failed)) if failed else views.ok_html(done_note)), grid

    go.click(run, [scales, y_axis, adapters, seeds, gen.model, gen.prompt, gen.seed, *gen.field_outputs()],
             [status, out], api_visibility="private", concurrency_limit=None)

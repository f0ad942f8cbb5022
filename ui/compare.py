"""The Compare tab: A1111's X/Y plot of adapter weights, a preset of the X/Y/Z plot.

X is the adapter weight; Y is either several adapters (at the same seed) or several seeds
(with the first adapter). The tab only turns its few inputs into X/Y/Z axes (``axes``): the
cells are planned, queued as one batch, followed (ETA, Cancel), assembled and saved by
``ui.xyz`` exactly as an X/Y/Z plot is. The prompt, model and sampling fields come from the
Generate tab; its LoRA stack does not take part (the adapters chosen here are the plot).
"""
from __future__ import annotations

import gradio as gr

from backend.errors import InvalidParameter
from backend.service import check_plot_cells

from . import views
from .generate import GenerateTab
from .grid import cell_size, parse_numbers
from .server_state import models_by_id
from .xyz import ADAPTER, NOTHING, SEED, STACK_SCALE, Axis, form_params, plan, plot_view, wire

Y_TITLES = {"adapters": "adapter", "seeds": "seed"}  # the Y axis by its choice; X is "adapter weight"


def axes(y_axis: str, scales: list[float], adapters: list[str], seeds: list[int]) -> tuple[tuple, list[dict]]:
    """The X/Y/Z axes and the starting stack for a Compare grid: X scales the whole (one-adapter) stack;
    Y adds each adapter at weight 1 (then scaled by X), or sets the seed with the first adapter."""
    if not adapters:
        raise InvalidParameter("choose at least one adapter", param="adapters")
    if y_axis == "adapters":
        x = Axis(STACK_SCALE, tuple(scales), tuple(f"{s:g}" for s in scales), "adapter weight")
        y = Axis(ADAPTER, tuple((name, 1.0) for name in adapters), tuple(adapters), Y_TITLES[y_axis])
        stack = []
    else:
        name = adapters[0]
        x = Axis(STACK_SCALE, tuple(scales), tuple(f"{name} {s:g}" for s in scales), "adapter weight")
        y = Axis(SEED, tuple(seeds), tuple(f"seed {sd}" for sd in seeds), Y_TITLES[y_axis])
        stack = [{"name": name, "scale": 1.0}]
    return (x, y, Axis(NOTHING, (None,), ("",))), stack


def build(studio, gen: GenerateTab) -> None:
    gr.Markdown("Queue a grid of generations as one batch: the prompt, model and sampling fields come from "
                "the **Generate** tab; X is the adapter weight, Y is adapters or seeds. (A preset of the "
                "**X/Y/Z plot**, which has more axes.)")
    with gr.Row():
        scales = gr.Textbox(label="X: adapter weights", value="0, 0.5, 1, 1.5", elem_id="cmp-scales")
        y_axis = gr.Radio(["adapters", "seeds"], value="adapters", label="Y axis", elem_id="cmp-y")
    with gr.Row():
        adapters = gr.Dropdown(label="Adapters (Y = adapters; the first one for Y = seeds)", multiselect=True,
                               choices=[], elem_id="cmp-adapters")
        seeds = gr.Textbox(label="Y: seeds", value="1, 2, 3", elem_id="cmp-seeds")
    view = plot_view("cmp", "Queue grid", "Grid")

    def refresh_choices():
        try:
            choices, _ = views.adapter_choices(studio.adapters())
        except Exception:
            choices = []
        return gr.update(choices=choices)

    adapters.focus(refresh_choices, None, adapters, api_visibility="private")

    def planner(scale_text, axis, names, seed_text, model_id, prompt, seed, *values):
        m = models_by_id(studio).get(model_id)
        if m is None:
            raise InvalidParameter(f"pick a model on the Generate tab first (got {model_id!r})", param="model")
        xs = parse_numbers(scale_text, name="X: adapter weights")
        ys = parse_numbers(seed_text, kind=int, name="Y: seeds") if axis == "seeds" else []
        check_plot_cells(len(xs) * (len(names or []) if axis == "adapters" else len(ys)))  # before any planning
        grid_axes, stack = axes(axis, xs, list(names or []), ys)
        params = form_params(m, prompt, seed, values)
        return model_id, prompt, grid_axes, plan(grid_axes, params, stack, m.fields), cell_size(params, m.defaults)

    wire(studio, view, planner, [scales, y_axis, adapters, seeds, gen.model, gen.prompt, gen.seed,
                                 *gen.field_outputs()])

"""The Gallery tab: past outputs with their prompts as captions, filtered by model and adapter, in
pages (``Studio.outputs(limit, offset)``); "use these settings" sends one back to Generate, Delete
removes it and its sidecar (after a confirmation in the browser), and dropping an image (ours, A1111's
or ComfyUI's) restores its settings."""
from __future__ import annotations

from pathlib import Path

import gradio as gr

from . import views
from .generate import GenerateTab
from .stack import EDIT as STACK_EDIT
from .views import error_html, ok_html, readable


ANY_MODEL, ANY_ADAPTER = "(any model)", "(any adapter)"
PAGE_SIZES = (12, 24, 48, 96, 200)
# Delete asks the browser first; the answer travels in a hidden box beside the chosen path
CONFIRM_DELETE = ("(path, _) => [path, (!path || window.confirm(`Delete ${path.split('/').pop()} and its "
                  "sidecar from the outputs folder?`)) ? 'yes' : 'no']")


def caption(item: dict) -> str:
    """A thumbnail's caption: its prompt (shortened) and seed."""
    prompt = " ".join(str(item.get("prompt") or "").split()) or "(no prompt)"
    prompt = prompt if len(prompt) <= 70 else prompt[:70] + "…"
    return f"{prompt} · seed {item['seed']}" if item.get("seed") is not None else prompt


def page_html(first: int, shown: int, total: int) -> str:
    text = f"{first + 1}–{first + shown} of {total} result(s)" if shown else f"no results ({total} in all)"
    return f'<div class="ls-page" data-first="{first + 1 if shown else 0}" data-last="{first + shown}" ' \
           f'data-total="{total}">{text}</div>'


def build(studio, gen: GenerateTab, tabs: gr.Tabs):
    with gr.Row():
        refresh = gr.Button("Refresh", elem_id="gallery-refresh", scale=0, min_width=90)
        model_f = gr.Dropdown([ANY_MODEL], value=ANY_MODEL, label="Model", elem_id="gallery-model", scale=2)
        adapter_f = gr.Dropdown([ANY_ADAPTER], value=ANY_ADAPTER, label="Adapter", elem_id="gallery-adapter",
                                scale=2)
        per_page = gr.Dropdown(list(PAGE_SIZES), value=48, label="Per page", elem_id="gallery-per-page", scale=1,
                               min_width=90)
        prev = gr.Button("◀ Newer", elem_id="gallery-prev", scale=0, min_width=90)
        nxt = gr.Button("Older ▶", elem_id="gallery-next", scale=0, min_width=90)
    page_info = gr.HTML(elem_id="gallery-page")
    items = gr.State([])
    chosen = gr.State(None)
    page = gr.State(0)
    with gr.Row():
        with gr.Column(scale=3):
            gallery = gr.Gallery(label="Outputs (newest first)", columns=6, height=480, allow_preview=True,
                                 elem_id="gallery", interactive=False, show_label=True)
        with gr.Column(scale=2):
            meta = gr.JSON(label="Parameters", elem_id="gallery-meta")
            with gr.Row():
                use = gr.Button("Use these settings", variant="primary", elem_id="gallery-use")
                delete = gr.Button("Delete", variant="stop", elem_id="gallery-delete")
            selected = gr.Textbox(visible=False, elem_id="gallery-selected")
            confirmed = gr.Textbox(value="yes", visible=False)
            drop = gr.File(label="…or drop an image (LoRA Studio, A1111 or ComfyUI PNG; JPEG/WebP)",
                           file_types=[".png", ".jpg", ".jpeg", ".webp"], type="filepath",
                           elem_id="gallery-drop")
            status = gr.HTML(elem_id="gallery-status")

    def page_of(request, model=ANY_MODEL, adapter=ANY_ADAPTER, size=48, number=0, note=""):
        """One page of the signed-in user's outputs (an admin's: everyone's)."""
        mine = studio.of(request)
        try:
            facets = mine.output_facets()
            size = int(size or 48)
            model = model if model in facets["models"] else ANY_MODEL
            adapter = adapter if adapter in facets["adapters"] else ANY_ADAPTER
            keep = dict(model=None if model == ANY_MODEL else model,
                        adapter=None if adapter == ANY_ADAPTER else adapter)
            total = len(mine.outputs(limit=10**9, **keep)) if any(keep.values()) else facets["total"]
            number = max(0, min(int(number or 0), max(0, (total - 1) // size)))
            outs = mine.outputs(limit=size, offset=number * size, **keep)
        except Exception as exc:
            return [gr.update()] * 4 + [number, gr.update(), gr.update(), error_html(readable(exc))]
        shown = [(o["path"], caption(o)) for o in outs]
        return [shown, outs, page_html(number * size, len(outs), total), "", number,
                gr.update(choices=[ANY_MODEL, *facets["models"]], value=model),
                gr.update(choices=[ANY_ADAPTER, *facets["adapters"]], value=adapter), note]

    filters = [model_f, adapter_f, per_page]
    list_outs = [gallery, items, page_info, selected, page, model_f, adapter_f, status]
    def listing(request: gr.Request, m=ANY_MODEL, a=ANY_ADAPTER, n=48, p=0):
        return page_of(request, m, a, n, p)

    def first_page(request: gr.Request, m, a, n):  # a new filter starts at the first page
        return page_of(request, m, a, n, 0)

    def prev_page(request: gr.Request, m, a, n, p):
        return page_of(request, m, a, n, p - 1)

    def next_page(request: gr.Request, m, a, n, p):
        return page_of(request, m, a, n, p + 1)

    refresh.click(listing, [*filters, page], list_outs, api_visibility="private")
    for f in filters:
        f.input(first_page, filters, list_outs, api_visibility="private")
    prev.click(prev_page, [*filters, page], list_outs, api_visibility="private")
    nxt.click(next_page, [*filters, page], list_outs, api_visibility="private")

    def select(outs, evt: gr.SelectData):
        if evt is None or evt.index is None or evt.index >= len(outs):
            return None, None, ""
        m = outs[evt.index].get("metadata") or {}
        return m, views.settings_from_metadata(m), outs[evt.index]["path"]

    gallery.select(select, items, [meta, chosen, selected], api_visibility="private")

    def remove(request: gr.Request, path, answer, m, a, n, p):
        if answer == "no":  # the browser's confirmation was answered "Cancel": the choice stays
            kept = page_of(request, m, a, n, p, ok_html(f"nothing deleted ({Path(path).name} kept)"))
            kept[3] = path
            return kept
        if not path:
            return page_of(request, m, a, n, p, error_html("choose an output first"))
        try:
            gone = studio.of(request).delete_output(path)["deleted"]
        except Exception as exc:
            return page_of(request, m, a, n, p, error_html(readable(exc)))
        return page_of(request, m, a, n, p, ok_html(f"deleted {', '.join(Path(x).name for x in gone)}"))

    delete.click(remove, [selected, confirmed, *filters, page], list_outs, api_visibility="private",
                 js="(path, answer, ...rest) => [...(" + CONFIRM_DELETE + ")(path, answer), ...rest]")

    def from_png(path):
        """A dropped image's settings: ours, A1111's infotext or ComfyUI's graph (Studio.png_info)."""
        if not path:
            return None, None, ""
        try:
            info = studio.png_info(path)
        except Exception as exc:
            return None, None, error_html(readable(exc))
        if not info:
            return None, None, error_html(f"{Path(path).name} carries no LoRA Studio settings (nor A1111 "
                                          f"'parameters' or ComfyUI 'prompt'/'workflow' ones)")
        return info, info, ""

    def to_model(settings, model_id):
        if not settings:  # stops the chain below (it runs .success only)
            raise gr.Error("choose an output (or drop a PNG) first")
        # another tool's image names no model of ours: its settings go to the model shown now
        return gr.update(value=settings.get("model") or model_id), gr.Tabs(selected="generate")

    restore = (lambda settings, model_id: gen.restore_updates(studio, settings, model_id))
    def restore_chain(event):
        event.success(to_model, [chosen, gen.model], [gen.model, tabs], api_visibility="private") \
            .success(gen.switch, [gen.model], gen.switch_outputs, api_visibility="private") \
            .success(**gen.fit_after_switch) \
            .success(restore, [chosen, gen.model], gen.restore_outputs(), **STACK_EDIT)

    restore_chain(use.click(lambda: None, None, None, api_visibility="private", queue=False))
    dropped = drop.upload(from_png, drop, [meta, chosen, status], api_visibility="private")
    restore_chain(dropped)
    dropped.then(lambda: None, None, drop, api_visibility="private", queue=False)  # ready for the next one
    return listing, [*filters, page], list_outs

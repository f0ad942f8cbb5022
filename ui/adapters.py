"""The Adapters tab: the library as a table, a detail view, import by upload, delete, pin."""
from __future__ import annotations

from pathlib import Path

import gradio as gr

from . import views
from .views import error_html, ok_html, readable

UPLOAD_TYPES = [".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt"]  # pickles are refused by the backend


def default_name(paths: list[str]) -> str:
    first = Path(paths[0])
    return first.stem if len(paths) == 1 else first.parent.name


# Delete asks the browser first; the answer travels in a hidden box beside the adapter's name
CONFIRM_DELETE = ("(name, _) => [name, (!name || window.confirm(`Delete the adapter ${name} from the library? "
                  "Its file is removed.`)) ? 'yes' : 'no']")


def build(studio):
    with gr.Row():
        refresh = gr.Button("Refresh", scale=0, elem_id="adapters-refresh")
        status = gr.HTML(elem_id="adapters-status")
    table = gr.Dataframe(headers=views.ADAPTER_COLUMNS, value=[], interactive=False, wrap=True,
                         column_widths=["17%", "8%", "5%", "5%", "10%", "7%", "10%", "26%", "7%", "5%"],
                         elem_id="adapters-table", label="Library (fit is for the loaded model)")
    with gr.Row():
        with gr.Column(scale=2):
            selected = gr.Dropdown(label="Adapter", choices=[], elem_id="adapters-selected")
            confirmed = gr.Textbox(value="yes", visible=False)
            with gr.Row():
                pin = gr.Button("Pin", elem_id="adapters-pin")
                unpin = gr.Button("Unpin", elem_id="adapters-unpin")
                delete = gr.Button("Delete", variant="stop", elem_id="adapters-delete")
            with gr.Row(equal_height=True):
                copy_name = gr.Textbox(label="Save a copy as", max_lines=1, scale=3, elem_id="adapters-copy-name",
                                       placeholder="a name for the copy",
                                       info="the chosen adapter at weight 1, in the layout picked: kohya for "
                                            "ComfyUI and A1111, diffusers for diffusers and peft")
                copy_layout = gr.Dropdown(label="layout", scale=1, min_width=120, elem_id="adapters-copy-layout",
                                          choices=[("kohya", "kohya"), ("diffusers", "diffusers")], value="kohya")
                copy = gr.Button("Save copy", scale=1, elem_id="adapters-copy")
            detail = gr.JSON(label="Detail: config, safetensors metadata, fit report", elem_id="adapters-detail")
        with gr.Column(scale=1):
            gr.Markdown("**Import**: a `.safetensors` LoRA (diffusers, kohya, ComfyUI, lightx2v keys), or a PEFT "
                        "folder's `adapter_config.json` + `adapter_model.safetensors` together. Pickled files are "
                        "refused.")
            upload = gr.File(label="Adapter file(s)", file_count="multiple", file_types=UPLOAD_TYPES,
                             type="filepath", elem_id="adapters-upload")
            name = gr.Textbox(label="Name (default: the file name)", elem_id="adapters-name")
            do_import = gr.Button("Import", variant="primary", elem_id="adapters-import")

    def listing(message: str | None = None):
        # a plain refresh (tab opened, Refresh) keeps the status line: it may still be
        # showing the answer to an import that finished while the table was loading
        try:
            adapters, where = studio.adapters(), views.tiers_of(studio.system())
        except Exception as exc:
            return [gr.update(), gr.update(), error_html(readable(exc))]
        names = [a["name"] for a in adapters]
        return [views.adapter_rows(adapters, where), gr.update(choices=names),
                gr.update() if message is None else message]

    outs = [table, selected, status]
    refresh.click(listing, None, outs, api_visibility="private")

    def show(name):
        # leave the status alone unless the detail fails: a listing refresh changes the
        # dropdown's choices, and clearing here would wipe the import/pin message it shows
        if not name:
            return None, gr.update()
        try:
            return studio.adapter_detail(name), gr.update()
        except Exception as exc:
            return None, error_html(readable(exc))

    selected.change(show, selected, [detail, status], api_visibility="private")

    def pick_row(evt: gr.SelectData):
        row = evt.row_value if evt is not None else None
        return row[0] if row else gr.update()

    table.select(pick_row, None, selected, api_visibility="private")

    def act(verb):
        def run(name, answer="yes"):
            if answer == "no":  # the browser's confirmation was answered "Cancel"
                return listing(ok_html(f"nothing deleted ({name} kept)"))
            if not name:
                return listing(error_html("choose an adapter first"))
            try:
                if verb == "delete":
                    studio.delete_adapter(name)
                else:
                    studio.pin(name, verb == "pin")
            except Exception as exc:
                return listing(error_html(readable(exc)))
            return listing(ok_html(f"{verb}{'ned' if verb != 'delete' else 'd'} {name}"))
        return run

    for btn, verb in ((pin, "pin"), (unpin, "unpin"), (delete, "delete")):
        btn.click(act(verb), [selected, confirmed] if verb == "delete" else selected, outs,
                  api_visibility="private", js=CONFIRM_DELETE if verb == "delete" else None)

    def save_copy(name, new_name, layout):
        """The chosen adapter written again, alone at weight 1, in another layout (Studio.export_adapter):
        a LoRA made for diffusers, as kohya names for ComfyUI or A1111, and back."""
        if not name:
            return [*listing(error_html("choose an adapter first")), gr.update()]
        if not str(new_name or "").strip():
            return [*listing(error_html("give the copy a name first")), gr.update()]
        try:
            done = studio.export_adapter([{"name": name, "scale": 1.0}], str(new_name).strip(), layout=layout)
        except Exception as exc:  # a taken name, a layout that cannot hold it, a LyCORIS / DoRA adapter
            return [*listing(error_html(f"could not save {name} as {str(new_name).strip()!r}: {readable(exc)}")),
                    gr.update()]
        how = "exact" if done.get("exact_in") else "to fp32 rounding"
        return [*listing(ok_html(f"saved {name} as {done['adapter']['name']} in the {layout} layout "
                                 f"({done['layers']} layers, {how})")), ""]

    copy.click(save_copy, [selected, copy_name, copy_layout], [*outs, copy_name], api_visibility="private")

    def imp(paths, given):
        """Import, then clear the upload box (success or not) so the next upload starts fresh."""
        if not paths:
            return [*listing(error_html("choose a file to import")), None]
        paths = [paths] if isinstance(paths, str) else list(paths)
        label = (given or "").strip() or default_name(paths)
        try:
            # the backend checks the name before any byte is written and stages inside the library
            record = studio.import_adapter(paths, label)
        except Exception as exc:
            files = ", ".join(Path(p).name for p in paths)
            return [*listing(error_html(f"could not import {files} as {label!r}: {readable(exc)}")), None]
        shown = record.get("name", label) if isinstance(record, dict) else label
        return [*listing(ok_html(f"imported {shown}")), None]

    do_import.click(imp, [upload, name], [*outs, upload], api_visibility="private", show_progress="minimal")
    return listing, outs

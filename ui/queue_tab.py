"""The Queue tab: a live table of jobs, cancel and retry. The table fits the page (nine columns with set
widths) and is redrawn only when a row changed: an idle queue leaves it alone under the cursor."""
from __future__ import annotations

import gradio as gr

from . import views
from .views import error_html, ok_html, readable

REFRESH_S = 1.0


def build(studio):
    timer = gr.Timer(REFRESH_S, active=False)
    table = gr.Dataframe(headers=views.JOB_COLUMNS, value=[], interactive=False, wrap=True,
                         column_widths=views.JOB_COLUMN_WIDTHS, elem_id="queue-table",
                         label="Jobs (newest first; refreshes itself)")
    shown = gr.State(None)  # the rows the table holds now
    with gr.Row():
        job_id = gr.Textbox(label="Job (its number, #12, or its id)", elem_id="queue-job", scale=2)
        cancel = gr.Button("Cancel", variant="stop", elem_id="queue-cancel", scale=1)
        retry = gr.Button("Retry", elem_id="queue-retry", scale=1)
    status = gr.HTML(elem_id="queue-status")

    def rows(request):
        """The signed-in user's jobs (an admin's: everyone's)."""
        try:
            return views.job_rows(studio.of(request).jobs(limit=100))
        except Exception as exc:
            return gr.update(label=f"Jobs (could not list: {readable(exc)})")

    def tick(request: gr.Request, before):
        now = rows(request)
        if now == before:
            return gr.update(), before
        return now, now if isinstance(now, list) else None

    timer.tick(tick, shown, [table, shown], api_visibility="private", queue=False, show_progress="hidden")

    def pick(evt: gr.SelectData):
        row = evt.row_value if evt is not None else None
        return str(row[0]) if row else gr.update()

    table.select(pick, None, job_id, api_visibility="private")

    def do_cancel(request: gr.Request, jid):
        if not jid:
            return error_html("enter or click a job first"), rows(request)
        try:
            job = studio.of(request).cancel(jid.strip())
        except Exception as exc:
            return error_html(readable(exc)), rows(request)
        return (ok_html(f"job {jid}: {job.get('status', 'cancelled') if isinstance(job, dict) else 'cancelled'}"),
                rows(request))

    def do_retry(request: gr.Request, jid):
        if not jid:
            return error_html("enter or click a job first"), rows(request)
        mine = studio.of(request)
        try:
            old = mine.job(jid.strip())
            new = mine.submit(old.get("kind") or "generate", old.get("params") or {}, old.get("adapters"),
                              old.get("preset"), old.get("model"))
        except Exception as exc:
            return error_html(readable(exc)), rows(request)
        return ok_html(f"job {jid} queued again as job {views.job_label(new)}"), rows(request)

    cancel.click(do_cancel, job_id, [status, table], api_visibility="private")
    retry.click(do_retry, job_id, [status, table], api_visibility="private")
    return timer, rows, table

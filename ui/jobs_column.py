"""The Generate tab's job column. Jobs belong to the server, not to the page: Generate only queues
them (one per click, ``batch`` per click with seeds +1) and returns at once; a timer on the page polls
the server for its active jobs and the ones this page queued, so a reload, a second tab or another
device re-attaches to running and queued jobs, and closing the page cancels nothing. The same poll
keeps the page in step with the server's state: the fused preset (badge, picker, sampling fields),
the loaded model and the adapter library."""
from __future__ import annotations

import random

import gradio as gr

from backend.service import MAX_BATCH_SIZE

from . import views
from .fields import WIDGETS, form_values
from .result_view import result_updates
from .server_state import (adapter_pick_updates, badge_html, field_updates, locked_reasons, model_choices,
                           models_by_id, preset_choices, preset_contract, NO_PRESET)
from .stack import adapter_payload, stack_as_shown, stack_weights
from .views import ModelInfo, error_html, ok_html, readable

MAX_BATCH = 16  # batch count
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


def wire(studio, t, go, stop, cancel_one) -> None:
    """Generate (queue the jobs), Cancel (every job the page follows), a job line's ✕, and the poll."""
    followed = Followed()

    def submit(request: gr.Request, model_id, prompt, seed, batch, size, stack, watch, *values):
        """Queue batch count x batch size jobs (one image each, seeds +1), all or none; a batch's jobs carry
        ``batch_size`` so the server may run them as one pipeline call (backend/batch.py)."""
        values, weights = values[:len(WIDGETS)], values[len(WIDGETS):]
        stack = stack_as_shown(stack, weights)
        m = models_by_id(studio).get(model_id)
        if m is None:
            return [error_html(f"pick a model first (got {model_id!r})"), gr.update(), gr.update()]
        for label, value, top in (("Batch count", batch, MAX_BATCH), ("Batch size", size, MAX_BATCH_SIZE)):
            if value is None or not 1 <= value <= top:
                return [error_html(f"{label} must be 1 to {top}, got {'nothing' if value is None else value}"),
                        gr.update(), gr.update()]
        n = int(batch) * int(size)
        try:
            stack_weights(stack, m.two_stage)
        except ValueError as exc:
            return [error_html(str(exc)), gr.update(), gr.update()]
        seed = -1 if seed is None else int(seed)
        base_seed = random.randrange(2**31) if seed == -1 else seed  # -1: random, then +1 per job
        params = {"prompt": prompt, **form_values(m.fields, values)}
        if int(size) > 1:
            params["batch_size"] = int(size)
        try:
            payload = adapter_payload(stack, m.two_stage)
        except Exception as exc:  # a bad "weight over steps": refused by name, nothing queued
            return [error_html(readable(exc)), gr.update(), gr.update()]
        mine = studio.of(request)
        try:  # all n or none; the server knows what it has fused (apply_preset): the jobs need not name it
            queued = mine.submit_many([{"kind": "generate", "params": {**params, "seed": base_seed + i},
                                          "adapters": payload, "model": model_id} for i in range(n)])
        except Exception as exc:
            return [error_html(readable(exc)), gr.update(), gr.update()]
        first = queued[0]
        where = (f"position {first['queue_position']} in the queue" if first.get("queue_position")
                 else "starting")
        ids = ", ".join(views.job_label(j) for j in queued)
        note = views.queued_html(f"queued job{'s' if n > 1 else ''} {ids} (seed {base_seed}"
                                 f"{f'…{base_seed + n - 1}' if n > 1 else ''}) · {where}",
                                 [str(j["id"]) for j in queued])
        # a new click starts a new list: the finished jobs of earlier clicks leave it
        known = list(dict.fromkeys([*((watch or {}).get("ids") or []), *followed.get(_session(request))]))
        keep = [j for j in known if _active(mine, j)]
        watch = {**(watch or {}), "ids": keep + [str(j["id"]) for j in queued]}
        followed.set(_session(request), watch["ids"])
        return [note, watch, str(queued[-1]["id"])]

    weights = t.weight_inputs()
    go.click(submit, [t.model, t.prompt, t.seed, t.batch, t.batch_size, t.stack, t.watch, *t.field_outputs(), *weights],
             [t.status, t.watch, t.job_id], api_visibility="private", queue=False, trigger_mode="multiple",
             show_progress="hidden")

    def cancel_jobs(request: gr.Request, watch):
        """Cancel every queued or running job this page follows."""
        cancelled, errors, mine = [], [], studio.of(request)
        for job_id in dict.fromkeys([*((watch or {}).get("ids") or []), *followed.get(_session(request))]):
            if not _active(mine, job_id):
                continue
            try:
                mine.cancel(job_id)
                cancelled.append(job_id)
            except Exception as exc:  # finished meanwhile
                errors.append(readable(exc))
        if errors and not cancelled:
            return error_html(errors[0])
        return ok_html(f"cancelled job{'s' if len(cancelled) > 1 else ''} {', '.join(cancelled)}" if cancelled
                       else "nothing to cancel")

    stop.click(cancel_jobs, t.watch, t.status, api_visibility="private", queue=False)

    def poll(request: gr.Request, watch, seen, model_id, note):
        """The page's view of the server: its jobs, fused preset, loaded model and adapter library.
        Each part is sent only when it changed (gr.update() otherwise). A "queued ... position 1" note
        leaves once the jobs it names have ended (their lines in the job list say how)."""
        watch, seen = dict(watch or {}), dict(seen or {})
        out, mine = {}, studio.of(request)
        # jobs: the server's active ones (a reload, another tab) plus the ones this page queued (its state,
        # and the table a click that ran beside this poll wrote to)
        try:
            ids = list(dict.fromkeys([*(watch.get("ids") or []), *followed.get(_session(request))]))
            for j in mine.active_jobs():
                if str(j["id"]) not in ids:
                    ids.append(str(j["id"]))
            jobs = []
            for job_id in ids:
                try:
                    jobs.append(mine.job(job_id))
                except Exception:  # gone (pruned): nothing to show
                    pass
            finished = [j for j in jobs if j.get("status") in views.FINISHED]
            while len(jobs) > MAX_WATCH and finished:
                jobs.remove(finished.pop(0))
            watch["ids"] = [str(j["id"]) for j in jobs]
            spp = studio.seconds_per_step() if any(j.get("status") == "running" for j in jobs) else None
            previews = {}
            shows_previews = studio.preferences()["live_previews"]  # the Settings tab's switch
            for j in jobs:  # the running job's latents as a small image, about once a second
                if shows_previews and j.get("status") == "running":
                    try:
                        previews[str(j["id"])] = mine.job_preview(j["id"])
                    except Exception:  # it ended meanwhile
                        pass
            named = views.queued_ids(note)
            if named and all(j.get("status") in views.FINISHED for j in jobs if str(j["id"]) in named):
                out["note"] = ""  # (a job pruned from the list has ended too)
            html = views.jobs_html(jobs, seconds_per_step=spp, previews=previews)
            if html != watch.get("html"):
                watch["html"] = out["jobs"] = html
            done = [j for j in jobs if j.get("status") == "succeeded"]
            grid = views.batch_grid(done)  # a batch's images side by side, once two have come
            if [p for p, _ in grid] != watch.get("grid"):
                watch["grid"] = [p for p, _ in grid]
                out["grid"] = gr.update(value=grid or None, visible=bool(grid))
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
            if seen.get("picker") != [model_now, preset_now]:  # not what the page's load already put there:
                # sending the same choices again re-renders the dropdown and closes a list the user has open
                out["preset"] = gr.update(choices=preset_choices(studio, model_now), value=preset_now or NO_PRESET)
            # the preset's defaults in the fields and the ones it fixes locked (unlocked when it goes)
            defaults, required = preset_contract(studio, preset_now)
            m_fields = m_now or models_by_id(studio).get(model_now)
            if m_fields is not None and (m_now is not None or preset_now != seen.get("preset")):
                out["fields"] = field_updates(m_fields, defaults, reset=m_now is not None,
                                              locked=locked_reasons(preset_now, required))
        seen["model"], seen["preset"], seen["picker"] = model_now, preset_now, [model_now, preset_now]
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
            out["library"] = [pick, unfit, str(sig)]  # the last: its change takes gone adapters off the stack
        keep = gr.update()
        return ([out.get("jobs", keep), *out.get("result", [keep] * 4), out.get("grid", keep), watch, seen,
                 out.get("badge", keep),
                 out.get("preset", keep), *out.get("model", [keep, keep]),
                 *out.get("fields", [keep] * len(WIDGETS)), *out.get("library", [keep, keep, keep]),
                 out.get("note", keep)])

    poll_outputs = [t.jobs, t.image, t.video, t.metadata, t.infotext, t.grid, t.watch, t.seen, t.badge, t.preset,
                    t.model, t.mode,
                    *t.field_outputs(), t.pick, t.unfit, t.library_seen, t.status]
    t.timer.tick(poll, [t.watch, t.seen, t.model, t.status], poll_outputs, api_visibility="private",
                 queue=False, show_progress="hidden")
    _wire_cancel_one(studio, t, cancel_one)


def _wire_cancel_one(studio, t, box) -> None:
    """A job line's ✕ cancels that job only (the Cancel button cancels every job the page follows)."""
    def cancel_one(request: gr.Request, value):
        job_id = str(value or "").split("\n", 1)[0].strip()
        if not job_id:
            return gr.update()
        try:
            job = studio.of(request).cancel(job_id)
        except Exception as exc:  # finished meanwhile, or not a job
            return error_html(readable(exc))
        label = views.job_label(job)
        if job.get("status") == "running":
            return ok_html(f"cancelling job {label}: it stops at its next step")
        return ok_html(f"cancelled job {label}" if job.get("status") == "cancelled"
                       else f"job {label} has already {job.get('status')}")

    box.change(cancel_one, box, t.status, api_visibility="private", queue=False)


def _active(studio, job_id) -> bool:
    try:
        return studio.job(job_id).get("status") not in views.FINISHED
    except Exception:
        return False

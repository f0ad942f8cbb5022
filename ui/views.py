"""Pure functions from the Studio facade's plain dicts to what the tabs display.

No Gradio and no torch here: every rule about how a job, an adapter, a preset or
the system is shown lives in this one module, so the tabs stay wiring only.
"""
from __future__ import annotations

import base64
import html
import json
import logging
import re
from dataclasses import dataclass, field

from backend.errors import StudioError

log = logging.getLogger("lora_studio.ui")

FINISHED = ("succeeded", "failed", "cancelled")


# -- errors -----------------------------------------------------------------------------------
def readable(exc: BaseException) -> str:
    """One line for the user: the StudioError's own message, never a traceback."""
    if isinstance(exc, StudioError):
        return exc.message
    log.exception("unexpected error in the UI", exc_info=exc)
    text = str(exc).strip().splitlines()
    return f"unexpected {type(exc).__name__}: {text[0] if text else 'no message'} (details in the server log)"


def error_html(message: str) -> str:
    return f'<div class="ls-error" role="alert">⚠ {html.escape(message)}</div>'


def ok_html(message: str) -> str:
    return f'<div class="ls-ok" role="status">{html.escape(message)}</div>'


_QUEUED = re.compile(r'^<div class="ls-ok ls-queued" role="status" data-jobs="([0-9a-zA-Z,]*)">')


def queued_html(message: str, job_ids: list[str]) -> str:
    """A "queued ..." note that names its jobs, so the page can take it away once they have ended."""
    ids = ",".join(j for j in job_ids if j.isalnum())
    return f'<div class="ls-ok ls-queued" role="status" data-jobs="{ids}">{html.escape(message)}</div>'


def queued_ids(note) -> set[str]:
    """The jobs a ``queued_html`` note names (empty for any other note)."""
    found = _QUEUED.match(note) if isinstance(note, str) else None
    return set(filter(None, found.group(1).split(","))) if found else set()


# -- models -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    """What the Generate tab needs to know about one model."""

    id: str
    pipeline: str = ""
    output: str = "image"  # "image" | "video" | "video+audio"
    mode: str = "text-to-image"
    fields: frozenset = frozenset()
    defaults: dict = field(default_factory=dict)
    denoisers: tuple = ("transformer",)
    loaded: bool = False

    @property
    def is_video(self) -> bool:
        return self.output.startswith("video")

    @property
    def two_stage(self) -> bool:
        return len(self.denoisers) > 1

    @classmethod
    def from_dict(cls, d: dict) -> "ModelInfo":
        return cls(id=d["id"], pipeline=d.get("pipeline") or "", output=d.get("output") or "image",
                   mode=d.get("mode") or "text-to-image", fields=frozenset(d.get("fields") or ()),
                   defaults=dict(d.get("defaults") or {}), denoisers=tuple(d.get("denoisers") or ("transformer",)),
                   loaded=bool(d.get("loaded")))


def mode_markdown(m: ModelInfo) -> str:
    stages = " · two transformers (high noise → `transformer`, low noise → `transformer_2`)" if m.two_stage else ""
    return f"**Mode:** {m.mode} · output: {m.output} · pipeline `{m.pipeline}`{stages}"


def lora_hint(cards: list[dict], model: str | None, prompt: str) -> str:
    """The first-run hint under the prompt: one demo LoRA that fits the loaded model, the prompt tag that
    calls it and what its card says it does (nothing when the library has none)."""
    c = next((c for c in cards if c.get("demo") and c.get("fits") and c.get("description")), None)
    if c is None or not model:
        return ""
    tag = f"<lora:{c['name']}:1>"
    return (f'<div class="ls-hint"><b>Try a LoRA</b> with {html.escape(model)}: '
            f'<code>{html.escape(prompt)} {html.escape(tag)}</code> ({html.escape(c["description"])}; '
            f'a weight of 0.5 gives part of it). The LoRAs tab lists the others.</div>')


# -- sizes ------------------------------------------------------------------------------------
ASPECTS = ("1:1", "4:3", "3:4", "3:2", "2:3", "16:9", "9:16")


def aspect_size(aspect: str, width: int, height: int, multiple: int = 16) -> tuple[int, int]:
    """(width, height) of ``aspect`` ("16:9") with about the area of ``width`` x ``height``, each side a
    multiple of ``multiple`` (the pipelines' rule), at least one multiple."""
    import math

    a, _, b = aspect.partition(":")
    try:
        ratio = float(a) / float(b)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"aspect {aspect!r}: not W:H (e.g. 16:9)") from None
    if not (ratio > 0 and math.isfinite(ratio)):
        raise ValueError(f"aspect {aspect!r}: not W:H (e.g. 16:9)")
    area = max(1, int(width)) * max(1, int(height))

    def side(x: float) -> int:
        return max(multiple, int(round(x / multiple)) * multiple)

    return side(math.sqrt(area * ratio)), side(math.sqrt(area / ratio))


# -- jobs -------------------------------------------------------------------------------------
def job_label(job: dict) -> str:
    """A job as people read it: its number ("#12", the queue's order, which the Queue tab's box also
    takes), else its id."""
    return f"#{job['number']}" if isinstance(job.get("number"), int) else str(job.get("id", ""))


def batch_grid(done: list[dict]) -> list[tuple[str, str]]:
    """The followed jobs' image results as (path, caption "#12 · seed 7"), in queue order, when there are
    two or more (one result is the result view's alone); a video's is left out."""
    from backend.service import IMAGE_SUFFIXES

    images = [j for j in done if str((j.get("result") or {}).get("path", "")).lower().endswith(IMAGE_SUFFIXES)]
    if len(images) < 2:
        return []
    images.sort(key=lambda j: (j.get("number") or 0, j.get("created_at") or 0))
    return [(j["result"]["path"], f"{job_label(j)} · seed "
             f"{((j['result'].get('metadata') or {}).get('seed', (j.get('params') or {}).get('seed')))}")
            for j in images]


def job_fraction(job: dict) -> float:
    prog = job.get("progress") or {}
    step, total = prog.get("step") or 0, prog.get("total") or 0
    if job.get("status") == "succeeded":
        return 1.0
    return min(1.0, step / total) if total else 0.0


def job_line(job: dict) -> str:
    status = job.get("status", "?")
    prog = job.get("progress") or {}
    if status == "queued":
        pos = job.get("queue_position")
        return f"queued · position {pos} in the queue" if pos else "queued"
    if status == "running":
        if prog.get("total"):
            return f"running · step {prog.get('step') or 0}/{prog['total']}"
        return "running · loading"
    if status == "failed":
        return f"failed · {job.get('error') or 'no reason given'}"
    return status


def seconds(s: float) -> str:
    s = max(0.0, float(s))
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60):02d} s"


def timing(job: dict, now: float | None = None, seconds_per_step: float | None = None) -> str:
    """Elapsed and ETA of a running job (ETA from its own pace, else the worker's seconds per step);
    how long a finished one took."""
    import time

    started, finished = job.get("started_at"), job.get("finished_at")
    if not isinstance(started, (int, float)):
        return ""
    if job.get("status") in FINISHED:
        return f"took {seconds(finished - started)}" if isinstance(finished, (int, float)) else ""
    elapsed = (now or time.time()) - started
    prog = job.get("progress") or {}
    step, total = prog.get("step") or 0, prog.get("total") or 0
    per_step = elapsed / step if step else seconds_per_step
    text = f"{seconds(elapsed)} elapsed"
    if total and per_step:
        text += f" · ETA {seconds(per_step * (total - step))}"
    return text


def plot_progress(jobs: list[dict], now: float | None = None) -> str:
    """A plot's one line (X/Y/Z and Compare): cells finished of all, the running cell's step and the whole
    plot's ETA. The pace is the wall time since the first cell started over the steps done so far (so a
    cell's load and decode are in it); a queued cell's steps are its request's, else the mean of the known."""
    import time

    now = now or time.time()
    done = sum(j.get("status") in FINISHED for j in jobs)
    totals = [(j.get("progress") or {}).get("total") or (j.get("params") or {}).get("num_inference_steps")
              for j in jobs]
    known = [t for t in totals if isinstance(t, int) and t > 0]
    mean = sum(known) / len(known) if known else None
    ran = remaining = 0.0
    for j, total in zip(jobs, totals):
        total = total if isinstance(total, int) and total > 0 else mean
        step = (j.get("progress") or {}).get("step") or 0
        if j.get("status") == "succeeded":
            ran += total or 0
        elif j.get("status") == "running":
            ran += step
            remaining += max(0.0, (total or step) - step)
        elif j.get("status") == "queued":
            remaining += total or 0
    starts = [j["started_at"] for j in jobs if isinstance(j.get("started_at"), (int, float))]
    text = f"{done}/{len(jobs)} cells finished"
    running = next((j for j in jobs if j.get("status") == "running"), None)
    if running:
        prog = running.get("progress") or {}
        text += f" · cell {jobs.index(running) + 1} at step {prog.get('step') or 0}/{prog.get('total') or '?'}"
    eta = None
    if done < len(jobs) and starts and ran:
        eta = (now - min(starts)) / ran * remaining
        text += f" · about {seconds(eta)} left"
    elif done < len(jobs):
        text += " · estimating the time left"
    return (f'<div class="ls-job ls-plot" data-done="{done}" data-total="{len(jobs)}" '
            f'data-eta="{"" if eta is None else round(eta, 1)}">{html.escape(text)}</div>')


def preview_img(preview: dict | None) -> str:
    """A running job's live preview ({"step", "png"}: Studio.job_preview) as an inline image."""
    if not preview or not preview.get("png"):
        return ""
    src = "data:image/png;base64," + base64.b64encode(preview["png"]).decode("ascii")
    step = int(preview.get("step") or 0)
    return (f'<img class="ls-live" data-step="{step}" src="{src}" '
            f'alt="live preview at step {step}" title="live preview at step {step} (an approximation)">')


def progress_html(job: dict, now: float | None = None, seconds_per_step: float | None = None,
                  preview: dict | None = None) -> str:
    """The per-step progress bar (and the live preview of a running job); data-* attributes let the
    browser tests read it."""
    prog = job.get("progress") or {}
    pct = round(100 * job_fraction(job))
    status = html.escape(str(job.get("status", "")))
    cls = "ls-error" if status == "failed" else ""
    line = job_line(job)
    when = timing(job, now, seconds_per_step)
    if when:
        line += f" · {when}"
    seed = (job.get("params") or {}).get("seed")
    meta_seed = ((job.get("result") or {}).get("metadata") or {}).get("seed")
    seed_text = f" · seed {meta_seed if meta_seed is not None else seed}" if seed is not None else ""
    job_id = html.escape(str(job.get("id", "")), quote=True)
    cancel = (f' <button type="button" class="ls-job-cancel" data-job="{job_id}" title="cancel this job">✕'
              f'</button>' if status in ("queued", "running") else "")
    return (f'<div class="ls-job {cls}" data-job="{html.escape(str(job.get("id", "")))}" data-status="{status}" '
            f'data-step="{prog.get("step") or 0}" data-total="{prog.get("total") or 0}" '
            f'data-position="{job.get("queue_position") or ""}">'
            f'<div class="ls-job-line">Job {html.escape(job_label(job))}{html.escape(seed_text)} · '
            f'{html.escape(line)}{cancel}</div>'
            f'<div class="ls-bar"><div class="ls-bar-fill" style="width:{pct}%"></div></div>'
            f'{preview_img(preview) if status == "running" else ""}</div>')


def jobs_html(jobs: list[dict], now: float | None = None, seconds_per_step: float | None = None,
              previews: dict | None = None) -> str:
    """The jobs a page follows, each with its bar; the container's data-* attributes give the page
    title its progress ("[3/20] LoRA Studio") and let the browser tests count jobs."""
    if not jobs:
        return '<div class="ls-jobs" data-count="0" data-title=""></div>'
    running = [j for j in jobs if j.get("status") == "running"]
    queued = [j for j in jobs if j.get("status") == "queued"]
    title = ""
    if running:
        prog = running[0].get("progress") or {}
        title = f"[{prog.get('step') or 0}/{prog.get('total') or '?'}]"
        if queued:
            title += f" +{len(queued)}"
    elif queued:
        title = f"[queued {len(queued)}]"
    # the queued and running jobs, and the one that finished last, in full; older finished ones folded
    ended = [j for j in jobs if j.get("status") in FINISHED]
    newest = max(ended, key=lambda j: j.get("finished_at") or 0, default=None)
    older = [j for j in ended if j is not newest]
    line = lambda j: progress_html(j, now, seconds_per_step, (previews or {}).get(str(j.get("id"))))  # noqa: E731
    shown = "".join(line(j) for j in jobs if j not in older)
    if older:
        failed = sum(j.get("status") == "failed" for j in older)
        shown += (f'<details class="ls-finished"><summary>{len(older)} earlier job{"s" if len(older) > 1 else ""}'
                  f'{f" ({failed} failed)" if failed else ""}</summary>' + "".join(line(j) for j in older)
                  + "</details>")
    return f'<div class="ls-jobs" data-count="{len(jobs)}" data-title="{html.escape(title)}">{shown}</div>'


# nine columns that fit a laptop's width: the kind joins the status when it is not a generation, the queue
# position too ("queued · 2"), the preset the model ("demo:qwen-image + lightning-4step")
JOB_COLUMNS = ["job", "status", "progress", "prompt", "model", "adapters", "created", "took", "error"]
JOB_COLUMN_WIDTHS = ["5%", "11%", "6%", "26%", "14%", "12%", "7%", "5%", "14%"]  # of the page's width


def _clock(ts) -> str:
    if not ts:
        return ""
    import time

    return time.strftime("%H:%M:%S", time.localtime(float(ts))) if isinstance(ts, (int, float)) else str(ts)[11:19]


def _took(job: dict) -> str:
    a, b = job.get("started_at"), job.get("finished_at")
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return f"{b - a:.1f}s"
    return ""


def adapters_label(adapters) -> str:
    parts = []
    for a in adapters or []:
        scale = a.get("scale")
        if isinstance(scale, dict) and set(scale) == {"start", "end"}:  # a linear schedule
            scale = f"{scale['start']:g}->{scale['end']:g}"
        elif isinstance(scale, dict) and all(isinstance(v, (int, float)) for v in scale.values()):
            scale = "/".join(f"{v:g}" for v in scale.values())
        elif isinstance(scale, (int, float)):
            scale = f"{scale:g}"
        elif scale is not None:  # a step schedule or block weights (backend/lora/schedule.py)
            scale = json.dumps(scale, separators=(",", ":"))
        parts.append(f"{a.get('name')}@{scale}" if scale is not None else str(a.get("name")))
    return ", ".join(parts)


def job_rows(jobs: list[dict]) -> list[list]:
    rows = []
    for j in jobs:
        prog = j.get("progress") or {}
        status = str(j.get("status") or "")
        if j.get("kind") not in (None, "generate"):
            status = f"{j['kind']}: {status}"
        if j.get("queue_position"):
            status += f" · {j['queue_position']}"
        model = str(j.get("model") or "") + (f" + {j['preset']}" if j.get("preset") else "")
        rows.append([job_label(j), status, f"{prog.get('step') or 0}/{prog.get('total') or '?'}",
                     short(str((j.get("params") or {}).get("prompt") or ""), 60), model,
                     adapters_label(j.get("adapters")), _clock(j.get("created_at")), _took(j),
                     (j.get("error") or "")[:120]])
    return rows


# -- adapters ---------------------------------------------------------------------------------
ADAPTER_COLUMNS = ["name", "format", "rank", "alpha", "targets", "size", "sha256", "fit", "where", "pinned"]


def human_bytes(n) -> str:
    if not isinstance(n, (int, float)):
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def fit_of(adapter: dict) -> tuple[bool, str]:
    """(fits the loaded model, a short reason)."""
    fit = adapter.get("fit")
    if isinstance(fit, dict):
        ok = bool(fit.get("ok", fit.get("fits", False)))
        return ok, str(fit.get("summary") or fit.get("reason") or ("fits" if ok else "does not fit"))
    if isinstance(fit, bool):
        return fit, "fits" if fit else "does not fit"
    return False, "fit unknown"


def tiers_of(system: dict | None) -> dict[str, str]:
    """adapter name -> the cache tier holding it now ("device" beats "cpu"), from system()."""
    tiers = ((system or {}).get("lora_cache") or {}).get("tiers") or {}
    where = {}
    for tier in ("cpu", "device"):
        for name in (tiers.get(tier) or {}).get("adapters") or []:
            where[name] = tier
    return where


def adapter_rows(adapters: list[dict], where: dict[str, str] | None = None) -> list[list]:
    rows = []
    for a in adapters:
        targets = a.get("targets") or a.get("target_modules") or ""
        if isinstance(targets, (list, tuple)):
            targets = ", ".join(map(str, targets[:6])) + (" …" if len(targets) > 6 else "")
        ok, reason = fit_of(a)
        size = a.get("size") if isinstance(a.get("size"), str) else human_bytes(a.get("size_bytes"))
        rows.append([a.get("name"), a.get("format") or "", a.get("rank") or "", a.get("alpha") or "", targets,
                     size, (a.get("sha256") or "")[:12], ("✓ " if ok else "✗ ") + short(reason),
                     a.get("tier") or (where or {}).get(a.get("name"), "disk"),
                     "pinned" if a.get("pinned") else ""])
    return rows


def short(text: str, limit: int = 90) -> str:
    """A cell's or a note's worth of ``text`` (cut with an ellipsis)."""
    return text if len(text) <= limit else text[:limit] + "…"


def adapter_choices(adapters: list[dict]) -> tuple[list[tuple[str, str]], str]:
    """Dropdown choices (only adapters that fit) and a folded note listing the others with their reason."""
    fit, unfit = [], []
    for a in adapters:
        ok, reason = fit_of(a)
        (fit if ok else unfit).append((a["name"], reason))
    choices = [(name, name) for name, _ in fit]
    if not unfit:
        return choices, ""
    items = "".join(f'<li class="ls-unfit" title="{html.escape(r)}">{html.escape(n)}: '
                    f'{html.escape(r if len(r) <= 140 else r[:140] + "…")}</li>' for n, r in unfit)
    return choices, (f'<details class="ls-unfit-list"><summary>{len(unfit)} adapter(s) in the library do not fit '
                     f'this model</summary><ul>{items}</ul></details>')


# -- presets ----------------------------------------------------------------------------------
def preset_cards_html(presets: list[dict], fused: dict | None = None) -> str:
    active = (fused or {}).get("preset") if isinstance(fused, dict) else None
    cards = []
    for p in presets:
        files = []
        for f in p.get("files") or []:
            pattern = f.get("pattern") or f.get("filename") or ""
            if f.get("present"):
                line = f'✓ present ({html.escape(str(f.get("where") or ""))}) <code>{html.escape(str(f.get("path")))}</code>'
            else:
                line = (f'✗ missing: <code>huggingface-cli download {html.escape(str(f.get("repo", "")))} '
                        f'--include \'{html.escape(pattern)}\'</code>')
            kind = f' ({html.escape(str(f["demo_kind"]))})' if f.get("demo_kind") else ""
            demo = f' · demo file{kind} <code>{html.escape(str(f["demo"]))}</code>' if f.get("demo") else ""
            files.append(f'<li class="{"ls-present" if f.get("present") else "ls-missing"}">'
                         f'<b>{html.escape(str(f.get("component", "")))}</b>: {line}{demo}</li>')
        defaults = ", ".join(f"{k}={v}" for k, v in (p.get("defaults") or {}).items())
        reqs = ", ".join(f"{k}: {v}" for k, v in (p.get("requirements") or {}).items())
        badge = ' <span class="ls-badge">fused now</span>' if p.get("id") == active else ""
        ready = "ready" if p.get("ready") else "files missing (demo models use their demo files)"
        cards.append(
            f'<div class="ls-card" data-preset="{html.escape(str(p.get("id")))}">'
            f'<h3>{html.escape(str(p.get("title") or p.get("id")))}{badge}</h3>'
            f'<div><code>{html.escape(str(p.get("id")))}</code> · {html.escape(str(p.get("pipeline", "")))} · '
            f'{html.escape(ready)}</div>'
            f'<div>models: {html.escape(", ".join(p.get("models") or []))}</div>'
            f'<ul>{"".join(files)}</ul>'
            f'<div>sampling: {html.escape(defaults) or "—"}</div>'
            f'<div>requires: {html.escape(reqs) or "—"}</div></div>')
    return f'<div class="ls-cards">{"".join(cards)}</div>' if cards else "<p>No presets found.</p>"


# -- gallery / metadata -----------------------------------------------------------------------
def settings_from_metadata(meta: dict) -> dict:
    """The Generate-tab values a result's metadata restores: model, fields, seed, adapters."""
    params = dict(meta.get("params") or {})
    params.setdefault("seed", meta.get("seed"))
    adapters = [{"name": a.get("name"), "scale": a.get("scale", 1.0)} for a in meta.get("adapters") or []
                if a.get("name")]
    return {"model": meta.get("model"), "params": params, "adapters": adapters, "preset": meta.get("preset")}


# -- the LoRA browser -------------------------------------------------------------------------
ALL_FAMILIES = "all families"
BROWSER_SORTS = ("name", "newest", "largest", "most used")


def browser_families(cards: list[dict]) -> list[str]:
    """The family filter's choices: every family the cards name, then "unknown" if any has none."""
    fams = sorted({c["family"] for c in cards if c.get("family")})
    return [ALL_FAMILIES, *fams, *(["unknown"] if any(not c.get("family") for c in cards) else [])]


def filter_cards(cards: list[dict], query: str = "", family: str = ALL_FAMILIES, fits_only: bool = False,
                 sort: str = "name") -> list[dict]:
    """Cards whose name, title or a trigger word contains every word of ``query`` (any case), of
    ``family``, fitting the loaded model if ``fits_only``; sorted by name, newest or largest first,
    or most used first (``uses``: finished jobs that used it; ties by name)."""
    words = str(query or "").lower().split()
    out = []
    for c in cards:
        text = " ".join([c["name"], c.get("title") or "", *c.get("triggers", [])]).lower()
        if any(w not in text for w in words):
            continue
        if family not in (None, "", ALL_FAMILIES) and (c.get("family") or "unknown") != family:
            continue
        if fits_only and not c.get("fits"):
            continue
        out.append(c)
    if sort == "newest":
        out.sort(key=lambda c: (-(c.get("mtime") or 0), c["name"].lower()))
    elif sort == "largest":
        out.sort(key=lambda c: (-(c.get("size_bytes") or 0), c["name"].lower()))
    elif sort == "most used":
        out.sort(key=lambda c: (-(c.get("uses") or 0), c["name"].lower()))
    else:
        out.sort(key=lambda c: c["name"].lower())
    return out


def _attr(text) -> str:
    return html.escape(str(text), quote=True)


def card_html(c: dict) -> str:
    """One card: preview (the embedded thumbnail, a generated one or a placeholder), name, family/fit,
    numbers and uses, clickable trigger words, an Add button and "Make preview" (only when it fits;
    a fitting card's body adds it too), and the reason when it cannot be used.
    Everything from the file is escaped; the thumbnail is a data URL the backend checked or wrote."""
    name = c["name"]
    shown = short(name, 128)  # wrapped on the card (CSS), never cut short of a real name
    if c.get("thumbnail"):
        preview = (f'<img class="ls-thumb" src="{_attr(c["thumbnail"])}" alt="preview of {_attr(shown)}" '
                   f'data-source="{_attr(c.get("thumbnail_source") or "file")}">')
    else:
        preview = (f'<div class="ls-thumb ls-thumb-none" title="{_attr(c.get("thumbnail_note") or "no preview in the file")}">'
                   f'{html.escape(name[:1].upper() or "?")}</div>')
    model = c.get("model") or ""
    fam = c.get("family")
    if c.get("fits"):
        made = f"fits {model}" + (f" ({fam})" if fam else "")
    elif not c.get("usable"):
        made = "unusable"
    else:
        made = ((f"made for {fam}" + (" (by its name)" if c.get("family_source") == "name" else ""))
                if fam else "does not fit the loaded model")
    nums = " · ".join(x for x in (f"rank {c['rank']}" if c.get("rank") not in (None, "-") else "",
                                  f"alpha {c['alpha']}" if c.get("alpha") not in (None, "-") else "",
                                  str(c.get("size") or ""), str(c.get("format") or ""),
                                  f"weight {c['preferred_weight']:g}" if c.get("preferred_weight") is not None
                                  else "") if x and x != "-")
    negative = c.get("negative_text") or ""
    uses = int(c.get("uses") or 0)
    triggers = "".join(f'<button type="button" class="ls-trigger" data-trigger="{_attr(t)}" '
                       f'title="insert into the prompt">{html.escape(t)}</button>' for t in c.get("triggers") or [])
    reason = c.get("error") or ("" if c.get("fits") else c.get("fit") or "")
    if c.get("fits"):
        action = f'<button type="button" class="ls-add" data-name="{_attr(name)}">Add to stack</button>'
        if c.get("preview_pending"):
            action += '<span class="ls-preview-pending">making a preview…</span>'
        elif not c.get("thumbnail"):
            action += (f'<button type="button" class="ls-preview" data-name="{_attr(name)}" '
                       'title="generate a 4-step preview with the loaded model">Make preview</button>')
    else:
        action = ""
    cls = "ls-lcard" + ("" if c.get("fits") else " ls-lcard-off")
    title = c.get("title") or ""
    about = c.get("description") or ""
    tip = ' title="click to add to the LoRA stack"' if c.get("fits") else ""
    return (f'<div class="{cls}" data-name="{_attr(name)}"{tip}>{preview}<div class="ls-lcard-body">'
            f'<h4 title="{_attr(name)}">{html.escape(shown)}</h4>'
            + (f'<div class="ls-lcard-title">{html.escape(title)}</div>' if title and title != name else "")
            + (f'<div class="ls-about" title="{_attr(about)}">{html.escape(short(about, 120))}</div>' if about else "")
            + f'<div class="ls-family">{html.escape(made)}</div><div class="ls-nums">{html.escape(nums)}</div>'
            + (f'<div class="ls-uses">used in {uses} job{"s" if uses != 1 else ""}</div>' if uses else "")
            + (f'<div class="ls-triggers">{triggers}</div>' if triggers else "")
            + (f'<div class="ls-negative" title="{_attr(negative)}">negative: {html.escape(short(negative, 120))}</div>'
               if negative else "")
            + (f'<div class="ls-reason" title="{_attr(reason)}">{html.escape(short(reason, 160))}</div>'
               if reason else "")
            + f'{action}</div></div>')


def misfit_reason(c: dict) -> str:
    """Why a card does not fit the loaded model, in one plain line (the converter's own words, with its
    key names, stay in the card's tooltip and the Adapters tab)."""
    model = c.get("model") or "the loaded model"
    if not c.get("usable"):
        return "cannot be read as an adapter (the Adapters tab says why)"
    fam = c.get("family")
    if fam and fam != c.get("model_family"):
        return f"made for {fam}, not {model}" + (" (by its name)" if c.get("family_source") == "name" else "")
    reason = str(c.get("fit_reason") or "")  # the fit report's own plain line (backend/lora/fit.py)
    if reason and not reason.startswith("could not be checked"):
        return reason
    return f"could not be checked against {model} (the Adapters tab says why)"


def cards_html(cards: list[dict], total: int | None = None, misfits: list[dict] | None = None) -> str:
    """The cards; with ``misfits`` (the browser's default "fits the loaded model" view) the matching
    adapters that do not fit follow, collapsed, one line each with the reason."""
    total = len(cards) if total is None else total
    folded = ""
    if misfits:
        model = misfits[0].get("model") or "the loaded model"
        items = "".join(f'<li title="{_attr(c.get("error") or c.get("fit") or "")}"><b>{html.escape(c["name"])}'
                        f'</b>: {html.escape(misfit_reason(c))}</li>' for c in misfits)
        folded = (f'<details class="ls-misfits"><summary>{len(misfits)} more do not fit {html.escape(model)}'
                  f'</summary><ul>{items}</ul></details>')
    if not cards:
        return ok_html(f"no adapter matches ({total} in the library)") + folded
    head = f'<div class="ls-browser-count">{len(cards)} of {total} adapter(s)</div>'
    return head + '<div class="ls-lcards">' + "".join(card_html(c) for c in cards) + "</div>" + folded

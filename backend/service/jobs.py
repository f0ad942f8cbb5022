"""The jobs part of the service: a request checked and resolved, then queued (alone or all or none),
its row read back, cancelled, waited for; the queue's client for every front end."""
from __future__ import annotations

from ..errors import InvalidParameter, StudioError
from ..limits import check_request, check_text
from ..users import User, listing_owner
from .core import Core
from .models import ModelService


class JobService:
    def __init__(self, core: Core, models: ModelService):
        self.core, self.models = core, models

    def submit(self, kind: str, params: dict, adapters: list[dict] | None = None, preset: str | None = None,
               model: str | None = None, *, user: User | None = None) -> dict:
        """Queue a job; the returned dict is already a committed row. Raises StudioError subclasses."""
        return self.submit_many([{"kind": kind, "params": params, "adapters": adapters, "preset": preset,
                                  "model": model}], user=user)[0]

    def submit_many(self, requests: list[dict], *, user: User | None = None) -> list[dict]:
        """Queue several jobs (each {"kind", "params", "adapters", "preset", "model"}, as ``submit`` takes
        them) all or none: every one is checked first, then all are queued in one transaction, so a plot
        or a grid never sits half in the queue (a bad cell, or too little room, queues nothing). The jobs
        belong to ``user`` (backend/users.py)."""
        if user is not None and not user.name:
            raise InvalidParameter("this request is not signed in as anyone; log in again", param="user")
        checked = [{**self._checked(r.get("kind", "generate"), r.get("params"), r.get("adapters"), r.get("preset"),
                                    r.get("model")), "owner": user.name if user is not None else None}
                   for r in requests]
        jobs = self.core.queue.submit_many(checked)
        self.core.supervisor.wake()
        return jobs

    def _checked(self, kind: str, params: dict, adapters: list[dict] | None, preset: str | None,
                 model: str | None) -> dict:
        """One request checked and resolved into the queue's row fields; raises what ``submit`` raises."""
        core, limits = self.core, self.core.limits
        if not isinstance(params, dict):
            raise InvalidParameter("params must be an object of generation fields", param="params")
        if adapters is not None and not isinstance(adapters, list):
            raise InvalidParameter("'lora' must be an adapter object or a list of them", param="lora")
        if adapters and len(adapters) > limits.max_adapters:  # before resolving any of them
            check_request(limits, None, {}, {}, adapters)
        for key, value in params.items():
            check_text(key, "params")
            check_text(value, str(key))
        check_text(adapters, "lora")
        check_text(preset, "preset")
        if model is not None:
            model = self.models.check_model(model)
        if adapters and core.lora_backend == "distill":
            raise InvalidParameter(
                "this server runs --lora-backend distill: its LoRA is fused into the base at start, so "
                "per-request 'lora' is refused; start a peft server for per-request adapters", param="lora")
        if isinstance(params.get("prompt"), str) and "<lora:" in params["prompt"].lower():
            from ..lora import prompt_tags  # <lora:NAME:WEIGHT> (A1111): into the stack, out of the text

            # the bounds first, on the text as sent: its length, then its tags with the request's adapters
            # against --max-adapters, before any tag is parsed or looked up (20,000 tags took a minute)
            check_request(limits, None, {}, {"prompt": params["prompt"]}, None)
            tags, listed = prompt_tags.count(params["prompt"]), len(adapters or [])
            if tags + listed > limits.max_adapters:
                raise InvalidParameter(
                    f"'prompt' has {tags} <lora:> tags" + (f" and 'lora' lists {listed} adapters" if listed else "")
                    + f"; this server takes at most {limits.max_adapters} adapters per request "
                      "(--max-adapters)", param="prompt")
            text, tagged = prompt_tags.split(params["prompt"])
            for a in tagged:  # unknown names refused by name, before anything is queued
                core.resolver.by_name(a["name"])
            params = {**params, "prompt": text}
            adapters = prompt_tags.merge(adapters, tagged)
        if preset is not None and preset != core.current_preset():
            raise InvalidParameter(f"preset {preset!r} is not the one applied now "
                                   f"({core.current_preset() or 'none'}); apply it first", param="preset")
        params = self._check_params(params, model, adapters)
        resolved = [a.as_dict() for a in core.resolver.resolve(adapters)]
        if resolved:  # a tag or an adapter made for another model: refused now, by name, in a plain line
            from ..lora.library import check_fits

            check_fits(model or core.current_model(), [(a["name"], a["path"]) for a in resolved], core.data_dir)
        return {"kind": kind, "model": model or core.current_model(), "params": params, "adapters": resolved,
                "preset": core.current_preset()}

    def _check_params(self, params: dict, model: str | None, adapters: list | None = None) -> dict:
        """Reject what the loaded model's spec refuses now (an HTTP 400), before the job is queued."""
        from ..params import FIELDS, IMAGE_FIELDS, JOB_FIELDS, check_field

        core = self.core
        params = {k: v for k, v in params.items() if v is not None}
        if "batch_size" in params:
            params["batch_size"] = check_field("batch_size", params["batch_size"])
            if params["batch_size"] == 1:  # the default: the job's key for batching stays that of any other
                del params["batch_size"]
            elif core.engine == "ray":
                raise InvalidParameter("'batch_size' > 1 needs --engine local: a Ray replica takes one job at a "
                                       "time (ask for n images; each runs on the next free replica)",
                                       param="batch_size")
        if "lora_mode" in params:  # per request: merge or unfused (backend/lora/policy.py; the worker pops it)
            from ..lora.policy import check_mode

            check_mode(params["lora_mode"])
        current = model is None or model == core.current_model()
        spec = core.spec() if current else core.static_spec(model)
        if spec and current:
            unknown = sorted(k for k in params if k not in spec["fields"] and k != "lora_mode" and k not in JOB_FIELDS)
            if unknown:
                raise InvalidParameter(
                    f"unknown field {unknown[0]!r} for {spec['pipeline']}; accepted fields: "
                    f"{', '.join(spec['fields'])}", param=unknown[0])
        if "image" in params and not isinstance(params["image"], str):
            raise InvalidParameter("'image' must be a path to an image file", param="image")
        for name, value in params.items():  # types and ranges now (400), not in the worker (a failed job)
            if name in FIELDS and name not in IMAGE_FIELDS and name != "references":
                check_field(name, value)
        preset = core.current_preset() if current else None
        if preset:  # the fused preset's sampling contract (steps, CFG) by name, before the job is queued
            from ..presets import get_preset

            try:
                contract = get_preset(preset)
            except StudioError:  # a preset fused from files no longer listed: the worker's check stands
                contract = None
            if contract is not None:
                contract.check(params)
        if spec:  # the pipeline's size multiple and frame rule too (a 100-pixel height failed in the worker)
            from ..families import spec_for
            from ..params import check_img2img, check_shape

            try:
                shape = spec_for(spec["pipeline"])
            except StudioError:  # a pipeline no family lists: the worker's own checks stand
                shape = None
            if shape is not None:
                check_shape(shape, params)
                check_img2img(shape, params)
        check_request(core.limits, (spec or {}).get("pipeline"), (spec or {}).get("defaults") or {}, params,
                      adapters)
        return params

    def job(self, job_id: str, *, user: User | None = None) -> dict:
        """A job's row, by its id or its number (``12``, ``#12``), if ``user`` may see it (``Core.job_for``)."""
        return self.core.job_for(job_id, user)

    def job_preview(self, job_id: str, *, user: User | None = None) -> dict | None:
        """The latest live preview of a running job: {"step", "png"} (PNG bytes, at most 128 px a side),
        or None (not running, not yet a second into its run, or a model without previews)."""
        job_id = self.job(job_id, user=user)["id"]  # an unknown id is refused (404) like every other job route
        return self.core.supervisor.preview(job_id)

    def jobs(self, limit: int = 100, status: str | None = None, *, user: User | None = None) -> list[dict]:
        return self.core.queue.list(limit=limit, status=status, owner=listing_owner(user))

    def active_jobs(self, kinds: tuple[str, ...] | None = ("generate",), *, user: User | None = None) -> list[dict]:
        """Running and queued jobs (running first, then by queue position), optionally of some kinds:
        what a page opened mid-job (a reload, a second tab, another device) re-attaches to."""
        queue, owner = self.core.queue, listing_owner(user)
        jobs = queue.list(limit=1000, status="running", owner=owner) + \
            sorted(queue.list(limit=1000, status="queued", owner=owner), key=lambda j: j.get("queue_position") or 0)
        return [j for j in jobs if kinds is None or j.get("kind") in kinds]

    def cancel(self, job_id: str, *, user: User | None = None) -> dict:
        job_id = self.job(job_id, user=user)["id"]
        job, running = self.core.queue.cancel(job_id)
        if running:
            self.core.supervisor.cancel_running(job_id)
        return job

    def wait(self, job_id: str, timeout: float | None = None, *, user: User | None = None) -> dict:
        job_id = self.job(job_id, user=user)["id"]
        return self.core.queue.wait(job_id, timeout)

    async def wait_async(self, job_id: str, timeout: float | None = None, *, user: User | None = None) -> dict:
        """``wait`` from an event loop (HTTP handlers, Gradio events): no thread held while it waits."""
        job_id = self.job(job_id, user=user)["id"]
        return await self.core.queue.wait_async(job_id, timeout)

    def run(self, kind: str, params: dict, adapters=None, preset=None, model=None,
            timeout: float | None = None, *, user: User | None = None) -> dict:
        """submit + wait: the finished job dict (or the unfinished one after ``timeout``)."""
        return self.wait(self.submit(kind, params, adapters, preset, model, user=user)["id"], timeout)

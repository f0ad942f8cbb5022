"""The OpenAI-compatible HTTP app over the Studio facade.

Routes (the contract's): /health, /metrics, /v1/models, /v1/chat/completions,
/v1/images/generations, /v1/videos/generations, /v1/loras, /v1/load_lora_adapter,
/v1/unload_lora_adapter, /v1/jobs[/{id}[/preview]]. Every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with the StudioError's status.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import random
import time
import uuid
from pathlib import Path

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import BodyTooLarge, BodyTooSlow, InvalidParameter, StorageFull, StudioError, Timeout, storage_full
from ..service import job_error
from ..users import NOBODY
from .auth import AuthGate, Credentials, GateConfig, user_of
from .schemas import (BakeModelRequest, ChatRequest, ExportAdapterRequest, GenerationRequest, LoadAdapterRequest,
                      UnloadAdapterRequest, error_body)
from .server import CLIENT_TIMEOUT_S

MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_WAIT_S = 3600.0
log = logging.getLogger("lora_studio.api")


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` (413), by Content-Length or as they stream in, and
    bodies that take over ``timeout_s`` to arrive (408: a slow client holds no request open)."""

    def __init__(self, app, max_bytes: int, timeout_s: float = CLIENT_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send, int(length))
        # read the (JSON) body up to the limit first, then hand it on: a body streamed
        # without Content-Length is held to the same bound
        chunks, seen, more = [], 0, True
        with anyio.move_on_after(self.timeout_s) as slow:
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                chunks.append(message.get("body", b""))
                seen += len(chunks[-1])
                if seen > self.max_bytes:
                    return await self._refuse(scope, receive, send, seen)
                more = message.get("more_body", False)
        if slow.cancelled_caught:
            exc = BodyTooSlow(f"the request body did not arrive within {self.timeout_s:g} s ({seen} bytes came)")
            return await _studio_error(exc)(scope, receive, send)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope, receive, send, length: int):
        exc = BodyTooLarge(f"request body of {length}+ bytes is over the {self.max_bytes}-byte limit")
        await _studio_error(exc)(scope, receive, send)


def _studio_error(exc: StudioError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.http_status), status_code=exc.http_status)


def known_error(exc: BaseException) -> StudioError | None:
    """The client error an exception from a request stands for, or None (a bug: a 500)."""
    if isinstance(exc, StudioError):
        return exc
    if storage_full(exc):
        return StorageFull(f"no room on the server's disk to store the request's data ({exc.strerror}); "
                           "tell the operator", param=None)
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        return InvalidParameter(f"{param or 'body'}: {err.get('msg')}", param=param)
    if isinstance(exc, UnicodeError):
        return InvalidParameter("the request holds text that is not valid Unicode (e.g. a lone surrogate)")
    if isinstance(exc, ValueError) and "null byte" in str(exc):
        return InvalidParameter("a name or path in the request contains a NUL byte")
    if isinstance(exc, OverflowError):
        return InvalidParameter(f"a number in the request is out of range ({exc})")
    return None


def create_app(studio, api_key: str | list[str] | None = None, *, login: str | tuple[str, str] | None = None,
               users: dict[str, str] | None = None, admins=(), credentials: Credentials | None = None,
               max_body_bytes: int = MAX_BODY_BYTES,
               wait_s: float = DEFAULT_WAIT_S, client_timeout: float = CLIENT_TIMEOUT_S) -> FastAPI:
    """``api_key`` (one key, or ``KEY`` / ``NAME=KEY`` values), ``login`` (USER:PASS), ``users`` ({user:
    hash}, --auth-file), ``admins``: when any is set, every route but /health needs a credential
    (backend/api/auth.py; the UI adds its login page when it mounts), and each job belongs to the
    identity that submitted it (backend/users.py). ``credentials``: all of them, built already (app.py)."""
    app = FastAPI(title="LoRA Studio", version="1", docs_url="/docs", openapi_url="/openapi.json")
    app.state.studio = studio
    app.state.auth = GateConfig(credentials or Credentials(api_key, login, users=users, admins=admins))
    configured = app.state.auth.credentials.configured

    def mine(request: Request):
        """The Studio as this request's identity sees it (the gate put it in the scope)."""
        user = user_of(request.scope)
        if user is None and configured:
            user = NOBODY  # never happens behind the gate; if it did: it sees nothing
        return studio.for_user(user)

    @app.exception_handler(StudioError)
    async def _on_studio_error(request, exc: StudioError):
        return _studio_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request, exc: RequestValidationError):
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":  # loc is ("body", offset): the body itself is named
            where = err.get("loc", ())[-1] if len(err.get("loc", ())) > 1 else "?"
            return JSONResponse(error_body(f"body: not valid JSON at character {where} "
                                           f"({(err.get('ctx') or {}).get('error', err.get('msg'))})",
                                           "invalid_request_error", "body", 400), status_code=400)
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param or 'body'}: {err.get('msg')}", "invalid_request_error",
                                       param or "body", 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # FastAPI answers a body it cannot decode (not UTF-8, a broken form) with a bare 400: name the body
        param, detail = (("body", f"body: not readable as JSON ({exc.detail})") if exc.status_code == 400
                         else (None, str(exc.detail)))
        return JSONResponse(error_body(detail, kind, param, exc.status_code), status_code=exc.status_code)

    async def _on_other(request, exc: Exception):
        """Known user errors (a NUL byte, bad Unicode, a full disk) are JSON 4xx/507; anything else a
        JSON 500 (its traceback goes to the server log), never a plain-text page."""
        mapped = known_error(exc)
        if mapped is not None:
            return _studio_error(mapped)
        log.error("error in %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal server error ({type(exc).__name__}); see the server log",
                                       "server_error", None, 500), status_code=500)

    for cls in (ValueError, UnicodeError, OSError, ArithmeticError, Exception):
        app.add_exception_handler(cls, _on_other)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=client_timeout)

    # outermost (added last): credentials are judged on the headers, before any body is read
    app.add_middleware(AuthGate, config=app.state.auth)

    @app.get("/health")
    async def health():  # on the event loop: answers even when every worker thread is busy
        return {"status": "ok"}

    v1 = APIRouter(prefix="/v1")

    @app.get("/metrics")
    def metrics():
        return studio.system()

    @v1.get("/models")
    def models():
        now = int(studio.started_at)
        return {"object": "list", "data": [
            {"id": m["id"], "object": "model", "created": now, "owned_by": "lora-studio",
             "loaded": m.get("loaded", False), "pipeline": m.get("pipeline"), "output": m.get("output")}
            for m in studio.models()]}

    def submit(s, body, prompt: str, extra: dict, image: str | None) -> list[dict]:
        """Queue ``n`` jobs (seed, seed+1, ...); an input image that is refused is not kept."""
        fields = {**body.fields(exclude=frozenset({"prompt", "messages", "size", "response_format"})), **extra,
                  "prompt": prompt}
        model = _known_model(studio, body.model)
        adapters = body.adapters()
        upload, jobs = None, []
        try:
            if image is not None or "image" in fields:
                upload = fields["image"] = _save_upload(studio, image if image is not None else fields["image"])
            seed = fields.get("seed")
            if seed is not None and body.n > 1 and int(seed) == -1:  # -1: one random base, then +1 per image
                seed = random.randrange(2**31)
            requests = []
            for i in range(body.n):
                params = dict(fields)
                if seed is not None and body.n > 1:
                    params["seed"] = int(seed) + i
                requests.append({"kind": "generate", "params": params, "adapters": adapters, "model": model})
            jobs = s.submit_many(requests)  # all n or none: a full queue never takes half a request
        except BaseException:
            if upload is not None and not jobs:
                Path(upload).unlink(missing_ok=True)
            raise
        return jobs

    async def generate(request: Request, body, prompt: str, extra: dict, image: str | None) -> list[dict]:
        """Queue the jobs, then wait for them without holding a thread; the finished job dicts."""
        s = mine(request)
        jobs = await run_in_threadpool(submit, s, body, prompt, extra, image)
        done = [await s.wait_async(j["id"], wait_s) for j in jobs]
        for job in done:
            _raise_for(job)
        return done

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        prompt, image = body.prompt_and_image()
        jobs = await generate(request, body, prompt, {}, image)
        return await run_in_threadpool(chat_answer, jobs)

    def chat_answer(jobs: list[dict]) -> dict:
        choices = []
        for i, job in enumerate(jobs):
            url, is_video = _data_url(job)
            part = {"type": "video_url", "video_url": {"url": url}} if is_video else \
                {"type": "image_url", "image_url": {"url": url}}
            choices.append({"index": i, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": [part]}})
        return {"id": f"chatcmpl-{jobs[0]['id']}", "object": "chat.completion", "created": int(time.time()),
                "model": jobs[0]["model"], "choices": choices,
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                "metadata": [j["result"]["metadata"] for j in jobs]}

    async def media(request: Request, body: GenerationRequest, want_video: bool):
        jobs = await generate(request, body, body.prompt, body.size_fields(), None)
        return await run_in_threadpool(media_answer, jobs, want_video)

    def media_answer(jobs: list[dict], want_video: bool) -> dict:
        data = []
        for job in jobs:
            path = Path(job["result"]["path"])
            if (path.suffix == ".mp4") != want_video:
                raise InvalidParameter(f"model {job['model']} makes {'videos' if path.suffix == '.mp4' else 'images'}"
                                       f"; use /v1/{'videos' if path.suffix == '.mp4' else 'images'}/generations",
                                       param="model")
            data.append({"b64_json": base64.b64encode(path.read_bytes()).decode(), "job_id": job["id"],
                         "metadata": job["result"]["metadata"]})
        return {"created": int(time.time()), "data": data}

    @v1.post("/images/generations")
    async def images(body: GenerationRequest, request: Request):
        return await media(request, body, want_video=False)

    @v1.post("/videos/generations")
    async def videos(body: GenerationRequest, request: Request):
        return await media(request, body, want_video=True)

    @v1.get("/loras")
    def loras():
        return {"object": "list", "data": studio.loaded_adapters(), "library": studio.adapters()}

    @v1.post("/loras/export")
    def export_lora(body: ExportAdapterRequest):
        """A stack (the ``lora`` list, weights as in a generation request) as one LoRA file in the library,
        under ``name`` (a plain file name: nothing the client sends decides where else it is written)."""
        return studio.export_adapter(body.adapters(), body.name, portable=body.portable, layout=body.layout)

    @v1.post("/models/bake")
    def bake_model(body: BakeModelRequest, request: Request):
        """The loaded model with a stack merged into a copy on the server's disk, served as ``baked:<name>``
        (a plain name). A copy can take the disk of the whole model: on a server with several users, admins only."""
        return mine(request).bake_model(body.adapters(), body.name)

    @v1.post("/load_lora_adapter")
    def load_lora(body: LoadAdapterRequest):
        studio.load_adapter(body.lora_name, body.lora_path)
        return {"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                "adapter": next(a for a in studio.loaded_adapters() if a["name"] == body.lora_name)}

    @v1.post("/unload_lora_adapter")
    def unload_lora(body: UnloadAdapterRequest):
        studio.unload_adapter(body.lora_name)
        return {"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."}

    @v1.get("/jobs")
    def jobs(request: Request, limit: int = 100, status: str | None = None):
        """The caller's jobs, newest first (an admin's: everyone's)."""
        return {"object": "list", "data": mine(request).jobs(limit=max(1, min(limit, 1000)), status=status)}

    @v1.get("/jobs/{job_id}")
    def job(job_id: str, request: Request):
        return mine(request).job(job_id)

    @v1.get("/jobs/{job_id}/preview")
    def job_preview(job_id: str, request: Request):
        """The running job's latest live preview (PNG, at most 128 px a side; X-Preview-Step says which
        step); 204 while there is none (queued, finished, its first second, or a model without previews)."""
        preview = mine(request).job_preview(job_id)
        if preview is None:
            return Response(status_code=204, headers={"Cache-Control": "no-store"})
        return Response(preview["png"], media_type="image/png",
                        headers={"X-Preview-Step": str(preview["step"]), "Cache-Control": "no-store"})

    @v1.delete("/jobs/{job_id}")
    def cancel(job_id: str, request: Request):
        return mine(request).cancel(job_id)

    app.include_router(v1)
    return app


def _raise_for(job: dict) -> None:
    if job["status"] == "succeeded":
        return
    if job["status"] in ("failed", "cancelled"):
        raise job_error(job)
    raise Timeout(f"job {job['id']} is still {job['status']}; poll GET /v1/jobs/{job['id']}", param="job_id")


def _data_url(job: dict) -> tuple[str, bool]:
    path = Path(job["result"]["path"])
    is_video = path.suffix == ".mp4"
    mime = "video/mp4" if is_video else "image/png"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}", is_video


def _known_model(studio, model: str | None) -> str | None:
    """OpenAI clients always send some ``model``; only a model this server serves (Studio.check_model)
    selects one, any other name means "the loaded one"."""
    if not model or model == studio.current_model():
        return None
    try:
        return studio.check_model(model)
    except StudioError:
        return None


def _save_upload(studio, value) -> str:
    """An input image given as a data URL or base64 -> a file under <data-dir>/uploads."""
    if not isinstance(value, str):
        raise InvalidParameter("'image' must be a data URL or base64-encoded image", param="image")
    payload = value.split(",", 1)[1] if value.startswith("data:") else value
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParameter("'image' must be a data URL or base64-encoded image (server paths are not "
                               "accepted over HTTP)", param="image") from None
    folder = Path(studio.data_dir) / "uploads"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(raw).hexdigest()[:24]}-{uuid.uuid4().hex[:6]}.img"
    try:
        path.write_bytes(raw)
    except OSError as exc:
        path.unlink(missing_ok=True)  # no half-written upload left behind
        if storage_full(exc):
            raise StorageFull(f"no room on the server's disk to store the input image ({exc.strerror}); "
                              "tell the operator", param="image") from None
        raise
    return str(path)

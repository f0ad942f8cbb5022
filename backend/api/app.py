"""The OpenAI-compatible HTTP app over the Studio facade.

Routes (the contract's): /health, /metrics, /v1/models, /v1/chat/completions,
/v1/images/generations, /v1/videos/generations, /v1/loras, /v1/load_lora_adapter,
/v1/unload_lora_adapter, /v1/jobs[/{id}]. Every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with the StudioError's status.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import time
import uuid
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvalidParameter, StudioError
from ..service import job_error
from .auth import AuthGate, Credentials, GateConfig
from .schemas import ChatRequest, GenerationRequest, LoadAdapterRequest, UnloadAdapterRequest

MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_WAIT_S = 3600.0


class Timeout(StudioError):
    http_status = 504
    kind = "timeout"


class BodyTooLarge(StudioError):
    http_status = 413


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` (413), by Content-Length or as they stream in."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send, int(length))
        # read the (JSON) body up to the limit first, then hand it on: a body streamed
        # without Content-Length is held to the same bound
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await self._refuse(scope, receive, send, seen)
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope, receive, send, length: int):
        exc = BodyTooLarge(f"request body of {length}+ bytes is over the {self.max_bytes}-byte limit")
        await _studio_error(exc)(scope, receive, send)


def error_body(message: str, kind: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _studio_error(exc: StudioError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.http_status), status_code=exc.http_status)


def create_app(studio, api_key: str | None = None, *, login: str | tuple[str, str] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, wait_s: float = DEFAULT_WAIT_S) -> FastAPI:
    """``api_key`` / ``login`` (USER:PASS): when either is set, every route but /health needs a
    credential (backend/api/auth.py; the UI adds its login page when it mounts)."""
    app = FastAPI(title="LoRA Studio", version="1", docs_url="/docs", openapi_url="/openapi.json")
    app.state.studio = studio
    app.state.auth = GateConfig(Credentials(api_key, login))

    @app.exception_handler(StudioError)
    async def _on_studio_error(request, exc: StudioError):
        return _studio_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param or 'body'}: {err.get('msg')}", "invalid_request_error", param, 400),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, None, exc.status_code), status_code=exc.status_code)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    # outermost (added last): credentials are judged on the headers, before any body is read
    app.add_middleware(AuthGate, config=app.state.auth)

    @app.get("/health")
    def health():
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

    def generate(body, prompt: str, extra: dict, image: str | None) -> list[dict]:
        """Queue ``n`` jobs (seed, seed+1, ...) and wait for them; the finished job dicts."""
        fields = {**body.fields(exclude=frozenset({"prompt", "messages", "size", "response_format"})), **extra,
                  "prompt": prompt}
        if image is not None or "image" in fields:
            fields["image"] = _save_upload(studio, image if image is not None else fields["image"])
        model = body.model if body.model and body.model != studio.current_model() and \
            _known_model(studio, body.model) else None
        adapters = body.adapters()
        seed = fields.get("seed")
        jobs = []
        for i in range(body.n):
            params = dict(fields)
            if seed is not None and body.n > 1:
                params["seed"] = int(seed) + i
            jobs.append(studio.submit("generate", params, adapters, None, model))
        done = [studio.wait(j["id"], wait_s) for j in jobs]
        for job in done:
            _raise_for(job)
        return done

    @v1.post("/chat/completions")
    def chat(body: ChatRequest):
        prompt, image = body.prompt_and_image()
        jobs = generate(body, prompt, {}, image)
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

    def media(body: GenerationRequest, want_video: bool):
        jobs = generate(body, body.prompt, body.size_fields(), None)
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
    def images(body: GenerationRequest):
        return media(body, want_video=False)

    @v1.post("/videos/generations")
    def videos(body: GenerationRequest):
        return media(body, want_video=True)

    @v1.get("/loras")
    def loras():
        return {"object": "list", "data": studio.loaded_adapters(), "library": studio.adapters()}

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
    def jobs(limit: int = 100, status: str | None = None):
        return {"object": "list", "data": studio.jobs(limit=max(1, min(limit, 1000)), status=status)}

    @v1.get("/jobs/{job_id}")
    def job(job_id: str):
        return studio.job(job_id)

    @v1.delete("/jobs/{job_id}")
    def cancel(job_id: str):
        return studio.cancel(job_id)

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


def _known_model(studio, model: str) -> bool:
    """OpenAI clients always send some ``model``; only a model we serve selects one."""
    return any(m["id"] == model for m in studio.models())


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
    path.write_bytes(raw)
    return str(path)

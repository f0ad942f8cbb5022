"""One credential boundary for the whole port: the HTTP API, /metrics and the UI mounted beside them.

The rule: when any credential is configured (``--api-key KEY``, ``--auth USER:PASS``), every
request needs one, except the few ``open`` paths that read no state (``/health``; the UI adds its
login page and static assets). ``AuthGate`` is the outermost ASGI middleware, so a request is
judged on its headers alone, before any byte of its body is read (nor the body limit's buffer
filled). It accepts:

- ``Authorization: Bearer KEY`` (the API key);
- HTTP Basic: the ``--auth`` login; with only ``--api-key``, any user name and the key as the
  password. With both set, /v1 and /metrics take the key only (the login is the UI's);
- the UI's session cookie (``Sessions``, given by the UI when it mounts), on the UI's routes only:
  /v1 and /metrics never take a cookie, so another web page cannot drive the API through a
  logged-in browser.

``Throttle``: per client address, a few failed attempts are free, then each further failure
doubles a lockout (answered 429 with Retry-After, without checking the credential). The table
holds at most ``max_clients`` addresses (least recently failing ones are dropped).
This module imports no gradio: the UI plugs in through ``Sessions``.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import time
from collections import OrderedDict
from typing import Callable, Protocol

from ..errors import InvalidParameter

API_PREFIXES = ("/v1/", "/metrics")  # routes that take no cookie, and say "WWW-Authenticate: Bearer"
OPEN_PATHS = ("/health",)
LOGIN_MAX_BYTES = 16 * 1024


class Sessions(Protocol):
    """What the UI plugs into the gate (ui/blocks.py implements it over Gradio's login)."""

    def user(self, headers: dict[bytes, bytes]) -> str | None:
        """The user whose valid session cookie these request headers carry, else None."""

    def admit(self, scope: dict, user: str) -> None:
        """Let the UI's own login checks see ``scope`` (a request the gate accepted by key or
        Basic login) as ``user``'s."""


class Credentials:
    """The configured key and login; ``configured`` is False when neither is set (all open)."""

    def __init__(self, api_key: str | None = None, login: str | tuple[str, str] | None = None):
        if api_key is not None and not api_key.strip():
            raise InvalidParameter("--api-key must not be empty", param="api_key")
        if isinstance(login, str):
            user, sep, password = login.partition(":")
            if not sep or not user or not password:
                raise InvalidParameter("--auth must be USER:PASS", param="auth")
            login = (user, password)
        self.api_key, self.login = api_key, login

    @property
    def configured(self) -> bool:
        return self.api_key is not None or self.login is not None

    def bearer(self, token: str) -> bool:
        return self.api_key is not None and hmac.compare_digest(token.encode(), self.api_key.encode())

    def password(self, user: str, password: str) -> bool:
        """A login: the --auth pair; with only --api-key, any user name and the key as password."""
        if self.login is None:
            return self.bearer(password)
        ok_user = hmac.compare_digest(user.encode(), self.login[0].encode())
        ok_password = hmac.compare_digest(password.encode(), self.login[1].encode())
        return ok_user and ok_password

    __call__ = password  # Gradio's ``auth=`` callable: (user, password) -> bool


class Throttle:
    """Per-client backoff after failed logins: ``free`` failures, then a lockout of ``base_s`` doubling
    with each further failure up to ``max_s``; a client's record is forgotten ``forget_s`` after its
    last failure, or at a success. The same wrong credential sent again (a client with a stale key
    retrying) counts once: only new guesses count. At most ``max_clients`` records are kept, each
    with at most ``remember`` digests of recent wrong credentials."""

    def __init__(self, free: int = 5, base_s: float = 1.0, max_s: float = 300.0, forget_s: float = 900.0,
                 max_clients: int = 4096, remember: int = 16, clock=time.monotonic):
        self.free, self.base_s, self.max_s, self.forget_s = free, base_s, max_s, forget_s
        self.max_clients, self.remember, self.clock = max_clients, remember, clock
        # client -> (failures, last failure, locked until, digests of recent wrong credentials)
        self._records: OrderedDict[str, tuple[int, float, float, tuple[bytes, ...]]] = OrderedDict()

    def retry_after(self, client: str) -> float:
        """Seconds this client must wait before its next attempt (0: go ahead)."""
        record = self._records.get(client)
        if record is None:
            return 0.0
        now = self.clock()
        if now - record[1] > self.forget_s:
            del self._records[client]
            return 0.0
        return max(0.0, record[2] - now)

    def failed(self, client: str, attempt: bytes | None = None) -> None:
        """A wrong credential from ``client``; ``attempt``: what it sent (None: always a new guess)."""
        now = self.clock()
        failures, last, until, seen = self._records.pop(client, (0, now, now, ()))
        if now - last > self.forget_s:
            failures, seen = 0, ()
        digest = hashlib.sha256(attempt).digest()[:16] if attempt is not None else None
        if digest is None or digest not in seen:
            failures += 1
            over = failures - self.free
            until = now + min(self.max_s, self.base_s * 2 ** (over - 1)) if over > 0 else now
            last = now
            if digest is not None:
                seen = (*seen, digest)[-self.remember:]
        self._records[client] = (failures, last, until, seen)
        while len(self._records) > self.max_clients:
            self._records.popitem(last=False)

    def succeeded(self, client: str) -> None:
        self._records.pop(client, None)

    def __len__(self) -> int:
        return len(self._records)


class GateConfig:
    """Shared by the gate and whoever mounts more routes on the app (the UI adds its open paths and
    its ``sessions``); lives at ``app.state.auth``."""

    def __init__(self, credentials: Credentials, throttle: Throttle | None = None):
        self.credentials = credentials
        self.throttle = throttle or Throttle()
        self.open_exact: set[str] = set(OPEN_PATHS)
        self.open_prefixes: list[str] = []
        self.login_paths: set[str] = set()  # the UI's login form: throttled, its answer tells the outcome
        self.sessions: Sessions | None = None
        # the UI's login page as an anonymous client gets it: ``scrub(html) -> html`` takes out what the
        # page would show only to someone logged in (Gradio embeds its API description there)
        self.page_paths: set[str] = set()
        self.scrub: Callable[[bytes], bytes] | None = None

    def add_open(self, exact=(), prefixes=(), login=()) -> None:
        self.open_exact.update(exact)
        self.open_prefixes.extend(prefixes)
        self.login_paths.update(login)
        self.open_exact.update(login)

    def is_open(self, path: str) -> bool:
        return path in self.open_exact or any(path.startswith(p) for p in self.open_prefixes)


def _is_api(path: str) -> bool:
    return path.startswith(API_PREFIXES) or path in ("/v1", "/metrics")


class AuthGate:
    """ASGI middleware: see the module docstring. Wraps the whole app (add it last)."""

    def __init__(self, app, config: GateConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        config = self.config
        if scope["type"] not in ("http", "websocket") or not config.credentials.configured:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(reversed(scope.get("headers") or []))  # the first of repeated headers, as Starlette reads
        client = (scope.get("client") or ("?", 0))[0]
        throttle = config.throttle

        if path in config.login_paths and scope.get("method") == "POST":
            wait = throttle.retry_after(client)
            if wait:
                return await _refuse(scope, receive, send, 429, _too_many(wait), wait=wait)
            length = headers.get(b"content-length", b"")
            if not length.isdigit() or int(length) > LOGIN_MAX_BYTES:  # the form is the credential: keep it small
                return await _refuse(scope, receive, send, 413,
                                     f"a login form is at most {LOGIN_MAX_BYTES} bytes, sent with a Content-Length")
            return await self.app(scope, receive, _watch_login(send, throttle, client))

        api = _is_api(path)
        if not api and config.sessions is not None and config.sessions.user(headers) is not None:
            return await self.app(scope, receive, send)  # a logged-in browser (its cookie is no guess)
        if b"authorization" in headers:
            wait = throttle.retry_after(client)
            if wait:  # locked out: not even checked
                return await _refuse(scope, receive, send, 429, _too_many(wait), wait=wait)
            given, user = _presented(headers, config.credentials, api=api)
            if user is None:
                throttle.failed(client, headers.get(b"authorization"))
                return await _refuse(scope, receive, send, 401, f"wrong {given}: {_hint(config.credentials, api)}",
                                     challenge=_challenge(config.credentials, api))
            throttle.succeeded(client)
            if config.sessions is not None and not api:
                config.sessions.admit(scope, user)
            return await self.app(scope, receive, send)
        if config.is_open(path):
            if config.scrub is not None and path in config.page_paths and scope["type"] == "http":
                return await _scrubbed(self.app, scope, receive, send, config.scrub)
            return await self.app(scope, receive, send)
        return await _refuse(scope, receive, send, 401,
                             f"this server needs credentials: {_hint(config.credentials, api)}"
                             + ("" if api else ", or log in at /"), challenge=_challenge(config.credentials, api))


def _hint(credentials: Credentials, api: bool) -> str:
    if credentials.login is None:
        return "send 'Authorization: Bearer <key>' (or HTTP Basic with the key as password)"
    if credentials.api_key is None:
        return "send the login as HTTP Basic ('Authorization: Basic <base64 of USER:PASS>', curl -u USER:PASS)"
    if api:
        return "send 'Authorization: Bearer <key>' (the login is for the UI)"
    return "send 'Authorization: Bearer <key>' or the login as HTTP Basic"


def _challenge(credentials: Credentials, api: bool) -> str | None:
    """WWW-Authenticate on the API routes (none on the UI's: a browser would pop up its own dialog
    over the UI's login form)."""
    if not api:
        return None
    return 'Bearer realm="lora-studio"' if credentials.api_key is not None else 'Basic realm="lora-studio"'



def _presented(headers: dict, credentials: Credentials, api: bool) -> tuple[str | None, str | None]:
    """(what kind of credential the request carries, or None; the user it proves, or None).
    With an API key, the API routes take only the key: a login is for the UI."""
    raw = headers.get(b"authorization")
    if raw is None:
        return None, None
    scheme, _, value = raw.decode("latin-1").strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return "API key", ("api" if credentials.bearer(value) else None)
    if scheme.lower() == "basic":
        try:
            user, sep, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return "Basic login", None
        if api and credentials.api_key is not None and credentials.login is not None:
            return "Basic login", None
        if not sep or not credentials.password(user, password):
            return "Basic login", None
        return "Basic login", credentials.login[0] if credentials.login is not None else "api"
    return f"'{scheme}' authorization", None


def _too_many(wait: float) -> str:
    return f"too many failed logins from this address: retry in {math.ceil(wait)} s"


def _watch_login(send, throttle: Throttle, client: str):
    """The UI's login answer: 200 is a success, a 4xx a failed guess."""

    async def watching(message):
        if message["type"] == "http.response.start":
            status = message["status"]
            if status < 300:
                throttle.succeeded(client)
            elif 400 <= status < 500:
                throttle.failed(client)
        await send(message)

    return watching


async def _scrubbed(app, scope, receive, send, scrub) -> None:
    """Run ``app`` for an anonymous page request and pass its HTML through ``scrub`` (buffered: a login page
    is a few kB), Content-Length set again; asked uncompressed so the text can be read."""
    scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers") or [] if k != b"accept-encoding"]}
    start, chunks = None, []

    async def buffered(message):
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body":
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = b"".join(chunks)
        headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() != b"content-length"]
        kind = dict(headers).get(b"content-type", b"")
        if kind.startswith(b"text/html") and b"content-encoding" not in dict(headers):
            body = scrub(body)
        await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    await app(scope, receive, buffered)


async def _refuse(scope, receive, send, status: int, message: str, *, challenge: str | None = None,
                  wait: float | None = None) -> None:
    """An OpenAI-shaped error, sent without reading the request body."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    from fastapi.responses import JSONResponse

    from .schemas import error_body

    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    headers = {}
    if challenge and status == 401:
        headers["WWW-Authenticate"] = challenge
    if wait is not None:
        headers["Retry-After"] = str(math.ceil(wait))
    headers["Connection"] = "close"  # the unread body is not drained: this connection ends here
    response = JSONResponse(error_body(message, kind, "authorization", status), status_code=status, headers=headers)
    await response(scope, receive, send)

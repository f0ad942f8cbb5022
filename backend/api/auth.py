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
from ..users import API_USER, MAX_PASSWORD, User, Verified, parse_key, verify_password

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
    """The configured keys and logins (backend/users.py says who each one is); ``configured`` is False
    when none is set (all open). ``api_key``: one key or a list of ``KEY`` / ``NAME=KEY`` values;
    ``login``: the one ``--auth USER:PASS``; ``users``: {user: hash} from ``--auth-file``; ``admins``:
    names that see everyone's work (the one login and an unnamed key always do)."""

    def __init__(self, api_key: str | list[str] | None = None, login: str | tuple[str, str] | None = None, *,
                 users: dict[str, str] | None = None, admins=()):
        if isinstance(login, str):
            user, sep, password = login.partition(":")
            if not sep or not user or not password:
                raise InvalidParameter("--auth must be USER:PASS", param="auth")
            login = (user, password)
        values = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
        self.keys: list[tuple[str, str]] = [parse_key(v) for v in values]
        self.login, self.users = login, dict(users or {})
        self.admins = frozenset(admins)
        self._verified = Verified()
        named = {n for n, _ in self.keys if n != API_USER}
        if any(n == API_USER for n, _ in self.keys) and API_USER in self.users:
            raise InvalidParameter(f"--auth-file lists a user '{API_USER}', the name an unnamed --api-key acts as; "
                                   "rename the user or name the key (--api-key NAME=KEY)", param="auth_file")
        known = set(self.users) | named | ({login[0]} if login else set()) | \
            ({API_USER} if any(n == API_USER for n, _ in self.keys) else set())
        unknown = sorted(set(self.admins) - known)
        if unknown:
            raise InvalidParameter(f"--admin {unknown[0]}: no such user or key name (users: "
                                   f"{', '.join(sorted(known)) or 'none'})", param="admin")

    @property
    def api_key(self) -> str | None:
        """The first key (None without keys): whether keys are configured, for the hints."""
        return self.keys[0][1] if self.keys else None

    @property
    def logins(self) -> bool:
        """Whether there are logins besides the keys (--auth, --auth-file)."""
        return self.login is not None or bool(self.users)

    @property
    def configured(self) -> bool:
        return bool(self.keys) or self.logins

    def _role(self, name: str, default: bool = False) -> User:
        return User(name, admin=default or name in self.admins)

    def bearer(self, token: str) -> User | None:
        """The identity a key acts as (every key compared, so the time does not say which matched)."""
        found = None
        for name, key in self.keys:
            if hmac.compare_digest(token.encode(), key.encode()) and found is None:
                found = self._role(name, default=name == API_USER)
        return found

    def check(self, user: str, password: str) -> User | None:
        """A login: the --auth pair, an --auth-file user (a slow hash: call off the event loop), or, with
        no logins configured, a key as the password (a named key under its own name, an unnamed one
        under any name)."""
        if len(password) > MAX_PASSWORD:
            return None
        if self.login is not None and hmac.compare_digest(user.encode(), self.login[0].encode()) \
                and hmac.compare_digest(password.encode(), self.login[1].encode()):
            return self._role(self.login[0], default=True)
        hashed = self.users.get(user)
        if hashed is not None:
            if self._verified.known(user, password, hashed) or verify_password(password, hashed):
                self._verified.remember(user, password, hashed)
                return self._role(user)
            return None
        if self.logins:
            return None
        key = self.bearer(password)
        if key is None or (key.name != API_USER and user != key.name):
            return None
        return key if key.name != API_USER else self._role(user or API_USER, default=True)

    def password(self, user: str, password: str) -> bool:
        return self.check(user, password) is not None

    __call__ = password  # Gradio's ``auth=`` callable: (user, password) -> bool

    async def login_async(self, user: str, password: str) -> bool:
        """``password`` for Gradio's login route (awaited there): a hash is checked in a worker thread."""
        if user in self.users:
            import anyio

            return await anyio.to_thread.run_sync(self.password, user, password)
        return self.password(user, password)

    def lookup(self, name: str | None) -> User | None:
        """The identity behind a UI session's user name (its login was checked when the session began)."""
        if not name:
            return None
        if self.login is not None and name == self.login[0]:
            return self._role(name, default=True)
        if name in self.users or any(n == name and n != API_USER for n, _ in self.keys):
            return self._role(name)
        if any(n == API_USER for n, _ in self.keys):  # an unnamed key's login (any name), or its Bearer
            return self._role(name, default=True)
        return None


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
        # ``guard(path, user) -> refusal or None``: per-user rules on paths (the UI's result files)
        self.guards: list[Callable[[str, User], str | None]] = []

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
        if not api and config.sessions is not None:
            user = config.credentials.lookup(config.sessions.user(headers))
            if user is not None:  # a logged-in browser (its cookie is no guess)
                return await self._pass(scope, receive, send, user)
        if b"authorization" in headers:
            wait = throttle.retry_after(client)
            if wait:  # locked out: not even checked
                return await _refuse(scope, receive, send, 429, _too_many(wait), wait=wait)
            given, user = await _presented(headers, config.credentials, api=api)
            if user is None:
                throttle.failed(client, headers.get(b"authorization"))
                return await _refuse(scope, receive, send, 401, f"wrong {given}: {_hint(config.credentials, api)}",
                                     challenge=_challenge(config.credentials, api))
            throttle.succeeded(client)
            if config.sessions is not None and not api:
                config.sessions.admit(scope, user.name)
            return await self._pass(scope, receive, send, user)
        if config.is_open(path):
            if config.scrub is not None and path in config.page_paths and scope["type"] == "http":
                return await _scrubbed(self.app, scope, receive, send, config.scrub)
            return await self.app(scope, receive, send)
        return await _refuse(scope, receive, send, 401,
                             f"this server needs credentials: {_hint(config.credentials, api)}"
                             + ("" if api else ", or log in at /"), challenge=_challenge(config.credentials, api))

    async def _pass(self, scope, receive, send, user: User):
        """Hand an accepted request on, its identity in ``scope["state"]["user"]`` (``user_of``); a path a
        ``guard`` refuses for this user (another user's result file) is a 404, as if it did not exist."""
        scope.setdefault("state", {})["user"] = user
        for guard in self.config.guards:
            refusal = guard(scope.get("path", ""), user)
            if refusal:
                return await _refuse(scope, receive, send, 404, refusal)
        return await self.app(scope, receive, send)


def user_of(scope) -> User | None:
    """The identity the gate accepted for this request (None: a server without credentials)."""
    state = scope.get("state") or {}
    return state.get("user") if isinstance(state, dict) else getattr(state, "user", None)


def _hint(credentials: Credentials, api: bool) -> str:
    if not credentials.logins:
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



async def _presented(headers: dict, credentials: Credentials, api: bool) -> tuple[str | None, User | None]:
    """(what kind of credential the request carries, or None; the identity it proves, or None).
    With an API key, the API routes take only the key: a login is for the UI. A password hash is
    checked in a worker thread (tens of milliseconds the event loop does not wait)."""
    raw = headers.get(b"authorization")
    if raw is None:
        return None, None
    scheme, _, value = raw.decode("latin-1").strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return "API key", credentials.bearer(value)
    if scheme.lower() == "basic":
        try:
            user, sep, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return "Basic login", None
        if api and credentials.keys and credentials.logins:
            return "Basic login", None
        if not sep:
            return "Basic login", None
        if user in credentials.users:
            import anyio

            return "Basic login", await anyio.to_thread.run_sync(credentials.check, user, password)
        return "Basic login", credentials.check(user, password)
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

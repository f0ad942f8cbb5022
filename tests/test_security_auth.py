"""One credential boundary (issue 14, items 1, 2, 6, 7), driven over HTTP against real
``python app.py serve`` processes: one per credential configuration (API key only, login only,
both), shared by this module.

Every route of the port is tried, the UI's too: the list comes from the routes the installed
FastAPI app and Gradio mount (not a hand-written guess). Throttled clients are told apart by
their address: each test talks from its own 127.0.0.N, so one test's failures do not lock out
another's.
"""
from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from backend.api.server import free_port
from ui_fixtures import MODEL, ServedApp, app_home, start_app

ROOT = Path(__file__).resolve().parents[1]
KEY, USER, PASSWORD = "k3y-sec", "alice", "pa55-word"


def _serve(tmp_path_factory, data_dir, demo_path, *flags) -> ServedApp:
    demo_path(MODEL)
    return start_app(app_home(data_dir, tmp_path_factory, "auth-app"), *flags, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def key_srv(tmp_path_factory, data_dir, demo_path):
    served = _serve(tmp_path_factory, data_dir, demo_path, "--api-key", KEY)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def login_srv(tmp_path_factory, data_dir, demo_path):
    served = _serve(tmp_path_factory, data_dir, demo_path, "--auth", f"{USER}:{PASSWORD}")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def both_srv(tmp_path_factory, data_dir, demo_path):
    served = _serve(tmp_path_factory, data_dir, demo_path, "--auth", f"{USER}:{PASSWORD}", "--api-key", KEY)
    yield served
    served.stop()


def _basic(user: str, password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


BEARER = {"Authorization": f"Bearer {KEY}"}


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route the served app has: the HTTP API's and those Gradio mounts,
    enumerated from the installed packages (the app is built in-process, not served)."""
    from starlette.routing import Mount

    import ui
    from backend.api import create_app

    app = create_app(None, api_key="x")
    ui.mount(app, None)

    def walk(routes, prefix=""):
        for r in routes:
            if isinstance(r, Mount):
                yield from walk(r.routes, prefix + r.path)
            elif hasattr(r, "effective_candidates"):  # FastAPI's included router
                yield from walk(r.effective_candidates(), prefix)
            else:
                for method in sorted(getattr(r, "methods", None) or {"GET"}):
                    yield method, prefix + r.path

    return sorted(set(walk(app.routes)))


# what a browser needs to log in (and /health): everything else needs a credential
OPEN = re.compile(r"^/(health|favicon\.ico|theme\.css|gradio_api/theme\.css|robots\.txt|manifest\.json|login/?"
                  r"|assets/.*|static/.*|svelte/.*|pwa_icon.*)?$")


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x", path)


def _assert_all_closed(served: ServedApp, source: str) -> int:
    routes = _routes()
    assert len(routes) > 60, routes  # Gradio's routes are in the list, not only ours
    checked, open_ = 0, []
    with served.client(source) as c:
        for method, path in routes:
            url = _concrete(path)
            if OPEN.match(url):
                continue
            checked += 1
            try:
                r = c.request(method, url, json={} if method in ("POST", "PUT", "DELETE") else None, timeout=20)
            except httpx.HTTPError as exc:  # an event stream that was served, then cut: open too
                open_.append(f"{method} {url} -> {type(exc).__name__}")
                continue
            if r.status_code != 401:
                open_.append(f"{method} {url} -> {r.status_code}")
    assert not open_, "answered without a credential:\n" + "\n".join(open_)
    return checked


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    return err


def _event_table(c: httpx.Client) -> list[dict]:
    config = c.get("/config")
    assert config.status_code == 200, config.text[:300]
    return config.json()["dependencies"]


def _private_fn(deps: list[dict]) -> int:
    """The fn_index of an event the browser uses that is not a public endpoint (the Queue tab's refresh)."""
    private = [d for d in deps if d.get("api_visibility") == "private"]
    assert private, [d.get("api_visibility") for d in deps]
    return private[0]["id"]


# --- item 1: --api-key alone closes the UI side of the port too ---------------------------------

def test_api_key_alone_closes_every_route_of_the_port(key_srv):
    n = _assert_all_closed(key_srv, "127.0.0.11")
    assert n > 50
    with key_srv.client("127.0.0.11") as c:
        assert c.get("/health").status_code == 200
        # the event table and a private event's fn_index, read with the key, then posted without it
        with key_srv.client("127.0.0.11", headers=BEARER) as keyed:
            fn = _private_fn(_event_table(keyed))
        for body in ({"data": [], "fn_index": fn, "session_hash": "s1", "trigger_id": None},):
            _error(c.post("/gradio_api/queue/join", json=body), 401)
        _error(c.post("/gradio_api/call/generate", json={"data": ["a cat"]}), 401)
        _error(c.post("/gradio_api/upload", files={"files": ("a.png", b"\x89PNG", "image/png")}), 401)
        _error(c.get("/gradio_api/queue/data", params={"session_hash": "s1"}), 401)
        # the login page and its assets stay reachable, and it asks for a login
        page = c.get("/")
        assert page.status_code == 200 and '"auth_required":true' in page.text.replace(" ", "")
        asset = re.search(r'(?:src|href)="\.?/?(assets/[^"]+\.(?:js|css))"', page.text)
        assert asset and c.get("/" + asset.group(1)).status_code == 200


def test_api_key_opens_gradio_routes_by_bearer_basic_and_login(key_srv):
    with key_srv.client("127.0.0.12", headers=BEARER) as c:
        assert c.get("/gradio_api/info").status_code == 200
        fn = _private_fn(_event_table(c))
        joined = c.post("/gradio_api/queue/join", json={"data": [], "fn_index": fn, "session_hash": "s2",
                                                          "trigger_id": None})
        assert joined.status_code == 200, joined.text[:300]
        event = c.post("/gradio_api/call/list_adapters", json={"data": []})
        assert event.status_code == 200, event.text[:300]
        stream = c.get(f"/gradio_api/call/list_adapters/{event.json()['event_id']}")
        assert stream.status_code == 200 and "event: complete" in stream.text, stream.text[:300]
        up = c.post("/gradio_api/upload", files={"files": ("a.txt", b"hello", "text/plain")})
        assert up.status_code == 200, up.text[:300]
        got = c.get(f"/gradio_api/file={up.json()[0]}")
        assert got.status_code == 200 and got.content == b"hello"
        assert c.get("/v1/models").status_code == 200 and c.get("/metrics").status_code == 200
    # HTTP Basic: any user name, the key as password
    with key_srv.client("127.0.0.12", headers=_basic("anyone", KEY)) as c:
        assert c.get("/config").status_code == 200 and c.get("/v1/jobs").status_code == 200
    # the browser's way: the login form takes any user name and the key; its cookie opens the UI routes
    with key_srv.client("127.0.0.12") as c:
        assert c.post("/login", data={"username": "me", "password": KEY}).status_code == 200
        assert c.get("/config").status_code == 200
        # ... but never the API: another web page must not drive /v1 through a logged-in browser
        _error(c.get("/v1/jobs"), 401)


def test_gradio_client_passes_the_key(key_srv):
    from gradio_client import Client

    with pytest.raises(Exception, match="(?i)credentials|401|login"):
        Client(key_srv.url, verbose=False)
    client = Client(key_srv.url, headers=BEARER, verbose=False)
    assert isinstance(client.predict(api_name="/list_adapters"), list)
    path, meta = client.predict("a red square", None, 3, 64, 64, 2, api_name="/generate")
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # downloaded through /gradio_api/file=, keyed
    assert meta["seed"] == 3
    # or log in like the browser: any user name, the key as password
    assert isinstance(Client(key_srv.url, auth=("me", KEY), verbose=False).predict(api_name="/list_adapters"), list)


# --- item 2: --auth alone closes /v1 --------------------------------------------------------------

def test_login_alone_closes_v1_and_metrics(login_srv):
    with login_srv.client("127.0.0.21") as c:
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/jobs"), ("GET", "/v1/loras"), ("GET", "/metrics"),
                             ("POST", "/v1/images/generations"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/load_lora_adapter"), ("DELETE", "/v1/jobs/x")):
            r = c.request(method, path, json={"prompt": "x"})
            err = _error(r, 401)
            assert "HTTP Basic" in err["message"] and r.headers["www-authenticate"].startswith("Basic")
        # no key is configured: no Bearer value opens anything
        _error(c.get("/v1/models", headers={"Authorization": f"Bearer {PASSWORD}"}), 401)
        _error(c.get("/v1/models", headers=_basic(USER, "wrong")), 401)
        # the login, as HTTP Basic, opens the API and the UI routes
        assert c.get("/v1/models", headers=_basic(USER, PASSWORD)).status_code == 200
        assert c.get("/metrics", headers=_basic(USER, PASSWORD)).status_code == 200
        assert c.get("/config", headers=_basic(USER, PASSWORD)).status_code == 200
    _assert_all_closed(login_srv, "127.0.0.22")


def test_both_key_and_login(both_srv):
    """With both, the API takes the key, the UI takes the login or the key (docs/server.md)."""
    from openai import AuthenticationError, OpenAI

    with both_srv.client("127.0.0.31") as c:
        assert c.get("/v1/models", headers=BEARER).status_code == 200
        _error(c.get("/v1/models", headers=_basic(USER, PASSWORD)), 401)  # the login is the UI's
        _error(c.get("/metrics", headers=_basic("anyone", KEY)), 401)
        for headers in (BEARER, _basic(USER, PASSWORD)):
            assert c.get("/gradio_api/info", headers=headers).status_code == 200
        _error(c.get("/gradio_api/info", headers=_basic("anyone", KEY)), 401)  # the key is no login here
        assert c.post("/login", data={"username": "anyone", "password": KEY}).status_code == 400
        assert c.post("/login", data={"username": USER, "password": PASSWORD}).status_code == 200
        assert c.get("/config").status_code == 200
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{both_srv.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert OpenAI(base_url=f"{both_srv.url}/v1", api_key=KEY).models.list().data


def test_share_needs_a_credential_and_an_empty_key_is_refused():
    for flags, word in ((["--share"], "--api-key"), (["--api-key", ""], "--api-key"),
                        (["--share", "--api-key", " "], "--api-key")):
        r = subprocess.run([sys.executable, "app.py", "serve", MODEL, "--port", str(free_port()), *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and word in r.stderr, (flags, r.stderr)


# --- item 6: throttle -----------------------------------------------------------------------------

def _hammer(c: httpx.Client, send, seconds: float = 4.0, cap: int = 400) -> dict:
    counts, start, n = {}, time.monotonic(), 0
    while time.monotonic() - start < seconds and n < cap:
        r = send(c)
        counts[r.status_code] = counts.get(r.status_code, 0) + 1
        n += 1
    return counts


def test_failed_logins_back_off_per_client(login_srv):
    with login_srv.client("127.0.0.41") as c:
        counts = _hammer(c, lambda c: c.post("/login", data={"username": USER, "password": f"guess{time.time()}"}))
        assert counts.get(429, 0) > 0 and counts.get(400, 0) <= 8, counts  # a handful of real guesses in 4 s
        refused = c.post("/login", data={"username": USER, "password": PASSWORD})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1  # not even checked
        # another client is not locked out
        with login_srv.client("127.0.0.42") as other:
            assert other.post("/login", data={"username": USER, "password": PASSWORD}).status_code == 200
        # the lockout ends: then the right login works
        time.sleep(int(refused.headers["retry-after"]) + 0.5)
        assert c.post("/login", data={"username": USER, "password": PASSWORD}).status_code == 200
    # wrong Basic logins on /v1 back off the same way (each a new guess)
    with login_srv.client("127.0.0.43") as c:
        counts = _hammer(c, lambda c: c.get("/v1/models", headers=_basic(USER, f"guess{time.time()}")))
        assert counts.get(429, 0) > 0 and counts.get(401, 0) <= 8, counts
        r = c.get("/v1/models", headers=_basic(USER, PASSWORD))
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


# --- item 7: credentials before the body ----------------------------------------------------------

def _raw_post(port: int, source: str, key: str, length: int, send: int) -> bytes:
    """POST ``length`` announced bytes with ``key``, sending ``send`` of them; the first answer bytes."""
    head = (f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=15, source_address=(source, 0)) as s:
        try:
            s.sendall(head)
            chunk = b" " * (1 << 20)
            for _ in range(send >> 20):
                s.sendall(chunk)
        except OSError:
            pass  # answered and closed before all of it went: what we want
        try:
            return s.recv(200)
        except OSError:
            return b""


def test_a_wrong_key_is_refused_before_the_body_is_read(key_srv):
    # 62 MiB announced, 1 MiB sent: the 401 comes now, not after the rest of the body
    start = time.monotonic()
    answer = _raw_post(key_srv.port, "127.0.0.51", "wrong", 62 << 20, 1 << 20)
    assert answer.startswith(b"HTTP/1.1 401"), answer
    assert time.monotonic() - start < 10
    # the body limit stays, for a request with the right key
    assert _raw_post(key_srv.port, "127.0.0.51", KEY, 65 << 20, 0).startswith(b"HTTP/1.1 413")
    # four whole 60 MiB bodies with a wrong key barely move the server's memory (each from its own address)
    server = psutil.Process(key_srv.proc.pid)
    before = server.memory_info().rss
    for i in range(4):
        _raw_post(key_srv.port, f"127.0.0.{52 + i}", "wrong", 60 << 20, 60 << 20)
    time.sleep(0.5)
    grown = (server.memory_info().rss - before) / 2**20
    assert grown < 64, f"the server grew {grown:.0f} MiB"
    assert json.loads(httpx.get(f"{key_srv.url}/health").text)["status"] == "ok"


def test_the_backoff_table_is_bounded_and_forgets():
    """Memory for the per-client records stays bounded under many addresses; old records go."""
    from backend.api.auth import Throttle

    now = [0.0]
    t = Throttle(free=2, base_s=1, max_s=8, forget_s=60, max_clients=100, remember=4, clock=lambda: now[0])
    for i in range(10_000):
        t.failed(f"10.0.{i // 256}.{i % 256}", f"guess{i}".encode())
    assert len(t) == 100
    for i in range(6):  # 2 free, then 1, 2, 4, 8 (the cap)
        t.failed("a", f"g{i}".encode())
    assert t.retry_after("a") == 8
    t.failed("a", b"g5")  # the same wrong value again: not a new guess
    assert t.retry_after("a") == 8
    now[0] += 61  # forgotten a while after the last failure
    assert t.retry_after("a") == 0


def test_the_login_page_shows_no_api_description_and_logs_in_in_a_browser(login_srv):
    """Gradio embeds the app's API description (named endpoints, their parameters) in every page it serves,
    the login page too, while /gradio_api/info needs a credential: an anonymous visitor gets the login page
    without it, a logged-in one gets it (the UI's "Use via API" reads it), and the login works in Chromium."""
    from ui_browser import ARGS, CHROMIUM, TIMEOUT_MS

    with login_srv.client("127.0.0.13") as c:
        page = c.get("/", headers={"Accept-Encoding": "gzip, br"})  # as a browser asks for it
        assert page.status_code == 200 and '"auth_required":true' in page.text, page.text[:300]
        for word in ("/generate", "/list_adapters", "/apply_preset", "parameter_name", "num_inference_steps"):
            assert word not in page.text, word
        _error(c.get("/gradio_api/info"), 401)
    with login_srv.client("127.0.0.13", headers=_basic(USER, PASSWORD)) as c:
        assert '"/generate"' in c.get("/").text
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium for the browser half")
    import playwright.sync_api as playwright

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(login_srv.url + "/")
            page.get_by_label("username").fill(USER)
            page.get_by_label("password").fill(PASSWORD)
            page.get_by_role("button", name="Login").click()
            page.wait_for_selector("#prompt textarea")
            assert page.title() == "LoRA Studio"
        finally:
            browser.close()

"""Users who share one server (issue 25, item 2): ``--auth-file`` with hashed passwords, named API keys and
``--admin``; each job, its live preview, its result file and its place in the gallery belong to the
identity that submitted it. One real ``python app.py serve`` over HTTP: the API routes, Gradio's routes
(``gradio_client``, the UI's own API) and Gradio's file route, with ids guessed and ids known."""
from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from backend.users import check_hash, hash_password, read_auth_file, verify_password
from ui_fixtures import MODEL, app_home, served_app

ROOT = Path(__file__).resolve().parents[1]
PASSWORDS = {"alice": "alice-pw-1", "bob": "bob-pw-2", "root": "root-pw-3"}
# keys acting as the file users (with keys set, /v1 takes a key: a login is for the UI) and one for a script
KEYS = {"alice": "alice-key-3c1", "bob": "bob-key-9f2", "root": "root-key-5d0", "ci": "ci-key-77a"}


def _basic(user: str) -> dict:
    """The UI's login as HTTP Basic (Gradio's routes and the file route take it)."""
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{PASSWORDS[user]}".encode()).decode()}


def _key(user: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[user]}"}


def _hash_cli(user: str, password: str) -> str:
    """``python app.py hash-password USER`` with the password on stdin: one USER:HASH line."""
    r = subprocess.run([sys.executable, "app.py", "hash-password", user], cwd=ROOT, input=password + "\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert password not in r.stdout
    return r.stdout.strip()


@pytest.fixture(scope="module")
def users_srv(data_dir, demo_path, tmp_path_factory):
    """alice (scrypt, from the CLI), bob (bcrypt) and root (scrypt, --admin) in an --auth-file; a key
    acting as each, and one named ci."""
    import bcrypt

    demo_path(MODEL)
    home = app_home(data_dir, tmp_path_factory, "users")
    lines = ["# the users of this server", _hash_cli("alice", PASSWORDS["alice"]),
             "bob:" + bcrypt.hashpw(PASSWORDS["bob"].encode(), bcrypt.gensalt(rounds=4)).decode(),
             "root:" + hash_password(PASSWORDS["root"], ln=10)]
    auth_file = home / "users.txt"
    auth_file.write_text("\n".join(lines) + "\n")
    keys = [flag for name, key in KEYS.items() for flag in ("--api-key", f"{name}={key}")]
    with served_app(home, "--auth-file", str(auth_file), "--admin", "root", *keys,
                    env={"OMP_NUM_THREADS": "1"}) as served:
        yield served


def _generate(served, headers: dict, prompt: str) -> dict:
    with served.client(headers=headers) as c:
        r = c.post("/v1/images/generations", json={"prompt": prompt, "num_inference_steps": 1, "size": "64x64",
                                                   "seed": 5}, timeout=300)
        assert r.status_code == 200, r.text[:400]
        return c.get(f"/v1/jobs/{r.json()['data'][0]['job_id']}").json()


@pytest.fixture(scope="module")
def work(users_srv):
    """One finished job each for alice, bob and ci, over /v1 with their keys."""
    return {"alice": _generate(users_srv, _key("alice"), "a red digit 1"),
            "bob": _generate(users_srv, _key("bob"), "a blue digit 2"),
            "ci": _generate(users_srv, _key("ci"), "a green digit 3")}


def _not_found(r: httpx.Response, job_id: str) -> str:
    assert r.status_code == 404, (r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    assert message == f"no job with id {job_id!r}", message
    return message


def test_each_user_lists_only_their_own_jobs_and_admins_see_all(users_srv, work):
    ids = {who: job["id"] for who, job in work.items()}
    assert all(job["status"] == "succeeded" for job in work.values()), work
    assert work["alice"]["owner"] == "alice" and work["bob"]["owner"] == "bob" and work["ci"]["owner"] == "ci"
    for who in ("alice", "bob", "ci"):
        with users_srv.client(headers=_key(who)) as c:
            listed = {j["id"] for j in c.get("/v1/jobs").json()["data"]}
            assert listed == {ids[who]}, (who, listed)
    with users_srv.client(headers=_key("root")) as c:  # --admin
        assert set(ids.values()) <= {j["id"] for j in c.get("/v1/jobs").json()["data"]}
        assert c.get(f"/v1/jobs/{ids['alice']}").json()["id"] == ids["alice"]


def test_another_users_job_is_refused_exactly_as_an_unknown_id(users_srv, work):
    """Read, preview, cancel: bob gets for alice's job the 404 a made-up id gets, by id known or guessed."""
    alice = work["alice"]["id"]
    with users_srv.client(headers=_key("bob")) as c:
        for path in (f"/v1/jobs/{alice}", f"/v1/jobs/{alice}/preview"):
            _not_found(c.get(path), alice)
        _not_found(c.delete(f"/v1/jobs/{alice}"), alice)
        for guess in [uuid.uuid4().hex[:16] for _ in range(50)] + [alice[:-1] + "0", alice.upper()]:
            _not_found(c.get(f"/v1/jobs/{guess}"), guess)
        # by its short number (#26) as by its id: the unknown-job answer
        number = str(work["alice"]["number"])
        _not_found(c.get(f"/v1/jobs/{number}"), number)
        _not_found(c.delete(f"/v1/jobs/%23{number}"), "#" + number)
    with users_srv.client(headers=_key("alice")) as c:
        job = c.get(f"/v1/jobs/{alice}").json()
        assert job["status"] == "succeeded" and job["params"]["prompt"] == "a red digit 1", job
        assert c.get(f"/v1/jobs/%23{job['number']}").json()["id"] == alice
        assert c.get(f"/v1/jobs/{alice}/preview").status_code == 204


def test_a_users_result_file_is_served_to_them_and_admins_only(users_srv, work):
    """Gradio's file route serves the outputs folder: another user's result (and its JSON sidecar, which
    holds the prompt) is "not found" to them, the owner and an admin get the PNG."""
    path = work["alice"]["result"]["path"]
    assert Path(path).is_file()
    for who, status in (("alice", 200), ("root", 200), ("bob", 404)):
        with users_srv.client(headers=_basic(who)) as c:
            r = c.get(f"/gradio_api/file={path}")
            assert r.status_code == status, (who, r.status_code, r.text[:200])
            if status == 200:
                assert r.content[:8] == b"\x89PNG\r\n\x1a\n"
            if who == "bob":
                side = c.get(f"/gradio_api/file={path}.json")
                assert side.status_code == 404 and "a red digit 1" not in side.text, side.status_code
    with users_srv.client(headers=_key("ci")) as c:
        assert c.get(f"/gradio_api/file={path}").status_code == 404
    with users_srv.client(headers=_key("alice")) as c:  # the key acting as alice is alice
        assert c.get(f"/gradio_api/file={path}").status_code == 200


def test_the_ui_api_acts_as_the_signed_in_user(users_srv, work):
    """Gradio's routes (what the UI and gradio_client call) apply the same rule: bob's /cancel of alice's job
    is refused as an unknown id, his /generate is his job, listed by his key on /v1 (one person: the login
    and the key acting as bob) and not by alice's."""
    from gradio_client import Client

    alice = work["alice"]["id"]
    bob = Client(users_srv.url, auth=("bob", PASSWORDS["bob"]), verbose=False)
    with pytest.raises(Exception, match=re.escape(f"no job with id {alice!r}")):
        bob.predict(alice, api_name="/cancel")
    path, meta = bob.predict("a blue digit 4", None, 7, 64, 64, 1, api_name="/generate")
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and meta["seed"] == 7
    with users_srv.client(headers=_key("bob")) as c:
        mine = [j for j in c.get("/v1/jobs").json()["data"] if j["params"].get("prompt") == "a blue digit 4"]
        assert len(mine) == 1 and mine[0]["owner"] == "bob", mine
    with users_srv.client(headers=_key("alice")) as c:
        assert not [j for j in c.get("/v1/jobs").json()["data"] if j["owner"] != "alice"]
        assert c.get(f"/v1/jobs/{alice}").json()["status"] == "succeeded"  # bob's cancel changed nothing


def test_wrong_passwords_and_keys_are_refused(users_srv):
    for path, headers in (("/config", {"Authorization": "Basic " + base64.b64encode(b"alice:bob-pw-2").decode()}),
                          ("/config", {"Authorization": "Basic " + base64.b64encode(b"nobody:x").decode()}),
                          ("/v1/jobs", {"Authorization": f"Bearer {KEYS['bob']}x"}),
                          ("/v1/jobs", _basic("bob"))):  # with keys set, /v1 takes a key only
        with users_srv.client("127.0.0.31", headers=headers) as c:
            assert c.get(path).status_code == 401, (path, headers)
    with users_srv.client("127.0.0.32", headers=_basic("bob")) as c:
        assert c.get("/config").status_code == 200
    with users_srv.client("127.0.0.32") as c:  # the login form: a file user by password, not a key
        assert c.post("/login", data={"username": "bob", "password": KEYS["bob"]}).status_code == 400
        assert c.post("/login", data={"username": "bob", "password": PASSWORDS["bob"]}).status_code == 200
        assert c.get("/config").status_code == 200


def _start(*flags: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "app.py", "serve", MODEL, "--port", "9", "--device", "cpu",
                           "--data-dir", str(home), *flags], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LORA_STUDIO_HOME": str(home)})


@pytest.mark.parametrize("line, says", [
    ("alice:plain-secret", "plain-text password"),
    ("alice:$1$abc$def", "does not check"),
    ("alice:$scrypt$ln=30,r=8,p=1$c2FsdHNhbHRzYWx0$ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGk", "at most ln=20"),
    ("../etc:$scrypt$ln=10,r=8,p=1$c2FsdHNhbHRzYWx0$ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGlnZXN0ZGk", "plain user name"),
])
def test_a_bad_auth_file_stops_the_start_naming_the_line(tmp_path, line, says):
    auth_file = tmp_path / "users.txt"
    auth_file.write_text(f"# users\n\n{line}\n")
    r = _start("--auth-file", str(auth_file), home=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert f"{auth_file}, line 3" in r.stderr and says in r.stderr, r.stderr
    assert "plain-secret" not in r.stderr  # a password in the file is never echoed


def test_an_admin_that_names_no_one_is_refused(tmp_path):
    auth_file = tmp_path / "users.txt"
    auth_file.write_text(f"alice:{hash_password('x', ln=4)}\n")
    r = _start("--auth-file", str(auth_file), "--admin", "mallory", home=tmp_path)
    assert r.returncode == 2 and "--admin mallory: no such user" in r.stderr, r.stderr


def test_hashes_check_the_password_and_bound_their_cost(tmp_path):
    line = _hash_cli("dana", "correct horse")
    name, hashed = line.split(":", 1)
    assert name == "dana" and check_hash(hashed) is None and hashed.startswith("$scrypt$ln=14,r=8,p=1$")
    assert verify_password("correct horse", hashed) and not verify_password("correct horsf", hashed)
    (tmp_path / "u.txt").write_text(line + "\n")
    assert read_auth_file(tmp_path / "u.txt") == {"dana": hashed}
    assert "bcrypt cost of 31" in check_hash("$2b$31$" + "a" * 53)
    assert not verify_password("x" * 100, "$2b$04$" + "a" * 53)  # over bcrypt's 72 bytes: never a match


def test_in_the_browser_a_user_sees_their_own_queue_and_gallery(users_srv, work):
    """bob logs in with Chromium and generates from the Generate tab: the job is his (listed by his key),
    the Queue tab lists his jobs and none of alice's or ci's, the Gallery counts his results only. The
    server log shows no UI event that touched jobs without a user (ui/signed.py would raise there)."""
    from ui_browser import ARGS, CHROMIUM, TIMEOUT_MS, expect, fill, loaded, wait_for

    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium")
    import playwright.sync_api as playwright

    def bobs():
        with users_srv.client(headers=_key("bob")) as c:
            return c.get("/v1/jobs").json()["data"]

    before = {j["id"] for j in bobs()}
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(users_srv.url + "/")
            page.get_by_label("username").fill("bob")
            page.get_by_label("password").fill(PASSWORDS["bob"])
            page.get_by_role("button", name="Login").click()
            loaded(page)
            fill(page, "prompt", "a blue digit 5")
            fill(page, "field-num_inference_steps", 2)
            page.locator("#generate-btn").click()
            job = wait_for("bob's job from the Generate tab", lambda: next(
                (j for j in bobs() if j["id"] not in before and j["status"] == "succeeded"), None), page=page)
            assert job["owner"] == "bob" and job["params"]["prompt"] == "a blue digit 5", job
            expect(page.locator("#gen-status")).to_contain_text(f"Job #{job['number']}")  # its line in the job list
            page.get_by_role("tab", name="Queue").click()
            table = page.locator("#queue-table")
            expect(table.locator("tbody tr").first.locator("td").first).to_have_text(f"#{job['number']}")
            numbers = {td.text_content().strip() for td in table.locator("tbody tr td:first-child").all()}
            for other in ("alice", "ci"):
                assert f"#{work[other]['number']}" not in numbers, numbers
            page.get_by_role("tab", name="Gallery").click()
            mine = [j for j in bobs() if j["status"] == "succeeded"]
            expect(page.locator("#gallery-page .ls-page")).to_have_attribute("data-total", str(len(mine)))
            # the settings are the server's, for everyone's results: bob may read them, not save them
            page.get_by_role("tab", name="Settings").click()
            page.locator("#set-save").click()
            expect(page.locator("#set-status .ls-error")).to_contain_text("admins only")
            assert not Path(users_srv.home, "preferences.json").exists()
        finally:
            browser.close()
    log = Path(users_srv.home, "server.log").read_text(errors="replace")
    assert "acts on someone's work" not in log and "Traceback" not in log, log[-3000:]


def test_single_user_servers_keep_seeing_everything_and_named_keys_do_not():
    """The credentials as before (one login, one key) are admins: a single-user server is unchanged. A named
    key acts as its name and sees only its own work unless --admin names it; a named key logs in to the UI
    under its own name only."""
    from backend.api.auth import Credentials
    from backend.users import User, sees

    assert Credentials("k").bearer("k") == User("api", admin=True)
    assert Credentials(login="u:p").check("u", "p") == User("u", admin=True)
    assert Credentials("k").check("anyone", "k") == User("anyone", admin=True)  # the UI login: any name
    named = Credentials(["ci=k1", "ops=k2"], admins=["ops"])
    assert named.bearer("k1") == User("ci") and named.bearer("k2") == User("ops", admin=True)
    assert named.bearer("k3") is None and named.check("mallory", "k1") is None and named.check("ci", "k1")
    assert named.lookup("ci") == User("ci") and named.lookup("mallory") is None
    assert sees(User("ci"), "ci") and not sees(User("ci"), "ops") and not sees(User("ci"), None)
    assert sees(User("ops", admin=True), None) and sees(None, "anyone")
    assert not sees(User(""), "") and not sees(User(""), None)  # no one sees nothing
    with pytest.raises(Exception, match="--admin zed: no such user"):
        Credentials(["ci=k1"], admins=["zed"])


def test_only_an_admin_may_bake_a_model_copy_onto_the_servers_disk(users_srv):
    """POST /v1/models/bake writes a copy of the model (the disk of every shard a stack touches): a user who is
    not an admin gets a 403 before any adapter is read; an admin's request goes on (here refused on its name)."""
    body = {"lora": [{"name": "demo-inverted"}], "name": "mine"}
    with users_srv.client(headers=_key("bob")) as c:
        r = c.post("/v1/models/bake", json=body)
        assert r.status_code == 403 and "admins only" in r.json()["error"]["message"], r.text
    with users_srv.client(headers=_key("root")) as c:
        r = c.post("/v1/models/bake", json={**body, "name": "../up"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text

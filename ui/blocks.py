"""Assembling the tabs into one ``gr.Blocks`` over a ``backend.service.Studio``."""
from __future__ import annotations

import os
import re
from pathlib import Path

import gradio as gr


from . import (adapters, api, compare, gallery, generate, lora_browser, presets, queue_tab, server_state,
               settings_tab, system, workspace, xyz)
from .signed import Signed

CSS = """
.ls-bar { height: 10px; background: var(--neutral-200); border-radius: 5px; overflow: hidden; margin-top: 4px; }
.ls-bar-fill { height: 100%; background: var(--color-accent); transition: width .15s linear; }
.ls-job { padding: 6px 0; }
.ls-live { display: block; max-width: 128px; max-height: 128px; margin-top: 6px; border-radius: 4px; }
.ls-error { color: var(--error-text-color, #b91c1c); background: var(--error-background-fill, #fef2f2);
            border: 1px solid var(--error-border-color, #fca5a5); border-radius: 6px; padding: 6px 10px; }
.ls-ok { color: var(--body-text-color); padding: 6px 0; }
.ls-unfit-list { opacity: .6; font-size: .9em; }
.ls-misfits { opacity: .75; font-size: .85em; margin-top: 8px; }
.ls-cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(320px, 1fr)); gap: 12px; }
.ls-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 10px; }
.ls-card h3 { margin: 0 0 4px 0; }
.ls-card code { word-break: break-all; white-space: normal; }
.ls-missing { color: var(--error-text-color, #b91c1c); }
.ls-present { color: var(--color-green-600, #16a34a); }
#result-image img, #cmp-grid img, #xyz-grid img { image-rendering: pixelated; min-width: 256px; object-fit: contain; }
.ls-lcards { display: grid; grid-template-columns: repeat(auto-fill, minmax(220px, 1fr)); gap: 10px; }
.ls-lcard { border: 1px solid var(--border-color-primary); border-radius: 8px; overflow: hidden; display: flex;
            flex-direction: column; }
.ls-lcard-off { opacity: .65; }
.ls-thumb { width: 100%; aspect-ratio: 1; object-fit: cover; display: block; background: var(--neutral-100); }
.ls-thumb-none { aspect-ratio: 3; display: flex; align-items: center; justify-content: center; font-size: 2em;
                 color: var(--neutral-400); }
.ls-lcard-body { padding: 8px; display: flex; flex-direction: column; gap: 4px; }
.ls-lcard h4 { margin: 0; overflow-wrap: anywhere; }
.ls-family { font-weight: 600; font-size: .85em; }
.ls-nums, .ls-lcard-title, .ls-about, .ls-browser-count { font-size: .8em; opacity: .8; }
.ls-reason { font-size: .8em; color: var(--error-text-color, #b91c1c); overflow-wrap: anywhere; }
.ls-triggers { display: flex; flex-wrap: wrap; gap: 4px; }
#lora-hint .ls-hint { font-size: .9em; opacity: .85; }
.ls-trigger { border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 0 8px;
              font-size: .8em; cursor: pointer; background: var(--background-fill-secondary); }
.ls-add { border-radius: 6px; padding: 2px 8px; cursor: pointer; background: var(--color-accent); color: white; }
.ls-lcard:not(.ls-lcard-off) { cursor: pointer; }
.ls-preview { border: 1px solid var(--border-color-primary); border-radius: 6px; padding: 2px 8px; cursor: pointer; }
.ls-uses, .ls-preview-pending { font-size: .8em; opacity: .8; }
.ls-job-cancel { border: 1px solid var(--border-color-primary); border-radius: 6px; padding: 0 6px; cursor: pointer;
                 margin-left: 6px; font-size: .8em; }
.ls-badge { background: var(--color-accent); color: white; border-radius: 4px; padding: 0 6px; font-size: .8em; }
"""

# The page's own behaviour: progress in the title (from the jobs panel's data-title), "✓ job N done"
# there and a browser notification (when the browser allows them) when a job it
# watched finishes, Ctrl+Enter generates and Esc cancels while the Generate tab is shown. Runs once,
# on page load.
PAGE_JS = """
() => {
  const base = document.title || "LoRA Studio";
  const seen = new Map();  // job id -> the status this page saw last
  let done = "";  // "✓ job 12 done" in the title once the page's jobs have all finished
  const finished = (s) => s === "succeeded" || s === "failed" || s === "cancelled";
  const notify = (id, status) => {
    const prefs = document.querySelector("#ls-prefs-data");
    if (prefs && prefs.dataset.notifications === "off") return;  // the Settings tab's switch
    const body = `job ${id} ${status}`;
    done = status === "succeeded" ? `✓ job ${id} done` : `✗ job ${id} ${status}`;
    if (!("Notification" in window) || Notification.permission !== "granted") return;
    try { new Notification("LoRA Studio", {body, tag: `ls-job-${id}`}); } catch (err) { /* not allowed here */ }
  };
  // the folded "N earlier jobs" stays open (or shut) as the user left it when the list is redrawn
  let foldOpen = false;
  document.addEventListener("toggle", (e) => {
    if (e.target.matches && e.target.matches("#gen-status details.ls-finished")) foldOpen = e.target.open;
  }, true);
  const sync = () => {
    const fold = document.querySelector("#gen-status details.ls-finished");
    if (fold && fold.open !== foldOpen) fold.open = foldOpen;
    const jobs = document.querySelector("#gen-status .ls-jobs");
    for (const el of document.querySelectorAll("#gen-status .ls-job[data-job]")) {
      const id = el.dataset.job, status = el.dataset.status, before = seen.get(id);
      // a job this page watched run (or wait) and end: not the finished ones a reload finds
      if (before && !finished(before) && finished(status) && status !== "cancelled") notify(id, status);
      seen.set(id, status);
    }
    const t = jobs ? jobs.getAttribute("data-title") : "";
    if (t) done = "";
    const want = t ? `${t} ${base}` : (done ? `${done} · ${base}` : base);
    if (document.title !== want) document.title = want;
  };
  new MutationObserver(sync).observe(document.body, {subtree: true, childList: true, attributes: true,
                                                     attributeFilter: ["data-title", "data-status"]});
  // a job line's ✕: its id (with a nonce, so asking again is a change) to the hidden box the server reads
  document.addEventListener("click", (e) => {
    const btn = e.target.closest && e.target.closest("#gen-status .ls-job-cancel");
    const box = document.querySelector("#gen-cancel-one textarea, #gen-cancel-one input");
    if (!btn || !box) return;
    box.value = `${btn.dataset.job}\n${Date.now()}`;
    box.dispatchEvent(new Event("input", {bubbles: true}));
  });
  // the browser asks once, on the first Generate click (a permission prompt needs a user gesture)
  document.addEventListener("click", (e) => {
    if (e.target.closest && e.target.closest("#generate-btn") && "Notification" in window
        && Notification.permission === "default") Notification.requestPermission().catch(() => {});
  }, true);
  document.addEventListener("keydown", (e) => {
    const panel = document.querySelector("#tab-generate");
    if (!panel || panel.offsetParent === null) return;
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      document.querySelector("#generate-btn")?.click();
    } else if (e.key === "Escape" && !document.querySelector("[role=listbox], .options")) {
      document.querySelector("#cancel-btn")?.click();
    }
  });
}
"""

def parse_auth(auth) -> tuple[str, str] | None:
    """``"USER:PASS"`` (the --auth flag) or a (user, password) pair (a callable passes through)."""
    if auth is None or isinstance(auth, tuple) or callable(auth):
        return auth
    user, sep, password = str(auth).partition(":")
    if not sep or not user or not password:
        from backend.errors import InvalidParameter

        raise InvalidParameter("--auth must be USER:PASS", param="auth")
    return user, password


def build_ui(studio, *, auth=None, who=None) -> gr.Blocks:
    """The UI over ``studio``; ``who(username)``: the identity behind a signed-in session (a server
    with credentials; ui/signed.py), None: one user, no login."""
    if studio is not None and not isinstance(studio, Signed):
        studio = Signed(studio, who)
    with gr.Blocks(title="LoRA Studio") as blocks:
        gr.Markdown("# LoRA Studio")
        # the saved switches the page's script reads (notifications), set on load and by the Settings tab
        prefs_box = gr.HTML(value=lambda: settings_tab.prefs_html(settings_tab.saved(studio)), elem_id="ls-prefs",
                            padding=False)
        api.build(studio)  # first, so the named endpoints keep their names (private events are named too)
        with gr.Tabs() as tabs:
            with gr.Tab("Generate", id="generate", elem_id="tab-generate") as t_generate:
                gen = generate.build(studio)
                with gen.browser_slot:  # beside the prompt, as Extra Networks is
                    lora_browser.build(studio, gen)
            with gr.Tab("Compare", id="compare", elem_id="tab-compare") as t_compare:
                compare.build(studio, gen)
            with gr.Tab("X/Y/Z plot", id="xyz", elem_id="tab-xyz") as t_xyz:
                xyz.build(studio, gen, t_xyz)
            with gr.Tab("Adapters", id="adapters", elem_id="tab-adapters") as t_adapters:
                list_adapters, adapter_outs = adapters.build(studio)
            with gr.Tab("Presets", id="presets", elem_id="tab-presets") as t_presets:
                list_presets, preset_outs = presets.build(studio)
            with gr.Tab("Queue", id="queue", elem_id="tab-queue") as t_queue:
                timer, job_rows, job_table = queue_tab.build(studio)
            with gr.Tab("Gallery", id="gallery", elem_id="tab-gallery") as t_gallery:
                list_outputs, gallery_ins, gallery_outs = gallery.build(studio, gen, tabs)
            with gr.Tab("System", id="system", elem_id="tab-system") as t_system:
                show_system, system_outs = system.build(studio)
            with gr.Tab("Settings", id="settings", elem_id="tab-settings") as t_settings:
                settings_tab.build(studio, prefs_box)

        # each tab refreshes when shown; the queue table ticks only while its tab is open
        def tab_refresh(fn, tab, outs):
            tab.select(fn, None, outs, api_visibility="private")

        tab_refresh(list_adapters, t_adapters, adapter_outs)
        tab_refresh(list_presets, t_presets, preset_outs)
        t_gallery.select(list_outputs, gallery_ins, gallery_outs, api_visibility="private")
        tab_refresh(show_system, t_system, system_outs)
        def open_queue(request: gr.Request):
            return gr.Timer(active=True), job_rows(request)

        t_queue.select(open_queue, None, [timer, job_table], api_visibility="private")
        for other in (t_adapters, t_presets, t_gallery, t_system, t_settings):
            other.select(lambda: gr.Timer(active=False), None, timer, api_visibility="private")

        def on_load():
            # the server's state: loaded model, fused preset (badge and picker), the library
            model, preset = studio.current_model(), studio.current_preset()
            return [*gen.load_models(), *server_state.adapter_pick_updates(studio),
                    gr.update(choices=server_state.preset_choices(studio, model),
                              value=preset or server_state.NO_PRESET),
                    server_state.badge_html(preset), generate.lora_hint(studio),
                    {"picker": [model, preset]}]  # the poll sends the picker again only when this changes

        loaded = blocks.load(on_load, None, [*gen.model_outputs, gen.pick, gen.unfit, gen.preset, gen.badge,
                                             gen.hint, gen.seen], api_visibility="private", js=PAGE_JS)
        workspace.wire(studio, gen, tabs, {
            "generate": t_generate, "compare": t_compare, "xyz": t_xyz, "adapters": t_adapters,
            "presets": t_presets, "queue": t_queue, "gallery": t_gallery, "system": t_system,
            "settings": t_settings}, loaded)
        blocks.load(None, None, None, api_visibility="private", js=lora_browser.PAGE_JS)
    # Follow-events only poll the Studio's queue (which serializes the work), so they need no
    # Gradio-side limit; that is what lets the UI show the real queue position.
    blocks.queue(default_concurrency_limit=None, max_size=None)
    blocks.ls_launch = {"auth": parse_auth(auth), "allowed_paths": output_roots(studio), "css": CSS,
                        "ssr_mode": False}
    return blocks


def output_roots(studio) -> list[str]:
    """Where result files live: Gradio serves files only from these."""
    roots = {studio.outputs_dir()} if studio is not None else set()
    extra = os.environ.get("LORA_STUDIO_HOME")
    if extra:
        roots.add(str(Path(extra) / "outputs"))
    return sorted(roots)


def end_streams(app) -> None:
    """Shutdown: end the event streams open browser tabs hold (Gradio's session heartbeats), which
    would otherwise outlive the HTTP server's graceful close and be cancelled with a traceback.
    Gradio does this itself only for a server it launched, not for a mounted app."""
    for route in app.routes:
        stop = getattr(getattr(route, "app", None), "stop_event", None)
        if stop is not None:
            stop.set()


# What a browser needs to show the login form and post it, when the server has credentials
# (backend/api/auth.py refuses every other path without one). Gradio 6.31's routes: "/" renders
# the login form for a visitor without a session; assets, styles and icons hold no state.
LOGIN_PAGE = ("/", "/favicon.ico", "/theme.css", "/gradio_api/theme.css", "/robots.txt", "/manifest.json")
LOGIN_ASSETS = ("/assets/", "/static/", "/svelte/", "/pwa_icon")
LOGIN_FORM = ("/login", "/login/")


_API_INFO = re.compile(rb"window\.gradio_api_info\s*=\s*.*?;\s*</script>", re.S)
_NO_API_INFO = b'window.gradio_api_info = {"named_endpoints": {}, "unnamed_endpoints": {}};</script>'


def scrub_login_page(html: bytes) -> bytes:
    """The login page as an anonymous visitor gets it: Gradio embeds the app's API description (its named
    endpoints and their parameters) in every page, the login page too, while ``/gradio_api/info`` itself
    needs a credential; the login page keeps an empty description."""
    return _API_INFO.sub(lambda m: _NO_API_INFO, html, count=1)


class GradioSessions:
    """backend.api.auth.Sessions over Gradio's own login (its session cookie and token table), so
    the gate and Gradio agree on who is logged in, and Gradio's own checks pass a request the gate
    accepted by API key or Basic login."""

    def __init__(self, gradio_app):
        self.app = gradio_app
        self._own: dict[str, str] = {}  # user ("api" or the --auth user) -> the token the gate hands Gradio

    def _names(self) -> tuple[str, str]:
        cid = self.app.cookie_id
        return f"access-token-{cid}", f"access-token-unsecure-{cid}"

    def user(self, headers) -> str | None:
        from starlette.requests import cookie_parser

        cookies = cookie_parser(headers.get(b"cookie", b"").decode("latin-1"))
        secure, unsecure = self._names()
        token = cookies.get(secure) or cookies.get(unsecure)  # Gradio's own order
        return self.app.tokens.get(token) if token else None

    def admit(self, scope, user: str) -> None:
        import secrets

        token = self._own.setdefault(user, secrets.token_urlsafe(32))
        self.app.tokens[token] = user  # again each time: Gradio's /logout drops a user's tokens
        secure, unsecure = self._names()
        kept = [part for part in (v.decode("latin-1") for k, v in scope["headers"] if k == b"cookie")
                for part in part.split(";")
                if part.strip() and not part.strip().startswith(("access-token-",))]
        headers = [(k, v) for k, v in scope["headers"] if k != b"cookie"]
        headers.append((b"cookie", "; ".join([*map(str.strip, kept), f"{unsecure}={token}"]).encode("latin-1")))
        scope["headers"] = headers


def mount(app, studio, *, auth=None, path: str = "/"):
    """Mount the UI on the backend's FastAPI app, so UI and HTTP API share one server.
    Mount last: routes added to ``app`` before this keep priority over the UI.

    When the app has credentials (``app.state.auth``, from create_app's api_key/login), the UI's
    login takes them (the --auth login, or any user name with the API key as password), its login
    page stays reachable, and the gate knows Gradio's session cookie."""
    gate = getattr(app.state, "auth", None)
    if gate is not None:
        if auth is not None:  # one rule: a UI login guards the API too
            login = parse_auth(auth)
            if gate.credentials.login not in (None, login):
                raise ValueError("mount(auth=...) differs from create_app(login=...)")
            gate.credentials.login = login
        if gate.credentials.configured:
            auth = gate.credentials.login_async  # (user, password) -> bool, awaited by Gradio's login
    who = gate.credentials.lookup if gate is not None and gate.credentials.configured else None
    blocks = build_ui(studio, auth=auth, who=who)
    kw = blocks.ls_launch
    gr.mount_gradio_app(app, blocks, path=path, auth=kw["auth"], allowed_paths=kw["allowed_paths"],
                        css=kw["css"], ssr_mode=False, footer_links=["api", "settings"])
    if gate is not None and gate.credentials.configured:
        gradio_app = next(r.app for r in app.routes if getattr(r, "app", None) is not None
                          and hasattr(r.app, "cookie_id") and hasattr(r.app, "tokens"))
        root = path.rstrip("/")
        gate.add_open(exact=[root + p for p in LOGIN_PAGE] + ([root] if root else []),
                      prefixes=[root + p for p in LOGIN_ASSETS], login=[root + p for p in LOGIN_FORM])
        gate.sessions = GradioSessions(gradio_app)
        gate.page_paths.update({root + "/", root or "/"})
        gate.scrub = scrub_login_page
        gate.guards.append(result_file_guard(studio, [root + p for p in FILE_ROUTES]))
    return app


FILE_ROUTES = ("/gradio_api/file=", "/file=")  # Gradio's routes that serve a file by its path


def result_file_guard(studio, prefixes: list[str]):
    """``guard(path, user)`` for the gate: a file in the outputs folder asked for by path through Gradio's
    file routes is served to its owner (and admins) only; another user's is "not found", as a missing
    file is. (The UI itself shows results from Gradio's cache, under names made from their content.)"""
    roots = [os.path.realpath(r) for r in output_roots(studio)]

    def guard(path: str, user) -> str | None:
        if user.admin or not path.startswith(tuple(prefixes)):
            return None
        target = path.split("file=", 1)[1]
        real = os.path.realpath(target)
        if not any(real == r or real.startswith(r + os.sep) for r in roots):
            return None  # not a result: Gradio's own rules decide
        return None if studio.owns_file(real, user) else "file not found"

    return guard


def launch(blocks: gr.Blocks, **kwargs):
    """``blocks.launch`` with the settings build_ui chose (tests and standalone use)."""
    opts = {**blocks.ls_launch, **kwargs}
    if opts.get("share") and not opts.get("auth"):
        from backend.errors import InvalidParameter

        raise InvalidParameter("--share makes a public link: it needs --auth USER:PASS", param="share")
    return blocks.launch(**opts)


def share_link(host: str, port: int, *, auth) -> str:
    """A public gradio.live link to a server already listening on host:port (--share).
    Refuses without a login: the link is public for a week."""
    if not auth:
        from backend.errors import InvalidParameter

        raise InvalidParameter("--share makes a public link: it needs --auth USER:PASS", param="share")
    import secrets

    from gradio import networking

    url = networking.setup_tunnel(local_host=host, local_port=port, share_token=secrets.token_urlsafe(32),
                                  share_server_address=None, share_server_tls_certificate=None)
    return url.replace("http://", "https://", 1)

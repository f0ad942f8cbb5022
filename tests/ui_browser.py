"""Chromium for the browser tests: one set-up shared by every ``test_ui_*`` module that drives the page
(Playwright over Debian's Chromium, headless, against the module's ``python app.py serve``).

``expect``'s timeout is process-wide in Playwright, so it is set here, once: each wait ends as soon as
its answer shows, and a shared CI box can be slow (``LORA_STUDIO_UI_TIMEOUT_MS``, default 90 s: within
the per-test limit of pytest.ini, so a wait that fails says what it waited for).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import playwright.sync_api as playwright
import pytest

from ui_fixtures import ARTIFACTS, wait_until

expect = playwright.expect
TIMEOUT_MS = int(os.environ.get("LORA_STUDIO_UI_TIMEOUT_MS", "90000"))
expect.set_options(timeout=TIMEOUT_MS)
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

#: ``pytestmark = needs_chromium`` in each browser test module
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")


@pytest.fixture(scope="module")
def browser(app):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


def open_page(browser, app):
    """A new tab on the app, once its page load has landed (the fused badge is its last answer)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(app.url)
    loaded(page)
    return page


def loaded(page) -> None:
    """Wait until the page's load has landed: the server's state shown (the fused badge is its last answer)
    and the saved workspace put back (ui/workspace.py marks the body), so nothing the test types is
    overwritten by a late restore."""
    page.wait_for_selector("#prompt textarea")
    if page.locator("#fused-badge").count():
        # attached, not visible: a reload puts back the tab that was open, and on any tab but Generate
        # the badge is there but hidden (a wait for it to be visible timed out on CI)
        page.wait_for_selector("#fused-badge .ls-badge", state="attached")
        page.wait_for_selector("body[data-workspace=restored]", state="attached")


def reload(page) -> None:
    page.reload()
    loaded(page)


@pytest.fixture
def page(browser, app):
    page = open_page(browser, app)
    yield page
    page.close()


def shot(page, name: str) -> Path:
    """A full-page screenshot under test-artifacts/."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def fill(page, elem_id: str, value) -> None:
    """Type into a Gradio textbox or number field and leave it (Gradio reads the value on blur)."""
    box = page.locator(f"#{elem_id} input, #{elem_id} textarea").first
    box.fill(str(value))
    box.press("Tab")


def wait_for(what, check, timeout: float = TIMEOUT_MS / 1000, every: float = 0.2, page=None):
    """``wait_until`` for a page; with ``page``, a timeout says what the page showed then (the Generate tab's
    note and job lines) and leaves a screenshot under test-artifacts/, so a failure on CI can be read."""
    try:
        return wait_until(check, timeout, what, every)
    except pytest.fail.Exception:
        if page is None:
            raise
        shown = {}
        for elem in ("gen-note", "gen-status"):
            try:
                shown[elem] = " ".join(page.locator(f"#{elem}").inner_text(timeout=2000).split())[:600]
            except Exception as exc:  # noqa: BLE001 - the page itself may be the problem
                shown[elem] = f"<unreadable: {type(exc).__name__}>"
        path = shot(page, "timeout-" + re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")[:60])
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; the page showed {shown} ({path})")


def all_jobs(app):
    return app.get("v1/jobs?limit=1000")["data"]


FINISHED = ("succeeded", "failed", "cancelled")


def generate(page, app, timeout: float = TIMEOUT_MS / 1000) -> dict:
    """Click Generate and wait for the job that click queued to finish; returns that job (any outcome)."""
    before = {j["id"] for j in all_jobs(app)}
    page.locator("#generate-btn").click()
    return wait_for("the job Generate queued",
                    lambda: next((j for j in all_jobs(app) if j["id"] not in before and j["status"] in FINISHED),
                                 None), timeout=timeout)


def choose(page, elem_id: str, option: str) -> None:
    """Pick ``option`` in a Gradio dropdown."""
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).first.click()


def add_to_stack(page, name: str) -> None:
    """Put a library adapter into the (empty) LoRA stack through the picker and *Add to stack*."""
    choose(page, "adapter-pick", name)
    page.locator("#adapter-add").click()
    expect(page.locator("#stack-name-0 textarea, #stack-name-0 input").first).to_have_value(name)


def clear_stack(page, rows: int) -> None:
    """Empty a LoRA stack of ``rows`` rows from the last, each removal seen landed before the next click (two
    quick clicks on the ✕ race: both handlers read the stack before either writes it, and one row comes back)."""
    for i in reversed(range(rows)):
        page.locator(f"#stack-remove-{i}").click()
        expect(page.locator(f"#stack-row-{i}:visible")).to_have_count(0)


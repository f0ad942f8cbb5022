"""The Generate tab's "weight over steps" field, in Chromium against ``python app.py serve``: a
schedule typed into a stack row reaches the job as the schedule, and a bad one is refused by
name on the page with nothing queued."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from ui_fixtures import app, lora_files, wait_until  # noqa: F401  (fixtures)

import playwright.sync_api as playwright  # noqa: E402
expect = playwright.expect
TIMEOUT_MS = int(os.environ.get("LORA_STUDIO_UI_TIMEOUT_MS", "120000"))
expect.set_options(timeout=TIMEOUT_MS)
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")


@pytest.fixture(scope="module")
def page(app, lora_files):  # noqa: F811
    app.add_adapter(lora_files["style"], "sched-me")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(app.url)
        page.wait_for_selector("#prompt textarea")
        yield page
        browser.close()


def fill(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input, #{elem_id} textarea").first
    box.fill(str(value))
    box.press("Tab")


def test_a_typed_schedule_reaches_the_job_and_a_bad_one_is_refused(page, app):  # noqa: F811
    jobs = lambda: app.get("v1/jobs?limit=1000")["data"]  # noqa: E731
    page.locator("#adapter-pick input").click()
    page.get_by_role("option", name="sched-me").first.click()
    page.locator("#adapter-add").click()
    fill(page, "field-num_inference_steps", 2)
    fill(page, "stack-schedule-0", "1.0,x")
    fill(page, "prompt", "a scheduled cat")
    before = len(jobs())
    page.locator("#generate-btn").click()
    expect(page.locator("#gen-note")).to_contain_text("sched-me: weight over steps[1]: 'x' is not a number")
    assert len(jobs()) == before  # nothing queued
    fill(page, "stack-schedule-0", "1.0->-0.5")
    page.locator("#generate-btn").click()
    done = wait_until(lambda: [j for j in jobs() if (j.get("params") or {}).get("prompt") == "a scheduled cat"
                               and j["status"] in ("succeeded", "failed")], TIMEOUT_MS / 1000, "the job")
    assert done[0]["status"] == "succeeded", done[0]
    assert done[0]["adapters"][0]["scale"] == {"start": 1.0, "end": -0.5}
    row = done[0]["result"]["metadata"]["adapters"][0]
    assert row["scale_resolved"]["per_step"] == [1.0, -0.5] and row["mode"] == "unfused"

"""The Generate tab's "weight over steps" field, in Chromium against ``python app.py serve``: a
schedule typed into a stack row reaches the job as the schedule, and a bad one is refused by
name on the page with nothing queued."""
from __future__ import annotations

import pytest

from ui_browser import (TIMEOUT_MS, add_to_stack, browser, expect, fill, needs_chromium,  # noqa: F401  (fixtures)
                        open_page)
from ui_fixtures import app, lora_files, wait_until  # noqa: F401  (fixtures)

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def page(browser, app, lora_files):  # noqa: F811
    app.add_adapter(lora_files["style"], "sched-me")
    page = open_page(browser, app)
    yield page
    page.close()


def test_a_typed_schedule_reaches_the_job_and_a_bad_one_is_refused(page, app):  # noqa: F811
    jobs = lambda: app.get("v1/jobs?limit=1000")["data"]  # noqa: E731
    add_to_stack(page, "sched-me")
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

"""The Settings tab (#26: "no application settings page; the footer's is Gradio's"): saved in the data dir,
read back by a new page, and acted on: result names and format, the Generate tab's size and steps for image
models, the notification switch; a bad value is refused by name and nothing is written. And `python app.py
serve` with no model loads the saved default model. Playwright in Chromium against its own served app."""
from __future__ import annotations

import json

import httpx
from PIL import Image

from ui_browser import browser, expect, fill, generate, needs_chromium, open_page, shot  # noqa: F401
from ui_fixtures import app, app_home, served_app, wait_until  # noqa: F401  (fixtures)

pytestmark = needs_chromium


def test_settings_are_saved_in_the_data_dir_and_acted_on(browser, app):  # noqa: F811
    prefs_file = app.data_dir / "preferences.json"
    page = open_page(browser, app)
    try:
        page.get_by_role("tab", name="Settings").click()
        expect(page.locator("#set-pattern textarea, #set-pattern input").first).to_have_value("{date}-{seed}")
        expect(page.locator("#set-format input[value=png]")).to_be_checked()
        # a pattern that names a folder: refused by its setting's name, nothing written
        fill(page, "set-pattern", "../{seed}")
        expect(page.locator("#set-example")).to_contain_text("no folders")
        page.locator("#set-save").click()
        expect(page.locator("#set-status .ls-error")).to_contain_text("'filename_pattern'")
        assert not prefs_file.exists()

        fill(page, "set-pattern", "{seed}_{prompt}")
        expect(page.locator("#set-example")).to_contain_text("e.g. 42_a-red-fox-in-the-snow-ink-drawing-")
        page.locator("#set-format input[value=webp]").check()
        fill(page, "set-width", 128)
        fill(page, "set-height", 64)
        fill(page, "set-steps", 3)
        page.locator("#set-notify input").uncheck()
        page.locator("#set-save").click()
        expect(page.locator("#set-status .ls-ok")).to_contain_text("saved")
        saved = json.loads(prefs_file.read_text())
        assert saved["output_format"] == "webp" and saved["filename_pattern"] == "{seed}_{prompt}", saved
        assert (saved["width"], saved["height"], saved["steps"], saved["notifications"]) == (128, 64, 3, False)
        expect(page.locator("#ls-prefs-data")).to_have_attribute("data-notifications", "off")
        shot(page, "settings")
    finally:
        page.close()

    # a new page (another browser, or after a restart) reads them from the server; the Generate tab's
    # image-model fields start from them, and a result is named and written as they say
    page = open_page(browser, app)
    try:
        expect(page.locator("#field-num_inference_steps input")).to_have_value("3")
        expect(page.locator("#field-width input")).to_have_value("128")
        expect(page.locator("#field-height input")).to_have_value("64")
        expect(page.locator("#ls-prefs-data")).to_have_attribute("data-notifications", "off")
        page.get_by_role("tab", name="Settings").click()
        expect(page.locator("#set-format input[value=webp]")).to_be_checked()
        expect(page.locator("#set-steps input")).to_have_value("3")
        page.get_by_role("tab", name="Generate").click()
        fill(page, "prompt", "a red fox")
        fill(page, "seed", 7)
        job = generate(page, app)
        assert job["status"] == "succeeded" and job["params"]["num_inference_steps"] == 3, job
        path = job["result"]["path"]
        name = path.rsplit("/", 1)[-1]
        assert name.startswith("7_a-red-fox-") and name.endswith(".webp"), name
        with Image.open(path) as img:
            assert img.format == "WEBP" and img.size == (128, 64)
        # the Gallery and the result view read it like a PNG (its settings ride in EXIF)
        expect(page.locator("#result-metadata")).to_contain_text("a red fox")
    finally:
        page.close()
        prefs_file.unlink()  # the module's later tests (none today) see the defaults


def test_serve_with_no_model_loads_the_saved_default_model(data_dir, demo_path, tmp_path_factory):
    demo_path("demo:sd3.5")
    home = app_home(data_dir, tmp_path_factory, "prefs-model")
    (home / "preferences.json").write_text(json.dumps({"default_model": "demo:sd3.5"}))
    with served_app(home, model="") as served:
        models = httpx.get(served.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models if m["loaded"]] == ["demo:sd3.5"], models
        assert "serving demo:sd3.5: the default model in the settings" in served.log.read_text()


def test_live_previews_off_means_none_are_made(app):  # noqa: F811
    """#26: the Settings tab's "live previews" switch only hid them in the page; the worker went on making
    one about every second. Off, a running job has none (the HTTP preview route answers 204 throughout); on
    (the default), one comes within a few steps."""
    import threading
    import time

    prefs_file = app.data_dir / "preferences.json"

    def run_one(prompt: str, until) -> int:
        """A 40-step job let on a step at a time until ``until(job_id, elapsed)``; returns the preview's
        status code then (the job is cancelled after)."""
        before = {j["id"] for j in app.get("v1/jobs?limit=1000")["data"]}
        with app.gate.held(1):
            body = {"prompt": prompt, "size": "64x64", "num_inference_steps": 40, "seed": 3}
            post = threading.Thread(target=lambda: httpx.post(app.url + "v1/images/generations", json=body,
                                                              timeout=300), daemon=True)
            post.start()
            job_id = wait_until(lambda: next((j["id"] for j in app.get("v1/jobs?limit=1000")["data"]
                                              if j["id"] not in before), None), 60, "the job queued")
            started = time.monotonic()
            app.gate.step_until(lambda: until(job_id, time.monotonic() - started), f"{prompt}: its steps")
            code = httpx.get(app.url + f"v1/jobs/{job_id}/preview", timeout=30).status_code
            httpx.delete(app.url + f"v1/jobs/{job_id}", timeout=30)
        post.join(120)
        return code

    def step_of(job_id) -> int:
        return app.get(f"v1/jobs/{job_id}")["progress"]["step"]

    prefs_file.write_text(json.dumps({"live_previews": False}))
    try:
        seen = []

        def four_seconds_on(job_id, elapsed):  # every step's preview asked for on the way: none ever made
            seen.append(httpx.get(app.url + f"v1/jobs/{job_id}/preview", timeout=30).status_code)
            return elapsed > 4 and step_of(job_id) >= 6

        assert run_one("previews off", four_seconds_on) == 204
        assert set(seen) == {204}, seen
    finally:
        prefs_file.unlink()
    assert run_one("previews on", lambda job_id, elapsed: httpx.get(
        app.url + f"v1/jobs/{job_id}/preview", timeout=30).status_code == 200) == 200

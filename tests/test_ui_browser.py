"""The UI in a real browser: Playwright driving Debian's Chromium, headless.

Opens the page, picks a demo model, imports an adapter, adds it to the stack,
generates, and watches the progress bar move and the image appear; uploads a broken
adapter and reads the error; saves a screenshot of every tab under test-artifacts/.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from ui_browser import TIMEOUT_MS, browser, expect, needs_chromium, open_page, shot, wait_for  # noqa: F401  (fixtures)
from ui_fixtures import MODEL, app, lora_files  # noqa: F401  (fixtures)

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def page(browser, app):  # noqa: F811
    page = open_page(browser, app)
    yield page
    page.close()


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def pick(page, elem_id: str, option: str) -> None:
    """Choose an option in a Gradio dropdown."""
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=False).first.click()


def upload_adapter(page, path: Path, name: str) -> str:
    open_tab(page, "Adapters")
    page.locator("#adapters-upload input[type=file]").set_input_files(str(path))
    page.locator("#adapters-name textarea, #adapters-name input").first.fill(name)
    page.locator("#adapters-import").click()
    # both answers name the adapter: wait for the one about this upload
    status = page.locator("#adapters-status").locator(".ls-ok, .ls-error").filter(has_text=name)
    status.first.wait_for()
    return status.first.inner_text()


def test_import_add_generate_with_progress(page, app, lora_files):  # noqa: F811
    # a broken file is refused, and the page says why
    message = upload_adapter(page, lora_files["broken"], "ui-broken")
    assert message.startswith("⚠"), message
    assert "ui-broken" in message and "Traceback" not in message
    shot(page, "adapters-broken-upload")

    message = upload_adapter(page, lora_files["style"], "ui-style")
    assert "imported" in message, message
    expect(page.locator("#adapters-table")).to_contain_text("ui-style")
    # the targets column says what each adapter targets, block indices folded (it was empty for every adapter)
    expect(page.locator("#adapters-table")).to_contain_text("attn.to_q")
    shot(page, "adapters")

    open_tab(page, "Generate")
    pick(page, "model-picker", MODEL)
    expect(page.locator("#mode")).to_contain_text("text-to-image")
    # the adapter list is read when the model is picked: it offers the imported adapter
    pick(page, "adapter-pick", "ui-style")
    page.locator("#adapter-add").click()
    expect(page.locator("#stack-name-0 textarea, #stack-name-0 input").first).to_have_value("ui-style")
    page.locator("#prompt textarea").fill("a lighthouse at dusk")
    page.locator("#field-num_inference_steps input").fill("4")
    job = page.locator("#gen-status .ls-job")

    def shows(status: str, step: int):
        return lambda: job.count() and job.get_attribute("data-status") == status \
            and int(job.get_attribute("data-step") or 0) == step

    # the step gate holds the job after each step until the test has seen the bar there
    seen = []  # the bar moves step by step: 1, then 2, then the finished job at 4 of 4
    with app.gate.held(1):
        page.locator("#generate-btn").click()
        for step in (1, 2):
            app.gate.hold(step)
            wait_for(f"the bar at step {step}", shows("running", step))
            seen.append(("running", step))
    wait_for("the job to succeed", lambda: job.count() and job.get_attribute("data-status") == "succeeded")
    seen.append(("succeeded", int(job.get_attribute("data-step") or 0)))
    assert seen[-1] == ("succeeded", 4), (seen, page.locator("#gen-status").inner_text())
    page.locator("#result-image img").wait_for()
    expect(page.locator("#result-metadata")).to_contain_text("ui-style")
    shot(page, "generate")


def test_gallery_restores_settings(page, lora_files):  # noqa: F811
    # forget the settings on the Generate tab, then get them back from the result
    open_tab(page, "Generate")
    page.locator("#prompt textarea").fill("")
    page.locator("#stack-remove-0").click()
    expect(page.locator("#stack-name-0 textarea, #stack-name-0 input").first).to_be_hidden()
    open_tab(page, "Gallery")
    page.locator("#gallery-refresh").click()
    page.locator("#gallery button.thumbnail-item, #gallery .thumbnail-item").first.click()
    expect(page.locator("#gallery-meta")).to_contain_text("a lighthouse at dusk")
    page.locator("#gallery-use").click()
    expect(page.locator("#prompt textarea")).to_have_value("a lighthouse at dusk")
    expect(page.locator("#stack-name-0 textarea, #stack-name-0 input").first).to_have_value("ui-style")
    expect(page.locator("#field-num_inference_steps input")).to_have_value("4")

    # a PNG that was not made here is refused with a reason
    open_tab(page, "Gallery")
    page.locator("#gallery-drop input[type=file]").set_input_files(str(plain_png(lora_files["style"].parent)))
    expect(page.locator("#gallery-status")).to_contain_text("carries no LoRA Studio settings")


def plain_png(folder: Path) -> Path:
    from PIL import Image

    path = folder / "plain.png"
    Image.new("RGB", (16, 16), "white").save(path)
    return path


def test_compare_grid_is_one_batch(page):
    # the grid renders with the Generate tab's settings: 4 cells at the 300 steps an earlier gallery test
    # restored took 60 s on a quiet machine and past the wait on a busy one; 20 steps show the same
    open_tab(page, "Generate")
    page.locator("#field-num_inference_steps input").fill("20")
    open_tab(page, "Compare")
    page.locator("#cmp-scales textarea, #cmp-scales input").first.fill("0, 1")
    page.get_by_label("seeds", exact=True).check()
    page.locator("#cmp-seeds textarea, #cmp-seeds input").first.fill("1, 2")
    page.locator("#cmp-adapters input").click()
    page.get_by_role("option", name="ui-style").first.click()
    page.keyboard.press("Escape")
    page.locator("#cmp-go").click()
    page.locator("#cmp-status .ls-ok, #cmp-status .ls-error").first.wait_for()
    shot(page, "compare")
    expect(page.locator("#cmp-status")).to_contain_text("4 cells")
    page.locator("#cmp-grid img").wait_for()
    shot(page, "compare")


def test_preset_picker_fuses_and_restores(browser, app):  # noqa: F811
    """The Lightning preset from the picker: fused, its 4 steps in the form, and (#39) its 4 steps at CFG 1
    draw the prompt recognisably (the trained distill; read by the oracles); then back to base. A page of
    its own: the shared one carries an earlier test's LoRA stack and fields."""
    import io
    import re

    import httpx
    from PIL import Image

    from oracles import read

    page = open_page(browser, app)
    try:
        open_tab(page, "Generate")
        page.locator("#gen-preset").get_by_text("Preset (distill").first.click()
        pick(page, "gen-preset-pick", "qwen-image-2512-lightning-4step")
        # before applying, the picker shows what will be fused and which files are missing
        expect(page.locator("#gen-preset")).to_contain_text("demo file (trained distill)")
        page.locator("#gen-preset-apply").click()
        expect(page.locator("#gen-preset")).to_contain_text("fused preset qwen-image-2512-lightning-4step")
        expect(page.locator("#field-num_inference_steps input")).to_have_value("4")
        # #26: the fields the preset fixes are locked, saying why (they were editable, then failed in the worker)
        expect(page.locator("#field-num_inference_steps input")).to_be_disabled()
        expect(page.locator("#field-num_inference_steps")).to_contain_text(
            "set by the fused preset qwen-image-2512-lightning-4step")
        expect(page.locator("#field-height input")).to_be_enabled()
        page.locator("#prompt textarea").fill("a red digit 3 on a black background")
        page.locator("#seed input").fill("42")
        earlier = {j["id"] for j in httpx.get(app.url + "v1/jobs", params={"limit": 1000}, timeout=30).json()["data"]}
        image = page.locator("#result-image img")
        shown_before = image.get_attribute("src") if image.count() else None
        page.locator("#generate-btn").click()

        def mine_succeeded() -> bool:  # the job this click queued (the page also shows earlier tests' jobs)
            for el in page.locator("#gen-status .ls-job[data-job]").all():
                if el.get_attribute("data-job") not in earlier:
                    return el.get_attribute("data-status") == "succeeded"
            return False

        wait_for("the preset's job to succeed", mine_succeeded, page=page)
        wait_for("its picture", lambda: image.count() and image.get_attribute("src") != shown_before)
        src = image.get_attribute("src")
        raw = httpx.get(src if re.match(r"https?://", src) else app.url + src.lstrip("/"), timeout=30).content
        got = read(Image.open(io.BytesIO(raw)))
        assert (got.colour, got.background, got.digit) == ("red", "black", 3), got
        shot(page, "generate-preset")
        pick(page, "gen-preset-pick", "(none: base weights)")
        page.locator("#gen-preset-apply").click()
        expect(page.locator("#gen-preset")).to_contain_text("restored the base weights")
        expect(page.locator("#field-num_inference_steps input")).to_be_enabled()
    finally:
        page.close()


@pytest.mark.parametrize("tab", ["Presets", "Queue", "Gallery", "System"])
def test_every_tab_renders(page, tab):
    open_tab(page, tab)
    panel = page.locator(f"#tab-{tab.lower()}")
    panel.wait_for(state="visible")
    time.sleep(0.5)  # let the tab's refresh land
    assert page.locator(".ls-error").filter(has_text="unexpected").count() == 0
    shot(page, tab.lower())


def test_the_placeholder_prompt_draws_what_it_says(browser, app):  # noqa: F811
    """A new user types the prompt the box suggests and leaves every field blank (the model's
    defaults): the picture shows it (read by the oracles)."""
    import io
    import re

    import httpx
    from PIL import Image

    from oracles import asked, read

    page = open_page(browser, app)
    try:
        hint = page.locator("#prompt textarea").get_attribute("placeholder")
        want = asked(hint)  # the hint is a prompt of the demo grammar
        page.locator("#prompt textarea").fill(hint)
        page.locator("#generate-btn").click()
        job = page.locator("#gen-status .ls-job")
        wait_for("the job to succeed", lambda: job.count() and job.get_attribute("data-status") == "succeeded",
                 page=page)
        src = page.locator("#result-image img").get_attribute("src")
        raw = httpx.get(src if re.match(r"https?://", src) else app.url + src.lstrip("/"), timeout=30).content
        got = read(Image.open(io.BytesIO(raw)))
        # colour and background on this one seed; the digit is scored over a grid (tests/test_demo_trained.py)
        assert (got.colour, got.background) == (want["colour"], want["background"]) and got.foreground > 0.05, got
        shot(page, "generate-placeholder-prompt")
    finally:
        page.close()


def test_the_first_run_hint_names_a_lora_that_does_what_it_says(browser, app):  # noqa: F811
    """The hint under the prompt names a demo LoRA and the prompt that calls it; typed as it says (the
    model's defaults), the picture has the effect the hint promises: demo-grayscale drains the colour."""
    import io
    import re

    import httpx
    from PIL import Image

    from oracles import chroma, read

    page = open_page(browser, app)
    try:
        hint = page.locator("#lora-hint .ls-hint")
        wait_for("the LoRA hint", lambda: hint.count() == 1 and "<lora:" in hint.inner_text())
        text = hint.locator("code").inner_text()
        assert text == "a red digit 3 on a black background <lora:demo-grayscale:1>", text
        assert "colour drains out" in hint.inner_text()
        page.locator("#prompt textarea").fill(text)
        page.locator("#generate-btn").click()
        job = page.locator("#gen-status .ls-job")
        wait_for("the job to succeed", lambda: job.count() and job.get_attribute("data-status") == "succeeded",
                 page=page)
        src = page.locator("#result-image img").get_attribute("src")
        image = Image.open(io.BytesIO(httpx.get(src if re.match(r"https?://", src) else app.url + src.lstrip("/"),
                                                timeout=30).content)).convert("RGB")
        # a red digit, drained: a grey foreground on black (the base draws it at a saturation of 30-40)
        assert chroma(image) < 10 and read(image).background == "black" and read(image).foreground > 0.05, \
            (chroma(image), read(image))
        shot(page, "generate-lora-hint")
    finally:
        page.close()

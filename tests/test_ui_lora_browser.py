"""The LoRA browser in the Generate tab: Playwright in Chromium against one ``python app.py serve``
for the module. Cards show what the files' headers say (trigger words from kohya's metadata and
modelspec, an embedded thumbnail), search narrows them, a trigger word goes into the prompt, and a
card's "Add to stack" gives a stack that generates, with the adapter named in the job's metadata.
"""
from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from test_ui_jobs import (CHROMIUM, all_jobs, browser, fill, open_page, page, shot, wait_for,  # noqa: F401
                          expect)
from ui_fixtures import app, lora_files  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")


def png_data_url(color=(200, 40, 40)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def with_metadata(src, out, metadata: dict):
    save_file(load_file(str(src)), str(out), metadata=metadata)
    return out


@pytest.fixture(scope="module")
def library(app, lora_files, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("browser")
    kohya = with_metadata(lora_files["style"], root / "k.safetensors", {
        "ss_output_name": "kohyacat",
        "ss_tag_frequency": json.dumps({"10_cat": {"orange cat": 40, "whiskers": 12, "sofa": 3}}),
        "ss_base_model_version": "qwen_image"})
    spec = with_metadata(lora_files["other"], root / "s.safetensors", {
        "modelspec.trigger_phrase": "dogstyle, <img src=x onerror=alert(1)>",
        "modelspec.title": "Dog style",
        "modelspec.thumbnail": png_data_url()})
    hostile = with_metadata(lora_files["style"], root / "h.safetensors", {
        "modelspec.thumbnail": "data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==",
        "modelspec.trigger_phrase": "x" * 5000})
    app.add_adapter(kohya, "kohya-cat")
    app.add_adapter(spec, "spec-dog")
    app.add_adapter(hostile, "hostile-one")
    return app


def open_browser(page):  # noqa: F811
    page.get_by_text("LoRA browser", exact=True).click()
    expect(page.locator("#lora-cards .ls-lcard").first).to_be_visible()


def card(page, name):  # noqa: F811
    return page.locator(f'#lora-cards .ls-lcard[data-name="{name}"]')


def test_cards_show_the_headers_and_search_narrows(page, library):  # noqa: F811
    open_browser(page)
    kohya, spec, hostile = card(page, "kohya-cat"), card(page, "spec-dog"), card(page, "hostile-one")
    expect(kohya.locator(".ls-trigger")).to_contain_text(["kohyacat", "orange cat", "whiskers", "sofa"])
    expect(kohya.locator(".ls-family")).to_contain_text("Qwen-Image")
    expect(kohya.locator(".ls-nums")).to_contain_text("rank 4")
    expect(spec.locator("img.ls-thumb")).to_have_attribute("src", png_data_url())
    expect(spec.locator(".ls-lcard-title")).to_have_text("Dog style")
    # a hostile header is text, bounded, and its non-image "thumbnail" is not shown
    expect(spec.locator(".ls-trigger").nth(1)).to_have_text("<img src=x onerror=alert(1)>")
    assert page.locator("#lora-cards img[src=x]").count() == 0
    assert hostile.locator("img").count() == 0
    assert len(hostile.locator(".ls-trigger").first.inner_text()) <= 80
    shot(page, "lora-browser")

    fill(page, "lora-search", "orange")
    expect(page.locator("#lora-cards .ls-lcard")).to_have_count(1)
    expect(kohya).to_be_visible()
    fill(page, "lora-search", "")
    expect(spec).to_be_visible()

    # the library's demo adapters for other models are greyed out with their reason; the filters
    # keep only what fits the loaded model, or one family
    expect(page.locator("#lora-cards .ls-lcard-off .ls-reason").first).to_be_visible()
    page.locator("#lora-fits input").check()
    expect(page.locator("#lora-cards .ls-lcard-off")).to_have_count(0)
    expect(spec).to_be_visible()
    page.locator("#lora-fits input").uncheck()
    expect(page.locator("#lora-cards .ls-lcard-off").first).to_be_visible()
    page.locator("#lora-family input").click()
    page.get_by_role("option", name="Wan2.2", exact=True).click()
    expect(kohya).to_have_count(0)
    families = page.locator("#lora-cards .ls-family").all_inner_texts()
    assert families and all("Wan2.2" in f for f in families), families


def test_the_open_browser_follows_the_library(page, library, lora_files):  # noqa: F811
    open_browser(page)
    expect(card(page, "spec-dog")).to_be_visible()
    library.add_adapter(lora_files["other"], "arrived-later")
    expect(card(page, "arrived-later")).to_be_visible()  # no Refresh clicked
    (library.data_dir / "adapters" / "arrived-later.safetensors").unlink()
    expect(card(page, "arrived-later")).to_have_count(0)


def test_trigger_word_goes_into_the_prompt_and_a_card_into_the_stack(page, library):  # noqa: F811
    open_browser(page)
    fill(page, "prompt", "a cat on a sofa")
    card(page, "kohya-cat").locator(".ls-trigger", has_text="orange cat").click()
    expect(page.locator("#prompt textarea")).to_have_value("a cat on a sofa, orange cat")

    card(page, "spec-dog").locator(".ls-add").click()
    expect(page.locator("#stack-name-0 input, #stack-name-0 textarea").first).to_have_value("spec-dog")
    expect(page.locator("#gen-note")).to_contain_text("added spec-dog to the LoRA stack")

    fill(page, "field-num_inference_steps", 2)
    before = {j["id"] for j in all_jobs(library)}
    page.locator("#generate-btn").click()
    done = wait_for("the job", lambda: [j for j in all_jobs(library) if j["id"] not in before
                                        and j["status"] in ("succeeded", "failed", "cancelled")])
    assert done[0]["status"] == "succeeded", done[0]
    assert done[0]["params"]["prompt"] == "a cat on a sofa, orange cat"
    assert [a["name"] for a in done[0]["adapters"]] == ["spec-dog"]
    expect(page.locator("#result-metadata")).to_contain_text("spec-dog")

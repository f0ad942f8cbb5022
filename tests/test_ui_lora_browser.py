"""The LoRA browser in the Generate tab: Playwright in Chromium against one ``python app.py serve``
for the module. Cards show what the files' headers say (trigger words from kohya's metadata and
modelspec, an embedded thumbnail), search narrows them, a trigger word goes into the prompt, and a
card's "Add to stack" gives a stack that generates, with the adapter named in the job's metadata;
a click on a card's body adds it too, "most used" sorts by the jobs that used each adapter, and
"Make preview" caches a generated picture that the card shows (also after a reload).
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import re

import httpx
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from ui_browser import (all_jobs, browser, expect, fill, generate, needs_chromium, open_page, page,  # noqa: F401
                        reload, shot)
from ui_fixtures import app, lora_files  # noqa: F401  (fixtures)

pytestmark = needs_chromium


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

    # #26: by default only what fits the loaded model is a card; the library's demo adapters for other
    # models fold into one plain line each (it was 9 greyed cards of 12, with converter errors and paths)
    expect(page.locator("#lora-fits input")).to_be_checked()
    expect(page.locator("#lora-cards .ls-lcard-off")).to_have_count(0)
    expect(spec).to_be_visible()
    folded = page.locator("#lora-cards details.ls-misfits")
    expect(folded.locator("summary")).to_contain_text("more do not fit demo:qwen-image")
    expect(folded.locator("li").first).to_be_hidden()  # collapsed until asked
    folded.locator("summary").click()
    lines = folded.locator("li").all_inner_texts()
    assert lines and any(": made for Wan2.2, not demo:qwen-image" in line for line in lines), lines
    assert not any("unmatched key" in line or "/" in line or "refused" in line for line in lines), lines
    # the whole list is still one click away, greyed with the converter's own words
    page.locator("#lora-fits input").uncheck()
    expect(page.locator("#lora-cards .ls-lcard-off .ls-reason").first).to_be_visible()
    expect(page.locator("#lora-cards details.ls-misfits")).to_have_count(0)
    page.locator("#lora-family input").click()
    page.get_by_role("option", name="Wan2.2", exact=True).click()
    expect(kohya).to_have_count(0)
    families = page.locator("#lora-cards .ls-family").all_inner_texts()
    assert families and all("Wan2.2" in f for f in families), families


def test_the_browser_is_a_drawer_under_the_prompt_and_long_names_are_whole(page, library, lora_files):  # noqa: F811
    """#26: the browser was folded at the bottom of the page (under the whole Generate tab); long names
    were cut to one line."""
    long_name = "a-really-long-adapter-name-" + "that-goes-on-" * 6 + "end"
    library.add_adapter(lora_files["other"], long_name)
    try:
        open_browser(page)
        box = {k: page.locator(sel).bounding_box() for k, sel in (
            ("prompt", "#prompt"), ("browser", "#lora-browser"), ("stack", "#lora-stack"),
            ("generate", "#generate-btn"))}
        assert box["prompt"]["y"] < box["browser"]["y"] < box["stack"]["y"], box
        assert box["browser"]["x"] + box["browser"]["width"] <= box["generate"]["x"], box  # the left column
        head = card(page, long_name).locator("h4")
        expect(head).to_have_text(long_name)
        assert head.evaluate("e => e.scrollWidth <= e.clientWidth"), "the name overflows its card"
    finally:
        (library.data_dir / "adapters" / f"{long_name}.safetensors").unlink()


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
    done = generate(page, library)
    assert done["status"] == "succeeded", done
    assert done["params"]["prompt"] == "a cat on a sofa, orange cat"
    assert [a["name"] for a in done["adapters"]] == ["spec-dog"]
    expect(page.locator("#result-metadata")).to_contain_text("spec-dog")


def test_a_click_on_a_card_adds_it_to_the_stack(page, library):  # noqa: F811
    open_browser(page)
    card(page, "kohya-cat").locator("h4").click()
    expect(page.locator("#stack-name-0 input, #stack-name-0 textarea").first).to_have_value("kohya-cat")
    expect(page.locator("#gen-note")).to_contain_text("added kohya-cat to the LoRA stack")
    # a trigger word on a card goes into the prompt only; the card's picture adds it (once: a second
    # add would say "already in the stack")
    dog = card(page, "spec-dog")
    dog.locator(".ls-trigger").first.click()
    expect(page.locator("#prompt textarea")).to_have_value(re.compile(r"dogstyle$"))
    dog.locator("img.ls-thumb").click()
    expect(page.locator("#stack-name-1 input, #stack-name-1 textarea").first).to_have_value("spec-dog")
    expect(page.locator("#gen-note")).to_contain_text("added spec-dog to the LoRA stack")


def uses_shown(page) -> list[tuple[str, int]]:  # noqa: F811
    return page.locator("#lora-cards .ls-lcard").evaluate_all(
        "els => els.map(e => [e.dataset.name, +((e.querySelector('.ls-uses') || {}).textContent || '0')"
        ".replace(/[^0-9]/g, '') || 0])")


def test_sort_by_most_used_counts_finished_jobs(page, library):  # noqa: F811
    def used(name):
        return sum(1 for j in all_jobs(library) if j["status"] == "succeeded"
                   and name in {a["name"] for a in j.get("adapters") or []})

    before = used("spec-dog")
    body = {"model": "demo:qwen-image", "prompt": "count me", "n": 2, "size": "64x64", "seed": 1,
            "num_inference_steps": 1, "lora": [{"name": "spec-dog", "scale": 1.0}]}
    r = httpx.post(library.url + "v1/images/generations", json=body, timeout=600)
    assert r.status_code == 200, r.text
    assert used("spec-dog") == before + 2

    open_browser(page)
    page.locator("#lora-sort input").click()
    page.get_by_role("option", name="most used", exact=True).click()
    expect(page.locator("#lora-cards .ls-lcard").first).to_have_attribute("data-name", "spec-dog")
    expect(card(page, "spec-dog").locator(".ls-uses")).to_have_text(f"used in {before + 2} jobs")
    shown = uses_shown(page)
    assert shown == sorted(shown, key=lambda nu: (-nu[1], nu[0].lower())), shown  # ties by name
    assert dict(shown)["spec-dog"] > max(n for name, n in shown if name != "spec-dog")


def test_make_preview_caches_a_generated_picture(browser, page, library):  # noqa: F811
    open_browser(page)
    cat = card(page, "kohya-cat")
    assert cat.locator("img").count() == 0  # no thumbnail in its header
    cat.locator(".ls-preview").click()
    expect(page.locator("#gen-note")).to_contain_text("making a preview of kohya-cat")
    expect(cat.locator("img.ls-thumb")).to_have_attribute("data-source", "generated")
    assert cat.locator(".ls-preview").count() == 0

    jobs = [j for j in all_jobs(library) if [a["name"] for a in j.get("adapters") or []] == ["kohya-cat"]
            and j["params"].get("prompt") == "kohyacat"]  # its first trigger word
    assert len(jobs) == 1 and jobs[0]["status"] == "succeeded", jobs
    params = jobs[0]["params"]
    assert (params["num_inference_steps"], params["seed"], jobs[0]["adapters"][0]["scale"]) == (4, 0, 1.0), params
    sha = hashlib.sha256((library.data_dir / "adapters" / "kohya-cat.safetensors").read_bytes()).hexdigest()
    png = library.data_dir / "previews" / f"{sha}.png"
    assert png.is_file()
    src = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    expect(cat.locator("img.ls-thumb")).to_have_attribute("src", src)

    again = open_page(browser, library)  # a reload shows the cached preview
    try:
        open_browser(again)
        expect(card(again, "kohya-cat").locator("img.ls-thumb")).to_have_attribute("src", src)
        shot(again, "lora-browser-preview")
    finally:
        again.close()


def test_a_sidecars_preferred_weight_activation_and_negative_text_are_on_the_card_and_in_the_stack(
        page, library, lora_files):  # noqa: F811
    """#28 item 4: A1111's ``<name>.json`` beside the file: the card shows the preferred weight, the activation
    text first among its trigger words and the negative text; Add to stack enters the preferred weight."""
    library.add_adapter(lora_files["other"], "sidecar-ink")
    (library.data_dir / "adapters" / "sidecar-ink.json").write_text(json.dumps(
        {"preferred weight": 0.6, "activation text": "inked lines", "negative text": "blurry, smudged"}))
    reload(page)
    open_browser(page)
    ink = card(page, "sidecar-ink")
    expect(ink.locator(".ls-nums")).to_contain_text("weight 0.6")
    expect(ink.locator(".ls-trigger").first).to_have_text("inked lines")
    expect(ink.locator(".ls-negative")).to_contain_text("negative: blurry, smudged")
    ink.locator(".ls-add").click()
    expect(page.locator("#stack-name-0 input, #stack-name-0 textarea").first).to_have_value("sidecar-ink")
    expect(page.locator("#stack-scale-0 input[type=number]")).to_have_value("0.6")

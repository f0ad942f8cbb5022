#!/usr/bin/env python3
"""README screenshots of the Generate tab, taken with headless Chromium (Playwright).

Start an app first (``python app.py serve demo:qwen-image --port 7861``) with a few adapters
in its library, then::

    python scripts/ui_screenshots.py http://127.0.0.1:7861/ [docs/img]

It stacks the first two adapters that fit, queues a batch of three jobs and shoots the
Generate tab while the first result is shown and the others run (with its live preview) or wait
(docs/img/generate.png),
then opens the LoRA browser and shoots its cards (docs/img/lora-browser.png; adapters with
``modelspec.thumbnail`` / ``modelspec.trigger_phrase`` / kohya ``ss_tag_frequency`` metadata make
the cards worth looking at), then an X/Y/Z plot of the first adapter's weight by seed
(docs/img/xyz.png), the Queue tab (docs/img/queue.png) and the Settings tab (docs/img/settings.png).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main(url: str, out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        page.set_default_timeout(120_000)
        page.goto(url)
        page.wait_for_selector("#fused-badge .ls-badge")
        page.locator("#prompt textarea").fill("a lighthouse at dusk, ink drawing")
        for i in range(2):
            page.locator("#adapter-pick input").click()
            options = page.get_by_role("option")
            if options.count() <= i:
                page.keyboard.press("Escape")
                break
            options.nth(i).click()
            page.locator("#adapter-add").click()
        # jobs of a few seconds each on CPU, so the running one has a live preview to show
        for field, value in (("num_inference_steps", "40"), ("height", "256"), ("width", "256")):
            box = page.locator(f"#field-{field} input")
            box.fill(value)
            box.press("Tab")
        batch = page.locator("#batch-count input")
        batch.fill("3")
        batch.press("Tab")
        page.locator("#generate-btn").click()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the first result shown while the next one runs
            states = page.locator("#gen-status .ls-job").evaluate_all("els => els.map(e => e.dataset.status)")
            if "succeeded" in states and "running" in states and page.locator("#result-image img").count() \
                    and page.locator("#gen-status img.ls-live").count():  # the running one's live preview
                break
            time.sleep(0.2)
        time.sleep(1.0)
        page.screenshot(path=str(out_dir / "generate.png"), full_page=True)
        page.locator("#cancel-btn").click()
        lora_browser(page, out_dir / "lora-browser.png")
        xyz_plot(page, out_dir / "xyz.png")
        queue_tab(page, out_dir / "queue.png")
        page.get_by_role("tab", name="Settings").click()
        page.wait_for_selector("#set-save")
        time.sleep(1.0)
        page.screenshot(path=str(out_dir / "settings.png"), full_page=False)
        browser.close()
    for name in ("generate", "lora-browser", "xyz", "queue", "settings"):
        print(out_dir / f"{name}.png")
    return 0


def xyz_plot(page, out: Path) -> None:
    """The X/Y/Z tab: the first stack adapter's weight by seed, shot finished (the labelled plot)."""
    weight = page.evaluate("() => document.querySelector('#stack-name-0 input, #stack-name-0 textarea')?.value")
    for field, value in (("num_inference_steps", "8"), ("height", "128"), ("width", "128")):
        box = page.locator(f"#field-{field} input")
        box.fill(value)
        box.press("Tab")
    page.get_by_role("tab", name="X/Y/Z plot").click()
    axes = ((f"Weight: {weight}" if weight else "Seed", "0, 0.5, 1" if weight else "1, 2, 3"), ("Seed", "7, 8"))
    for axis, (kind, values) in zip("xy", axes):
        page.locator(f"#xyz-{axis}-kind input").click()
        page.get_by_role("option", name=kind, exact=True).first.click()
        box = page.locator(f"#xyz-{axis}-values textarea, #xyz-{axis}-values input").first
        box.fill(values)
        box.press("Tab")
    page.locator("#xyz-go").click()
    page.wait_for_selector("#xyz-status [data-path]")
    page.wait_for_selector("#xyz-grid img")
    time.sleep(1.0)
    page.screenshot(path=str(out), full_page=True)


def queue_tab(page, out: Path) -> None:
    """The Queue tab: short job numbers, nine columns that fit the page."""
    page.get_by_role("tab", name="Queue").click()
    page.wait_for_selector("#queue-table tbody tr", state="attached")  # (the table's rows read as hidden)
    time.sleep(1.5)
    page.screenshot(path=str(out), full_page=False)


def lora_browser(page, out: Path) -> None:
    """The LoRA browser's cards, the panel alone (search, filters, cards)."""
    page.get_by_text("LoRA browser", exact=True).click()
    page.wait_for_selector("#lora-cards .ls-lcard")
    time.sleep(1.0)
    page.locator("#lora-browser").screenshot(path=str(out))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2] if len(sys.argv) > 2 else "docs/img")))

"""The X/Y/Z plot, sending results onward, the Gallery's captions, filters, paging and delete, and the
finished-job notification: Playwright in Chromium against one ``python app.py serve`` for the module.
"""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from PIL import Image

from test_ui_jobs import (CHROMIUM, all_jobs, browser, expect, fill, open_page, page, shot,  # noqa: F401
                          wait_for)
from ui_fixtures import app, lora_files  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")


def choose(page, elem_id: str, option: str) -> None:
    """Pick ``option`` in a Gradio dropdown."""
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).first.click()


def add_to_stack(page, name: str) -> None:
    choose(page, "adapter-pick", name)
    page.locator("#adapter-add").click()
    expect(page.locator("#stack-name-0 textarea, #stack-name-0 input").first).to_have_value(name)


def test_xyz_plot_scale_by_seed_is_one_labelled_png(page, app, lora_files):  # noqa: F811
    app.add_adapter(lora_files["style"], "plot-style")
    page.reload()
    page.wait_for_selector("#prompt textarea")
    fill(page, "prompt", "a plotted lighthouse")
    fill(page, "field-num_inference_steps", 2)
    fill(page, "seed", 11)
    add_to_stack(page, "plot-style")
    before = {j["id"] for j in all_jobs(app)}

    page.get_by_role("tab", name="X/Y/Z plot").click()
    choose(page, "xyz-x-kind", "LoRA scale (whole stack)")
    fill(page, "xyz-x-values", "0, 1")
    choose(page, "xyz-y-kind", "Seed")
    fill(page, "xyz-y-values", "3, 4")
    choose(page, "xyz-z-kind", "(nothing)")
    page.locator("#xyz-go").click()
    status = page.locator("#xyz-status [data-path]")
    expect(status).to_be_visible()
    expect(page.locator("#xyz-status")).to_contain_text("4 cells")
    path = status.get_attribute("data-path")
    shot(page, "xyz-plot")

    # the cells were queued as jobs through the Studio, with the stack scaled and the seeds set
    jobs = {j["id"]: j for j in all_jobs(app) if j["id"] not in before and j["kind"] == "generate"}
    assert len(jobs) == 4 and all(j["status"] == "succeeded" for j in jobs.values()), jobs
    sidecar = json.loads(open(path + ".json").read())
    assert path.startswith(str(app.data_dir / "outputs" / "plots")), path
    cells = {(c["y"], c["x"]): c for c in sidecar["cells"]}
    assert len(cells) == 4
    for (row, col), c in cells.items():
        job = jobs[c["job"]]
        assert job["params"]["seed"] == [3, 4][row]
        assert job["params"]["prompt"] == "a plotted lighthouse"
        assert [(a["name"], a["scale"]) for a in job["adapters"]] == [("plot-style", [0.0, 1.0][col])]

    # ONE PNG: 2x2 cells plus the label margins on the left and on top
    grid = Image.open(path).convert("RGB")
    layout = sidecar["layout"]
    cw, ch = layout["cell_box_size"]
    assert layout["cell_size"] == [64, 64] and cw == 64 * layout["zoom"]
    pad = layout["pad"]
    assert layout["left"] > 0 and layout["top"] > 0
    assert grid.size == (layout["left"] + 2 * (cw + pad) + pad, layout["top"] + 2 * (ch + pad) + pad)
    assert grid.width > 2 * cw + 40 and grid.height > 2 * ch + 20  # room for the labels
    crops = {}
    for box in layout["boxes"]:
        crop = np.asarray(grid.crop(tuple(box["box"])))
        cell = cells[(box["y"], box["x"])]
        own = Image.open(jobs[cell["job"]]["result"]["path"]).convert("RGB").resize((cw, ch), Image.NEAREST)
        assert np.array_equal(crop, np.asarray(own)), box  # each cell is its job's image
        crops[(box["y"], box["x"])] = crop
    assert not np.array_equal(crops[(0, 0)], crops[(0, 1)])  # the scale changes along X
    assert not np.array_equal(crops[(0, 0)], crops[(1, 0)])  # the seed changes along Y
    assert not np.array_equal(crops[(1, 0)], crops[(1, 1)])
    # the labels are drawn in the margins (not white there)
    margin = np.asarray(grid.crop((0, layout["top"], layout["left"], grid.height)))
    assert (margin < 128).any()
    header = np.asarray(grid.crop((layout["left"], 0, grid.width, layout["top"])))
    assert (header < 128).any()

    # a download link serves the same PNG
    link = page.locator("#xyz-file a").first
    expect(link).to_be_visible()
    href = link.get_attribute("href")
    got = httpx.get(href if href.startswith("http") else app.url + href.lstrip("/"), timeout=60)
    assert got.status_code == 200 and got.content == open(path, "rb").read()
    page.get_by_role("tab", name="Generate").click()
    page.locator("#stack-remove-0").click()

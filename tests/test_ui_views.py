"""The UI's pure pieces: what is shown for jobs, adapters, presets, metadata; the X/Y grid;
and that importing the UI never loads torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from backend.errors import AdapterError, InvalidParameter

ROOT = Path(__file__).resolve().parents[1]


def test_importing_ui_does_not_load_torch():
    code = "import ui, sys; assert 'torch' not in sys.modules, 'ui imported torch'; " \
           "assert 'diffusers' not in sys.modules; print('clean')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout


def test_errors_are_one_readable_line():
    from ui.views import error_html, readable

    assert readable(AdapterError("broken.safetensors: header is not valid JSON", param="file")) == \
        "broken.safetensors: header is not valid JSON"
    msg = readable(KeyError("transformer"))
    assert "KeyError" in msg and "Traceback" not in msg and "\n" not in msg
    assert "&lt;script&gt;" in error_html("<script>")


def test_progress_bar_follows_the_job():
    from ui.views import job_line, progress_html

    queued = {"id": "7", "status": "queued", "queue_position": 3, "progress": {"step": 0, "total": None}}
    assert job_line(queued) == "queued · position 3 in the queue"
    half = progress_html({"id": "7", "status": "running", "progress": {"step": 2, "total": 4}})
    assert 'data-step="2"' in half and 'data-total="4"' in half and "width:50%" in half
    failed = progress_html({"id": "7", "status": "failed", "error": "'height' must be a multiple of 16"})
    assert "ls-error" in failed and "multiple of 16" in failed


def test_only_fitting_adapters_are_offered_and_the_others_say_why():
    from ui.views import adapter_choices, adapter_rows

    library = [{"name": "good", "fit": {"ok": True, "summary": "240/240 keys bind"}, "rank": 4, "pinned": True},
               {"name": "wan-only", "fit": {"ok": False, "summary": "0 of 96 keys bind to QwenImagePipeline"}}]
    choices, note = adapter_choices(library)
    assert choices == [("good", "good")]
    assert "wan-only" in note and "0 of 96 keys bind" in note and "1 adapter(s)" in note
    rows = adapter_rows(library)
    assert rows[0][0] == "good" and rows[0][-1] == "pinned" and rows[1][7].startswith("✗")


def test_the_stack_becomes_the_facade_payload_and_back():
    from ui.stack import adapter_payload, stack_from_payload

    stack = [{"name": "a", "scale": 0.5, "split": False, "high": 0.5, "low": 0.5},
             {"name": "b", "scale": 1.0, "split": True, "high": 1.2, "low": 0.3}]
    two = adapter_payload(stack, two_stage=True)
    assert two == [{"name": "a", "scale": 0.5}, {"name": "b", "scale": {"transformer": 1.2, "transformer_2": 0.3}}]
    # a one-transformer model ignores the split: one weight per adapter
    assert adapter_payload(stack, two_stage=False)[1] == {"name": "b", "scale": 1.0}
    assert adapter_payload(stack_from_payload(two), two_stage=True) == two


def test_a_blank_weight_is_refused_by_the_adapters_name_only_where_the_job_reads_it():
    from ui.stack import stack_weights

    row = {"name": "ink", "scale": None, "split": True, "high": 1.0, "low": 0.5}
    with pytest.raises(ValueError, match="LoRA ink: the weight box is empty"):
        stack_weights([row], two_stage=False)
    assert stack_weights([row], two_stage=True) == [row]  # split: the two boxes are the ones read
    with pytest.raises(ValueError, match="LoRA ink: the transformer_2 \\(low noise\\) weight 'nan' is not a finite"):
        stack_weights([{**row, "low": "nan"}], two_stage=True)
    assert stack_weights([{**row, "split": False, "schedule": "0.5->1"}], two_stage=False)  # the text replaces them


def test_settings_come_back_from_metadata():
    from ui.views import settings_from_metadata

    meta = {"model": "demo:sd3.5", "seed": 9, "params": {"prompt": "cake", "num_inference_steps": 3},
            "adapters": [{"name": "style", "sha256": "ab" * 32, "scale": 0.75}]}
    s = settings_from_metadata(meta)
    assert s["model"] == "demo:sd3.5" and s["params"]["seed"] == 9 and s["params"]["prompt"] == "cake"
    assert s["adapters"] == [{"name": "style", "scale": 0.75}]


def test_xy_plan_and_grid():
    from ui.compare import axes
    from ui.grid import compose, parse_numbers
    from ui.xyz import corner_of, plan

    assert parse_numbers("0, 0.5,1 ;1.5") == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(InvalidParameter, match="adapter weights"):
        parse_numbers("0, a lot", name="X: adapter weights")
    # Compare is a preset of the X/Y/Z plot: its inputs become axes, planned by the X/Y/Z planner
    grid_axes, stack = axes("seeds", [0.0, 1.0], ["style"], [1, 2, 3])
    cells = plan(grid_axes, {"prompt": "p", "seed": 42}, stack, frozenset())
    assert [c["labels"][:2] for c in cells[:2]] == [["style 0", "seed 1"], ["style 1", "seed 1"]]
    assert (cells[5]["params"]["seed"], cells[5]["adapters"]) == (3, [{"name": "style", "scale": 1.0}])
    assert corner_of(grid_axes) == "seed \\ adapter weight"
    grid_axes, stack = axes("adapters", [0.0, 0.5], ["a", "b"], [])
    cells = plan(grid_axes, {"prompt": "p", "seed": 7}, stack, frozenset())
    assert [(c["labels"][:2], c["adapters"]) for c in cells] == [
        (["0", "a"], [{"name": "a", "scale": 0.0}]), (["0.5", "a"], [{"name": "a", "scale": 0.5}]),
        (["0", "b"], [{"name": "b", "scale": 0.0}]), (["0.5", "b"], [{"name": "b", "scale": 0.5}])]
    assert {c["params"]["seed"] for c in cells} == {7}
    with pytest.raises(InvalidParameter, match="at least one adapter"):
        axes("adapters", [1.0], [], [])
    red, blue = Image.new("RGB", (32, 32), "red"), Image.new("RGB", (32, 32), "blue")
    grid = compose([[red, blue], [None, red]], ["0", "1"], ["a", "b"], "weight", "adapter")
    # cells are scaled up to at least 160 px, laid out in a 2 x 2 grid with labels around them
    assert grid.width > 2 * 160 and grid.height > 2 * 160
    colours = {c for _, c in grid.getcolors(maxcolors=1 << 20)}
    assert (255, 0, 0) in colours and (0, 0, 255) in colours and (200, 200, 200) in colours


def test_a_plots_line_has_its_eta_from_the_pace_so_far():
    from ui.views import plot_progress

    def job(status, step=0, total=4, started=None):
        return {"status": status, "progress": {"step": step, "total": total if status != "queued" else 0},
                "params": {"num_inference_steps": 4}, "started_at": started}

    # 2 cells of 4 steps done and one at step 2, in 20 s: 2 s a step; 2 + 4 + 4 steps left: about 20 s
    jobs = [job("succeeded", 4, started=100.0), job("succeeded", 4, started=108.0), job("running", 2, started=116.0),
            job("queued"), job("queued")]
    line = plot_progress(jobs, now=120.0)
    assert 'data-done="2" data-total="5" data-eta="20.0"' in line, line
    assert "2/5 cells finished · cell 3 at step 2/4 · about 20.0 s left" in line
    # a cancelled or failed cell needs no more time; before any step there is no pace to go by
    assert 'data-eta="0.0"' in plot_progress([job("succeeded", 4, started=0.0), job("running", 4, started=1.0),
                                              job("cancelled")], now=10.0)
    first = plot_progress([job("queued"), job("queued")], now=5.0)
    assert 'data-eta=""' in first and "estimating the time left" in first
    assert "left" not in plot_progress([job("succeeded", 4, started=0.0)], now=9.0)


def test_the_batch_grid_holds_two_or_more_images_in_queue_order():
    from ui.views import batch_grid

    def job(n, path, seed):
        return {"id": f"id{n}", "number": n, "status": "succeeded", "params": {"seed": seed},
                "result": {"path": path, "metadata": {"seed": seed}}}

    assert batch_grid([job(3, "/o/a.png", 1)]) == []  # one result: the result view alone
    assert batch_grid([job(5, "/o/b.webp", 9), job(4, "/o/a.png", 8), job(6, "/o/c.mp4", 7)]) == [
        ("/o/a.png", "#4 · seed 8"), ("/o/b.webp", "#5 · seed 9")]  # a video is not a picture for the grid


def test_plot_labels_are_readable():
    """#26: the labels were Pillow's 10 px default font, whose 2 px space ran "LoRA scale" together."""
    import numpy as np

    from ui.grid import compose_xyz

    cell = Image.new("RGB", (64, 64), "red")
    grid, layout = compose_xyz([[[cell, cell]]], ["LoRA scale: 0", "LoRA scale: 1"], ["seed: 3"], [""], "Seed")
    assert layout["font_size"] >= 16
    header = np.asarray(grid.crop((layout["left"], 0, grid.width, layout["top"])).convert("L")) < 128
    rows = np.flatnonzero(header.any(axis=1))
    assert rows.max() - rows.min() + 1 >= 12, rows  # the column label's ink is at least 12 px tall
    # the words keep a visible gap: a blank column run of >= 3 px inside the first label
    cols = header.any(axis=0)[: layout["cell_box_size"][0]]
    ink = np.flatnonzero(cols)
    gaps = np.diff(ink)
    assert gaps.max() >= 4, gaps


def test_share_needs_auth():
    import ui

    assert ui.parse_auth("me:secret") == ("me", "secret")
    with pytest.raises(InvalidParameter, match="USER:PASS"):
        ui.parse_auth("nopassword")
    # a public link without a login is refused before anything starts
    with pytest.raises(InvalidParameter, match="needs --auth"):
        ui.launch(ui.build_ui(studio=None), share=True, prevent_thread_lock=True)
    with pytest.raises(InvalidParameter, match="needs --auth"):
        ui.share_link("127.0.0.1", 7860, auth=None)


def test_preset_cards_say_which_files_are_missing_and_how_to_get_them():
    from ui.views import preset_cards_html

    preset = {"id": "wan2.2-t2v-a14b-lightx2v-4step", "title": "Wan2.2 T2V 4-step", "pipeline": "WanPipeline",
              "models": ["Wan-AI/Wan2.2-T2V-A14B-Diffusers", "demo:wan2.2-t2v"], "ready": False,
              "defaults": {"num_inference_steps": 4}, "requirements": {"num_inference_steps": 4},
              "files": [{"component": "transformer", "repo": "lightx2v/Wan2.2-Lightning", "pattern": "*high*.safetensors",
                         "present": False, "path": None, "demo": "high.safetensors"},
                        {"component": "transformer_2", "repo": "lightx2v/Wan2.2-Lightning", "pattern": "*low*",
                         "present": True, "path": "/models/low.safetensors", "where": "adapter-dir"}]}
    card = preset_cards_html([preset], fused={"preset": "wan2.2-t2v-a14b-lightx2v-4step"})
    assert "huggingface-cli download lightx2v/Wan2.2-Lightning --include '*high*.safetensors'" in card
    assert "/models/low.safetensors" in card and "fused now" in card and "files missing" in card


def test_where_an_adapter_lives_comes_from_the_cache_tiers():
    from ui.views import adapter_rows, tiers_of

    system = {"lora_cache": {"tiers": {"cpu": {"adapters": ["a", "b"]}, "device": {"adapters": ["a"]}}}}
    where = tiers_of(system)
    assert where == {"a": "device", "b": "cpu"}
    rows = adapter_rows([{"name": n} for n in ("a", "b", "c")], where)
    assert [r[8] for r in rows] == ["device", "cpu", "disk"]


def test_running_job_shows_elapsed_and_eta():
    from ui import views

    job = {"id": "j1", "status": "running", "progress": {"step": 5, "total": 20}, "started_at": 100.0,
           "params": {"seed": 7}}
    assert views.timing(job, now=110.0) == "10.0 s elapsed · ETA 30.0 s"
    # before the first step the ETA comes from the worker's seconds per step
    first = {**job, "progress": {"step": 0, "total": 20}}
    assert views.timing(first, now=101.0, seconds_per_step=0.5) == "1.0 s elapsed · ETA 10.0 s"
    done = {**job, "status": "succeeded", "finished_at": 172.5}
    assert views.timing(done) == "took 1 min 12 s"
    html = views.jobs_html([job, {"id": "j2", "status": "queued", "queue_position": 1, "progress": {}}], now=110.0)
    assert 'data-title="[5/20] +1"' in html and "position 1 in the queue" in html and "seed 7" in html


def test_queue_rows_carry_the_prompt():
    from ui import views

    row = views.job_rows([{"id": "j", "kind": "generate", "status": "failed", "params": {"prompt": "a cat"},
                           "created_at": 0, "error": "boom"}])[0]
    assert dict(zip(views.JOB_COLUMNS, row))["prompt"] == "a cat"
    assert dict(zip(views.JOB_COLUMNS, row))["error"] == "boom"
    queued, load = views.job_rows([
        {"id": "q", "kind": "generate", "status": "queued", "queue_position": 2, "model": "m", "preset": "p4"},
        {"id": "l", "kind": "load_model", "status": "running", "model": "m"}])
    assert dict(zip(views.JOB_COLUMNS, queued))["status"] == "queued · 2"
    assert dict(zip(views.JOB_COLUMNS, queued))["model"] == "m + p4"
    assert dict(zip(views.JOB_COLUMNS, load))["status"] == "load_model: running"
    assert len(views.JOB_COLUMNS) == len(views.JOB_COLUMN_WIDTHS) == len(queued)


def test_grid_labels_cancelled_cells_apart_from_failed_ones():
    import numpy as np
    from PIL import Image

    from ui.grid import compose

    img = Image.new("RGB", (16, 16), "red")
    cancelled = np.asarray(compose([[img, "cancelled"]], ["a", "b"], ["r"], "x", "y"))
    failed = np.asarray(compose([[img, "failed"]], ["a", "b"], ["r"], "x", "y"))
    assert cancelled.shape == failed.shape and not np.array_equal(cancelled, failed)


def test_lora_browser_cards_escape_and_filter():
    from ui import views

    hostile = {"name": 'x"><script>alert(1)</script>', "format": "diffusers", "rank": "4", "alpha": "4",
               "size": "1 KiB", "size_bytes": 10, "mtime": 1.0, "usable": True, "error": None, "fits": True,
               "fit": "ok", "model": "demo:qwen-image", "family": "Qwen-Image", "title": "<b>t</b>",
               "triggers": ['"><img src=x onerror=alert(1)>'], "thumbnail": None, "thumbnail_note": None}
    other = {**hostile, "name": "b-older", "family": None, "fits": False, "mtime": 0.5, "size_bytes": 99,
             "triggers": ["dog"], "title": "", "fit": "refused: no module matches"}
    page = views.cards_html([hostile, other])
    assert "<script>" not in page and "<img src=x" not in page and "<b>" not in page
    assert page.count('class="ls-add"') == 1  # only a card that fits can be added
    assert "made for" not in page and "does not fit the loaded model" in page
    assert views.browser_families([hostile, other]) == [views.ALL_FAMILIES, "Qwen-Image", "unknown"]
    assert [c["name"] for c in views.filter_cards([hostile, other], "DOG")] == ["b-older"]
    assert [c["name"] for c in views.filter_cards([hostile, other], fits_only=True)] == [hostile["name"]]
    assert [c["name"] for c in views.filter_cards([hostile, other], family="unknown")] == ["b-older"]
    assert [c["name"] for c in views.filter_cards([hostile, other], sort="largest")] == ["b-older", hostile["name"]]
    assert [c["name"] for c in views.filter_cards([hostile, other], sort="newest")][0] == hostile["name"]
    by_name = views.card_html({**other, "family": "Wan2.2", "family_source": "name"})
    assert "made for Wan2.2 (by its name)" in by_name
    assert "made for Wan2.2<" in views.card_html({**other, "family": "Wan2.2", "family_source": "metadata"})


def test_a_plot_of_elongated_cells_stays_inside_the_budget_and_reopens(tmp_path):
    """Issue 25.5: 64 cells at 2048x16 made a 1,311,162 x 210 px plot (275 MP), over PIL's own limit. The
    cells are scaled to the budget now (their shape kept) and the saved plot opens again; cells no scale
    fits are refused by size before a job is queued."""
    import warnings

    from backend.limits import MAX_PLOT_PIXELS, MAX_PLOT_SIDE
    from ui.grid import compose_xyz, geometry

    cell = Image.new("RGB", (2048, 16), "red")
    blocks = [[[cell] * 8 for _ in range(8)]]
    grid, layout = compose_xyz(blocks, [f"seed {i}" for i in range(8)], [f"steps {i}" for i in range(8)], [""],
                               "steps \\ seed")
    width, height = grid.size
    assert width * height <= MAX_PLOT_PIXELS and max(grid.size) <= MAX_PLOT_SIDE, grid.size
    cw, ch = layout["cell_box_size"]
    assert abs(cw / ch - 128) < 128 * 0.05, (cw, ch)  # shape kept
    grid.save(tmp_path / "plot.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning would be an error here
        with Image.open(tmp_path / "plot.png") as again:
            again.load()
            assert again.size == grid.size
    with pytest.raises(InvalidParameter, match="px a side"):
        geometry(2048, 16, [f"seed {i}" for i in range(64)], [""], [""], "seed")
    # a label of any length is cut: it never sets the picture's size
    long = geometry(64, 64, ["x" * 20_000] * 8, ["y" * 20_000] * 8, [""], "c")
    short = geometry(64, 64, ["x" * 59 + "…"] * 8, ["y" * 59 + "…"] * 8, [""], "c")
    assert long["size"] == short["size"]


def test_the_first_run_hint_names_a_demo_lora_that_fits_and_escapes_the_card():
    from ui import views

    cards = [{"name": "mine", "fits": True, "demo": False, "description": "a user's own"},
             {"name": "demo-far", "fits": False, "demo": True, "description": "does not fit"},
             {"name": "demo-<b>x</b>", "fits": True, "demo": True, "description": "drains <i>it</i>"}]
    hint = views.lora_hint(cards, "demo:qwen-image", "a red digit 3 on a black background")
    assert "&lt;lora:demo-&lt;b&gt;x&lt;/b&gt;:1&gt;" in hint and "drains &lt;i&gt;it&lt;/i&gt;" in hint
    assert "<b>x" not in hint and "mine" not in hint and "demo-far" not in hint
    assert views.lora_hint(cards[:2], "demo:qwen-image", "p") == ""  # no fitting demo LoRA: no hint


def test_aspect_presets_keep_the_area_in_multiples_of_16():
    from ui.views import aspect_size

    assert aspect_size("1:1", 1328, 1328) == (1328, 1328)
    assert aspect_size("16:9", 1328, 1328) == (1776, 992) and aspect_size("9:16", 1328, 1328) == (992, 1776)
    assert aspect_size("4:3", 64, 64) == (80, 48) and aspect_size("1:1", 8, 8) == (16, 16)
    for bad in ("wide", "16:0", "0:9", "-1:2"):
        with pytest.raises(ValueError, match="not W:H"):
            aspect_size(bad, 64, 64)


def test_a_saved_workspace_is_read_as_untrusted_input(tmp_path):
    """ui/workspace.py: what the browser sends back is only put into the tab as known fields of the right
    kind, a bounded stack of well-formed rows whose adapters fit, and the key file is the owner's."""
    from ui import workspace

    fields = workspace.clean_fields({"height": 64.0, "num_inference_steps": 2.7, "negative_prompt": 5,
                                     "task_type": "t2va", "sample_solver": "../../etc", "seed": 3,
                                     "guidance_scale": float("nan"), "width": True, "image": "/tmp/x.png"})
    assert fields == {"height": 64, "num_inference_steps": 2, "task_type": "t2va"}
    stack, left = workspace.clean_stack([{"name": "a", "scale": 5, "split": 0, "high": "x"}, 3, {"name": "b"},
                                         {"name": "a", "scale": 1}, {"name": ["c"]},
                                         {"name": "d", "schedule": "0.5->1", "scale": None}], {"a", "d"}, 6)
    assert stack == [{"name": "a", "split": False, "scale": 5, "high": 5, "low": 5},
                     {"name": "d", "split": False, "scale": None, "high": None, "low": None, "schedule": "0.5->1"}]
    assert left == ["b"]
    assert len(workspace.clean_stack([{"name": f"x{i}"} for i in range(100)], {f"x{i}" for i in range(100)},
                                     6)[0]) == 6
    key = workspace.secret(tmp_path)
    assert len(key) == 64 and workspace.secret(tmp_path) == key  # made once, then read back
    assert (tmp_path / workspace.SECRET_FILE).stat().st_mode & 0o077 == 0


def test_a_misfit_is_one_plain_line_and_the_fold_lists_them():
    from ui.views import cards_html, misfit_reason

    base = {"model": "demo:qwen-image", "model_family": "Qwen-Image", "usable": True, "fits": False}
    wan = {**base, "name": "wan-style", "family": "Wan2.2", "family_source": "name",
           "fit": "refused: 96 unmatched key(s): blocks.0.attn1.to_q [no such layer]"}
    shapes = {**base, "name": "big-qwen", "family": "Qwen-Image", "family_source": "metadata",
              "fit": "refused: 12 shape mismatch(es): transformer_blocks.0.attn.to_q: adapter (4, 3072) vs model (4, 64)",
              "fit_reason": "12 of its layers have other sizes in demo:qwen-image (made for another model)"}
    unknown = {**base, "name": "odd", "family": None, "fit": "refused: 7 unmatched key(s): x [no such layer]",
               "fit_reason": "7 of its layers are not in demo:qwen-image (made for another model)"}
    broken = {**base, "name": "bad", "usable": False, "error": "/srv/lib/bad.safetensors: not a safetensors file"}
    assert misfit_reason(wan) == "made for Wan2.2, not demo:qwen-image (by its name)"
    assert misfit_reason(shapes) == "12 of its layers have other sizes in demo:qwen-image (made for another model)"
    assert misfit_reason(unknown) == "7 of its layers are not in demo:qwen-image (made for another model)"
    assert misfit_reason(broken) == "cannot be read as an adapter (the Adapters tab says why)"
    page = cards_html([], 4, [wan, shapes, unknown, broken])
    assert "4 more do not fit demo:qwen-image" in page and page.count("<li") == 4 and "<details" in page
    assert "<b>big-qwen</b>: 12 of its layers" in page and "/srv/lib" in page.split("<li")[4]  # tooltip only
    assert cards_html([], 4) == cards_html([], 4, [])  # no misfits: no fold


def test_a_queued_note_names_its_jobs_and_no_other_note_does():
    from ui.views import error_html, ok_html, queued_html, queued_ids

    note = queued_html("queued jobs 7, 8 (seed 1…2) · starting", ["7", "8", "x\"><script>"])
    assert queued_ids(note) == {"7", "8"} and "<script>" not in note
    assert queued_ids(ok_html("queued job 9")) == set() and queued_ids(error_html("x")) == set()
    assert queued_ids(None) == set() and queued_ids("") == set()


def test_only_a_queued_or_running_job_has_its_own_cancel():
    from ui.views import progress_html

    for status, has in (("queued", True), ("running", True), ("succeeded", False), ("failed", False)):
        line = progress_html({"id": "a1b2", "status": status, "progress": {"step": 1, "total": 4}})
        assert ('class="ls-job-cancel" data-job="a1b2"' in line) is has, (status, line)


def test_earlier_finished_jobs_fold_under_the_active_ones_and_the_last_result():
    """#26: six jobs pushed the result off-screen and old failures stayed: the queued and running jobs and
    the one that finished last stay in full, the others fold into "N earlier jobs (k failed)"."""
    from ui.views import jobs_html

    jobs = [{"id": f"j{i}", "status": s, "finished_at": t, "progress": {"step": 1, "total": 2}}
            for i, (s, t) in enumerate([("failed", 1), ("succeeded", 2), ("succeeded", 3), ("running", None),
                                        ("queued", None)])]
    page = jobs_html(jobs)
    shown, folded = page.split("<details", 1)
    assert [f'data-job="j{i}"' in shown for i in range(5)] == [False, False, True, True, True]
    assert "2 earlier jobs (1 failed)</summary>" in folded and 'data-job="j0"' in folded
    assert 'data-count="5"' in page
    assert "<details" not in jobs_html(jobs[2:])  # one finished job: nothing to fold

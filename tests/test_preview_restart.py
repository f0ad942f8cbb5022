"""A LoRA browser preview ("Make preview", Studio.make_preview) asked for before a restart is made
after it: the pending job id -> adapter map is kept in ``<data-dir>/previews/jobs.json`` beside the
queue that recovers the job, and preview jobs stay out of the "most used" counts across restarts."""
from __future__ import annotations

import hashlib

from backend.service import Studio
from ui_fixtures import MODEL, make_lora


def test_a_preview_queued_before_a_restart_is_made_after_it(data_dir, demo_path, tmp_path, gate):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(data_dir / "models", target_is_directory=True)
    lora = make_lora(demo_path(MODEL), home / "adapters" / "cat.safetensors")
    sha = hashlib.sha256(lora.read_bytes()).hexdigest()
    png = home / "previews" / f"{sha}.png"

    gate.hold(1)  # the long job holds the worker (at step 1) across the restart until it is cancelled
    try:
        first = Studio(MODEL, data_dir=home, device="cpu").start()
        try:
            long = first.submit("generate", {"prompt": "ahead of it", "num_inference_steps": 4})
            preview = first.make_preview("cat")
            assert first.job(preview["id"])["status"] == "queued"
        finally:
            first.close()  # the long job is stopped mid-run, the preview never started
        assert not png.exists()

        second = Studio(MODEL, data_dir=home, device="cpu").start()
    except BaseException:
        gate.release()
        raise
    try:
        assert second.job(preview["id"])["status"] == "queued"  # the queue kept the job ...
        second.cancel(long["id"])
        gate.release()
        assert second.wait(preview["id"], timeout=300)["status"] == "succeeded"
        card = next(c for c in second.adapter_cards() if c["name"] == "cat")  # ... and the server what it is for
        assert card["thumbnail_source"] == "generated" and png.is_file()
        assert "cat" not in second.adapter_use_counts()  # a preview is not a use, after a restart too
    finally:
        gate.release()
        second.close()

"""The previews part of the service: "Make preview" jobs for the LoRA browser's cards and the
thumbnails they leave in ``<data-dir>/previews/<sha256>.png``. The pending jobs and every preview
job this server made (not counted as uses) are kept in ``previews/jobs.json``, so a restart keeps
both (a queued preview job is recovered with the queue)."""
from __future__ import annotations

import base64
import json
import logging
import re
import threading
from pathlib import Path

from .. import settings
from ..errors import InvalidParameter, StudioError
from ..jobs.queue import FINISHED
from ..outputs import _atomic_write
from ..users import User
from .core import Core
from .gallery import Gallery
from .jobs import JobService

PREVIEW_SIDE = 512  # a generated preview's short side at most (the model's default if smaller)
PREVIEW_THUMB = 256  # the cached preview PNG's longest side at most
SHA256 = re.compile(r"[0-9a-f]{64}")
log = logging.getLogger("lora_studio.service")


class Previews:
    def __init__(self, core: Core, jobs: JobService, gallery: Gallery):
        self.core, self.jobs, self.gallery = core, jobs, gallery
        self._pending: dict[str, str] = {}  # job id -> adapter sha256
        self._made: set[str] = set()  # every preview job id this server made
        self._urls: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._load()

    def make(self, row: dict, *, user: User | None = None) -> dict:
        """Queue one small job that previews a library row's adapter: scale 1.0, 4 steps, seed 0, the
        loaded model's smallest sensible size (its default, the short side at most ``PREVIEW_SIDE``),
        the prompt its first trigger word (else its name). When it has succeeded its image is written
        (as a 256 px thumbnail) and shown on the adapter's card. Returns the job (an adapter whose
        preview is already being made returns that job)."""
        from ..lora import cards

        name = row["name"]
        if not row.get("usable") or not row["fit"]["ok"]:
            raise InvalidParameter(f"{name} does not fit the loaded model ({self.core.current_model()}); previews "
                                   "are made with the loaded model", param="name")
        sha = row.get("sha256") or ""
        if not SHA256.fullmatch(sha):
            raise InvalidParameter(f"{name}: no checksum to name its preview by", param="name")
        with self._lock:
            for job_id, pending in self._pending.items():
                if pending == sha:
                    return self.jobs.job(job_id)
        triggers = cards.header_card(row["path"])["triggers"]
        prompt = next((t for t in triggers if "<lora:" not in t.lower()), "")
        if not prompt.strip():
            prompt = name if "<lora:" not in name.lower() else "a picture"
        spec = self.core.spec() or self.core.static_spec(self.core.current_model()) or {}
        job = self.jobs.submit("generate", _preview_params(spec, prompt), [{"name": name, "scale": 1.0}], user=user)
        with self._lock:
            self._pending[job["id"]] = sha
            self._made.add(job["id"])
            self._save()
        return job

    def pending(self) -> set[str]:
        """The sha256 of each adapter whose preview is being made (finished ones collected first)."""
        self.collect()
        with self._lock:
            return set(self._pending.values())

    def made(self) -> set[str]:
        """Every preview job id this server made."""
        with self._lock:
            return set(self._made)

    def fingerprint(self) -> str:
        """What changes when a preview is queued, written or removed (part of the library's signature)."""
        pending = sorted(self.pending())
        try:
            written = sorted((p.name, p.stat().st_mtime_ns) for p in self._folder().glob("*.png"))
        except OSError:
            written = []
        return repr((pending, written))

    def collect(self) -> None:
        """Write the thumbnails of preview jobs that have succeeded; forget those that ended otherwise."""
        with self._lock:
            pending = dict(self._pending)
        for job_id, sha in pending.items():
            try:
                job = self.jobs.job(job_id)
            except StudioError:
                job = {"status": "failed"}
            if job["status"] not in FINISHED:
                continue
            if job["status"] == "succeeded":
                try:
                    self._write(job_id, sha)
                except Exception:  # noqa: BLE001 - the card keeps its "make preview" button
                    pass
            with self._lock:
                self._pending.pop(job_id, None)
                self._save()

    def url(self, sha: str) -> str | None:
        """The generated preview of the adapter with this sha256 as a PNG data URL (None if none)."""
        if not SHA256.fullmatch(sha or ""):
            return None
        path = self._folder() / f"{sha}.png"
        try:
            st = path.stat()
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        hit = self._urls.get(sha)
        if hit and hit[0] == stamp:
            return hit[1]
        if st.st_size > 4 << 20:
            return None
        url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
        if len(self._urls) > 4000:
            self._urls.clear()
        self._urls[sha] = (stamp, url)
        return url

    def _folder(self) -> Path:
        return settings.previews_dir(self.core.data_dir)

    def _write(self, job_id: str, sha: str) -> None:
        from PIL import Image

        src = self.gallery.result_image(job_id)["path"]
        with Image.open(src) as im:
            thumb = im.convert("RGB")
        thumb.thumbnail((PREVIEW_THUMB, PREVIEW_THUMB))
        _atomic_write(self._folder() / f"{sha}.png", lambda tmp: thumb.save(tmp, format="PNG"))

    def _load(self) -> None:
        """The preview jobs an earlier run of this server made (``<data-dir>/previews/jobs.json``)."""
        try:
            saved = json.loads((self._folder() / "jobs.json").read_text())
            pending, made = dict(saved.get("pending") or {}), list(saved.get("made") or [])
        except (OSError, ValueError, TypeError, AttributeError):
            return  # none yet, or unreadable: previews are a convenience, the server starts anyway
        self._pending = {str(k): str(v) for k, v in pending.items() if SHA256.fullmatch(str(v))}
        self._made = {str(j) for j in made}

    def _save(self) -> None:
        """Written under ``_lock`` whenever the pending set changes (atomic)."""
        data = json.dumps({"pending": self._pending, "made": sorted(self._made)})
        path = self._folder() / "jobs.json"
        try:
            _atomic_write(path, lambda tmp: Path(tmp).write_text(data))
        except OSError as exc:  # a full disk: the preview is still made while this server runs
            log.warning("could not record preview jobs in %s: %s", path, exc)


def _preview_params(spec: dict, prompt: str) -> dict:
    """A preview job's fields for a model spec: 4 steps, seed 0, the smallest sensible size (and
    one frame where the spec has a 4k+1 frame rule). Refused for a model that needs an input image."""
    from ..families import spec_for

    fields, defaults = set(spec.get("fields") or ()), spec.get("defaults") or {}
    try:
        shape = spec_for(spec["pipeline"])
    except Exception:  # noqa: BLE001 - an unknown pipeline: the usual multiple, no frame rule
        shape = None
    if shape is not None and "image" in shape.required:
        raise InvalidParameter(f"{spec.get('pipeline')} needs an input image; previews are made with "
                               "text-to-image or text-to-video models", param="name")
    m = shape.size_multiple if shape is not None else 16
    params = {"prompt": prompt, "seed": 0, "num_inference_steps": 4}
    h, w = defaults.get("height"), defaults.get("width")
    if isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0:
        k = min(1.0, PREVIEW_SIDE / min(h, w))
        params["height"], params["width"] = (max(m, int(v * k) // m * m) for v in (h, w))
    if "num_frames" in fields and shape is not None and shape.frame_multiple:
        params["num_frames"] = 1  # k * frame_multiple + 1 with k = 0 (Wan); others keep their default
    return {k: v for k, v in params.items() if k == "prompt" or k in fields}

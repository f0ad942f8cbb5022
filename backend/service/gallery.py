"""The outputs part of the service: finished results and what they were made with (the gallery's
pages and facets), deleting one, a video's last frame as an image, PNG info, saved plots."""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from .. import settings
from ..errors import InvalidParameter, PathNotAllowed
from ..outputs import SUFFIXES, _atomic_write
from ..users import User, listing_owner
from .core import Core


class Gallery:
    def __init__(self, core: Core):
        self.core = core

    def outputs_dir(self) -> str:
        """Where result files are written (the UI lets Gradio serve files from here only)."""
        return str(settings.outputs_dir(self.core.data_dir))

    def outputs(self, limit: int = 50, offset: int = 0, *, model: str | None = None,
                adapter: str | None = None, user: User | None = None) -> list[dict]:
        """Finished results, newest first (path, metadata, prompt, model, adapter names), from the job
        rows whose file still exists; ``offset``/``limit`` page through them, ``model`` and ``adapter``
        keep those made with that model / with that adapter in the stack."""
        if limit < 0 or offset < 0:
            raise InvalidParameter(f"limit and offset must be >= 0, got {limit} and {offset}", param="offset")
        out = []
        for item in self._outputs(user):
            if model and item["model"] != model or adapter and adapter not in item["adapters"]:
                continue
            out.append(item)
            if len(out) >= offset + limit:
                break
        return out[offset:offset + limit]

    def output_facets(self, *, user: User | None = None) -> dict:
        """What the gallery can filter on: the models and adapters its results were made with, and
        how many results there are (``user``'s own, unless an admin)."""
        models, adapters, total = {}, {}, 0
        for item in self._outputs(user):
            total += 1
            models[item["model"]] = None
            for name in item["adapters"]:
                adapters[name] = None
        return {"models": sorted(m for m in models if m), "adapters": sorted(adapters), "total": total}

    def _outputs(self, user: User | None = None):
        for job in self.core.queue.list(limit=1_000_000, status="succeeded", owner=listing_owner(user)):
            result = job.get("result") or {}
            path = result.get("path")
            if not path or not Path(path).exists():
                continue
            meta = result.get("metadata") or {}
            adapters = [a.get("name") for a in (meta.get("adapters") or job.get("adapters") or [])
                        if isinstance(a, dict) and a.get("name")]
            yield {"path": path, "metadata": meta, "job": job["id"], "model": meta.get("model") or job.get("model"),
                   "prompt": (meta.get("params") or {}).get("prompt") or (job.get("params") or {}).get("prompt") or "",
                   "seed": meta.get("seed"), "adapters": adapters}

    def delete_output(self, path: str, *, user: User | None = None) -> dict:
        """Remove a result file and its JSON sidecar (only files in the outputs folder; a user's own
        results only, unless an admin: another user's is "no such output", as a missing one)."""
        root = Path(os.path.realpath(settings.outputs_dir(self.core.data_dir)))
        target = Path(os.path.realpath(str(path)))
        if not target.is_relative_to(root) or target.suffix.lower() not in SUFFIXES:
            raise PathNotAllowed(f"{Path(str(path)).name} is not a result in the outputs folder; only those can "
                                 "be deleted here", param="path")
        if not target.is_file() or not self.owns_file(str(target), user):
            raise InvalidParameter(f"{target.name}: no such output (deleted already?)", param="path")
        removed = [str(target)]
        target.unlink()
        sidecar = target.with_suffix(target.suffix + ".json")
        if sidecar.is_file():
            sidecar.unlink()
            removed.append(str(sidecar))
        return {"deleted": removed}

    def owns_file(self, path: str, user: User | None) -> bool:
        """Whether ``user`` may read or delete ``path``, a file in the outputs folder: an admin (or the
        server's own code) any; a user the results of their own jobs and a video's last frame made from
        one (``<outputs>/frames/<name>-last.png``), nothing else there (plots and other users' results)."""
        if user is None or user.admin:
            return True
        target = os.path.realpath(path)
        frames = os.path.realpath(settings.outputs_dir(self.core.data_dir) / "frames")
        mine = set()
        for job in self.core.queue.list(limit=1_000_000, status="succeeded", owner=user.name):
            result = (job.get("result") or {}).get("path")
            if result:
                real = os.path.realpath(result)
                mine.add(real)
                mine.add(os.path.join(frames, f"{Path(real).stem}-last.png"))
        return target in mine

    def result_image(self, job_id: str, *, user: User | None = None) -> dict:
        """A finished job's result as one image file (what "send to image-to-video" takes): the image
        itself, or a video's last frame, written once as ``<outputs>/frames/<name>-last.png``.
        Returns {"path", "seed", "video"}."""
        job = self.core.job_for(job_id, user)
        result = job.get("result") or {}
        path = result.get("path")
        if job.get("status") != "succeeded" or not path or not Path(path).exists():
            raise InvalidParameter(f"job {job_id} has no result to send (status {job.get('status')})",
                                   param="job_id")
        seed = (result.get("metadata") or {}).get("seed", (job.get("params") or {}).get("seed"))
        if Path(path).suffix.lower() != ".mp4":
            return {"path": str(path), "seed": seed, "video": False}
        frame = settings.outputs_dir(self.core.data_dir) / "frames" / f"{Path(path).stem}-last.png"
        if not frame.exists():
            import imageio.v3 as iio
            from PIL import Image

            last = None
            for last in iio.imiter(path, plugin="FFMPEG"):
                pass
            if last is None:
                raise InvalidParameter(f"{Path(path).name} has no frames", param="job_id")
            _atomic_write(frame, lambda tmp: Image.fromarray(last).convert("RGB").save(tmp, format="PNG"))
        return {"path": str(frame), "seed": seed, "video": True}

    def png_info(self, path) -> dict | None:
        """The generation settings an image carries: ours, A1111's ``parameters`` or ComfyUI's
        ``prompt``/``workflow`` (backend/pnginfo.py); None when it carries none."""
        from ..pnginfo import read_info

        return read_info(path)

    def save_plot(self, image, sidecar: dict) -> dict:
        """An X/Y/Z plot (a PIL image, assembled by the UI) as ``<outputs>/plots/xyz-<time>-<id>.png``
        with the cells in a PNG text chunk and a JSON sidecar beside it; returns both paths."""
        folder = settings.outputs_dir(self.core.data_dir) / "plots"
        path = folder / f"xyz-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.png"
        text = json.dumps(sidecar, indent=2, default=str)

        def write_png(tmp):
            from PIL.PngImagePlugin import PngInfo

            info = PngInfo()
            info.add_text("lora_studio_plot", text)
            image.save(tmp, format="PNG", pnginfo=info)

        _atomic_write(path, write_png)
        side = path.with_suffix(".png.json")
        _atomic_write(side, lambda tmp: Path(tmp).write_text(text))
        return {"path": str(path), "sidecar": str(side)}

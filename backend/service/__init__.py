"""The Studio facade: what the UI (ui/) and the HTTP API (backend/api/) talk to.

``Studio`` builds the service's parts from one start config and hands each call to the part whose
job it is; no rule lives here. Every method returns plain JSON-able dicts; importing this package
does not import torch or Gradio (the worker process is where the pipeline lives).

    core.py      Core: the start config, the job queue, the worker, the adapter resolver, the limits
    jobs.py      JobService: submit (checked, all or none), job views, cancel, wait
    models.py    ModelService: the model list and switch, presets, the system view
    library.py   AdapterLibrary: adapters and their fit, cards, import/delete/pin/register
    previews.py  Previews: "Make preview" jobs and their thumbnails
    gallery.py   Gallery: outputs and facets, delete, a video's last frame, PNG info, plots
"""
from __future__ import annotations

import functools

from ..families import DEFAULT_MODEL
from ..jobs.queue import FINISHED
from ..limits import MAX_PLOT_PIXELS, MAX_PLOT_SIDE, check_plot_cells, check_plot_size  # noqa: F401 (the UI's plot budget)
from ..lora.schedule import parse_text as parse_scale_text  # noqa: F401 - the UI's scale fields (torch-free)
from ..outputs import IMAGE_SUFFIXES  # noqa: F401 - the UI's batch grid (which results are pictures)
from ..params import MAX_BATCH_SIZE  # noqa: F401 - the UI's Batch size field
from ..pnginfo import infotext  # noqa: F401 - the UI's result line (torch-free)
from ..preferences import TOKENS as FILENAME_TOKENS  # noqa: F401 - the UI's Settings tab (torch-free)
from ..preferences import Preferences, check as check_preferences, filename as preferred_filename  # noqa: F401
from ..users import NOBODY, User
from .core import Core
from .gallery import Gallery
from .jobs import JobService
from .library import AdapterLibrary
from .models import ModelService, job_error
from .previews import Previews


class Studio:
    """Start options as ``app.py serve`` takes them (``Core.build``); ``start()`` starts the worker."""

    def __init__(self, model: str = DEFAULT_MODEL, **options):
        self.core = core = Core.build(model, **options)
        self.model_service = ModelService(core)
        self.job_service = JobService(core, self.model_service)
        self.gallery = Gallery(core)
        self.previews = Previews(core, self.job_service, self.gallery)
        self.library = AdapterLibrary(core, self.previews)
        # what the HTTP API, the CLI and the tests read of the server's state
        self.data_dir, self.config, self.limits = core.data_dir, core.config, core.limits
        self.queue, self.supervisor, self.resolver = core.queue, core.supervisor, core.resolver
        self.model, self.preset, self.lora_backend, self.engine = model, core.preset, core.lora_backend, core.engine
        self.recovered, self.started_at = core.recovered, core.started_at
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, *, timeout: float = 600.0) -> "Studio":
        """Start the worker and wait until it has loaded the model (raises if it cannot)."""
        self.supervisor.start(wait_ready=True, timeout=timeout)
        return self

    def stopping(self) -> None:
        """Shutdown has begun (Ctrl-C, SIGTERM): end every wait for a job now (503), so the HTTP
        server's graceful close does not have to cancel those requests."""
        self.queue.interrupt()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stopping()
            self.supervisor.stop()
            self.queue.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- jobs (jobs.py) --------------------------------------------------------------------------
    # ``user`` (backend/users.py): whose work this is; None is the server's own code (CLI, Omni, tests)
    def submit(self, kind, params, adapters=None, preset=None, model=None, *, user: User | None = None) -> dict:
        return self.job_service.submit(kind, params, adapters, preset, model, user=user)

    def submit_many(self, requests: list[dict], *, user: User | None = None) -> list[dict]:
        return self.job_service.submit_many(requests, user=user)

    def job(self, job_id: str, *, user: User | None = None) -> dict:
        return self.job_service.job(job_id, user=user)

    def job_preview(self, job_id: str, *, user: User | None = None) -> dict | None:
        return self.job_service.job_preview(job_id, user=user)

    def jobs(self, limit: int = 100, status: str | None = None, *, user: User | None = None) -> list[dict]:
        return self.job_service.jobs(limit, status, user=user)

    def active_jobs(self, kinds: tuple[str, ...] | None = ("generate",), *, user: User | None = None) -> list[dict]:
        return self.job_service.active_jobs(kinds, user=user)

    def cancel(self, job_id: str, *, user: User | None = None) -> dict:
        return self.job_service.cancel(job_id, user=user)

    def wait(self, job_id: str, timeout: float | None = None, *, user: User | None = None) -> dict:
        return self.job_service.wait(job_id, timeout, user=user)

    async def wait_async(self, job_id: str, timeout: float | None = None, *, user: User | None = None) -> dict:
        return await self.job_service.wait_async(job_id, timeout, user=user)

    def run(self, kind, params, adapters=None, preset=None, model=None, timeout: float | None = None, *,
            user: User | None = None) -> dict:
        return self.job_service.run(kind, params, adapters, preset, model, timeout, user=user)

    def for_user(self, user: User | None) -> "Studio | UserView":
        """This Studio as ``user`` sees it: the methods that touch someone's work (OWNED) act as that
        user, everything else is the Studio's. ``None``: the Studio itself (no credentials)."""
        return self if user is None else UserView(self, user)

    # -- models and presets (models.py) ----------------------------------------------------------
    def current_model(self) -> str:
        return self.core.current_model()

    def current_preset(self) -> str | None:
        return self.core.current_preset()

    def seconds_per_step(self) -> float | None:
        return self.model_service.seconds_per_step()

    def models(self) -> list[dict]:
        return self.model_service.models()

    def check_model(self, model_id) -> str:
        return self.model_service.check_model(model_id)

    def switch_model(self, model_id: str) -> dict:
        return self.model_service.switch_model(model_id)

    def presets(self) -> list[dict]:
        return self.model_service.presets()

    def apply_preset(self, preset_id: str, timeout: float | None = 600.0) -> dict:
        return self.model_service.apply_preset(preset_id, timeout)

    def restore_base(self, timeout: float | None = 600.0) -> dict:
        return self.model_service.restore_base(timeout)

    def system(self) -> dict:
        return self.model_service.system()

    # -- the adapter library (library.py, previews.py) -------------------------------------------
    def adapters(self) -> list[dict]:
        return self.library.adapters()

    def adapter_detail(self, name: str) -> dict:
        return self.library.adapter_detail(name)

    def library_signature(self) -> str:
        return self.library.signature()

    def adapter_cards(self) -> list[dict]:
        return self.library.adapter_cards()

    def adapter_use_counts(self) -> dict[str, int]:
        return self.library.adapter_use_counts()

    def make_preview(self, name: str, *, user: User | None = None) -> dict:
        return self.library.make_preview(name, user=user)

    def import_adapter(self, src, name: str | None = None) -> dict:
        return self.library.import_adapter(src, name)

    def delete_adapter(self, name: str) -> dict:
        return self.library.delete_adapter(name)

    def export_adapter(self, specs: list[dict], name: str, portable: bool = False, layout: str = "diffusers") -> dict:
        return self.library.export_adapter(specs, name, portable, layout)

    def bake_model(self, specs: list[dict], name: str, user: User | None = None) -> dict:
        return self.library.bake_model(specs, name, user)

    def pin(self, name: str, pinned: bool = True) -> dict:
        return self.library.pin(name, pinned)

    def load_adapter(self, name: str, path: str) -> dict:
        return self.library.load_adapter(name, path)

    def unload_adapter(self, name: str) -> dict:
        return self.library.unload_adapter(name)

    def loaded_adapters(self) -> list[dict]:
        return self.library.loaded_adapters()

    # -- the application's settings (backend/preferences.py) --------------------------------------
    def preferences(self) -> dict:
        """The saved settings (the Settings tab), as plain values."""
        from .. import preferences

        return preferences.load(self.data_dir).model_dump()

    def set_preferences(self, data: dict, *, user: User | None = None) -> dict:
        """Check and save the settings; each problem names its setting. They are the server's (output
        names and format for everyone's results): where several users share it, admins only."""
        from .. import preferences
        from ..errors import PathNotAllowed

        if user is not None and not user.admin:
            raise PathNotAllowed("the settings are the server's, for every user: admins only", param="preferences")
        prefs = preferences.check(data)
        if prefs.default_model:  # one a client may name (the same rule as a request's model)
            self.model_service.check_model(prefs.default_model)
        return preferences.save(prefs.model_dump(), self.data_dir).model_dump()

    # -- outputs (gallery.py) --------------------------------------------------------------------
    def outputs_dir(self) -> str:
        return self.gallery.outputs_dir()

    def outputs(self, limit: int = 50, offset: int = 0, *, model: str | None = None,
                adapter: str | None = None, user: User | None = None) -> list[dict]:
        return self.gallery.outputs(limit, offset, model=model, adapter=adapter, user=user)

    def output_facets(self, *, user: User | None = None) -> dict:
        return self.gallery.output_facets(user=user)

    def delete_output(self, path: str, *, user: User | None = None) -> dict:
        return self.gallery.delete_output(path, user=user)

    def owns_file(self, path: str, user: User | None) -> bool:
        return self.gallery.owns_file(path, user)

    def result_image(self, job_id: str, *, user: User | None = None) -> dict:
        return self.gallery.result_image(job_id, user=user)

    def png_info(self, path) -> dict | None:
        return self.gallery.png_info(path)

    def save_plot(self, image, sidecar: dict) -> dict:
        return self.gallery.save_plot(image, sidecar)


# the methods that read or change someone's work: a UserView passes its user to these
OWNED = frozenset({"submit", "submit_many", "job", "job_preview", "jobs", "active_jobs", "cancel", "wait",
                   "wait_async", "run", "make_preview", "outputs", "output_facets", "delete_output",
                   "result_image", "bake_model", "set_preferences"})


class UserView:
    """A Studio as one user sees it (``Studio.for_user``): OWNED methods act as that user."""

    def __init__(self, studio: Studio, user: User):
        self.studio, self.user = studio, user

    def __getattr__(self, name):
        attr = getattr(self.studio, name)
        if name in OWNED:
            return functools.partial(attr, user=self.user)
        return attr


__all__ = ["Studio", "UserView", "OWNED", "NOBODY", "FINISHED", "DEFAULT_MODEL", "job_error"]

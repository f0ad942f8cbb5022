"""The adapter library part of the service: the adapters on disk and registered by API, each with its
fit for the loaded model; the LoRA browser's cards; import, delete, pin, register; the worker's cache."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import AdapterNotFound, InvalidParameter, PathNotAllowed, StudioError
from ..limits import check_request
from ..users import User
from .core import Core
from .previews import Previews

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterLibrary:
    def __init__(self, core: Core, previews: Previews):
        self.core, self.previews = core, previews

    def adapters(self) -> list[dict]:
        """The library, each with its fit for the loaded model; adapters loaded by API name are marked."""
        from ..lora import list_adapters

        core = self.core
        rows = list_adapters(core.current_model(), core.resolver.adapter_dirs, core.data_dir)
        by_path = {v: k for k, v in core.resolver.registered().items()}
        pinned = set((core.info.get("lora_cache") or {}).get("pinned") or [])
        for row in rows:
            row["fit"] = {"ok": bool(row.get("fits")), "summary": row.get("fit", "")}
            row["registered_as"] = by_path.get(os.path.realpath(row["path"]))
            row["pinned"] = row["name"] in pinned
        return rows

    def adapter_detail(self, name: str) -> dict:
        for row in self.adapters():
            if row["name"] == name:
                return row
        raise AdapterNotFound(f"no adapter named {str(name)[:100]!r} in the library", param="name")

    def signature(self) -> str:
        """A cheap fingerprint of the adapter library (names, sizes and times of the files in its roots,
        the names registered by API, the previews): it changes when an adapter is imported, deleted or
        registered, so a page can refresh its lists without reading every file."""
        h = hashlib.sha1()
        for root in self.core.resolver.roots:
            try:
                entries = sorted(root.iterdir())
            except OSError:
                continue
            for p in entries:
                try:
                    st = p.stat()
                except OSError:
                    continue
                h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        h.update(repr(sorted(self.core.resolver.registered().items())).encode())
        h.update(str(self.core.current_model()).encode())
        h.update(self.previews.fingerprint().encode())  # a finished preview's PNG is written now
        return h.hexdigest()

    def adapter_cards(self) -> list[dict]:
        """The LoRA browser's cards: one plain dict per library row, with what its safetensors header
        says (title, trigger words, a description, an embedded thumbnail, all bounded: backend/lora/cards.py), the
        base-model family (the publisher's hint, else the loaded model's when the adapter fits it, else
        one its name says: ``family_source`` is metadata, fit or name),
        and whether it can be used here and why not. Headers only, cached by (path, mtime, size)."""
        from ..lora import cards

        model = self.core.current_model()
        model_family = cards.family_of(model)
        pending = self.previews.pending()
        out = []
        for row in self.adapters():
            card = cards.header_card(row["path"]) if row.get("usable") else {**cards.card_info({}), "mtime": 0.0}
            sha = row.get("sha256") or ""
            thumb, made = card["thumbnail"], None
            if not thumb and row.get("usable"):
                thumb = self.previews.url(sha)
                made = "generated" if thumb else None
            fits = bool(row["fit"]["ok"])
            hint = row.get("base_model") or card["base_model"]
            # the family: the publisher's hint, else the loaded model's when it fits, else the file's name
            family, source = cards.family_of(hint), "metadata"
            if family is None and fits:
                family, source = cards.family_of(model), "fit"
            if family is None:
                family, source = cards.family_of(row["name"]), "name"
            triggers = card["triggers"]
            if row.get("activation_text"):  # A1111's activation text first (its sidecar), then the header's words
                triggers = [row["activation_text"], *(t for t in triggers if t != row["activation_text"])]
            out.append({"name": row["name"], "format": row["format"], "rank": row["rank"], "alpha": row["alpha"],
                        "size": row["size"], "size_bytes": row["size_bytes"], "mtime": card["mtime"],
                        "usable": bool(row.get("usable")), "error": row.get("error"), "fits": fits,
                        "fit": row["fit"]["summary"], "fit_reason": row.get("fit_reason", ""), "model": model, "model_family": model_family,
                        "family": family, "family_source": source if family else None,
                        "base_model": cards.clean_text(hint or ""), "title": card["title"],
                        "description": card["description"], "triggers": triggers, "thumbnail": thumb,
                        "preferred_weight": row.get("preferred_weight"), "negative_text": row.get("negative_text", ""),
                        "thumbnail_source": made or ("file" if thumb else None),
                        "preview_pending": bool(sha) and sha in pending,
                        "thumbnail_note": card["thumbnail_note"], "pinned": row.get("pinned", False),
                        "demo": bool(row.get("demo"))})
        return out

    def adapter_use_counts(self) -> dict[str, int]:
        """How many succeeded jobs used each adapter (by name, from the job rows' adapters): the LoRA
        browser's "most used" sort. Preview jobs made by this server are not uses."""
        counts: dict[str, int] = {}
        previews = self.previews.made()
        for job in self.core.queue.list(limit=1_000_000, status="succeeded"):
            if job["id"] in previews:
                continue
            for name in {a.get("name") for a in job.get("adapters") or [] if isinstance(a, dict)}:
                if isinstance(name, str) and name:
                    counts[name] = counts.get(name, 0) + 1
        return counts

    def make_preview(self, name: str, *, user: User | None = None) -> dict:
        """The card's "Make preview": a preview job for the adapter of that name (``Previews.make``)."""
        if not isinstance(name, str):
            raise AdapterNotFound(f"no adapter named {str(name)[:100]!r} in the library", param="name")
        return self.previews.make(self.adapter_detail(name), user=user)

    def import_adapter(self, src, name: str | None = None) -> dict:
        """Copy an adapter into <data-dir>/adapters (the library root we own).

        ``src`` is one file (a .safetensors) or a list of files: one file imports as itself, a PEFT
        folder's ``adapter_config.json`` + ``adapter_model.safetensors`` as a folder named ``name``.
        The name is checked first (``settings.check_plain_name``: a plain file name), then the files are
        staged in ``<root>/.staging/``, checked like any library file, and moved into place; the
        staging folder is removed whatever happens. Nothing is written anywhere else."""
        from ..settings import check_plain_name
        from ..lora.formats import inspect

        srcs = [Path(src)] if isinstance(src, (str, os.PathLike)) else [Path(p) for p in src]
        if not srcs:
            raise InvalidParameter("choose a file to import", param="path")
        if name is None or not str(name).strip():
            name = (srcs[0].name if srcs[0].is_dir() else srcs[0].stem) if len(srcs) == 1 else srcs[0].parent.name
        name = check_plain_name(name, "name")
        for p in srcs:
            if not p.is_file() and not (len(srcs) == 1 and p.is_dir()):
                raise AdapterNotFound(f"{p.name}: no such file to import", param="path")
        if len(srcs) == 1 and srcs[0].is_dir():  # a PEFT folder given as one path (not from the UI)
            srcs = sorted(srcs[0].iterdir())
            folder = True
        else:
            folder = len(srcs) > 1
        if folder and sorted(p.name for p in srcs) != sorted(PEFT_FILES):
            raise InvalidParameter(f"a PEFT folder imports as exactly {' + '.join(PEFT_FILES)}; got "
                                   f"{', '.join(sorted(p.name for p in srcs))[:200]}", param="path")
        root = self.core.resolver.roots[0]
        target = root / name if folder else root / f"{name}{srcs[0].suffix.lower()}"
        if os.path.lexists(target):
            raise InvalidParameter(f"an adapter named {name!r} already exists in the library", param="name")
        root.mkdir(parents=True, exist_ok=True)
        (root / ".staging").mkdir(exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix="import-", dir=root / ".staging"))
        try:
            staged = stage / target.name
            if folder:
                staged.mkdir()
                for p in srcs:
                    shutil.copyfile(p, staged / p.name)
            else:
                shutil.copyfile(srcs[0], staged)
            try:
                inspect(staged, name)
            except StudioError as exc:  # named by the file the user chose, not the staging copy's path
                raise exc.replacing(str(staged), name if folder else srcs[0].name) from None
            if os.path.lexists(target):
                raise InvalidParameter(f"an adapter named {name!r} already exists in the library", param="name")
            os.rename(staged, target)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return self.adapter_detail(name)

    def export_adapter(self, specs: list[dict], name: str, portable: bool = False, layout: str = "diffusers") -> dict:
        """A stack (``[{"name" or "path", "scale"}]``, resolved as a request's) written exactly as one LoRA file
        into the library root as ``<name>.safetensors`` (``backend/lora/export.py``); returns the new row and
        what was written. ``layout``: "diffusers" (exact unless ``portable``) or "kohya" (to fp32 rounding)."""
        from ..settings import check_plain_name
        from ..lora.export import LAYOUTS, export_stack

        if layout not in LAYOUTS:  # before the name or any file
            raise InvalidParameter(f"layout {layout!r}: one of {', '.join(LAYOUTS)}", param="layout")

        name = check_plain_name(name, "name")
        check_request(self.core.limits, None, {}, {}, specs)  # --max-adapters, before any file is read
        target = self.core.resolver.roots[0] / f"{name}.safetensors"
        if os.path.lexists(target) or name in {r["name"] for r in self.adapters()}:
            raise InvalidParameter(f"an adapter named {name!r} already exists in the library", param="name")
        written = export_stack(self.core.resolver.resolve(specs), self.core.current_model(), target,
                               data_dir=self.core.data_dir, title=name, dtype=self._serving_dtype(), portable=portable,
                               layout=layout)
        return {"adapter": self.adapter_detail(name), **written}

    def bake_model(self, specs: list[dict], name: str, user: User | None = None) -> dict:
        """The loaded model with a stack (as a request's) merged into a copy, ``<data-dir>/models/baked/<name>``,
        in the serving dtype (``backend/lora/bake.py``); returns its id ``baked:<name>`` and what was written.
        A copy can take the disk of the whole model: where several users share the server, admins only."""
        from ..settings import check_plain_name
        from ..lora.bake import bake_stack
        from ..models.resolve import BAKED, baked_path

        if user is not None and not user.admin:
            raise PathNotAllowed("baking a model writes a copy of it to the server's disk: admins only",
                                 param="name")
        name = check_plain_name(name, "name", what="model")
        check_request(self.core.limits, None, {}, {}, specs)  # --max-adapters, before any file is read
        target = baked_path(BAKED + name, self.core.data_dir)
        if os.path.lexists(target):
            raise InvalidParameter(f"a model named {BAKED}{name} already exists", param="name")
        target.parent.mkdir(parents=True, exist_ok=True)
        written = bake_stack(self.core.resolver.resolve(specs), self.core.current_model(), target,
                             data_dir=self.core.data_dir, dtype=self._serving_dtype())
        return {"model": BAKED + name, **{k: v for k, v in written.items() if k != "path"}}  # no server paths

    def _serving_dtype(self):
        """The dtype the worker serves the model in (its report; before one: what ``--dtype`` resolves to)."""
        import torch

        from ..manager import pick_device, pick_dtype

        reported = self.core.info.get("dtype")
        if isinstance(reported, str) and isinstance(getattr(torch, reported, None), torch.dtype):
            return getattr(torch, reported)
        return pick_dtype(self.core.config.dtype, pick_device(self.core.config.device))

    def delete_adapter(self, name: str) -> dict:
        row = self.adapter_detail(name)
        path, root = Path(os.path.realpath(row["path"])), self.core.resolver.roots[0]
        if not path.is_relative_to(root):
            raise PathNotAllowed(f"{path} is not in {root}; only adapters imported into the "
                                 "library can be deleted here", param="name")
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.core.supervisor.control({"op": "unload_adapter", "name": name})
        return {"name": name, "deleted": str(path)}

    def pin(self, name: str, pinned: bool = True) -> dict:
        """Keep an adapter in the worker's CPU cache (never evicted) or let it go again.
        Pins live as long as the worker process (a restarted worker starts unpinned)."""
        path = self.core.resolver.by_name(name)
        self.core.supervisor.control({"op": "pin", "name": name, "path": str(path),
                                      "int_id": self.core.resolver.int_id(path), "pinned": bool(pinned)})
        return {"name": name, "pinned": bool(pinned)}

    def load_adapter(self, name: str, path: str) -> dict:
        """vLLM's /v1/load_lora_adapter: register ``name`` for ``path`` (path rules apply)."""
        return self.core.resolver.register(name, path).as_dict()

    def unload_adapter(self, name: str) -> dict:
        self.core.resolver.unregister(name)
        self.core.supervisor.control({"op": "unload_adapter", "name": name})
        return {"name": name, "unloaded": True}

    def loaded_adapters(self) -> list[dict]:
        tiers = (self.core.info.get("lora_cache") or {}).get("tiers") or {}
        resident = set((tiers.get("cpu") or {}).get("adapters") or [])
        return [{"name": n, "path": p, "int_id": self.core.resolver.int_id(Path(p)), "resident": n in resident}
                for n, p in sorted(self.core.resolver.registered().items())]

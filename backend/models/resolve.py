"""Model resolution: ``demo:*``, ``baked:NAME`` (a copy with a stack baked in, ``backend/lora/bake.py``, under
``<data-dir>/models/baked``), a local diffusers directory, or a Hugging Face repo id.

A repo id is looked up in the local HF cache first; it is downloaded only when the
caller allows it (``allow_download=True``) and the machine is online.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import demo, families
from ..errors import CorruptModel, ModelNotFound


BAKED = "baked:"  # the id prefix of a model baked here (app.py bake, POST /v1/models/bake)
MAX_BAKED_LISTED = 200


def baked_path(model_id: str, data_dir=None) -> Path:
    """The folder of ``baked:NAME`` (NAME a plain name: nothing else is looked at)."""
    from .. import settings

    name = settings.check_plain_name(model_id[len(BAKED):], "model", what="model")
    return settings.models_dir(data_dir) / "baked" / name


def baked_models(data_dir=None) -> list[str]:
    """The ``baked:NAME`` ids present (folders with a model_index.json), sorted; at most MAX_BAKED_LISTED."""
    from .. import settings

    root = settings.models_dir(data_dir) / "baked"
    try:
        names = sorted(p.name for p in root.iterdir() if not p.name.startswith(".")
                       and (p / "model_index.json").is_file())
    except OSError:
        return []
    return [BAKED + n for n in names[:MAX_BAKED_LISTED]]


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str
    path: Path
    class_name: str
    # sampling defaults shipped with the directory (lora_studio.json), if any
    defaults: dict = field(default_factory=dict)
    model_index: dict = field(default_factory=dict)

    @property
    def family(self):
        """Its ``backend.families.Family``: by pipeline class, then by the components it carries."""
        return families.family_for(self.class_name, families.components_of(self.model_index))

    @property
    def denoisers(self) -> tuple[str, ...]:
        """The family's denoisers this checkpoint carries (Wan2.1 has no ``transformer_2``)."""
        have = families.components_of(self.model_index)
        return tuple(c for c in self.family.denoisers if have is None or c in have)

    def spec_info(self) -> dict:
        """Its spec as reported before any weights are loaded (``families.describe``)."""
        return families.describe(families.spec_for(self.class_name), self.defaults, self.denoisers)


# Downloads are opt-in: a server must never start fetching tens of GB by surprise.
ALLOW_DOWNLOAD_ENV = "LORA_STUDIO_ALLOW_DOWNLOAD"


def resolve_model(model_id: str, data_dir=None, *, allow_download: bool | None = None) -> ResolvedModel:
    if allow_download is None:
        allow_download = os.environ.get(ALLOW_DOWNLOAD_ENV) == "1"
    if not model_id or not isinstance(model_id, str):
        raise ModelNotFound("model must be a demo id, a local diffusers directory or a Hugging Face repo id",
                            param="model")
    if demo.is_demo(model_id):
        path = demo.ensure(model_id, data_dir)
    elif model_id.startswith(BAKED):
        path = baked_path(model_id, data_dir)
        if not (path / "model_index.json").is_file():
            raise ModelNotFound(f"no baked model {model_id!r} here (app.py bake ... -o writes one)", param="model")
    elif Path(model_id).expanduser().exists():
        path = Path(model_id).expanduser().resolve()
    else:
        path = _from_hub(model_id, allow_download)
    return _inspect(model_id, path)


def _from_hub(repo_id: str, allow_download: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError:
        raise ModelNotFound(f"model {repo_id!r} is not a demo id, an existing directory or a valid "
                            f"Hugging Face repo id", param="model") from None
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        if not allow_download:
            raise ModelNotFound(
                f"model {repo_id!r} is not in the local Hugging Face cache "
                f"({os.environ.get('HF_HUB_CACHE', '~/.cache/huggingface/hub')}); "
                f"fetch it with `huggingface-cli download {repo_id}`, set {ALLOW_DOWNLOAD_ENV}=1, "
                f"or pass a local directory",
                param="model") from None
    try:
        return Path(snapshot_download(repo_id))
    except Exception as exc:  # network, auth, missing repo: one line for the user
        raise ModelNotFound(f"could not download {repo_id!r}: {exc}", param="model") from None


def _inspect(model_id: str, path: Path) -> ResolvedModel:
    index_file = path / "model_index.json"
    if not index_file.is_file() and (path / "modular_model_index.json").is_file():
        index_file = path / "modular_model_index.json"  # a modular-only repository (MiniMax-H3)
    if not path.is_dir():
        raise CorruptModel(f"model path {path} is not a directory", param="model")
    if not index_file.is_file():
        raise CorruptModel(f"{path} is not a diffusers model directory: model_index.json is missing",
                           param="model")
    try:
        index = json.loads(index_file.read_text())
        class_name = index["_class_name"]
    except (ValueError, KeyError) as exc:
        raise CorruptModel(f"{index_file} is unreadable ({exc.__class__.__name__}: {exc})",
                           param="model") from None
    defaults = {}
    defaults_file = path / demo.DEFAULTS_FILE
    if defaults_file.is_file():
        defaults = json.loads(defaults_file.read_text()).get("defaults", {})
    return ResolvedModel(model_id, path, class_name, defaults, index)

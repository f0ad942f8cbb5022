"""The diffusers skeleton: a Wan2.2 image-to-video directory whose non-transformer
components (tokenizer, text encoder, VAE, scheduler, ...) the assembled model reuses."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import AssemblyError

PIPELINE_CLASS = "WanImageToVideoPipeline"
TRANSFORMERS = ("transformer", "transformer_2")
REQUIRED = ("tokenizer", "text_encoder", "vae", *TRANSFORMERS)


def config_name(component: str) -> str:
    """The file from_pretrained reads first in a component folder."""
    if component.startswith("tokenizer"):
        return "tokenizer_config.json"
    if component.startswith("scheduler"):
        return "scheduler_config.json"
    if component in ("image_processor", "feature_extractor"):
        return "preprocessor_config.json"
    return "config.json"


@dataclass(frozen=True)
class Skeleton:
    root: Path
    model_index: dict
    components: tuple[str, ...]          # every non-null component model_index.json names

    def transformer_class(self, name: str) -> str:
        return self.model_index[name][1]

    def config_file(self, name: str) -> Path:
        return self.root / name / config_name(name)

    def extra_entries(self) -> list[Path]:
        """Top-level entries carried over besides the transformers (components, model_index.json,
        README, ...). Hidden entries (.cache, .gitattributes, build markers) stay behind."""
        return sorted(p for p in self.root.iterdir()
                      if not p.name.startswith(".") and p.name not in TRANSFORMERS)


def load(root: Path) -> Skeleton:
    """Validate a skeleton directory; raise naming the first missing or wrong piece."""
    label = f"--diffusers-skeleton {root}"
    if not root.is_dir():
        raise AssemblyError(f"{label}: not a directory")
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise AssemblyError(f"{label}: model_index.json is missing (not a diffusers directory)")
    try:
        index = json.loads(index_file.read_text())
        class_name = index["_class_name"]
    except (ValueError, KeyError, TypeError) as exc:
        raise AssemblyError(f"{index_file}: unreadable ({exc.__class__.__name__}: {exc})") from None
    if class_name != PIPELINE_CLASS:
        raise AssemblyError(f"{index_file}: names {class_name!r}, not {PIPELINE_CLASS} "
                            f"(a Wan2.2 image-to-video skeleton is needed)")
    components = tuple(name for name, value in index.items()
                       if not name.startswith("_") and isinstance(value, list) and len(value) == 2
                       and value[0] is not None and value[1] is not None)
    for name in REQUIRED:
        if name not in components:
            raise AssemblyError(f"{index_file}: does not list the {name!r} component "
                                f"(Wan2.2 I2V needs {', '.join(REQUIRED)})")
    for name in components:
        folder = root / name
        if not folder.is_dir():
            raise AssemblyError(f"{label}: component folder {name}/ is missing")
        if not (folder / config_name(name)).is_file():
            raise AssemblyError(f"{label}: {name}/{config_name(name)} is missing")
    for name in TRANSFORMERS:
        if index[name][0] != "diffusers":
            raise AssemblyError(f"{index_file}: {name} is {index[name]}, not a diffusers model")
    return Skeleton(root, index, components)

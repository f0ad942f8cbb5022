"""Assemble a Wan2.2 I2V diffusers directory: the skeleton's components plus (optionally)
replacement transformer weights. Everything is validated before anything is written."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import checkpoint, skeleton, writer
from .checkpoint import CANONICAL_INDEX, Checkpoint
from .writer import Step

WEIGHT_FLAGS = {"transformer": "--transformer-weight", "transformer_2": "--transformer-2-weight"}


@dataclass(frozen=True)
class Request:
    skeleton: Path
    output_dir: Path
    weights: dict[str, Path | None]   # component -> replacement weight argument (None: keep)
    asset_mode: str = "symlink"       # "symlink" | "copy"
    overwrite: bool = False


@dataclass(frozen=True)
class Result:
    output_dir: Path
    steps: list[Step]


def run(req: Request) -> Result:
    skel = skeleton.load(req.skeleton)
    ckpts = {name: _checkpoint(skel, name, req.weights.get(name)) for name in skeleton.TRANSFORMERS}
    sources = [skel.root] + [p for c in ckpts.values() for p in (*c.shards, *filter(None, [c.index]))]
    writer.check_output(req.output_dir, req.overwrite, sources)  # cheap refusals before torch loads

    steps = [_carry(entry, req.asset_mode) for entry in skel.extra_entries()]
    for name, ckpt in ckpts.items():
        expected = checkpoint.expected_tensors(skel.config_file(name), skel.transformer_class(name),
                                               f"{req.skeleton}/{name}")
        against = f"{name}/{skel.config_file(name).name} ({skel.transformer_class(name)})"
        by_shard = checkpoint.check(ckpt, expected, against)
        steps += _transformer_steps(name, skel, ckpt, by_shard, req.asset_mode,
                                    replaced=req.weights.get(name) is not None)
    writer.check_space(steps, req.output_dir)
    writer.write(steps, req.output_dir, req.overwrite)
    return Result(req.output_dir, steps)


def _checkpoint(skel: skeleton.Skeleton, name: str, weight: Path | None) -> Checkpoint:
    if weight is not None:
        return checkpoint.resolve(weight, WEIGHT_FLAGS[name])
    return checkpoint.resolve(skel.root / name, "--diffusers-skeleton")


def _carry(entry: Path, mode: str) -> Step:
    # Top-level files (model_index.json, README, defaults) are small: always copied, so the
    # output is a real diffusers directory. Component folders follow the asset mode.
    if entry.is_dir() and mode == "symlink":
        return Step(entry.name, "link", entry, note="linked")
    return Step(entry.name, "copy", entry, note="copied")


def _transformer_steps(name: str, skel: skeleton.Skeleton, ckpt: Checkpoint, by_shard: dict,
                       mode: str, replaced: bool) -> list[Step]:
    origin = f"from {WEIGHT_FLAGS[name]}" if replaced else "from the skeleton"
    config = skel.config_file(name)
    steps = [Step(f"{name}/{config.name}", "copy", config, note="copied from the skeleton")]
    kind = "link" if mode == "symlink" else "copy"
    verb = "linked" if kind == "link" else "copied"
    for shard, canonical in zip(ckpt.shards, ckpt.canonical_names()):
        steps.append(Step(f"{name}/{canonical}", kind, shard,
                          note=f"{verb} {origin} ({len(by_shard[shard])} tensors)"))
    if ckpt.sharded:
        index = json.dumps(ckpt.canonical_index(by_shard), indent=2).encode() + b"\n"
        steps.append(Step(f"{name}/{CANONICAL_INDEX}", "write", data=index,
                          note=f"written ({len(ckpt.shards)} shards, renamed to diffusers' names)"))
    return steps

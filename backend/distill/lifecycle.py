"""The fused-weight lifecycle of one loaded pipeline.

Fusing goes through diffusers itself: ``load_lora_weights`` (its converters read the
lightx2v / Lightning layouts), ``fuse_lora(components=[c])``, then
``unload_lora_weights()`` so no LoRA layer remains and a step costs what a base step
costs. Before a file is fused, the base Linear layers it touches are copied
(``WeightSnapshot`` per layer), so going back to base is a bit-exact copy rather than
``W -= BA*s`` (which drifts in bf16). The snapshot is per layer *object*: PEFT wraps
and unwraps layers without replacing them, so a restore reaches the right tensors
whether or not per-request adapters are wrapped around them at the time.

Checksums of every denoiser are taken before fusing (base) and after (fused). A
restore is verified, by default, against a digest of each touched tensor taken on its
device before the first fuse (``weights.device_digest``: no copy to the CPU); the full
sha256 pass over every weight (27-37 s on real models) runs instead when
``LORA_STUDIO_RESTORE_CHECK=full`` or ``restore(full_check=True)``. Any failure while fusing puts the
model back at base before the error propagates.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..digest import file_sha256
from ..errors import AdapterError, CorruptModel, StudioError
from ..weights import WeightSnapshot, device_digest, digests_equal, module_checksum
from .support import Assignment, plan, support_for

ADAPTER_PREFIX = "distill_"


@dataclass(frozen=True)
class FusedFile:
    path: str
    component: str
    scale: float
    sha256: str
    layers: int  # Linear layers the file's LoRA pairs changed
    keys: dict = field(default_factory=dict)  # the fit report: key kind -> how many keys of it the file has
    deltas: int = 0  # full-tensor deltas applied (diff, diff_b, norm diff, diff_m)
    ignored: list = field(default_factory=list)  # {why, count, keys (first 3)}: keys naming nothing here


@dataclass
class FusedState:
    files: list[FusedFile]
    base_checksums: dict[str, str]
    fused_checksums: dict[str, str]
    fuse_seconds: float
    snapshot_bytes: int
    preset: str | None = None
    scheduler: dict | None = None  # the preset's scheduler while fused: {"class", **config}
    choices: list = field(default_factory=list)  # why each file, where several matched its pattern

    def as_dict(self) -> dict:
        return {"state": "fused", "preset": self.preset, "files": [asdict(f) for f in self.files],
                "scales": [f.scale for f in self.files], "checksums": dict(self.fused_checksums),
                "base_checksums": dict(self.base_checksums), "fuse_seconds": round(self.fuse_seconds, 4),
                "snapshot_bytes": self.snapshot_bytes, "scheduler": self.scheduler,
                "choices": list(self.choices)}


class CheckpointFiles:
    """A component's safetensors checkpoint (single file or sharded), read by tensor name."""

    INDEX = "diffusion_pytorch_model.safetensors.index.json"
    SINGLE = "diffusion_pytorch_model.safetensors"

    def __init__(self, directory: Path):
        import json

        self.directory = Path(directory)
        index = self.directory / self.INDEX
        if index.is_file():
            self.weight_map = {k: self.directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.weight_map = None
            self.single = self.directory / self.SINGLE

    @classmethod
    def find(cls, directory: Path | None) -> "CheckpointFiles | None":
        if directory is None:
            return None
        d = Path(directory)
        return cls(d) if (d / cls.INDEX).is_file() or (d / cls.SINGLE).is_file() else None

    def read(self, key: str) -> torch.Tensor | None:
        from safetensors import safe_open

        path = self.weight_map.get(key) if self.weight_map is not None else self.single
        if path is None:
            return None
        with safe_open(str(path), "pt") as f:
            return f.get_tensor(key) if key in f.keys() else None


class CheckpointCopy:
    """The base of one layer, re-read from the checkpoint on restore: no CPU copy is kept.

    Same interface as ``WeightSnapshot`` (restore, nbytes). Only used after the checkpoint
    has been checked to hold exactly the loaded base tensors (same dtype cast as
    ``from_pretrained``), so a restore from it is bit-exact too.
    """

    def __init__(self, layer: torch.nn.Module, prefix: str, names: list[str], files: CheckpointFiles):
        self.layer, self.prefix, self.names, self.files = layer, prefix, names, files

    @classmethod
    def verified(cls, layer, prefix: str, names: list[str], files: CheckpointFiles) -> "CheckpointCopy | None":
        for n in names:
            current = getattr(layer, n)
            stored = files.read(f"{prefix}.{n}" if prefix else n)
            if stored is None or stored.shape != current.shape or \
                    not torch.equal(stored.to(current.dtype), current.detach().cpu()):
                return None
        return cls(layer, prefix, names, files)

    def restore(self) -> None:
        with torch.no_grad():
            for n in self.names:
                param = getattr(self.layer, n)
                param.data.copy_(self.files.read(f"{self.prefix}.{n}" if self.prefix else n).to(param.dtype))

    def nbytes(self) -> int:
        return 0


# Above this size a component's base is re-read from its checkpoint rather than copied to
# CPU memory (Wan2.2 A14B: ~28 GB per transformer in bf16, nearly all of it touched).
CHECKPOINT_ABOVE_BYTES = 2 * 2**30


def _lora_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)]


class FusedBase:
    """Fuse distill files into a pipeline's denoisers and put the exact base back."""

    def __init__(self, pipeline, class_name: str, denoisers: dict[str, torch.nn.Module],
                 model_dir: Path | None = None, keep: str = "auto"):
        """``keep``: where the base of touched layers is kept for restore: "memory" (CPU
        copies), "checkpoint" (re-read from ``model_dir/<component>``), or "auto" (the
        checkpoint for components over CHECKPOINT_ABOVE_BYTES, else memory)."""
        if keep not in ("auto", "memory", "checkpoint"):
            raise ValueError(f"keep must be auto, memory or checkpoint, not {keep!r}")
        self.support = support_for(class_name)
        self.pipeline = pipeline
        self.class_name = class_name
        self.denoisers = dict(denoisers)
        self._checkpoints: dict[str, CheckpointFiles] = {}
        for name, module in self.denoisers.items():
            files = CheckpointFiles.find(Path(model_dir) / name) if model_dir is not None else None
            big = sum(p.numel() * p.element_size() for p in module.parameters()) > CHECKPOINT_ABOVE_BYTES
            if files is not None and (keep == "checkpoint" or (keep == "auto" and big)):
                self._checkpoints[name] = files
        # (component, layer name) -> how to put that Linear's weight/bias back to base
        self._snapshots: dict[tuple[str, str], WeightSnapshot | CheckpointCopy] = {}
        # (component, layer, "weight"/"bias") -> (base layer, device digest of the base tensor)
        self._digests: dict[tuple[str, str, str], tuple[torch.nn.Module, torch.Tensor]] = {}
        self._base_checksums: dict[str, str] | None = None
        self.fused: FusedState | None = None
        self.preset = None  # the presets.Preset whose contract applies while fused
        self._base_scheduler = None  # the pipeline's own scheduler while a preset's is set

    # -- state --------------------------------------------------------------------------
    def state(self) -> dict:
        if self.fused is None:
            return {"state": "base", "checksums": dict(self._base_checksums or {})}
        return self.fused.as_dict()

    def base_checksums(self) -> dict[str, str]:
        if self._base_checksums is None:
            self._refuse_resident_adapters("record the base")
            self._base_checksums = {n: module_checksum(m) for n, m in self.denoisers.items()}
        return self._base_checksums

    # -- fuse / restore -------------------------------------------------------------------
    def fuse(self, paths, scales=None, preset=None) -> FusedState:
        """Fuse ``paths`` (one per denoiser, in order) into the base; replaces any fused set."""
        assignments = plan(self.class_name, list(self.denoisers), paths, scales)
        self._refuse_resident_adapters("fuse distill files")
        if self.fused is not None:
            self.restore()
        base = self.base_checksums()
        started = time.perf_counter()
        fused_files = []
        try:
            for i, a in enumerate(assignments):
                fused_files.append(self._fuse_one(a, f"{ADAPTER_PREFIX}{i}"))
        except BaseException:
            self._abort()
            raise
        seconds = time.perf_counter() - started
        after = {n: module_checksum(m) for n, m in self.denoisers.items()}
        for f in fused_files:
            if after[f.component] == base[f.component]:
                self._abort()
                raise AdapterError(f"distill file {f.path} did not change {f.component} "
                                   f"(all-zero LoRA or zero scale?)", param="lora_path")
        scheduler = preset.build_scheduler() if getattr(preset, "scheduler", None) else None
        if scheduler is not None:  # the recipe's sampler, for as long as its files are fused
            self._base_scheduler = self.pipeline.scheduler
            self.pipeline.scheduler = scheduler
        self.fused = FusedState(fused_files, dict(base), after, seconds, self.snapshot_bytes(),
                                getattr(preset, "id", None), dict(preset.scheduler) if scheduler is not None else None)
        self.preset = preset
        return self.fused

    def restore(self, verify: bool = True, full_check: bool | None = None) -> None:
        """Back to the exact base weights (no reload); verified unless told not to: by the touched
        tensors' device digests (cheap), or with ``full_check`` (default: $LORA_STUDIO_RESTORE_CHECK
        == "full") by a sha256 of every weight, the larger part of a restore's cost on big models."""
        if self.fused is None:
            return
        self._refuse_resident_adapters("restore the base")
        self._write_back(verify, full_check)
        self._put_back_scheduler()
        self.fused, self.preset = None, None

    def _put_back_scheduler(self) -> None:
        if self._base_scheduler is not None:
            self.pipeline.scheduler, self._base_scheduler = self._base_scheduler, None

    def snapshot_bytes(self) -> int:
        return sum(s.nbytes() for s in self._snapshots.values())

    # -- internals -----------------------------------------------------------------------
    def _fuse_one(self, a: Assignment, adapter: str) -> FusedFile:
        try:
            from safetensors.torch import load_file

            raw = load_file(str(a.path))
        except Exception as exc:
            raise AdapterError(f"cannot read distill file {a.path}: {_one_line(exc)}", param="lora_path") from exc
        module = self.denoisers[a.component]
        lora_part, deltas, kinds, ignored = self._split(a, raw, module)
        layers = self._fuse_lora_pairs(a, adapter, lora_part, module) if lora_part else []
        self._apply_deltas(a, deltas)
        grouped: dict[str, list[str]] = {}
        for k, why in ignored:
            grouped.setdefault(why, []).append(k)
        return FusedFile(str(a.path), a.component, a.scale, file_sha256(a.path), len(layers), kinds, len(deltas),
                         [{"why": why, "count": len(keys), "keys": keys[:3]} for why, keys in grouped.items()])

    def _split(self, a: Assignment, raw: dict, module: torch.nn.Module):
        """Sort the file's keys by kind: LoRA pairs (diffusers fuses them), full-tensor deltas (applied
        here), and keys for a part this model does not have (reported, never silently dropped).
        A key of no known kind, or one naming nothing it could change, is refused by name."""
        from ..lora.convert import KEY_KINDS, classify_wan_key

        names = dict(module.named_modules())
        image_branch = any(n.endswith("attn2.add_k_proj") for n in names)
        wan = self.class_name.startswith("Wan")
        absent = ("CLIP image branch (k_img/v_img/norm_k_img/img_emb): this model has none, as Wan2.2 A14B; "
                  "LightX2V's own loader skips these keys there too")
        lora_part, deltas, ignored = {}, [], []
        kinds = {k: 0 for k in KEY_KINDS}
        for key, tensor in raw.items():
            target = classify_wan_key(key)
            if target.kind == "unknown":
                raise AdapterError(f"distill file {a.path.name}: key {key!r} is of no kind the distill backend "
                                   f"applies ({', '.join(KEY_KINDS)}); refusing it rather than dropping it",
                                   param="lora_path")
            kinds[target.kind] += 1
            if wan and target.image_branch and not image_branch:
                ignored.append((key, absent))
                continue
            if target.kind in ("lora_down", "lora_up", "alpha"):
                lora_part[key] = tensor
                continue
            if not wan:
                raise AdapterError(f"distill file {a.path.name}: key {key!r} is a {target.kind} key; the distill "
                                   f"backend applies those to Wan (lightx2v layout) only, not {self.class_name}",
                                   param="lora_path")
            owner = names.get(target.module) if target.module is not None else None
            param = getattr(owner, target.param, None) if owner is not None else None
            where = ".".join(p for p in (a.component, target.module, target.param) if p)
            if not isinstance(param, torch.Tensor):
                raise AdapterError(f"distill file {a.path.name}: key {key!r} ({target.kind}) names no parameter of "
                                   f"{a.component} (looked for {where}); is it for another model?", param="lora_path")
            if tuple(tensor.shape) != tuple(param.shape):
                raise AdapterError(f"distill file {a.path.name}: key {key!r} ({target.kind}) has shape "
                                   f"{tuple(tensor.shape)}, but {where} is {tuple(param.shape)}", param="lora_path")
            deltas.append((target, owner, tensor))
        paired = {classify_wan_key(k).module for k in lora_part}
        for target, _, _ in deltas:  # LightX2V applies only the pair there; diffusers calls it unexpected
            if target.kind == "diff" and target.module in paired:
                raise AdapterError(f"distill file {a.path.name}: key {target.key!r} is a full weight diff for a layer "
                                   f"that also has a LoRA pair; ambiguous (LightX2V applies only the pair), so "
                                   f"refused", param="lora_path")
        if not lora_part and not deltas:
            raise AdapterError(f"distill file {a.path.name} bound to no layer of {a.component}", param="lora_path")
        return lora_part, deltas, kinds, ignored

    def _fuse_lora_pairs(self, a: Assignment, adapter: str, lora_part: dict, module: torch.nn.Module) -> list:
        """The file's LoRA pairs, through diffusers: its converter, PEFT injection, fuse, unload."""
        pipe = self.pipeline
        try:
            state_dict = pipe.lora_state_dict(lora_part)
        except Exception as exc:
            raise AdapterError(f"cannot read distill file {a.path}: {_one_line(exc)}", param="lora_path") from exc
        if isinstance(state_dict, tuple):  # some mixins return (state_dict, network_alphas)
            state_dict = state_dict[0]
        self._check_binds(a, state_dict, module)
        kwargs = {**self.support.load_kwargs, **self.support.component_kwargs[a.component]}
        try:
            pipe.load_lora_weights(state_dict, adapter_name=adapter, **kwargs)
            layers = [(n, m) for n, m in _lora_layers(module) if adapter in getattr(m, "lora_A", {})]
            if not layers:
                raise AdapterError(f"distill file {a.path.name} bound to no layer of {a.component}",
                                   param="lora_path")
            for name, layer in layers:  # copy the base before anything writes into it
                key = (a.component, name)
                if key not in self._snapshots:
                    self._snapshots[key] = self._keep(a.component, name, layer.get_base_layer())
                    for p in ("weight", "bias"):
                        t = getattr(layer.get_base_layer(), p, None)
                        if t is not None:
                            self._digests[(*key, p)] = (layer.get_base_layer(), device_digest(t))
            pipe.fuse_lora(components=[a.component], lora_scale=a.scale, adapter_names=[adapter])
        except StudioError:
            raise
        except Exception as exc:
            raise AdapterError(f"cannot fuse {a.path.name} into {a.component}: {_one_line(exc)}",
                               param="lora_path") from exc
        finally:
            pipe.unload_lora_weights()  # also on failure: no half-loaded adapter stays behind
        return layers

    def _apply_deltas(self, a: Assignment, deltas: list) -> None:
        """``param += scale * delta`` for each full-tensor key (LightX2V's own rule), after keeping
        the base of every parameter it writes."""
        for target, owner, tensor in deltas:
            key = (a.component, target.module)
            snap = self._snapshots.get(key)
            if snap is None:  # the module's weight and bias too: a later key may write the other one
                names = [n for n in ("weight", "bias") if isinstance(getattr(owner, n, None), torch.Tensor)]
                names += [] if target.param in names else [target.param]
                self._snapshots[key] = self._keep(a.component, target.module, owner, names)
            elif isinstance(snap, WeightSnapshot):
                snap.capture([target.param])
            elif target.param not in snap.names:  # a checkpoint copy of the module's other tensors
                extra = WeightSnapshot(owner)
                extra.capture([target.param])
                self._snapshots[(a.component, f"{target.module}#{target.param}")] = extra
            param = getattr(owner, target.param)
            with torch.no_grad():
                summed = param.detach().float() + a.scale * tensor.to(param.device).float()
                param.data.copy_(summed.to(param.dtype))

    def _keep(self, component: str, name: str, base_layer: torch.nn.Module, names=None):
        names = names or [p for p in ("weight", "bias") if getattr(base_layer, p, None) is not None]
        files = self._checkpoints.get(component)
        if files is not None:
            copy = CheckpointCopy.verified(base_layer, name, names, files)
            if copy is not None:
                return copy
        # no checkpoint, or it does not hold these exact tensors: keep a CPU copy
        snap = WeightSnapshot(base_layer)
        snap.capture(names)
        return snap

    def _check_binds(self, a: Assignment, state_dict: dict, module: torch.nn.Module) -> None:
        """Every LoRA key must name a layer of its component (diffusers only warns)."""
        names = dict(module.named_modules())
        prefixes = tuple(f"{c}." for c in self.denoisers) + ("transformer.",)
        for key in state_dict:
            bare = key
            for p in prefixes:
                if key.startswith(p):
                    bare = key[len(p):]
                    break
            layer = bare.split(".lora_")[0]
            if layer not in names:
                raise AdapterError(f"distill file {a.path.name}: key {key!r} names no layer of {a.component} "
                                   f"({type(module).__name__}); is it for another model?", param="lora_path")

    def _abort(self) -> None:
        """A fuse failed part way: drop LoRA layers and put every touched layer back."""
        if _lora_layers_any(self.denoisers):
            self.pipeline.unload_lora_weights()
        self._write_back()
        self._put_back_scheduler()
        self.fused, self.preset = None, None

    def _write_back(self, verify: bool = True, full_check: bool | None = None) -> None:
        for snap in self._snapshots.values():
            snap.restore()
        if not verify:
            return
        if full_check is None:
            full_check = os.environ.get("LORA_STUDIO_RESTORE_CHECK", "").lower() == "full"
        if not full_check:
            bad = digests_equal({k: d for k, (_, d) in self._digests.items()},
                                {k: getattr(layer, k[2]) for k, (layer, _) in self._digests.items()})
            if bad:
                where = ", ".join(".".join(k) for k in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
                raise CorruptModel(f"restoring the base left {where} different from its digest taken before "
                                   f"fusing; reload the model", param="model")
            return
        base = self.base_checksums()
        now = {n: module_checksum(m) for n, m in self.denoisers.items()}
        bad = [n for n in base if now[n] != base[n]]
        if bad:  # only reachable if something outside this class wrote into base weights
            raise CorruptModel(f"restoring the base left {', '.join(bad)} different from its base checksum; "
                               f"reload the model", param="model")

    def _refuse_resident_adapters(self, what: str) -> None:
        for name, module in self.denoisers.items():
            if _lora_layers(module):
                raise StudioError(f"cannot {what}: per-request LoRA layers are loaded on {name}; "
                                  f"unload them first", param="lora_backend")


def _lora_layers_any(denoisers: dict) -> bool:
    return any(_lora_layers(m) for m in denoisers.values())


def _one_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__

"""Normalising any supported adapter layout to per-module LoRA factors.

Non-diffusers layouts (kohya ``lora_unet_*``, lightx2v/ComfyUI ``diffusion_model.*``,
Qwen's bare keys) go through the pipeline class's own ``lora_state_dict``, which runs
diffusers' converters (``diffusers.loaders.lora_conversion_utils``) and bakes kohya alphas
into the factors. PEFT folders and PEFT dumps only need their ``base_model.model.``
prefix removed. Scales follow peft's rules (``lora_alpha / r``, ``rank_pattern`` and
``alpha_pattern`` matched with peft's own ``get_pattern_key``; rsLoRA uses sqrt(r)).

The result groups factors by the component prefix in the keys (``transformer``,
``transformer_2``, ``text_encoder``...); binding them to modules is ``fit``'s job.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import torch

from ..errors import AdapterError
from .formats import RawAdapter

# the parts of one LoRA layer, as diffusers/peft name them
PARTS = ("lora_A.weight", "lora_B.weight", "lora_B.bias")
# DoRA's magnitude: peft's ``lora_magnitude_vector`` (out,), kohya / LyCORIS's ``dora_scale`` ((out, 1) or (1, in))
DORA_SUFFIXES = (".lora_magnitude_vector", ".lora_magnitude_vector.weight", ".dora_scale")
# the kinds of layer only a merge applies (no low-rank form to add per step), as an error names them
MERGE_ONLY = {"loha": "LyCORIS LoHa", "lokr": "LyCORIS LoKr", "full": "LyCORIS full diff", "dora": "DoRA"}


@dataclass
class LayerFactors:
    """One target layer's factors as stored, with the adapter's own scaling for it."""

    tensors: dict  # part -> tensor, part in PARTS (a LyCORIS layer: its own parts, lycoris.py)
    scaling: float  # lora_alpha / r for this module (1.0 when the file stores none)
    keys: dict  # part -> the key as it will be reported (component-prefixed, diffusers naming)
    kind: str = "lora"  # "dora" (a ``magnitude`` part too), or a LyCORIS kind: "loha", "lokr", "full"
    shape: tuple | None = None  # a LyCORIS layer's delta (out, in), set by lycoris.convert

    @property
    def bias_part(self) -> str:
        """The part added to the layer's bias: LoRA's ``lora_B.bias``, a full diff's ``diff_b``."""
        return "lora_B.bias" if self.kind in ("lora", "dora") else "diff_b"

    def delta_shape(self) -> tuple[int, int]:
        """(out, in): the Linear weight's shape these factors make a delta of."""
        if self.kind in ("lora", "dora"):
            return int(self.tensors["lora_B.weight"].shape[0]), int(self.tensors["lora_A.weight"].shape[1])
        return self.shape


@dataclass
class ConvertedAdapter:
    groups: dict[str, dict[str, LayerFactors]]  # component prefix -> module path -> factors
    unmatched: list[tuple[str, str]] = field(default_factory=list)  # (key, why) kept out of binding
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (key, why) safe to skip

    @property
    def num_keys(self) -> int:
        return sum(len(f.tensors) for g in self.groups.values() for f in g.values()) + len(self.unmatched)


def convert(raw: RawAdapter, pipeline_cls, default_component: str = "transformer",
            denoisers: dict[str, torch.nn.Module] | None = None,
            encoders: dict[str, torch.nn.Module] | None = None) -> ConvertedAdapter:
    """Factors of ``raw`` in diffusers naming, grouped by component. DoRA magnitudes are bound to their
    layers by the denoisers' own names (``denoisers``; without them a DoRA file is refused). Text-encoder
    layers (kohya ``lora_te*_``, diffusers ``text_encoder*.``) are read here against ``encoders``' own
    module names (diffusers' converters for these families drop or mangle them); with no such encoder
    they are reported unmatched, by name."""
    rec = raw.record
    tensors = dict(raw.tensors)
    names = ModuleNames(denoisers or {}, default_component, encoders)
    magnitudes = {k: tensors.pop(k) for k in list(tensors) if k.endswith(DORA_SUFFIXES)}
    if not magnitudes and (rec.peft_config or {}).get("use_dora"):
        raise AdapterError(f"{rec.path}: use_dora=true in adapter_config.json but no lora_magnitude_vector keys",
                           param="lora_path")
    if magnitudes and denoisers is None:
        _refuse_dora(rec, magnitudes)
    ignored: list[tuple[str, str]] = []
    unmatched: list[tuple[str, str]] = []
    configs: dict[str, dict] = {}
    encoder_keys: dict = {}

    if rec.format in ("peft", "peft-dump"):
        sd = {}
        for key, t in tensors.items():
            k = key.removeprefix("base_model.model.").replace(".lora_A.default.", ".lora_A.")
            k = k.replace(".lora_B.default.", ".lora_B.")
            sd[k] = t
        if not any(k.split(".", 1)[0] == default_component for k in sd):
            # a folder saved from the denoiser itself carries no component prefix
            sd = {f"{default_component}.{k}": v for k, v in sd.items()}
        if rec.peft_config is not None:
            configs = {default_component: rec.peft_config}
    else:
        configs = _configs_from_metadata(rec.metadata)
        encoder_keys = {k: tensors.pop(k) for k in list(tensors) if encoder_of(k) is not None}
        if rec.format == "lightx2v":
            tensors = _drop_norm_diffs(tensors, ignored, unmatched)
        sd = {}
        if tensors or not encoder_keys:
            try:
                sd = pipeline_cls.lora_state_dict(tensors)
            except Exception as exc:  # noqa: BLE001 - the converters raise ValueError/KeyError/IndexError
                detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else exc.__class__.__name__
                raise AdapterError(f"{rec.file}: diffusers' {pipeline_cls.__name__} converter could not read this "
                                   f"{rec.format} LoRA ({detail})", param="lora_path") from None
            if isinstance(sd, tuple):  # some loaders also return network alphas
                sd = sd[0]

    groups: dict[str, dict[str, LayerFactors]] = {}
    parts: dict[tuple[str, str], dict] = {}
    for key, t in sd.items():
        split = _split_key(key)
        if split is None:
            unmatched.append((key, "not a LoRA factor (expected <module>.lora_A.weight / lora_B.weight / lora_B.bias)"))
            continue
        comp, module, part = split
        parts.setdefault((comp, module), {})[part] = t
    for (comp, module), found in parts.items():
        if "lora_A.weight" not in found or "lora_B.weight" not in found:
            have = ", ".join(sorted(found))
            for part in found:
                unmatched.append((f"{comp}.{module}.{part}", f"incomplete layer: only {have}"))
            continue
        r = int(found["lora_A.weight"].shape[0])
        config_r = _config_rank(configs.get(comp), module)
        if config_r is not None and config_r != r:
            for part in found:
                unmatched.append((f"{comp}.{module}.{part}",
                                  f"rank mismatch: the config says r={config_r}, lora_A has {r} rows"))
            continue
        scaling = _scaling(configs.get(comp), module, r)
        groups.setdefault(comp, {})[module] = LayerFactors(
            tensors=found, scaling=scaling, keys={p: f"{comp}.{module}.{p}" for p in found})
    if rec.format not in ("peft", "peft-dump") and encoder_keys:
        _encoder_layers(encoder_keys, names, configs, groups, unmatched)
    if magnitudes:
        _bind_magnitudes(magnitudes, groups, unmatched, names)
    return ConvertedAdapter(groups=groups, unmatched=unmatched, ignored=ignored)


# -- text-encoder layers ----------------------------------------------------------------------------
# kohya sd-scripts names a text encoder's layers ``lora_te_`` (one encoder: SD1.x), ``lora_te1_`` /
# ``lora_te2_`` (SDXL; SD3's CLIP-L / CLIP-G) and ``lora_te3_`` (SD3's T5), the module path with dots as
# ``_`` (sd-scripts networks/lora.py, lora_sd3.py); diffusers' save_lora_weights writes ``text_encoder.``,
# ``text_encoder_2.``, ``text_encoder_3.`` and the module path dotted. The longest prefix is tried first.
KOHYA_ENCODERS = (("lora_te1_", "text_encoder"), ("lora_te2_", "text_encoder_2"), ("lora_te3_", "text_encoder_3"),
                  ("lora_te_", "text_encoder"))
ENCODER_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
# a text-encoder layer's LoRA parts (kohya's and diffusers' names) -> diffusers' part
_ENCODER_PARTS = ((".lora_down.weight", "lora_A.weight"), (".lora_up.weight", "lora_B.weight"),
                  (".lora_A.weight", "lora_A.weight"), (".lora_B.weight", "lora_B.weight"),
                  (".lora_B.bias", "lora_B.bias"), (".alpha", "alpha"))


def encoder_of(key: str) -> tuple[str, str] | None:
    """(text-encoder component, the rest of the key) when ``key`` names a text-encoder layer, else None."""
    for prefix, comp in KOHYA_ENCODERS:
        if key.startswith(prefix):
            return comp, key[len(prefix):]
    head, dot, rest = key.partition(".")
    if dot and head in ENCODER_COMPONENTS:
        return head, rest
    return None


def _encoder_layers(tensors: dict, names: "ModuleNames", configs: dict, groups: dict, unmatched: list) -> None:
    """Text-encoder keys -> ``LayerFactors`` under the encoder's component (kohya's ``alpha / rank`` or
    the saved config's scale, 1 without either, as for the denoisers' layers)."""
    found: dict[tuple[str, str], dict] = {}
    alphas: dict[tuple[str, str], float] = {}
    for key, t in tensors.items():
        part = next(((suffix, p) for suffix, p in _ENCODER_PARTS if key.endswith(suffix)), None)
        if part is None:
            unmatched.append((key, "not a LoRA part of a text-encoder layer (lora_down / lora_up / alpha or "
                                   "lora_A / lora_B)"))
            continue
        where = names.locate(key[: -len(part[0])])
        if isinstance(where, str):
            unmatched.append((key, where))
            continue
        if part[1] == "alpha":
            alphas[where] = float(t)
        else:
            found.setdefault(where, {})[part[1]] = (key, t)
    for (comp, module), parts in found.items():
        if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
            have = ", ".join(sorted(parts))
            unmatched += [(key, f"incomplete layer: only {have}") for key, _ in parts.values()]
            continue
        r = int(parts["lora_A.weight"][1].shape[0])
        alpha = alphas.get((comp, module))
        scaling = alpha / r if alpha is not None and r else _scaling(configs.get(comp), module, r)
        groups.setdefault(comp, {})[module] = LayerFactors(
            tensors={p: t for p, (_, t) in parts.items()}, scaling=scaling,
            keys={p: key for p, (key, _) in parts.items()})


def _bind_magnitudes(magnitudes: dict, groups: dict, unmatched: list, names: "ModuleNames") -> None:
    """Make each layer a DoRA magnitude names a ``dora`` layer: its LoRA factors plus the magnitude, kept
    2-D as the norm it scales is taken: (out, 1) per output row (peft's vector, LyCORIS ``wd_on_out``),
    (1, in) per input column (kohya / LyCORIS's default)."""
    for key, m in magnitudes.items():
        head = key[: -len(next(s for s in DORA_SUFFIXES if key.endswith(s)))]
        where = names.locate(head)
        if isinstance(where, str):
            unmatched.append((key, where))
            continue
        comp, module = where
        f = groups.get(comp, {}).get(module)
        if f is None:
            unmatched.append((key, "a DoRA magnitude with no LoRA factors on its layer"))
            continue
        f.kind = "dora"
        f.tensors["magnitude"] = m.reshape(-1, 1) if m.dim() == 1 else m
        f.keys["magnitude"] = key


def _split_key(key: str):
    for part in PARTS:
        suffix = "." + part
        if key.endswith(suffix):
            head = key[: -len(suffix)]
            if "." not in head:
                return None
            comp, module = head.split(".", 1)
            return comp, module, part
    return None


def _refuse_dora(rec, tensors) -> None:
    dora = [k for k in tensors if "dora_scale" in k or "lora_magnitude_vector" in k]
    if dora or (rec.peft_config or {}).get("use_dora"):
        where = f"key {dora[0]!r}" if dora else "use_dora=true in adapter_config.json"
        raise AdapterError(f"{rec.path}: DoRA adapters are not supported by the merge engine ({where})",
                           param="lora_path")


def _drop_norm_diffs(tensors: dict, ignored: list, unmatched: list) -> dict:
    """lightx2v/ComfyUI files carry `.diff` keys that diffusers' converter drops.

    Norm diffs are zero in published files, so skipping them changes nothing; we check
    that rather than assume it. Other full-weight `.diff` keys would be silently lost
    by the converter, so they are reported as unmatched instead.
    """
    kept = {}
    for key, t in tensors.items():
        if key.endswith((".diff", ".diff_b")) and "norm" in key:
            if bool((t == 0).all()):
                ignored.append((key, "zero norm diff (dropped by diffusers' converter; no effect)"))
            else:
                unmatched.append((key, "non-zero norm diff: not applied by diffusers' converter"))
            continue
        if key.endswith(".diff") and not key.startswith("diffusion_model.head.head"):
            unmatched.append((key, "full-weight .diff key: not applied by diffusers' converter"))
            continue
        if key.endswith(".diff_m"):
            unmatched.append((key, "modulation delta (diff_m): not applied by diffusers' converter "
                                   "(the distill backend applies it)"))
            continue
        kept[key] = t
    return kept


def _configs_from_metadata(metadata: dict) -> dict[str, dict]:
    """diffusers' save_lora_weights stores the LoraConfig per component as `comp.field`."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        flat = json.loads(raw)
    except ValueError:
        return {}
    out: dict[str, dict] = {}
    for key, value in flat.items():
        if "." in key:
            comp, name = key.split(".", 1)
            out.setdefault(comp, {})[name] = value
    return out


_LITERAL_PATH = re.compile(r"\w+(?:\\?\.\w+)*")  # a module path, its dots escaped or not


class PatternMap(dict):
    r"""peft's ``rank_pattern`` / ``alpha_pattern``, looked up as peft's ``get_pattern_key`` does (the first
    key, in order, matching the module as ``(.*\.)?(key)$``). peft tries every key's regex for every module:
    a file with a pattern per layer (diffusers' metadata of a 1,000-layer model, our exports) would take
    n^2 regex matches. When every key is a literal module path (dots escaped or not, as peft, diffusers and
    our export write them) the match is a dotted suffix of the module: found here by looking up the
    module's suffixes (a handful), the earliest key in order winning as in peft. Any other key: peft's own
    function."""

    _index: dict | None = None
    _literal: bool | None = None

    def lookup(self, module: str, default):
        if not self:
            return default
        if self._literal is None:
            self._literal = all(isinstance(k, str) and _LITERAL_PATH.fullmatch(k) for k in self)
            if self._literal:
                index: dict[str, tuple[int, str]] = {}
                for i, k in enumerate(self):
                    index.setdefault(k.replace("\\.", "."), (i, k))
                self._index = index
        if not self._literal:
            from peft.utils.other import get_pattern_key

            return self.get(get_pattern_key(self.keys(), module), default)
        parts = module.split(".")
        found = [self._index[s] for s in (".".join(parts[i:]) for i in range(len(parts))) if s in self._index]
        return self[min(found)[1]] if found else default


def _patterns(config: dict, field: str) -> PatternMap:
    value = config.get(field) or {}
    if not isinstance(value, PatternMap):
        value = config[field] = PatternMap(value)  # built once per config, looked up once per module
    return value


def _config_rank(config: dict | None, module: str) -> int | None:
    if not config or "r" not in config:
        return None
    return int(_patterns(config, "rank_pattern").lookup(module, config["r"]))


def _scaling(config: dict | None, module: str, r_stored: int) -> float:
    """peft's LoRA scale for one module: alpha / r (or alpha / sqrt(r) with rsLoRA)."""
    if not config:
        return 1.0  # diffusers' convention for files without alphas (kohya alphas are already baked in)
    r = _patterns(config, "rank_pattern").lookup(module, config.get("r", r_stored))
    alpha = _patterns(config, "alpha_pattern").lookup(module, config.get("lora_alpha", r))
    if config.get("use_rslora"):
        return float(alpha) / math.sqrt(float(r))
    return float(alpha) / float(r)


# -- lightx2v / ComfyUI key kinds (Wan) --------------------------------------------------------
# Published lightx2v Wan distill files carry, beside ``lora_down.weight`` / ``lora_up.weight`` /
# ``alpha``, full-tensor deltas that diffusers' converter drops or only partly applies:
#   ``<linear>.diff``    a full weight delta          ``<linear>.diff_b``  a bias delta
#   ``<norm>.diff``      a delta on the norm's weight  ``blocks.N.diff_m`` a delta on the block's
#                                                      modulation table (diffusers: scale_shift_table)
# LightX2V itself applies every one as ``param += delta * strength`` (its lora_adapter).
KEY_KINDS = ("lora_down", "lora_up", "alpha", "diff", "diff_b", "norm diff", "diff_m")

# original Wan module path (under blocks.N. or top level) -> diffusers module path
_WAN_BLOCK_MODULES = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0", "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2", "norm3": "norm2",  # Wan's norm3 is diffusers' norm2
}
_WAN_TOP_MODULES = {
    "head.head": "proj_out", "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
_WAN_BLOCK_ORIGINALS = {v: k for k, v in _WAN_BLOCK_MODULES.items()}
_WAN_TOP_ORIGINALS = {v: k for k, v in _WAN_TOP_MODULES.items()}
# the CLIP image branch: Wan2.1 I2V has it, Wan2.2 A14B does not (lightx2v's Wan2.2 I2V files still
# carry keys for it, which LightX2V's own loader skips there as naming no parameter)
IMAGE_BRANCH = ("cross_attn.k_img", "cross_attn.v_img", "cross_attn.norm_k_img", "img_emb.")


@dataclass(frozen=True)
class KeyTarget:
    """What one key of a lightx2v Wan file is, and which diffusers parameter it changes."""

    key: str
    kind: str  # one of KEY_KINDS
    module: str | None  # diffusers module path (None: the key names no known Wan module)
    param: str  # parameter of that module: weight, bias or scale_shift_table
    image_branch: bool = False


def wan_module(original: str) -> str | None:
    """Diffusers module path for an original Wan module path (``blocks.3.self_attn.q`` ...)."""
    if original.startswith("blocks."):
        _, n, rest = original.split(".", 2)
        mapped = _WAN_BLOCK_MODULES.get(rest)
        return f"blocks.{n}.{mapped}" if mapped else None
    return _WAN_TOP_MODULES.get(original)


def wan_original(module: str) -> str | None:
    """Wan's original module path for a diffusers one (``wan_module`` backwards): how musubi-tuner and
    ComfyUI name it."""
    if module.startswith("blocks."):
        _, n, rest = module.split(".", 2)
        original = _WAN_BLOCK_ORIGINALS.get(rest)
        return f"blocks.{n}.{original}" if original else None
    return _WAN_TOP_ORIGINALS.get(module)


def classify_wan_key(key: str) -> KeyTarget:
    """The kind of ``key`` (``diffusion_model.`` prefix optional) and the parameter it targets."""
    bare = key.removeprefix("diffusion_model.")
    for suffix, kind, param in ((".lora_down.weight", "lora_down", "weight"), (".lora_up.weight", "lora_up", "weight"),
                                (".lora_A.weight", "lora_down", "weight"), (".lora_B.weight", "lora_up", "weight"),
                                (".alpha", "alpha", "weight"), (".diff_b", "diff_b", "bias"),
                                (".diff_m", "diff_m", "scale_shift_table"), (".diff", "diff", "weight")):
        if bare.endswith(suffix):
            original = bare[: -len(suffix)]
            break
    else:
        return KeyTarget(key, "unknown", None, "")
    image = any(p in original for p in IMAGE_BRANCH)
    if kind == "diff_m":  # blocks.N.diff_m -> blocks.N.scale_shift_table; head.diff_m -> scale_shift_table
        if original.startswith("blocks.") and original.count(".") == 1:
            return KeyTarget(key, kind, original, param)
        return KeyTarget(key, kind, "" if original == "head" else None, param)
    module = wan_module(original)
    if kind == "diff" and "norm" in original.rsplit(".", 1)[-1]:
        kind = "norm diff"
    return KeyTarget(key, kind, module, param, image)


# -- module names as the layouts spell them ------------------------------------------------------------
# module-name prefixes, after any component prefix (``transformer.``): peft dumps, ComfyUI, LyCORIS / kohya
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "lycoris_", "lora_unet_",
             "lora_transformer_", "unet.")


class ModuleNames:
    """A key's module part -> (component, diffusers module path) of a Linear layer, from the denoisers'
    own names: dotted as they are, with dots written as ``_`` (kohya, LyCORIS), or Wan's original names
    (ComfyUI); a text-encoder key (``encoder_of``) from that encoder's names (``encoders``)."""

    def __init__(self, denoisers: dict[str, torch.nn.Module], default: str,
                 encoders: dict[str, torch.nn.Module] | None = None):
        self.denoisers = denoisers
        self.encoders = dict(encoders or {})
        self.default = default if default in denoisers or not denoisers else next(iter(denoisers))
        self.components = sorted(denoisers, key=len, reverse=True)  # transformer_2 before transformer
        self._maps: dict[str, tuple[set, dict]] = {}

    def _names(self, comp: str) -> tuple[set, dict]:
        if comp not in self._maps:
            module = self.denoisers.get(comp, self.encoders.get(comp))
            if module is None:
                module = self.denoisers.get(self.default)
            dotted = set() if module is None else \
                {n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
            underscored: dict[str, list[str]] = {}
            for n in dotted:
                underscored.setdefault(n.replace(".", "_"), []).append(n)
            self._maps[comp] = (dotted, underscored)
        return self._maps[comp]

    def locate(self, head: str):
        """(component, module), or why the key names none (a string)."""
        encoder = encoder_of(head)
        if encoder is not None:
            comp, name = encoder
            if comp not in self.encoders:
                have = ", ".join(self.encoders) or "none this model's adapters may change"
                return f"a layer of {comp} (a text encoder; text encoders here: {have})"
            return self._lookup(comp, name.removeprefix("base_model.model."), wan=False)
        name, comp = head, self.default
        for c in self.components:
            if name.startswith(c + "."):
                comp, name = c, name[len(c) + 1:]
                break
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        return self._lookup(comp, name)

    def _lookup(self, comp: str, name: str, wan: bool = True):
        """(comp, module) for a module name as dotted, underscored or (``wan``) Wan's original; else why not."""
        dotted, underscored = self._names(comp)
        if name in dotted:
            return comp, name
        hits = underscored.get(name, [])
        if len(hits) == 1:
            return comp, hits[0]
        if hits:
            return f"{name!r} could be any of {', '.join(sorted(hits)[:3])}"
        original = wan_module(name) if wan else None  # ComfyUI keeps Wan's original module names
        if original is not None and original in dotted:
            return comp, original
        return f"no Linear layer {name[:120]!r} in {comp}"

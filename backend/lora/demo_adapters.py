"""The demo adapter library: LoRAs for the demo models, in the layouts people publish.

demo:qwen-image's four are trained (``python -m backend.demo.train loras``, backend/demo/loras.py):
``demo-grayscale`` (a PEFT folder), ``demo-inverted`` (kohya), ``demo-outline`` (diffusers) and
``demo-nine`` (ComfyUI), copied from ``backend/demo/weights/qwen-image-loras/``. The other demo
models' adapters are still seeded random deltas (their models are not trained yet), each file
written by the tool its publishers use, so reading them exercises the same code paths as real
downloads:

- PEFT folders: peft's own ``PeftModel.save_pretrained`` (adapter_config.json +
  adapter_model.safetensors), target_modules as a list or as a regex string;
- diffusers files: the pipeline's own ``save_lora_weights`` (with diffusers'
  ``lora_adapter_metadata``);
- a PEFT dump: ``get_peft_model_state_dict`` saved as one file (``base_model.model.*``);
- kohya / musubi-tuner files: ``lora_unet_*`` with ``lora_down``/``lora_up``/``.alpha`` and
  ``ss_*`` metadata;
- lightx2v / ComfyUI files: ``diffusion_model.*`` with ``.alpha``, ``.diff_b`` and zero norm
  ``.diff`` keys, including a Wan2.2 high/low-noise pair.

``ensure(data_dir)`` writes them once under ``<data-dir>/demo/adapters/`` (same seed, same
bytes) and returns that folder: the demo root, an adapter root only while a demo model is
served (``settings.adapter_roots(demo=True)``), never the user's library ``<data-dir>/adapters``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from .. import settings

VERSION = 6  # 6: demo:qwen-image's adapters are the trained demo LoRAs
MARKER = settings.DEMO_ADAPTERS_MARKER


@dataclass(frozen=True)
class DemoAdapter:
    model: str  # demo model id it is made for
    relpath: str  # under <data-dir>/demo/adapters/
    writer: str  # function name in this module
    rank: int = 4
    alpha: float | None = None
    amplitude: float = 0.5  # size of the delta relative to the layer's weight scale


DEMO_ADAPTERS: tuple[DemoAdapter, ...] = (
    DemoAdapter("demo:sd3.5", "sd3.5/sd35-cheesecake-peft", "write_peft_folder", rank=4, alpha=8),
    DemoAdapter("demo:sd3.5", "sd3.5/sd35-watercolor.safetensors", "write_diffusers_file", rank=8, alpha=8),
    DemoAdapter("demo:sd3.5", "sd3.5/sd35-sketch-peft-dump.safetensors", "write_peft_dump", rank=4),
    # trained (backend/demo/loras.py): copied as written there
    DemoAdapter("demo:qwen-image", "qwen-image/demo-grayscale", "copy_trained"),
    DemoAdapter("demo:qwen-image", "qwen-image/demo-inverted.safetensors", "copy_trained"),
    DemoAdapter("demo:qwen-image", "qwen-image/demo-outline.safetensors", "copy_trained"),
    DemoAdapter("demo:qwen-image", "qwen-image/demo-nine.safetensors", "copy_trained"),
    DemoAdapter("demo:wan2.1-t2v", "wan2.1-t2v/wan21-t2v-lightx2v-demo.safetensors", "write_lightx2v", rank=4,
                alpha=4, amplitude=1.5),
    DemoAdapter("demo:wan2.1-t2v", "wan2.1-t2v/wan21-t2v-musubi-demo.safetensors", "write_musubi_wan", rank=4,
                alpha=2, amplitude=1.5),
    DemoAdapter("demo:wan2.2-t2v", "wan2.2-t2v/wan22-t2v-lightx2v-high.safetensors", "write_lightx2v", rank=4,
                alpha=4, amplitude=1.5),
    DemoAdapter("demo:wan2.2-t2v", "wan2.2-t2v/wan22-t2v-lightx2v-low.safetensors", "write_lightx2v", rank=4,
                alpha=4, amplitude=1.5),
    DemoAdapter("demo:wan2.2-i2v", "wan2.2-i2v/wan22-i2v-lightx2v-high.safetensors", "write_lightx2v", rank=4,
                alpha=4, amplitude=1.5),
    DemoAdapter("demo:wan2.2-i2v", "wan2.2-i2v/wan22-i2v-lightx2v-low.safetensors", "write_lightx2v", rank=4,
                alpha=4, amplitude=1.5),
)



def ensure(data_dir=None) -> Path:
    """Write the demo adapter library once; return ``<data-dir>/demo/adapters``."""
    root = settings.demo_adapters_dir(data_dir)
    root.parent.mkdir(parents=True, exist_ok=True)
    marker = root / MARKER
    if _current(marker):
        return root
    with FileLock(str(root) + ".lock"):
        if _current(marker):
            return root
        tmp = Path(tempfile.mkdtemp(prefix="adapters.", dir=root.parent))
        try:
            for spec in DEMO_ADAPTERS:
                out = tmp / spec.relpath
                out.parent.mkdir(parents=True, exist_ok=True)
                write(spec, out, data_dir)
            (tmp / MARKER).write_text(json.dumps(_marker()))
            if root.exists():
                shutil.rmtree(root)
            os.replace(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return root


def write(spec: DemoAdapter, out: Path, data_dir=None) -> None:
    """Write one demo adapter, byte for byte the same on every run."""
    globals()[spec.writer](spec, out, data_dir)
    for f in ([out / "adapter_model.safetensors"] if out.is_dir() else [out]):
        canonical_header(f)
    config = out / "adapter_config.json"
    if config.is_file():  # peft writes its target_modules set in hash order
        data = json.loads(config.read_text())
        if isinstance(data.get("target_modules"), list):
            data["target_modules"] = sorted(data["target_modules"])
        config.write_text(json.dumps(data, indent=2, sort_keys=True))


def canonical_header(file: Path) -> None:
    """safetensors writes ``__metadata__`` in hash-map order; sort it so the bytes (and sha256) repeat.

    The sorted header has the same length, so tensor offsets do not move.
    """
    import struct

    with open(file, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        meta = header.pop("__metadata__", None)
        ordered = ({"__metadata__": dict(sorted(meta.items()))} if meta else {}) | header
        text = json.dumps(ordered, separators=(",", ":")).encode()
        if len(text) > n:
            raise RuntimeError(f"{file}: canonical header longer than the original")
        fh.seek(8)
        fh.write(text + b" " * (n - len(text)))


def _marker() -> dict:
    """What the library was built from: this module's version and the trained files' digest (retrained
    LoRAs rebuild the copy)."""
    from ..demo import LORAS_DIR, _digest

    return {"version": VERSION, "trained": _digest(LORAS_DIR)}


def _current(marker: Path) -> bool:
    try:
        return json.loads(marker.read_text()) == _marker()
    except (OSError, ValueError):
        return False


# -- building blocks ---------------------------------------------------------------------------
def _denoiser(model: str, data_dir, component: str = "transformer"):
    import diffusers

    from .. import demo

    path = demo.ensure(model, data_dir) / component
    cls_name = json.loads((path / "config.json").read_text())["_class_name"]
    import torch

    # fp32 whatever the stored dtype (the trained demo weights ship in fp16): the adapters are made in fp32
    return getattr(diffusers, cls_name).from_pretrained(path, torch_dtype=torch.float32)


def _pipeline_cls(model: str, data_dir):
    import diffusers

    from .. import demo

    index = json.loads((demo.ensure(model, data_dir) / "model_index.json").read_text())
    return getattr(diffusers, index["_class_name"])


def _generator(spec: DemoAdapter):
    import torch

    return torch.Generator().manual_seed(zlib.crc32(spec.relpath.encode()))


def _factors(spec: DemoAdapter, gen, in_features: int, out_features: int):
    """Seeded (down, up) with delta B@A about `amplitude` times a default-init weight's scale."""
    import torch

    r = spec.rank
    down = torch.randn(r, in_features, generator=gen) / in_features ** 0.5
    up = torch.randn(out_features, r, generator=gen) * spec.amplitude / r ** 0.5
    return down.contiguous(), up.contiguous()


def _linears(module, suffixes) -> dict:
    import torch

    return {n: m for n, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and n.endswith(tuple(suffixes))}


def _fill_peft(peft_model, spec: DemoAdapter) -> None:
    """Give every LoRA layer seeded, non-zero factors (peft initialises B to zero)."""
    import torch

    gen = _generator(spec)
    with torch.no_grad():
        for name, module in sorted(peft_model.named_modules()):
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                a, b = module.lora_A["default"], module.lora_B["default"]
                down, up = _factors(spec, gen, a.in_features, b.out_features)
                a.weight.copy_(down[: a.out_features])
                b.weight.copy_(up[:, : b.in_features])


def _peft_folder(spec: DemoAdapter, out: Path, data_dir, target_modules, rank_pattern=None) -> None:
    from peft import LoraConfig, get_peft_model

    transformer = _denoiser(spec.model, data_dir)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha or spec.rank, target_modules=target_modules,
                        rank_pattern=rank_pattern or {}, init_lora_weights=True)
    peft_model = get_peft_model(transformer, config)
    _fill_peft(peft_model, spec)
    peft_model.peft_config["default"].base_model_name_or_path = spec.model
    with warnings.catch_warnings():  # peft looks for a hub config under base_model_name_or_path
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(str(out))


# -- writers (referenced by name in DEMO_ADAPTERS) -------------------------------------------
def copy_trained(spec: DemoAdapter, out: Path, data_dir) -> None:
    """A trained demo LoRA, copied from where ``python -m backend.demo.train loras`` wrote it."""
    from ..demo import LORAS_DIR

    src = LORAS_DIR / Path(spec.relpath).name
    if not src.exists():
        raise FileNotFoundError(f"the trained demo LoRA {src} is missing; run python -m backend.demo.train loras")
    if src.is_dir():
        shutil.copytree(src, out)
    else:
        shutil.copyfile(src, out)


def write_peft_folder(spec: DemoAdapter, out: Path, data_dir) -> None:
    _peft_folder(spec, out, data_dir, ["to_q", "to_k", "to_v", "to_out.0"])


def write_peft_dump(spec: DemoAdapter, out: Path, data_dir) -> None:
    """What `save_file(get_peft_model_state_dict(model))` of a PeftModel leaves: base_model.model.* keys."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    transformer = _denoiser(spec.model, data_dir)
    peft_model = get_peft_model(transformer, LoraConfig(r=spec.rank, lora_alpha=spec.rank,
                                                        target_modules=["ff.net.0.proj", "ff.net.2"]))
    _fill_peft(peft_model, spec)
    state = get_peft_model_state_dict(peft_model)
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(out), metadata={"format": "pt"})


def write_diffusers_file(spec: DemoAdapter, out: Path, data_dir) -> None:
    """The pipeline's own save_lora_weights, from a transformer carrying a diffusers (peft) adapter."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = _denoiser(spec.model, data_dir)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha or spec.rank,
                        target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=True)
    transformer.add_adapter(config)
    _fill_peft(transformer, spec)
    layers = get_peft_model_state_dict(transformer)
    _pipeline_cls(spec.model, data_dir).save_lora_weights(
        str(out.parent), transformer_lora_layers=layers, weight_name=out.name,
        transformer_lora_adapter_metadata={**config.to_dict(), "target_modules": sorted(config.target_modules)})


_WAN_MAP = {  # diffusers module -> original Wan (lightx2v / musubi) module
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}


def _wan_layers(transformer):
    out = []
    for name, lin in sorted(_linears(transformer, tuple(_WAN_MAP)).items()):
        block, rest = name.split(".", 2)[1], name.split(".", 2)[2]
        out.append((int(block), _WAN_MAP[rest], lin))
    return out


def write_lightx2v(spec: DemoAdapter, out: Path, data_dir) -> None:
    """lightx2v / ComfyUI layout: diffusion_model.blocks.N.self_attn.q.lora_down/up, .alpha, .diff_b,
    plus the zero norm .diff keys real files carry."""
    import torch
    from safetensors.torch import save_file

    transformer = _denoiser(spec.model, data_dir)
    gen = _generator(spec)
    tensors = {}
    for block, orig, lin in _wan_layers(transformer):
        key = f"diffusion_model.blocks.{block}.{orig}"
        down, up = _factors(spec, gen, lin.in_features, lin.out_features)
        tensors[f"{key}.lora_down.weight"] = down
        tensors[f"{key}.lora_up.weight"] = up
        tensors[f"{key}.alpha"] = torch.tensor(float(spec.alpha))
        tensors[f"{key}.diff_b"] = torch.randn(lin.out_features, generator=gen) * 0.02
    blocks = sorted({b for b, _, _ in _wan_layers(transformer)})
    dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    for block in blocks:
        tensors[f"diffusion_model.blocks.{block}.norm3.diff"] = torch.zeros(dim)
        tensors[f"diffusion_model.blocks.{block}.norm3.diff_b"] = torch.zeros(dim)
        tensors[f"diffusion_model.blocks.{block}.self_attn.norm_q.diff"] = torch.zeros(dim)
    save_file(tensors, str(out), metadata={"format": "pt", "lightx2v.demo_for": spec.model})


def write_musubi_wan(spec: DemoAdapter, out: Path, data_dir) -> None:
    """musubi-tuner (kohya) layout for Wan: lora_unet_blocks_N_self_attn_q.lora_down.weight, .alpha."""
    import torch
    from safetensors.torch import save_file

    transformer = _denoiser(spec.model, data_dir)
    gen = _generator(spec)
    tensors = {}
    for block, orig, lin in _wan_layers(transformer):
        flat = f"lora_unet_blocks_{block}_{orig.replace('.', '_')}"
        down, up = _factors(spec, gen, lin.in_features, lin.out_features)
        tensors[f"{flat}.lora_down.weight"] = down
        tensors[f"{flat}.lora_up.weight"] = up
        tensors[f"{flat}.alpha"] = torch.tensor(float(spec.alpha))
    save_file(tensors, str(out), metadata={
        "ss_network_module": "networks.lora_wan", "ss_network_dim": str(spec.rank),
        "ss_network_alpha": str(spec.alpha), "ss_base_model_version": "wan21_t2v_14b",
        "modelspec.architecture": "wan2.1-t2v-14b/lora"})




def for_model(model: str, data_dir=None) -> list[Path]:
    """Paths of the demo adapters made for one demo model."""
    root = ensure(data_dir)
    return [root / s.relpath for s in DEMO_ADAPTERS if s.model == model]

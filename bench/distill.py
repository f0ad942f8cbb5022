"""Fuse / restore time per demo model and for a synthetic Wan transformer, against
reloading from disk (the alternative way back to an exact base).

    python -m bench.distill [--device cpu|cuda] [--dtype float32|bfloat16] [--repeat N]
                                    [--models demo:qwen-image ...] [--no-synthetic]

Columns: fuse = load the file(s), fuse, drop LoRA layers, checksum before/after;
restore = copy the kept base tensors back and verify the base checksum; checksum =
one sha256 pass over the denoisers (part of both); reload = the alternative,
``from_pretrained`` of the denoiser(s) from disk and moving them to the device.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

SYNTHETIC = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=64, in_channels=16,
                 out_channels=16, text_dim=768, freq_dim=256, ffn_dim=3072, num_layers=4,
                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
SYNTHETIC_RANK = 64  # lightx2v's published rank


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _touch(module: torch.nn.Module) -> torch.nn.Module:
    """Read every weight once: on CPU, from_pretrained maps the file lazily (mmap), so an
    untouched reload would not have read anything yet."""
    for p in module.parameters():
        p.detach().sum()
    return module


def _measure(name: str, pipeline, class_name: str, denoisers: dict, files: list, reload, device, repeat,
             reload_pipeline=None, model_dir=None, keep="memory") -> dict:
    from backend.weights import module_checksum
    from backend.distill.lifecycle import FusedBase

    fb = FusedBase(pipeline, class_name, denoisers, model_dir, keep=keep)
    fb.base_checksums()  # recorded once per model, not per fuse
    fuses, restores, copies = [], [], []
    for _ in range(repeat):
        fuses.append(_timed(lambda: fb.fuse(files), device, 1))
        restores.append(_timed(fb.restore, device, 1))
        fb.fuse(files)
        copies.append(_timed(lambda: fb.restore(verify=False), device, 1))
    cycle, restore, copy = (statistics.median(x) for x in (fuses, restores, copies))
    checksum = _timed(lambda: [module_checksum(m) for m in denoisers.values()], device, repeat)
    reload_s = _timed(reload, device, max(1, repeat // 2))
    pipeline_s = _timed(reload_pipeline, device, max(1, repeat // 2)) if reload_pipeline else None
    params = sum(p.numel() for m in denoisers.values() for p in m.parameters())
    return {"model": f"{name} [{keep}]", "params_M": params / 1e6, "fuse_s": cycle, "restore_s": restore,
            "copy_s": copy, "checksum_s": checksum, "reload_s": reload_s, "reload_pipeline_s": pipeline_s, "snapshot_MB": fb.snapshot_bytes() / 2**20}


def bench_demo(model_id: str, device: str, dtype: str, repeat: int, data_dir=None) -> dict:
    from backend.manager import PipelineManager
    from backend.presets import get_preset
    from backend.distill.demo_files import write_demo_file

    preset_for = {"demo:qwen-image": "qwen-image-2512-lightning-4step", "demo:wan2.1-t2v": "wan2.1-t2v-lightx2v-4step",
                  "demo:wan2.2-t2v": "wan2.2-t2v-a14b-lightx2v-4step",
                  "demo:wan2.2-i2v": "wan2.2-i2v-a14b-lightx2v-4step"}
    m = PipelineManager(device=device, dtype=dtype, data_dir=data_dir)
    m.load(model_id)
    preset = get_preset(preset_for[model_id])
    files = [write_demo_file(model_id, f.demo, f.component, data_dir) for f in preset.files]
    import diffusers

    def reload():
        for name, module in m.denoisers().items():
            cls = getattr(diffusers, type(module).__name__)
            _touch(cls.from_pretrained(m.model_path, subfolder=name, torch_dtype=m.dtype).to(m.device))

    def reload_pipeline():
        PipelineManager(device=device, dtype=dtype, data_dir=data_dir).load(model_id)

    return _measure(model_id, m.pipeline, m.spec.class_name, m.denoisers(), files, reload, m.device, repeat,
                    reload_pipeline, m.model_path, keep="memory")


def bench_synthetic(device: str, dtype: str, repeat: int) -> list[dict]:
    from diffusers import WanPipeline, WanTransformer3DModel
    from safetensors.torch import save_file

    from backend.manager import pick_device, pick_dtype, quiet_libraries
    from backend.distill.demo_files import build_state_dict

    quiet_libraries()
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        WanTransformer3DModel(**SYNTHETIC).save_pretrained(root / "transformer")
        sd = build_state_dict(root, "lightx2v-wan", "transformer", seed=1, rank=SYNTHETIC_RANK)
        lora = root / "wan2.1_t2v_synthetic_lora_rank64_lightx2v_4step.safetensors"
        save_file(sd, str(lora))

        def load():
            return _touch(WanTransformer3DModel.from_pretrained(root / "transformer", torch_dtype=dt).to(dev))

        rows = []
        for keep in ("memory", "checkpoint"):
            transformer = load()
            pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=transformer)
            rows.append(_measure("synthetic Wan 768/12h/FFN3072/4L", pipe, "WanPipeline",
                                 {"transformer": transformer}, [lora], load, dev, repeat, model_dir=root, keep=keep))
        return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'model':<44} {'params':>7} {'fuse':>7} {'restore':>8} {'(copy)':>7} {'checksum':>8} "
            f"{'reload T':>8} {'reload P':>8} {'T/restore':>9} {'P/restore':>9} {'snapshot':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p, restore = r["reload_pipeline_s"], r["restore_s"]
        lines.append(
            f"{r['model']:<44} {r['params_M']:>6.2f}M {r['fuse_s']:>6.3f}s {r['restore_s']:>7.3f}s "
            f"{r['copy_s']:>6.3f}s {r['checksum_s']:>7.3f}s {r['reload_s']:>7.3f}s "
            f"{(f'{p:.3f}s' if p else '-'):>8} {r['reload_s'] / r['restore_s']:>8.1f}x "
            f"{(f'{p / restore:.1f}x' if p else '-'):>9} {r['snapshot_MB']:>6.1f}MB")
    lines.append("fuse: read + convert + inject + fuse + unload + 2 checksums; restore: copy back + verify "
                 "(copy: without the verify); [memory]: base copies in RAM, [checkpoint]: re-read from disk; reload T: the denoiser(s) from disk; reload P: the whole pipeline")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.distill", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--models", nargs="*",
                   default=["demo:qwen-image", "demo:wan2.1-t2v", "demo:wan2.2-t2v", "demo:wan2.2-i2v"])
    p.add_argument("--no-synthetic", action="store_true")
    p.add_argument("--data-dir")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    rows = [bench_demo(mid, args.device, args.dtype, args.repeat, args.data_dir) for mid in args.models]
    if not args.no_synthetic:
        rows.extend(bench_synthetic(args.device, args.dtype, args.repeat))
    print(f"distill fuse/restore vs reload (device={args.device}, dtype={args.dtype}, "
          f"median of {args.repeat}, torch threads={torch.get_num_threads()})")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

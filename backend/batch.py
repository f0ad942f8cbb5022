"""Mixed-adapter batches: several generate requests that differ only in prompt, seed and adapters
run as ONE pipeline call.

The base forward is shared; each sample gets its own set's low-rank delta through per-sample hooks
(``UnfusedServing.batch``, ``_BatchHook``: the factors of the sets present stacked and gathered per
sample, Punica's BGMV written with torch ops). Each sample has its own ``torch.Generator`` seeded with
its own seed (diffusers pipelines take a list of generators, one per prompt, and draw each sample's
latents from its own), so a sample's latents are those of the request run alone; with classifier-free
guidance the pipeline's batch is [negatives..., positives...] (or two calls of n rows), and the hooks
map row ``r`` to sample ``r % n``.

``compatible_key`` says which requests may share a call; ``generate_batch`` runs them and returns one
``GenerationResult`` per request, with ``metadata["batch"] = {"size", "index"}``.
"""
from __future__ import annotations

import json
import time

from . import stepgate
from .errors import Cancelled, InvalidParameter

# what may differ between the requests of one batch (everything else must be equal)
PER_SAMPLE = ("prompt", "seed")
# request fields that make a job run alone: an input image (I2V), a forced merge
_ALONE = ("image",)


def compatible_key(model: str | None, preset: str | None, params: dict) -> str | None:
    """The key two queued generate jobs must share to run in one batch, or None when this one runs alone.
    Built from the job's stored request (before validation): model, preset and every field but
    ``prompt`` and ``seed``."""
    if any(params.get(k) is not None for k in _ALONE) or params.get("lora_mode") == "merge":
        return None
    rest = {k: v for k, v in params.items() if k not in PER_SAMPLE}
    try:
        return json.dumps([model, preset, rest], sort_keys=True)
    except (TypeError, ValueError):
        return None


def generate_batch(manager, requests: list[dict], adapter_sets: list, *, on_step=None, cancel=None,
                   on_preview=None) -> list:
    """Run ``requests`` (request dicts) with ``adapter_sets[i]`` (list of (LoRARequest, scale)) as one call.

    ``on_step(step, total)`` after every denoising step; ``on_preview(step, total, render)`` too, where
    ``render(i)`` previews request ``i`` (manager.PreviewCallback); ``cancel()`` -> True stops the call
    (Cancelled).
    Raises InvalidParameter when the requests differ in anything but prompt and seed."""
    import torch

    from .manager import GenerationResult

    if len(requests) != len(adapter_sets) or not requests:
        raise InvalidParameter("a batch needs one adapter set per request", param="batch")
    with manager.exclusive():
        if manager.minimax is not None:
            raise InvalidParameter(f"{manager.model_id} has its own runtime; its requests run one by one",
                                   param="batch")
        params = [manager.validate({k: v for k, v in r.items() if k != "lora_mode"}) for r in requests]
        common = _shared(params[0])
        for i, p in enumerate(params[1:], 1):
            if _shared(p) != common:
                diff = sorted(k for k in set(common) | set(_shared(p)) if common.get(k) != _shared(p).get(k))
                raise InvalidParameter(f"request {i} of the batch differs from request 0 in {', '.join(diff)}; "
                                       "only prompt, seed and adapters may differ", param=diff[0])
        engine = manager.lora_engine
        if engine is None and any(adapter_sets):
            raise InvalidParameter("this pipeline manager has no LoRA engine attached (backend.lora.attach)",
                                   param="lora_request")
        started = time.time()
        n, total = len(requests), params[0].get("num_inference_steps")
        kwargs = {k: v for k, v in params[0].items()
                  if k not in ("seed", "prompt", "fps", "flow_shift", "sample_solver", "boundary_ratio")}
        kwargs["prompt"] = [p["prompt"] for p in params]
        generators = [torch.Generator(device="cpu").manual_seed(p["seed"]) for p in params]

        def step_end(pipeline, i, t, tensors):
            if cancel is not None and cancel():
                raise Cancelled("generation cancelled")
            if on_step is not None:
                on_step(i + 1, total)
            if on_preview is not None:
                on_preview(i + 1, total, manager.preview_renderer(tensors, params[0]))
            stepgate.wait(i + 1, cancel)  # tests only
            return tensors

        hooks = engine.unfused.batch(adapter_sets) if engine is not None else _no_adapters(n)
        with hooks as metas, manager.scheduler_for(params[0]), manager.boundary_for(params[0]):
            run_started = time.perf_counter()
            with torch.inference_mode():
                output = manager.pipeline(**kwargs, generator=generators, output_type="pil",
                                          callback_on_step_end=step_end)
            run_s = time.perf_counter() - run_started
        if engine is not None:
            engine.unfused.observe_batch(run_s, total, n)
        seconds = time.time() - started
        results = []
        for i, p in enumerate(params):
            if manager.spec.is_video:
                r = GenerationResult(frames=list(output.frames[i]), fps=p.get("fps", 16))
            else:
                r = GenerationResult(images=[output.images[i]])
            r.metadata = manager.run_metadata(p, metas[i], seconds)
            r.metadata["batch"] = {"size": n, "index": i}
            if metas[i]:
                r.metadata["lora_mode"] = {"mode": "unfused", "requested": "batch",
                                           "reason": f"mixed-adapter batch of {n}"}
            results.append(r)
        return results


def _shared(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in PER_SAMPLE}


class _no_adapters:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        return [[] for _ in range(self.n)]

    def __exit__(self, *exc):
        return False

"""Wan2.2 pair (A14B): ``transformer`` runs the high-noise steps and ``transformer_2`` the low-noise
ones, switching at ``boundary_ratio`` x 1000 timesteps; same pipeline classes as Wan2.1 (``wan``)."""
from __future__ import annotations

from . import Family, LoraRouting
from .wan import PIPELINES

FAMILY = Family(
    name="wan22",
    title="Wan2.2 A14B (high/low-noise transformer pair)",
    pipelines=PIPELINES,
    output="video",
    denoisers=("transformer", "transformer_2"),
    demo_models=("demo:wan2.2-t2v", "demo:wan2.2-i2v"),
    requires=frozenset({"transformer_2"}),
    lora=LoraRouting(
        # distill files come high-noise first, then low-noise, named so by lightx2v
        noise_roles={"transformer": "high_noise", "transformer_2": "low_noise"},
        distill={"transformer": {}, "transformer_2": {"load_into_transformer_2": True}},
        # a LoRA's generic ``transformer.`` keys bind to both experts, each with its own scale (lora/fit.py)
        shared_prefix="transformer",
        kohya_names={p.class_name: "wan" for p in PIPELINES},  # one file per expert (musubi-tuner)
    ),
)

"""Merge or unfused: the cost policy on numbers, and the unfused mode on the real demo pipelines
(outputs agree with the merge, base weights stay bit-exact, stacks and Wan2.2 per-expert scales,
the same refusals)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.errors import AdapterError, InvalidParameter
from backend.lora.policy import PolicyInputs, check_mode, decide, merge_cost, unfused_cost
from backend.lora.request import LoRARequest
from backend.weights import module_checksum

torch.set_num_threads(1)
STEPS = 2
# fp32: the two modes differ only by summation order; bf16: the merge rounds W0 + BA to bf16 once,
# unfused rounds x@A, then (xA)@B in bf16: the images (uint8-range floats in [0, 1]) agree to these
# measured on the trained demo:qwen-image with its trained LoRAs (inverted 0.7 + outline -1.3): 2.6e-6 and 0.039,
# where the stack moves it by 0.79 (with the earlier random amplitude-2 adapters: 5.6e-6 and 0.086 of 0.86)
# (on the random demo: 5e-7 and 0.0098 of 0.066): bf16 rounding, relative to the change, is the same
TOL = {torch.float32: 5e-5, torch.bfloat16: 0.12}


# -- the policy, on numbers ---------------------------------------------------------------------------
def test_policy_formula_on_numbers():
    i = PolicyInputs(steps=4, merge_bytes=400_000_000, bandwidth=2e9, fixed_s=0.02, step_s=0.5, ratio=0.01,
                     hooked_layers=100, hook_s=10e-6, forwards=2)
    assert merge_cost(i) == pytest.approx(0.02 + 0.2)                # 220 ms
    assert unfused_cost(i) == pytest.approx(4 * (0.005 + 2 * 100 * 10e-6))  # 28 ms
    d = decide(i)
    assert (d.mode, d.requested) == ("unfused", "auto")
    assert d.as_dict()["predicted_merge_s"] == pytest.approx(0.22)
    # a long request: 40 steps x 7 ms = 280 ms > 220 ms -> merge
    assert decide(PolicyInputs(**{**i.__dict__, "steps": 40})).mode == "merged"
    # the same set queued 3 more times: the merge is shared by 4 jobs (55 ms each) -> merge at 10 steps (70 ms)
    assert decide(PolicyInputs(**{**i.__dict__, "steps": 10})).mode == "unfused"
    assert decide(PolicyInputs(**{**i.__dict__, "steps": 10, "queued_same": 3})).mode == "merged"
    # it repeats (asked for just before): shared as well
    assert decide(PolicyInputs(**{**i.__dict__, "steps": 10, "repeats": 3})).mode == "merged"
    # already merged: nothing to write
    assert decide(PolicyInputs(**{**i.__dict__, "merge_bytes": 0})).mode == "merged"
    # unfused must first restore what an earlier request merged: 0.02 + 0.2 s more
    restoring = PolicyInputs(**{**i.__dict__, "restore_bytes": 400_000_000})
    assert unfused_cost(restoring) == pytest.approx(0.22 + 0.028)
    assert decide(restoring).mode == "merged"
    # no step time measured yet: the exact merge
    assert decide(PolicyInputs(**{**i.__dict__, "step_s": None})).reason == "no step time measured yet"
    # forced either way, whatever the numbers say
    assert decide(i, "merge").mode == "merged" and decide(PolicyInputs(steps=40, merge_bytes=0), "unfused").mode \
        == "unfused"
    with pytest.raises(InvalidParameter, match="lora_mode must be one of auto, merge, unfused"):
        check_mode("fused")


# -- the unfused mode on the demo pipelines --------------------------------------------------------------


def req(path, i) -> LoRARequest:
    return LoRARequest(path.stem, i, str(path))


def image(m, adapters, mode, seed=5):
    """(float output before any uint8 rounding, metadata of the same request through generate)."""
    out = m.generate({"prompt": "A piece of cheesecake", "seed": seed, "num_inference_steps": STEPS},
                     adapters=adapters, lora_mode=mode)
    params = m.validate({"prompt": "A piece of cheesecake", "seed": seed, "num_inference_steps": STEPS})
    kwargs = {k: v for k, v in params.items() if k not in ("seed", "fps", "flow_shift", "sample_solver",
                                                             "boundary_ratio")}
    with torch.inference_mode():  # the adapters generate() activated are still on: the same run, as floats
        raw = m.pipeline(**kwargs, generator=torch.Generator().manual_seed(seed), output_type="np")
    return np.asarray(raw.images if hasattr(raw, "images") else raw.frames, dtype=np.float32), out.metadata


def sums(m) -> dict:
    return {c: module_checksum(x) for c, x in m.denoisers().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfused_agrees_with_merged_and_writes_no_weight(dtype, library, managers):
    m = managers("demo:qwen-image", str(dtype).replace("torch.", ""))
    a = req(library / "qwen-image/demo-inverted.safetensors", 1)
    b = req(library / "qwen-image/demo-outline.safetensors", 2)
    base_sums = sums(m)
    base, _ = image(m, [], "merge")
    stack = [(a, 0.7), (b, -1.3)]
    merged, meta_m = image(m, stack, "merge")
    assert sums(m) != base_sums
    unfused, meta_u = image(m, stack, "unfused")
    assert sums(m) == base_sums  # the merge was taken off; the unfused run wrote nothing
    assert [x["mode"] for x in meta_m["adapters"]] == ["merged"] * 2
    assert [x["mode"] for x in meta_u["adapters"]] == ["unfused"] * 2
    assert meta_u["lora_mode"]["mode"] == "unfused" and meta_u["lora_mode"]["requested"] == "unfused"
    assert np.abs(merged - base).max() > 0.05  # the stack changes the image ...
    print(f"{dtype}: max |unfused - merged| = {np.abs(unfused - merged).max():.3g}, "
          f"max |merged - base| = {np.abs(merged - base).max():.3g}")
    assert np.abs(unfused - merged).max() <= TOL[dtype]  # ... the same way in both modes
    stats = m.lora_engine.stats()
    assert stats["merged_layers"] == 0 and stats["unfused"]["hooked_layers"] == 40  # 4 blocks x 10
    # a single adapter, then back to base: base bits, no hooks left
    single, _ = image(m, [(a, 1.0)], "unfused")
    again, _ = image(m, [(a, 1.0)], "merge")
    assert np.abs(single - again).max() <= TOL[dtype]
    back, meta = image(m, [], None)
    assert sums(m) == base_sums and m.lora_engine.stats()["unfused"]["hooked_layers"] == 0
    assert np.array_equal(back, base) and "lora_mode" not in meta
    written = m.lora_engine.counters["layers_written"]
    image(m, stack, "unfused")  # from the base: not one layer written
    assert m.lora_engine.counters["layers_written"] == written and sums(m) == base_sums
    m.lora_engine.activate([])


def test_unfused_per_expert_scales_on_wan22(library, managers):
    m = managers("demo:wan2.2-t2v")
    high = req(library / "wan2.2-t2v/wan22-t2v-lightx2v-high.safetensors", 1)
    low = req(library / "wan2.2-t2v/wan22-t2v-lightx2v-low.safetensors", 2)
    base_sums = sums(m)
    stack = [(high, {"transformer": 1.0}), (low, {"transformer_2": 0.5})]
    merged, _ = image(m, stack, "merge")
    unfused, meta = image(m, stack, "unfused")
    assert sums(m) == base_sums
    print(f"wan2.2 fp32: max |unfused - merged| = {np.abs(unfused - merged).max():.3g}")
    assert np.abs(unfused - merged).max() <= TOL[torch.float32]
    assert [x["scale"] for x in meta["adapters"]] == [{"transformer": 1.0, "transformer_2": 0.0},
                                                      {"transformer": 0.0, "transformer_2": 0.5}]
    hooked = {c: sum(bool(x._forward_hooks) for x in d.modules() if isinstance(x, torch.nn.Linear))
              for c, d in m.denoisers().items()}
    assert hooked["transformer"] > 0 and hooked["transformer_2"] > 0  # each expert, its own adapter
    # the same refusals in both modes: a scale naming a missing expert, an adapter that does not fit
    with pytest.raises(InvalidParameter, match="transformer_3"):
        m.lora_engine.activate([(high, {"transformer_3": 1.0})], mode="unfused")
    foreign = req(library / "qwen-image/demo-inverted.safetensors", 9)
    with pytest.raises(AdapterError):
        m.lora_engine.activate([(foreign, 1.0)], mode="unfused")
    m.lora_engine.activate([])
    assert sums(m) == base_sums


def test_auto_picks_by_measured_cost(library, managers):
    """auto with a measured step time: a costly switch runs unfused, a free one merges; metadata says which."""
    m = managers("demo:sd3.5")
    engine = m.lora_engine
    a = req(library / "sd3.5/sd35-watercolor.safetensors", 1)
    image(m, [], "auto")  # a base run: measures the step time
    assert engine.unfused.step_s is not None
    engine.unfused.config.update(fixed_s=10.0)  # a switch costs 10 s here: unfused wins at 2 steps
    _, meta = image(m, [(a, 1.0)], "auto")
    assert meta["lora_mode"]["mode"] == "unfused" and meta["adapters"][0]["mode"] == "unfused"
    assert meta["lora_mode"]["inputs"]["merge_bytes"] > 0
    engine.unfused.config.update(fixed_s=0.0, bandwidth=1e15)  # free switches: merge
    _, meta = image(m, [(a, 1.0)], "auto")
    assert meta["lora_mode"]["mode"] == "merged" and meta["adapters"][0]["mode"] == "merged"
    engine.activate([])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_1000_random_switches_across_both_modes_leave_the_base_bit_exact(dtype, library, managers):
    import random

    m = managers("demo:qwen-image", str(dtype).replace("torch.", ""))
    engine = m.lora_engine
    q = library / "qwen-image"
    pool = [req(q / "demo-inverted.safetensors", 1), req(q / "demo-outline.safetensors", 2),
            req(q / "demo-grayscale", 3)]
    base_sums = sums(m)
    rng = random.Random(0)
    modes = {"merged": 0, "unfused": 0}
    for _ in range(1000):
        chosen = rng.sample(pool, rng.randint(0, 3))
        engine.activate([(r, rng.choice([0.5, 1.0, -1.5])) for r in chosen],
                        mode=rng.choice(["merge", "unfused"]))
        if chosen:
            modes["unfused" if engine.unfused.active else "merged"] += 1
        if engine.unfused.active:  # serving unfused: the weights are the base, always
            assert engine.stats()["merged_layers"] == 0
    engine.activate([])
    assert sums(m) == base_sums and engine.stats()["unfused"]["hooked_layers"] == 0
    assert min(modes.values()) > 300


def test_unfused_follows_the_canonical_set_and_refuses_a_non_finite_stack(library, managers, tmp_path):
    """The unfused path uses the merge path's adapter identities and canonical order ([A, B] then
    [B, A] is a no-op; one file under two ids is one adapter with its scales summed), and a stack whose
    delta is not finite is refused with the merge's error: no hooks left, merged layers restored."""
    from safetensors.torch import load_file, save_file

    m = managers("demo:qwen-image")
    engine = m.lora_engine
    q = library / "qwen-image"
    a, b = req(q / "demo-inverted.safetensors", 1), req(q / "demo-outline.safetensors", 2)
    base_sums = sums(m)
    engine.activate([(a, 1.0), (b, 0.5)], mode="unfused")
    hooks, noops = engine.unfused.counters["hooks_installed"], engine.counters["noop_activations"]
    rows = engine.activate([(b, 0.5), (a, 1.0)], mode="unfused")  # the same composition
    assert engine.unfused.counters["hooks_installed"] == hooks and engine.counters["noop_activations"] == noops + 1
    assert [(r["name"], r["mode"]) for r in rows] == [(b.lora_name, "unfused"), (a.lora_name, "unfused")]
    # one file under two ids: one adapter at scale 0.5 + 0.5, the same output as the merge of a at 1.0
    alias = LoRARequest("ink-again", 7, a.lora_path)
    twice, meta = image(m, [(a, 0.5), (alias, 0.5)], "unfused")
    assert [(r["name"], r["int_id"], r["scale"], r["mode"]) for r in meta["adapters"]] == \
        [(a.lora_name, 1, 1.0, "unfused")]
    once, _ = image(m, [(a, 1.0)], "merge")
    assert np.abs(twice - once).max() <= TOL[torch.float32]
    assert engine.stats()["merged_layers"] > 0  # a is merged now
    # factors of 1e30 (finite in the file): the delta overflows; refused, and the merged a is taken off
    huge = {k: v.float().sign().where(v != 0, 1.0) * 1e30 for k, v in load_file(str(b.lora_path)).items()}
    path = tmp_path / "overflow-1e30.safetensors"
    save_file(huge, str(path))
    refused = engine.counters["nonfinite_refused"]
    with pytest.raises(AdapterError, match="'overflow-1e30'.* at transformer.*not finite"):
        engine.activate([(LoRARequest("overflow-1e30", 8, str(path)), 1.0)], mode="unfused")
    assert engine.counters["nonfinite_refused"] == refused + 1
    assert engine.active == [] and engine.stats()["unfused"]["hooked_layers"] == 0
    assert engine.stats()["merged_layers"] == 0 and sums(m) == base_sums
    engine.activate([])

"""Scheduled and per-block LoRA scales (backend/lora/schedule.py): the grammar and its refusals,
then on the real demo pipelines: a constant schedule is the scalar, a two-part schedule equals a
hand-run switch at the midpoint, per-block weights, Wan2.2 per-expert schedules, the base bits
back after, no weight written per step, and no torch.compile recompile per step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.errors import InvalidParameter
from backend.lora import schedule
from backend.lora.request import LoRARequest
from backend.weights import module_checksum

torch.set_num_threads(1)
STEPS = 4
PROMPT = "A piece of cheesecake"


# -- the grammar (no model) ---------------------------------------------------------------------------
def test_forms_parse_and_resolve_per_step():
    assert schedule.parse(0.7).plain and schedule.parse(0.7).given() == 0.7
    lst = schedule.parse([1.0, 0.8, 0.5]).default.steps
    assert lst.per_step(6) == [1.0, 1.0, 0.8, 0.8, 0.5, 0.5]  # split evenly: first third 1.0 ...
    assert lst.per_step(4) == [1.0, 1.0, 0.8, 0.5]  # step i uses value floor(i * K / N)
    lin = schedule.parse({"start": 0.0, "end": 1.0}).default.steps
    assert lin.per_step(5) == [0.0, 0.25, 0.5, 0.75, 1.0] and lin.per_step(1) == [0.0]
    assert schedule.parse([0.5, 0.5]).default.steps.constant == 0.5  # equal values: not scheduled
    assert not schedule.parse([0.5, 0.5]).scheduled and not schedule.parse([0.5, 0.5]).plain
    weighted = schedule.parse({"scale": [1, 0.5], "blocks": {"0-9": 0.5, "12-": 2, "10": 0}}).default
    assert weighted.scheduled and weighted.blocks.per_block(3) == [0.5, 0.5, 0.5]
    assert [weighted.blocks.weight(b) for b in (0, 9, 10, 11, 12, 99, None)] == [0.5, 0.5, 0.0, 1.0, 2.0, 2.0, 1.0]
    assert schedule.parse({"blocks": {"2-3": 0.0}}).default.blocks.weight(4) == 1.0  # unnamed blocks: 1.0
    per = schedule.parse({"transformer": [1.0, 0.0], "transformer_2": {"scale": 0.5, "blocks": {"0": 2}}})
    assert per.default is None and per.scheduled
    assert per.given() == {"transformer": [1.0, 0.0], "transformer_2": {"scale": 0.5, "blocks": {"0": 2.0}}}
    # the text forms of the CLI and the UI
    assert schedule.parse_text("0.8") == 0.8
    assert schedule.parse_text(" 1.0, 0.8,0.5 ") == [1.0, 0.8, 0.5]
    assert schedule.parse_text("0.5->1.0") == {"start": 0.5, "end": 1.0}
    assert schedule.parse_text('{"blocks": {"0-": 0.5}}') == {"blocks": {"0-": 0.5}}
    assert schedule.block_of("transformer_blocks.3.attn.to_q", [("transformer_blocks", 5)]) == 3
    assert schedule.block_of("single_transformer_blocks.1.proj", [("transformer_blocks", 5),
                                                                  ("single_transformer_blocks", 9)]) == 6
    assert schedule.block_of("proj_out", [("transformer_blocks", 5)]) is None


@pytest.mark.parametrize("value, names", [
    ([1.0, "x"], r"lora\.scale\[1\]: 'x' is not a number"),
    ([], r"lora\.scale: an empty list"),
    ({"start": 1.0}, r"lora\.scale: missing 'end'"),
    ({"start": 1.0, "stop": 0.0}, r"lora\.scale: unknown key 'stop'"),
    ({"start": 1.0, "end": float("inf")}, r"lora\.scale\.end: inf is not a finite number"),
    ({"blocks": {"a-b": 1.0}}, r"lora\.scale\.blocks\.a-b: 'a-b' is not a block range"),
    ({"blocks": {"5-2": 1.0}}, r"lora\.scale\.blocks\.5-2: range '5-2' ends before it starts"),
    ({"blocks": {"0-9": 1.0, "5-": 0.5}}, r"lora\.scale\.blocks: ranges '0-9' and '5-' overlap \(block 5\)"),
    ({"blocks": {"0": True}}, r"lora\.scale\.blocks\.0: True is not a number"),
    ({"blocks": []}, r"lora\.scale\.blocks: expected an object of block ranges"),
    ({"scale": 1.0}, r"lora\.scale: 'scale' inside an object needs 'blocks'"),
    ({"scale": 1.0, "blocks": {"0": 1}, "mode": 2}, r"lora\.scale: unknown key 'mode'"),
    ({"transformer": {"transformer_2": 1.0}}, r"lora\.scale\.transformer: per-component scales do not nest"),
    ({"transformer": [1.0, None]}, r"lora\.scale\.transformer\[1\]: None is not a number"),
    ({"scale": {"blocks": {"0": 1}}, "blocks": {"0": 1}}, r"lora\.scale\.scale: 'scale'/'blocks' cannot nest"),
    ("1.0,0.8", r"lora\.scale: '1.0,0.8' is not a number"),  # JSON takes no text forms
])
def test_bad_forms_are_refused_naming_the_field_and_the_part(value, names):
    with pytest.raises(InvalidParameter, match=names):
        schedule.parse(value)


def test_bad_text_forms_are_refused_by_name():
    for text, names in (("1.0,,0.5", r"--lora-scale\[1\]: '' is not a number"),
                        ("0.5->", r"--lora-scale\.end: '' is not a number"),
                        ("1->2->3", "one arrow"), ("{bad", "not valid JSON"), ("", "empty")):
        with pytest.raises(InvalidParameter, match=names):
            schedule.parse_text(text, "--lora-scale")


# -- the demo pipelines --------------------------------------------------------------------------------


def req(path, i) -> LoRARequest:
    return LoRARequest(path.stem, i, str(path))


def sums(m) -> dict:
    return {c: module_checksum(x) for c, x in m.denoisers().items()}


def pixels(m, adapters, mode=None, steps=STEPS, on_step=None):
    out = m.generate({"prompt": PROMPT, "seed": 5, "num_inference_steps": steps}, adapters=adapters,
                     lora_mode=mode, on_step=on_step)
    frames = out.images if out.images else out.frames
    return np.stack([np.asarray(f) for f in frames]).astype(np.int16), out.metadata


def floats(m, callback=None, steps=STEPS):
    """The pipeline run by hand on the engine's current state, as floats (no uint8 rounding)."""
    params = m.validate({"prompt": PROMPT, "seed": 5, "num_inference_steps": steps})
    kwargs = {k: v for k, v in params.items() if k not in ("seed", "fps", "flow_shift", "sample_solver",
                                                             "boundary_ratio")}
    with torch.inference_mode():
        raw = m.pipeline(**kwargs, generator=torch.Generator().manual_seed(5), output_type="np",
                         callback_on_step_end=callback)
    return np.asarray(raw.images if hasattr(raw, "images") else raw.frames, dtype=np.float32)


def test_constant_schedule_is_the_scalar_and_a_two_part_schedule_is_a_hand_run_switch(library, managers):
    m = managers("demo:qwen-image")
    engine = m.lora_engine
    ink = req(library / "qwen-image/demo-inverted.safetensors", 1)
    base_sums = sums(m)
    base, _ = pixels(m, [])
    s1, s2 = 1.0, -0.6
    one, _ = pixels(m, [(ink, s1)])
    two, _ = pixels(m, [(ink, s2)])
    # [s, s, s] is the scalar s, pixel for pixel, and is recorded as given
    const, meta = pixels(m, [(ink, [s1, s1, s1])])
    assert np.array_equal(const, one)
    assert meta["adapters"][0]["scale"] == [s1, s1, s1]
    assert meta["adapters"][0]["scale_resolved"] == {"steps": STEPS, "per_step": [s1] * STEPS}
    # [s1, s2]: s1 for the first half of the steps, s2 for the second, run unfused with no weight written
    steps_seen = []
    sched, meta = pixels(m, [(ink, [s1, s2])], on_step=lambda i, n: steps_seen.append(
        (engine.unfused.counters["hooks_installed"], engine.counters["layers_written"])))
    assert steps_seen == [steps_seen[0]] * STEPS  # hooks installed once before step 0; no layer written per step
    assert sums(m) == base_sums  # served unfused: the base weights are untouched
    row = meta["adapters"][0]
    assert row["scale"] == [s1, s2] and row["mode"] == "unfused"
    assert row["scale_resolved"] == {"steps": STEPS, "per_step": [s1, s1, s2, s2]}
    assert meta["lora_mode"]["mode"] == "unfused" and "step schedule" in meta["lora_mode"]["reason"]
    assert np.abs(sched - one).max() > 3 and np.abs(sched - two).max() > 3  # neither constant
    # the reference: the scalar s1, switched to s2 at the midpoint through the engine's own API
    engine.activate([(ink, s1)], mode="unfused")

    def switch(pipe, i, t, tensors):
        if i + 1 == STEPS // 2:
            engine.activate([(ink, s2)], mode="unfused")
        return tensors

    reference = floats(m, switch)
    assert engine.unfused.active and sums(m) == base_sums
    # the same schedule through the step callback generate() uses, as floats
    engine.activate([(ink, [s1, s2])], steps=STEPS)
    step = engine.unfused.stepper(STEPS, None)
    scheduled = floats(m, lambda pipe, i, t, tensors: (step(i + 1, STEPS), tensors)[1])
    print(f"max |scheduled - hand-run| = {np.abs(scheduled - reference).max():.3g}")
    assert np.abs(scheduled - reference).max() <= 1e-5  # fp32: the two hook forms differ by summation order
    assert np.abs(np.rint(reference * 255) - sched[0]).max() <= 1  # generate()'s pixels: the same image
    engine.activate([])
    assert sums(m) == base_sums and np.array_equal(pixels(m, [])[0], base)


def test_per_block_weights(library, managers):
    m = managers("demo:qwen-image")
    engine = m.lora_engine
    ink = req(library / "qwen-image/demo-inverted.safetensors", 1)
    base_sums = sums(m)
    base, _ = pixels(m, [])
    full, _ = pixels(m, [(ink, 1.0)])
    ones, meta = pixels(m, [(ink, {"blocks": {"0-": 1.0}})])
    assert np.array_equal(ones, full)
    assert meta["adapters"][0]["scale"] == {"blocks": {"0-": 1.0}}
    assert meta["adapters"][0]["scale_resolved"]["blocks"] == [1.0] * 4
    zeros, _ = pixels(m, [(ink, {"blocks": {"0-": 0.0}})])
    assert np.array_equal(zeros, base) and sums(m) == base_sums  # nothing written: every layer's weight is 0
    # block 0 only: a merge of block 0's layers alone (the plan leaves block 1 out), either mode
    first, _ = pixels(m, [(ink, {"blocks": {"0": 1.0, "1-": 0.0}})], mode="merge")
    assert engine._merged and all(k[1].startswith("transformer_blocks.0.") for k in engine._merged)
    first_u, _ = pixels(m, [(ink, {"blocks": {"0": 1.0, "1-": 0.0}})], mode="unfused")
    assert np.abs(first - first_u).max() <= 1
    assert np.abs(first - base).max() > 1 and np.abs(first - full).max() > 1
    # per-block weights with a schedule: unfused, the block weight times the step's value
    both, meta = pixels(m, [(ink, {"scale": {"start": 1.0, "end": 0.0}, "blocks": {"1": 0.5}})])
    assert meta["adapters"][0]["scale_resolved"] == {"steps": STEPS, "blocks": [1.0, 0.5, 1.0, 1.0],
                                                     "per_step": pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])}
    assert meta["adapters"][0]["mode"] == "unfused"
    # a range past the model's blocks, a list longer than the steps: refused by name
    with pytest.raises(InvalidParameter, match=r"lora_scale\.blocks: range '4-' starts past the last block: "
                                               r"transformer has 4 blocks \(0-3\)"):
        engine.activate([(ink, {"blocks": {"0-3": 1.0, "4-": 0.5}})], steps=STEPS)
    with pytest.raises(InvalidParameter, match=r"lora_scale: 5 values but the request runs 4 steps"):
        engine.activate([(ink, [1, 1, 1, 1, 0.5])], steps=STEPS)
    with pytest.raises(InvalidParameter, match="named twice"):
        engine.activate([(ink, [1.0, 0.5]), (ink, 1.0)], steps=STEPS)
    engine.activate([])
    assert sums(m) == base_sums


def test_per_expert_schedules_on_wan22(library, managers):
    m = managers("demo:wan2.2-t2v")
    engine = m.lora_engine
    high = req(library / "wan2.2-t2v/wan22-t2v-lightx2v-high.safetensors", 1)
    low = req(library / "wan2.2-t2v/wan22-t2v-lightx2v-low.safetensors", 2)
    base_sums = sums(m)
    plain, _ = pixels(m, [(high, {"transformer": 1.0}), (low, {"transformer_2": 0.5})], mode="unfused")
    scale = {"transformer": [1.0, 0.0], "transformer_2": {"scale": {"start": 0.5, "end": 1.0}, "blocks": {"1": 0}}}
    sched, meta = pixels(m, [(high, scale), (low, {"transformer_2": [0.5, 0.5, 0.5, 0.5]})])
    assert sums(m) == base_sums
    rows = meta["adapters"]
    blocks = len(m.pipeline.transformer_2.blocks)  # block "1" at 0, the others at the step's scale
    assert rows[0]["scale"] == scale and rows[0]["mode"] == "unfused"
    assert rows[0]["scale_resolved"] == {"steps": STEPS, "per_step": {"transformer": [1.0, 1.0, 0.0, 0.0],
                                         "transformer_2": pytest.approx([0.5, 0.5 + 0.5 / 3, 0.5 + 1 / 3, 1.0])},
                                         "blocks": {"transformer_2": [1.0, 0.0] + [1.0] * (blocks - 2)}}
    assert rows[1]["scale"] == {"transformer": 0.0, "transformer_2": [0.5, 0.5, 0.5, 0.5]}
    assert np.abs(sched - plain).max() > 1
    hooked = {c: sum(bool(x._forward_hooks) for x in d.modules() if isinstance(x, torch.nn.Linear))
              for c, d in m.denoisers().items()}
    assert hooked["transformer"] > 0 and hooked["transformer_2"] > 0
    with pytest.raises(InvalidParameter, match="transformer_3"):
        engine.activate([(high, {"transformer_3": [1.0, 0.5]})], steps=STEPS)
    engine.activate([])
    assert sums(m) == base_sums


@pytest.mark.slow  # torch.compile of a denoiser: 10-12 s of compiling on a CPU
def test_a_compiled_denoiser_is_not_recompiled_per_step(library, managers):
    """torch.compile on CPU (dynamo, eager backend): a scheduled request compiles when its hooks go
    on, then every step runs that graph (the scales are a tensor the graph reads); the same switch
    made by hand with a Python-float scale, mid-run, compiles a new graph: the count can grow."""
    from torch._dynamo.utils import counters

    m = managers("demo:qwen-image")
    engine = m.lora_engine
    ink = req(library / "qwen-image/demo-inverted.safetensors", 1)
    eager, _ = pixels(m, [(ink, [1.0, 0.3, -0.5, 0.8])])
    transformer = m.pipeline.transformer
    transformer.compile(backend="eager")
    try:
        graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
        pixels(m, [])
        per_step = []
        compiled, _ = pixels(m, [(ink, [1.0, 0.3, -0.5, 0.8])], on_step=lambda i, n: per_step.append(graphs()))
        assert per_step == [per_step[0]] * STEPS, per_step
        assert np.array_equal(compiled, eager)  # the compiled graph runs the hooks (not the stale base graph)
        again = graphs()
        per_step.clear()
        pixels(m, [(ink, {"start": 1.0, "end": -1.0})], on_step=lambda i, n: per_step.append(graphs()))
        assert per_step == [again] * STEPS  # another schedule on the same layers: not one new graph
        # the control: a float scale switched mid-run by hand compiles again during the run
        engine.activate([(ink, 0.25)], mode="unfused")
        floats(m)
        before = graphs()
        floats(m, lambda pipe, i, t, tensors: (engine.activate([(ink, 0.25 + i)], mode="unfused"), tensors)[1])
        assert graphs() > before
    finally:
        transformer._compiled_call_impl = None  # back to eager for the module's other users
        engine.activate([])


# -- the UI's stack (ui/generate.py: the "weight over steps" field) ---------------------------------------
def test_ui_stack_takes_the_text_forms_and_restores_them():
    from ui.stack import adapter_payload, stack_from_payload
    from ui.views import adapters_label

    stack = [{"name": "a", "scale": 0.5, "split": False, "high": 0.5, "low": 0.5, "schedule": "1.0,0.8,0.5"},
             {"name": "b", "scale": 1.0, "split": True, "high": 1.2, "low": 0.3, "schedule": " 0.5->1.0 "},
             {"name": "c", "scale": 0.7, "split": False, "high": 0.7, "low": 0.7, "schedule": ""},
             {"name": "d", "scale": 1.0, "split": False, "high": 1.0, "low": 1.0,
              "schedule": '{"scale": 0.8, "blocks": {"0-9": 0.5}}'}]
    payload = adapter_payload(stack, two_stage=True)
    assert payload == [{"name": "a", "scale": [1.0, 0.8, 0.5]}, {"name": "b", "scale": {"start": 0.5, "end": 1.0}},
                       {"name": "c", "scale": 0.7}, {"name": "d", "scale": {"scale": 0.8, "blocks": {"0-9": 0.5}}}]
    assert adapter_payload(stack_from_payload(payload), two_stage=True) == payload  # a result's settings come back
    assert [e.get("schedule", "") for e in stack_from_payload(payload)][:3] == ["1,0.8,0.5", "0.5->1", ""]
    apart = [{"name": "te", "scale": {"text_encoder": 0.5, "denoisers": 1.0}}]  # #28 item 3: not a split pair
    assert stack_from_payload(apart)[0]["schedule"] == '{"text_encoder": 0.5, "denoisers": 1.0}'
    assert adapter_payload(stack_from_payload(apart), two_stage=True) == apart
    assert adapters_label(payload) == 'a@[1.0,0.8,0.5], b@0.5->1, c@0.7, ' \
        'd@{"scale":0.8,"blocks":{"0-9":0.5}}'
    with pytest.raises(InvalidParameter, match=r"a: weight over steps\[1\]: 'x' is not a number"):
        adapter_payload([{**stack[0], "schedule": "1.0,x"}], two_stage=False)


def test_omni_takes_a_schedule_per_request(library, data_dir):
    """``Omni.generate``: one request takes one scale in any form (a list is then a schedule); a
    list of requests takes a list of scales, each in any form; bad ones are refused by name."""
    from backend import Omni

    omni = Omni(model="demo:qwen-image", device="cpu", dtype="float32", data_dir=data_dir)
    q = library / "qwen-image"
    ink, film = req(q / "demo-inverted.safetensors", 1), req(q / "demo-outline.safetensors", 2)
    fields = {"prompt": PROMPT, "seed": 5, "num_inference_steps": STEPS}
    out = omni.generate(**fields, lora_request=ink, lora_scale=[1.0, 0.5])[0]
    assert out.metadata["adapters"][0]["scale_resolved"]["per_step"] == [1.0, 1.0, 0.5, 0.5]
    out = omni.generate(**fields, lora_request=[ink, film],
                        lora_scale=[{"start": 1.0, "end": 0.0}, {"scale": 0.5, "blocks": {"1": 0.0}}])[0]
    assert [a["scale"] for a in out.metadata["adapters"]] == [{"start": 1.0, "end": 0.0},
                                                              {"scale": 0.5, "blocks": {"1": 0.0}}]
    assert out.metadata["lora_mode"]["mode"] == "unfused"
    with pytest.raises(InvalidParameter, match=r"lora_scale\[1\]\.blocks\.x: 'x' is not a block range"):
        omni.generate(**fields, lora_request=[ink, film], lora_scale=[1.0, {"blocks": {"x": 1}}])
    with pytest.raises(InvalidParameter, match="2 lora_request"):
        omni.generate(**fields, lora_request=[ink, film], lora_scale=[1.0, 0.5, 0.2])

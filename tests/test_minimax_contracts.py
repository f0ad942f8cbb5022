"""MiniMax-H3 sampling contracts: Turbo names, native metadata, pinned schedules, request checks, offload."""
from __future__ import annotations

import pytest

from backend.errors import AdapterError, ContractViolation, InvalidParameter
from backend.minimax import contracts as C
from backend.minimax import offload

TURBO_NAMES = [
    # name, steps, flow_shift, tasks, resolution
    ("minimax_h3_fl2v_turbo_4step_v1.0.safetensors", 4, 12.0, {"t2va", "fl2va"}, "544p"),
    ("minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors", 4, 6.0, {"t2va", "fl2va"}, "768p"),
    ("minimax_h3_fl2v_turbo_8step_v1.1_bf16.safetensors", 8, 12.0, {"t2va", "fl2va"}, "544p"),
    ("minimax_h3_ref2v_turbo_8step_v2.0_768p_bf16.safetensors", 8, 6.0, {"ref2va"}, "768p"),
    ("minimax_h3_ref2v_turbo_2step_v1.0.safetensors", 2, 12.0, {"ref2va"}, "544p"),
    ("minimax_h3_fl2v_turbo_12step_v10.25_768p.safetensors", 12, 6.0, {"t2va", "fl2va"}, "768p"),
]


@pytest.mark.parametrize("name,steps,shift,tasks,res", TURBO_NAMES)
def test_turbo_name_yields_contract(name, steps, shift, tasks, res):
    c = C.turbo_contract(name)
    assert (c.kind, c.steps, c.flow_shift, c.audio_flow_shift, set(c.tasks), c.resolution) == \
        ("turbo", steps, shift, 3.0, tasks, res)
    assert c.alpha == 8.0  # no __metadata__ alpha
    p = C.plan({"task_type": sorted(tasks)[0]}, c)
    assert p.steps == steps and p.sigma_points == steps + 1  # N steps = N+1 sigma points
    assert (p.flow_shift, p.audio_flow_shift, p.sigmas) == (shift, 3.0, None)


@pytest.mark.parametrize("name", [
    "minimax_h3_t2v_turbo_4step_v1.0.safetensors",         # unknown task
    "minimax_h3_fl2v_turbo_0step_v1.0.safetensors",        # zero steps
    "minimax_h3_fl2v_turbo_4steps_v1.0.safetensors",       # "steps"
    "minimax_h3_fl2v_turbo_4step_v1.safetensors",          # version without minor
    "minimax_h3_fl2v_turbo_4step_v1.0_1080p.safetensors",  # unknown resolution
    "minimax_h3_fl2v_turbo_4step_v1.0_bf16_768p.safetensors",  # suffixes out of order
    "minimax_h3_fl2v_turbo_4step_v1.0.ckpt",
    "MiniMax_H3_fl2v_turbo_4step_v1.0.safetensors",
    "my_turbo_lora.safetensors",
])
def test_malformed_turbo_name_refused_with_pattern(name):
    with pytest.raises(AdapterError) as err:
        C.turbo_contract(name)
    assert name in err.value.message and C.TURBO_PATTERN in err.value.message


def test_turbo_alpha_from_metadata_else_default_8():
    name = TURBO_NAMES[0][0]
    assert C.turbo_contract(name, {"alpha": "16"}).alpha == 16.0
    assert C.turbo_contract(name, {}).alpha == C.TURBO_DEFAULT_ALPHA == 8.0
    with pytest.raises(AdapterError, match="alpha"):
        C.turbo_contract(name, {"alpha": "sixteen"})


@pytest.mark.parametrize("request_,field,expected", [
    ({"num_inference_steps": 8}, "num_inference_steps", "num_inference_steps=4"),
    ({"flow_shift": 6.0}, "flow_shift", "flow_shift=12"),
    ({"audio_flow_shift": 5.0}, "audio_flow_shift", "audio_flow_shift=3"),
    ({"task_type": "ref2va"}, "task_type", "t2va or fl2va"),
])
def test_request_breaking_turbo_contract_is_rejected_by_name(request_, field, expected):
    c = C.turbo_contract("minimax_h3_fl2v_turbo_4step_v1.0.safetensors")
    with pytest.raises(ContractViolation) as err:
        C.plan(request_, c)
    assert err.value.http_status == 422 and err.value.param == field
    assert "minimax_h3_fl2v_turbo_4step_v1.0.safetensors" in err.value.message
    assert expected in err.value.message


def test_ref2v_turbo_needs_ref2va():
    c = C.turbo_contract("minimax_h3_ref2v_turbo_4step_v1.0_768p.safetensors")
    for task in ("t2va", "fl2va"):
        with pytest.raises(ContractViolation, match="ref2va"):
            C.plan({"task_type": task}, c)
    assert C.plan({"task_type": "ref2va", "num_inference_steps": 4, "flow_shift": 6}, c).flow_shift == 6.0


def test_native_metadata_contract_and_step_rules():
    meta = {"key_format": "minimax-h3-native", "qkv_layout": "grouped", "base_schedule": "1.0,0.7,0.4,0.15,0.0"}
    c = C.native_contract("flash.safetensors", meta)
    assert c.sigmas == (1.0, 0.7, 0.4, 0.15, 0.0) and c.steps == 4
    assert C.plan({}, c).steps == 4  # request mode may omit the step count
    with pytest.raises(ContractViolation, match=r"num_inference_steps=4.*got 5"):
        C.plan({"num_inference_steps": 5}, c)
    with pytest.raises(ContractViolation, match="flow_shift does not apply"):
        C.plan({"num_inference_steps": 4, "flow_shift": 12.0}, c)
    with pytest.raises(AdapterError, match="qkv_layout"):
        C.native_contract("flash.safetensors", {**meta, "qkv_layout": "stacked"})
    for bad in ("1.0,0.5", "0.9,0.4,0.0", "1.0,0.4,0.6,0.0", "1.0,x,0.0"):
        with pytest.raises(AdapterError, match="base_schedule"):
            C.native_contract("flash.safetensors", {**meta, "base_schedule": bad})


def test_checkpoint_pinned_schedule(tmp_path):
    (tmp_path / "modular_model_index.json").write_text('{"base_schedule": [1.0, 0.7, 0.4, 0.15, 0.0]}')
    c = C.checkpoint_contract(tmp_path)
    assert c.kind == "checkpoint" and c.steps == 4
    with pytest.raises(ContractViolation) as err:
        C.plan({"num_inference_steps": 8}, c)
    assert "num_inference_steps=4" in err.value.message and "got 8" in err.value.message
    assert C.checkpoint_contract(tmp_path / "missing") is None


def test_adapter_contract_overrides_checkpoint_and_conflicts_are_refused():
    pinned = C.SamplingContract("ckpt", "checkpoint", 4, sigmas=(1.0, 0.7, 0.4, 0.15, 0.0))
    native = C.native_contract("n.safetensors", {"key_format": "minimax-h3-native", "qkv_layout": "grouped",
                                                 "base_schedule": "1.0,0.5,0.0"})
    assert C.active_contract(pinned, [None, native]) is native
    assert C.active_contract(pinned, [None]) is pinned
    turbo = C.turbo_contract(TURBO_NAMES[0][0])
    with pytest.raises(ContractViolation, match="conflicting"):
        C.active_contract(pinned, [native, turbo])


def test_base_model_without_contract_uses_request_values():
    p = C.plan({"num_inference_steps": 7, "flow_shift": 5.0}, None)
    assert (p.steps, p.sigma_points, p.flow_shift, p.audio_flow_shift) == (7, 8, 5.0, 3.0)
    assert C.plan({}, None, default_steps=30).steps == 30


def test_offload_flags_allowed_and_refused_by_name():
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # Allowed: every mode with both backends (the policy does not depend on --lora-backend; docs/minimax.md).
    assert offload.check(None) == offload.OffloadPlan("none", False)
    assert offload.check("model") == offload.OffloadPlan("model", False)
    assert offload.check("group", stream=True) == offload.OffloadPlan("group", True)
    offload.check_device(offload.check("group"), cpu)  # group without streams runs on CPU (onload = cpu)
    for plan in (offload.check("model"), offload.check("group", stream=True)):
        offload.check_device(plan, cuda)
    # Refused, each naming the flags that conflict.
    refusals = [
        (lambda: offload.check("sequential"), ("--offload", "sequential")),
        (lambda: offload.check("model", stream=True), ("--offload-stream", "--offload model")),
        (lambda: offload.check(None, stream=True), ("--offload-stream", "--offload none")),
        (lambda: offload.check_device(offload.check("model"), cpu), ("--offload model", "CUDA", "--device cpu")),
        (lambda: offload.check_device(offload.check("group", stream=True), cpu), ("--offload-stream", "CUDA")),
        (lambda: offload.check_model(offload.check("group"), "WanPipeline"), ("--offload group", "WanPipeline")),
        (lambda: offload.check_engine(offload.check("model"), "ray"), ("--offload model", "--engine ray")),
    ]
    for call, words in refusals:
        with pytest.raises(InvalidParameter) as err:
            call()
        assert err.value.http_status == 400 and all(w in err.value.message for w in words), err.value.message
    offload.check_model(offload.check("none"), "WanPipeline")  # no offload: any model

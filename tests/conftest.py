"""Shared fixtures: one data directory per test session, so demo models are built once.

Set LORA_STUDIO_TEST_HOME to keep that directory between runs (CI does, to build the
demo models once per run rather than once per test module).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    root = os.environ.get("LORA_STUDIO_TEST_HOME")
    path = Path(root) if root else tmp_path_factory.mktemp("lora-studio-home")
    path.mkdir(parents=True, exist_ok=True)
    os.environ["LORA_STUDIO_HOME"] = str(path)  # subprocesses (CLI, server worker) share it
    return path


@pytest.fixture(scope="session")
def demo_path(data_dir):
    from backend import demo

    def _path(model_id: str) -> Path:
        return demo.ensure(model_id, data_dir)

    return _path


@pytest.fixture(scope="session")
def manager_for(data_dir):
    """A loaded PipelineManager per demo model, shared by the session (loading is the slow part)."""
    from backend.manager import PipelineManager

    cache = {}

    def _get(model_id: str) -> PipelineManager:
        if model_id not in cache:
            m = PipelineManager(device="cpu", data_dir=data_dir)
            m.load(model_id)
            cache[model_id] = m
        return cache[model_id]

    return _get


@pytest.fixture(scope="session")
def library(data_dir):
    """The demo adapter library (<data-dir>/demo/adapters), written once per session."""
    from backend.lora import demo_adapters

    return demo_adapters.ensure(data_dir)


@pytest.fixture(scope="module")
def managers(data_dir):
    """``get(model, dtype="float32")``: a CPU PipelineManager with the LoRA engine attached, loaded once
    per test module (its tests write into the weights, so modules never share one). Modules that need
    another kind (no engine, a preset restored per test) define their own ``managers``."""
    from backend.lora import attach
    from backend.manager import PipelineManager

    cache = {}

    def get(model: str, dtype: str = "float32") -> PipelineManager:
        if (model, dtype) not in cache:
            m = PipelineManager(device="cpu", dtype=dtype, data_dir=data_dir)
            m.load(model)
            attach(m)
            cache[(model, dtype)] = m
        return cache[(model, dtype)]

    yield get

"""Shared fixtures: one data directory per test session, so demo models are built once.

Set LORA_STUDIO_TEST_HOME to keep that directory between runs (CI does, to build the
demo models once per run rather than once per test module).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    root = os.environ.get("LORA_STUDIO_TEST_HOME")
    path = Path(root) if root else tmp_path_factory.mktemp("lora-studio-home")
    path.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # pytest -n: each worker its own home (queue, outputs, adapters), the built models shared
        (path / "models").mkdir(exist_ok=True)  # demo.ensure locks each build: built once for all workers
        path = path / worker
        path.mkdir(exist_ok=True)
        if not (path / "models").exists():
            (path / "models").symlink_to(path.parent / "models", target_is_directory=True)
    os.environ["LORA_STUDIO_HOME"] = str(path)  # subprocesses (CLI, server worker) share it
    # the step gate (backend/stepgate.py) of every worker and replica the tests start in this process;
    # a served app gets its own (ui_fixtures.start_app). Open until a test holds it (``gate``).
    from backend.stepgate import ENV

    os.environ[ENV] = str(path / "step-gate")
    return path


@pytest.fixture(scope="session")
def gate(data_dir):
    """The step gate of the workers started in this process: ``with gate.held(1):`` keeps a job running
    at step 1 until the block ends, so a test sees it running by construction, never by a race."""
    from backend.stepgate import ENV
    from ui_fixtures import StepGate

    gate = StepGate(Path(os.environ[ENV]))
    gate.release()
    return gate


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


# -- tiers (pytest.ini, README "Tests") --------------------------------------------------------------------
# A test is ``served`` when it, or a fixture it uses, starts another process: a served app, app.py on the
# command line, a Studio's worker, Chromium or Ray. Read from the source, so no test has to remember to say
# it; a module's helper functions that do it count where they are called. ``--quick`` leaves these out.
_STARTS = r"subprocess\.|Popen\(|served_app\(|start_app\(|Studio\(|ThreadedServer\(|RayEngine\(|" \
          r"sync_playwright\(|open_page\(|ray\.init\("


def _starts_pattern(module) -> re.Pattern:
    """``_STARTS`` plus calls of the module's own functions that start a process (to a fixed point)."""
    import inspect

    cached = getattr(module, "__lora_studio_starts__", None)
    if cached is not None:
        return cached
    sources = {}
    for name, fn in vars(module).items():
        if inspect.isfunction(fn) and getattr(fn, "__module__", None) == module.__name__:
            try:
                sources[name] = inspect.getsource(fn)
            except (OSError, TypeError):
                pass
    names: set[str] = set()
    while True:
        pattern = re.compile("|".join([_STARTS, *(rf"\b{re.escape(n)}\(" for n in sorted(names))]))
        more = {n for n, src in sources.items() if n not in names and pattern.search(src.split("\n", 1)[-1])}
        if not more:
            break
        names |= more
    module.__lora_studio_starts__ = pattern
    return pattern


def _starts_a_process(item) -> bool:
    import inspect

    funcs = [item.function] + [fd.func for defs in item._fixtureinfo.name2fixturedefs.values() for fd in defs]
    for fn in funcs:
        fn = inspect.unwrap(fn)
        module = inspect.getmodule(fn)
        if module is None or not getattr(module, "__file__", "").startswith(str(Path(__file__).parent)):
            continue  # pytest's own fixtures (tmp_path, monkeypatch, ...)
        try:
            body = inspect.getsource(fn).split("\n", 1)[-1]
        except (OSError, TypeError):
            continue
        if _starts_pattern(module).search(body):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _starts_a_process(item):
            item.add_marker(pytest.mark.served)

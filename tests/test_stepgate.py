"""The test-only step gate (backend/stepgate.py): it holds a job after a step until the file lets it on, a
cancel or the file's removal releases it, and without the variable it never reads a file."""
from __future__ import annotations

import threading

import pytest

from backend import stepgate
from ui_fixtures import StepGate


@pytest.fixture
def gate(tmp_path, monkeypatch):
    path = tmp_path / "gate"
    monkeypatch.setenv(stepgate.ENV, str(path))
    return StepGate(path)


def _waiter(step: int, cancelled=None) -> threading.Thread:
    t = threading.Thread(target=stepgate.wait, args=(step, cancelled), daemon=True)
    t.start()
    return t


def test_a_held_step_waits_until_the_gate_lets_it_on(gate):
    gate.hold(2)
    _waiter(1).join(5)  # step 1 < 2: through
    held = _waiter(2)
    held.join(0.3)
    assert held.is_alive()  # step 2 is held ...
    gate.hold(3)
    held.join(5)
    assert not held.is_alive()  # ... until the gate lets a third step through
    again = _waiter(3)
    again.join(0.3)
    assert again.is_alive()
    gate.release()  # no file: open
    again.join(5)
    assert not again.is_alive()


def test_a_cancel_releases_a_held_step(gate):
    cancelled = threading.Event()
    with gate.held(1):
        held = _waiter(1, cancelled.is_set)
        held.join(0.3)
        assert held.is_alive()
        cancelled.set()
        held.join(5)
        assert not held.is_alive()


def test_without_the_variable_nothing_waits_and_callbacks_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.delenv(stepgate.ENV, raising=False)
    (tmp_path / "gate").write_text("0")  # a closed gate nobody names
    done = _waiter(5)
    done.join(5)
    assert not done.is_alive()

    def on_step(step, total):
        pass

    assert stepgate.wrap(on_step) is on_step


def test_wrap_reports_the_step_then_waits(gate):
    seen = []
    gated = stepgate.wrap(lambda step, total: seen.append((step, total)))
    with gate.held(1):
        t = threading.Thread(target=gated, args=(1, 4), daemon=True)
        t.start()
        t.join(0.3)
        assert seen == [(1, 4)] and t.is_alive()  # the progress is out while the step is held
    t.join(5)
    assert not t.is_alive()

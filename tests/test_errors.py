"""One way for a StudioError to cross a process boundary: ``to_wire()`` / ``StudioError.from_wire()``."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from backend import errors
from backend.errors import ERRORS, StudioError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_every_error_class_round_trips_through_json(name):
    cls = ERRORS[name]
    exc = cls(f"{name}: something named is wrong", param="some.field")
    wire = json.loads(json.dumps(exc.to_wire()))  # plain JSON, as on the pipe, the Ray stream, the job row
    back = StudioError.from_wire(wire)
    assert type(back) is cls
    assert (back.message, back.param, back.http_status, back.kind) == (exc.message, exc.param, exc.http_status,
                                                                      exc.kind)
    # a job row keeps the message apart from the detail
    detail = dict(wire)
    message = detail.pop("message")
    again = StudioError.from_wire(detail, message=message)
    assert type(again) is cls and again.message == exc.message and again.http_status == exc.http_status


def test_a_detail_without_a_class_keeps_its_status_and_type():
    back = StudioError.from_wire({"status": 504, "type": "timeout", "param": "job_timeout"}, message="too slow")
    assert (back.message, back.http_status, back.kind, back.param) == ("too slow", 504, "timeout", "job_timeout")
    assert type(StudioError.from_wire({"class": "NoSuchError", "message": "m"})) is StudioError


def test_every_studio_error_is_defined_in_errors_py():
    """A StudioError class defined elsewhere would be missing from the table from_wire reads."""
    outside = []
    for path in sorted((ROOT / "backend").rglob("*.py")) + sorted((ROOT / "ui").rglob("*.py")):
        if path == ROOT / "backend" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
                         for b in node.bases}
                if bases & set(ERRORS):
                    outside.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not outside, f"define these in backend/errors.py: {outside}"
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, StudioError)}
    assert defined == set(ERRORS)

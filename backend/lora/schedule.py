"""A LoRA scale: a number, a schedule over the steps, per expert, and per-block weights.

The one place a scale is parsed and checked (the HTTP ``lora`` object, ``Omni.generate``,
the CLI's ``--lora-scale`` and the UI's stack all call ``parse``). Pure Python: no torch.

Grammar (JSON)::

    scale      := single | {COMPONENT: single, ...}           per expert (Wan2.2: transformer, transformer_2),
                                                             per text encoder (text_encoder, text_encoder_2 ...);
                                                             "denoisers" / "text_encoder": every one of the
                                                             group not named on its own
    single     := steps | {"scale": steps, "blocks": blocks}   ("scale" optional, default 1.0)
    steps      := NUMBER                                     the same at every step (today's form)
                | [NUMBER, ...]                              split evenly over the steps: with K values
                                                             and N steps, step i (0-based) uses value
                                                             floor(i * K / N); K <= N
                | {"start": NUMBER, "end": NUMBER}           linear: start at the first step, end at the last
    blocks     := {RANGE: NUMBER, ...}                       a weight per transformer block ("N", "N-M", "N-");
                                                             blocks not named keep weight 1.0; ranges must
                                                             not overlap

Step ``i`` always means the request's own step (0 .. num_inference_steps-1), for every
expert. A block is an entry of the denoiser's block lists (``transformer_blocks``,
``blocks``, ``single_transformer_blocks`` ... its ModuleList children whose name ends in
``blocks``, numbered in order, one numbering across the lists); a layer outside every
block (an embedder, the final projection) takes the scale without a block weight. At
step i a layer in block b runs at ``scale(i) * blocks(b)``.

Text forms (CLI, UI): ``0.8`` (a number), ``1.0,0.8,0.5`` (a list), ``0.5->1.0``
(start -> end), or any JSON text of the grammar.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from ..errors import InvalidParameter

MAX_VALUES = 1000      # values in one list schedule
MAX_RANGES = 256       # ranges in one blocks object
_RANGE = re.compile(r"\s*(\d{1,6})\s*(?:(-)\s*(\d{1,6})?)?\s*")
_STEP_KEYS = frozenset({"start", "end"})
_BLOCK_KEYS = frozenset({"scale", "blocks"})


def _fail(param: str, message: str):
    raise InvalidParameter(f"{param}: {message}", param=param)


def _number(value, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(param, f"{value!r} is not a number")
    v = float(value)
    if not math.isfinite(v):
        _fail(param, f"{value!r} is not a finite number")
    return v


@dataclass(frozen=True)
class Steps:
    """A scale over the steps: ``kind`` constant (values = (v,)), list, or linear (values = (start, end))."""

    kind: str
    values: tuple

    @property
    def constant(self) -> float | None:
        """The value when it is the same at every step (a list of equal values too), else None."""
        if self.kind == "constant" or len(set(self.values)) == 1:
            return self.values[0]
        return None

    def at(self, step: int, steps: int) -> float:
        if self.kind == "constant":
            return self.values[0]
        if self.kind == "list":
            return self.values[min(len(self.values) - 1, step * len(self.values) // max(1, steps))]
        start, end = self.values
        return start if steps <= 1 else start + (end - start) * (step / (steps - 1))

    def per_step(self, steps: int) -> list[float]:
        return [self.at(i, steps) for i in range(steps)]

    def given(self):
        if self.kind == "constant":
            return self.values[0]
        if self.kind == "list":
            return list(self.values)
        return {"start": self.values[0], "end": self.values[1]}

    def check_steps(self, steps: int, param: str) -> None:
        if self.kind == "list" and len(self.values) > steps:
            _fail(param, f"{len(self.values)} values but the request runs {steps} steps "
                  "(a list is split evenly over the steps: give at most one value per step)")


@dataclass(frozen=True)
class Blocks:
    """Weights per block index: ``ranges`` ((first, last or None for open, weight), ...) as given."""

    ranges: tuple
    keys: tuple  # the ranges as written, for messages and metadata

    def weight(self, block: int | None) -> float:
        if block is None:
            return 1.0
        for first, last, w in self.ranges:
            if block >= first and (last is None or block <= last):
                return w
        return 1.0

    def check_count(self, count: int, component: str, param: str) -> None:
        for (first, _, _), key in zip(self.ranges, self.keys):
            if first >= count:
                _fail(f"{param}.blocks", f"range {key!r} starts past the last block: {component} has "
                      f"{count} blocks (0-{count - 1})" if count else f"{component} has no transformer blocks")

    def per_block(self, count: int) -> list[float]:
        return [self.weight(b) for b in range(count)]

    def given(self) -> dict:
        return {k: w for k, (_, _, w) in zip(self.keys, self.ranges)}


@dataclass(frozen=True)
class ComponentScale:
    steps: Steps
    blocks: Blocks | None = None

    @property
    def scheduled(self) -> bool:
        """Changes between steps (runs unfused, its scale set per step)."""
        return self.steps.constant is None

    @property
    def plain(self) -> bool:
        """A number: one scale at every step and every block (today's form; a list of equal
        values is not scheduled, but is recorded as given)."""
        return self.steps.kind == "constant" and self.blocks is None

    def given(self):
        if self.blocks is None:
            return self.steps.given()
        out = {"blocks": self.blocks.given()}
        if not (self.steps.kind == "constant" and self.steps.values[0] == 1.0):
            out["scale"] = self.steps.given()
        return out


# a per-component key that stands for every denoiser the adapter binds to and the object does not name on
# its own (the text encoders' group is ``text_encoder``: every encoder not named alone); A1111's
# ``<lora:NAME:TE:UNET>`` becomes {"text_encoder": TE, "denoisers": UNET}
DENOISERS = "denoisers"


def fill_groups(given: dict, bound, encoders) -> dict:
    """``{component: value}`` for the ``bound`` components from a per-component object ``given``: a component
    named on its own keeps its value, the others take their group's (``text_encoder`` for the ``encoders``,
    ``denoisers`` for the rest); a component with neither is left out (weight 0)."""
    out = {}
    for comp in bound:
        group = "text_encoder" if comp in encoders else DENOISERS
        if comp in given or group in given:
            out[comp] = given[comp] if comp in given else given[group]
    return out


@dataclass(frozen=True)
class LoraScale:
    """A parsed scale: ``default`` for every component the adapter binds to, or ``components``."""

    default: ComponentScale | None = None
    components: tuple = ()  # ((component, ComponentScale), ...) in the order given

    def per_component(self, bound: list[str]) -> dict[str, ComponentScale]:
        if self.default is not None:
            return {c: self.default for c in bound}
        return dict(self.components)

    @property
    def plain(self) -> bool:
        return all(c.plain for c in self._all())

    @property
    def scheduled(self) -> bool:
        return any(c.scheduled for c in self._all())

    def _all(self):
        return [self.default] if self.default is not None else [c for _, c in self.components]

    def given(self):
        """The JSON form (as given, numbers as floats)."""
        if self.default is not None:
            return self.default.given()
        return {c: s.given() for c, s in self.components}


def parse(value, param: str = "lora.scale") -> LoraScale:
    """A scale in any of the grammar's forms (see the module docstring); InvalidParameter naming
    the field and the bad part otherwise. ``None`` is 1.0."""
    if isinstance(value, LoraScale):
        return value
    if value is None:
        return LoraScale(ComponentScale(Steps("constant", (1.0,))))
    if isinstance(value, dict) and value and not (set(value) & (_STEP_KEYS | _BLOCK_KEYS)):
        comps = []
        for comp, inner in value.items():
            if not isinstance(comp, str) or not comp:
                _fail(param, f"{comp!r} is not a component name")
            if isinstance(inner, dict) and inner and not (set(inner) & (_STEP_KEYS | _BLOCK_KEYS)):
                _fail(f"{param}.{comp}", "per-component scales do not nest (give a number, a list, "
                      '{"start", "end"} or {"scale", "blocks"})')
            comps.append((comp, _single(inner, f"{param}.{comp}")))
        return LoraScale(None, tuple(comps))
    return LoraScale(_single(value, param))


def _single(value, param: str) -> ComponentScale:
    if isinstance(value, dict) and set(value) & _BLOCK_KEYS:
        extra = sorted(set(value) - _BLOCK_KEYS)
        if extra:
            _fail(param, f"unknown key {extra[0]!r} next to 'scale'/'blocks' (allowed: scale, blocks)")
        if "blocks" not in value:
            _fail(param, "'scale' inside an object needs 'blocks' beside it (or give the scale alone)")
        steps = _steps(value.get("scale", 1.0), f"{param}.scale")
        return ComponentScale(steps, _blocks(value["blocks"], f"{param}.blocks"))
    return ComponentScale(_steps(value, param))


def _steps(value, param: str) -> Steps:
    if isinstance(value, (list, tuple)):
        if not value:
            _fail(param, "an empty list (a schedule needs at least one value)")
        if len(value) > MAX_VALUES:
            _fail(param, f"{len(value)} values (at most {MAX_VALUES})")
        return Steps("list", tuple(_number(v, f"{param}[{i}]") for i, v in enumerate(value)))
    if isinstance(value, dict):
        keys = set(value)
        if keys & _BLOCK_KEYS:
            _fail(param, "'scale'/'blocks' cannot nest here (blocks go next to the scale, not inside it)")
        if keys != _STEP_KEYS:
            missing, extra = sorted(_STEP_KEYS - keys), sorted(keys - _STEP_KEYS)
            why = f"unknown key {extra[0]!r}" if extra else f"missing {missing[0]!r}"
            _fail(param, f"{why} (a linear schedule is {{\"start\": s0, \"end\": s1}})")
        return Steps("linear", (_number(value["start"], f"{param}.start"), _number(value["end"], f"{param}.end")))
    return Steps("constant", (_number(value, param),))


def _blocks(value, param: str) -> Blocks:
    if not isinstance(value, dict) or not value:
        _fail(param, 'expected an object of block ranges to weights, e.g. {"0-9": 0.5, "10-": 1.0}')
    if len(value) > MAX_RANGES:
        _fail(param, f"{len(value)} ranges (at most {MAX_RANGES})")
    ranges, keys = [], []
    for key, weight in value.items():
        m = _RANGE.fullmatch(str(key))
        if m is None:
            _fail(f"{param}.{key}", f"{key!r} is not a block range (use \"N\", \"N-M\" or \"N-\")")
        first = int(m.group(1))
        last = first if m.group(2) is None else (None if m.group(3) is None else int(m.group(3)))
        if last is not None and last < first:
            _fail(f"{param}.{key}", f"range {key!r} ends before it starts")
        w = _number(weight, f"{param}.{key}")
        for (f2, l2, _), k2 in zip(ranges, keys):
            if first <= (math.inf if l2 is None else l2) and f2 <= (math.inf if last is None else last):
                _fail(param, f"ranges {k2!r} and {key!r} overlap (block {max(first, f2)})")
        ranges.append((first, last, w))
        keys.append(str(key))
    return Blocks(tuple(ranges), tuple(keys))


def parse_text(text, param: str = "lora_scale"):
    """The CLI's and the UI's text forms -> the JSON form (checked): ``0.8``, ``1.0,0.8,0.5``,
    ``0.5->1.0`` or JSON text. A number or a parsed value passes through."""
    if not isinstance(text, str):
        parse(text, param)
        return text
    s = text.strip()
    if not s:
        _fail(param, "empty (give a number, '1.0,0.8,0.5', '0.5->1.0' or JSON)")
    if s[0] in "[{":
        try:
            value = json.loads(s)
        except json.JSONDecodeError as exc:
            _fail(param, f"not valid JSON ({exc.msg} at character {exc.pos})")
    elif "->" in s:
        parts = s.split("->")
        if len(parts) != 2:
            _fail(param, f"{s!r}: one arrow, start->end (e.g. 0.5->1.0)")
        value = {"start": _text_number(parts[0], f"{param}.start"), "end": _text_number(parts[1], f"{param}.end")}
    elif "," in s:
        value = [_text_number(p, f"{param}[{i}]") for i, p in enumerate(s.split(","))]
    else:
        value = _text_number(s, param)
    parse(value, param)
    return value


def _text_number(text: str, param: str) -> float:
    try:
        v = float(text.strip())
    except ValueError:
        _fail(param, f"{text.strip()!r} is not a number")
    if not math.isfinite(v):
        _fail(param, f"{text.strip()!r} is not a finite number")
    return v


def to_json(value, param: str = "lora.scale"):
    """A checked scale back to plain JSON (numbers as floats): what a request records as given."""
    return parse(value, param).given()


# -- blocks of a denoiser (duck-typed: no torch import here) ------------------------------------------
def block_lists(denoiser) -> list[tuple[str, int]]:
    """The denoiser's block lists in order: [(child name, length)] for its ModuleList children
    named ``*blocks`` (one numbering across them)."""
    return [(name, len(child)) for name, child in denoiser.named_children()
            if name.endswith("blocks") and type(child).__name__ == "ModuleList"]


def block_of(module: str, lists: list[tuple[str, int]]) -> int | None:
    """The block index of a layer name (``transformer_blocks.3.attn.to_q`` -> 3), None outside blocks."""
    offset = 0
    for name, count in lists:
        if module.startswith(name + "."):
            head = module[len(name) + 1:].split(".", 1)[0]
            if head.isdigit() and int(head) < count:
                return offset + int(head)
            return None
        offset += count
    return None


def metadata(scales: dict, steps, block_counts: dict) -> dict:
    """What a result records of one adapter's scale: ``scale`` as given (per component, or one
    form when every component has the same) and ``scale_resolved``: the request's ``steps``, the
    value at each step and the weight of each block (blocks only where given)."""
    given, per_step, blocks = {}, {}, {}
    for comp, v in scales.items():
        if isinstance(v, ComponentScale):
            given[comp] = v.given()
            per_step[comp] = v.steps.per_step(int(steps)) if steps else [v.steps.at(0, 1)]
            if v.blocks is not None:
                blocks[comp] = v.blocks.per_block(int(block_counts.get(comp, 0)))
        else:
            given[comp] = v
            per_step[comp] = [v] * (int(steps) if steps else 1)
    same = len({json.dumps(g, sort_keys=True) for g in given.values()}) == 1 and \
        len({json.dumps(blocks.get(c)) for c in given}) == 1
    if same:
        comp = next(iter(given))
        resolved = {"steps": steps, "per_step": per_step[comp]}
        if comp in blocks:
            resolved["blocks"] = blocks[comp]
        return {"scale": given[comp], "scale_resolved": resolved}
    resolved = {"steps": steps, "per_step": per_step}
    if blocks:
        resolved["blocks"] = blocks
    return {"scale": given, "scale_resolved": resolved}

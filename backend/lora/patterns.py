"""Checking the LoRA configs an adapter carries (PEFT ``adapter_config.json``, diffusers'
``lora_adapter_metadata``) before anything uses them.

A config is data from the file, so it is checked like the tensors: ``r`` a positive integer,
``lora_alpha`` a finite number, ``rank_pattern``/``alpha_pattern`` objects of bounded size
whose values are ranks/finite alphas and whose keys are regexes that cannot blow up.

Why a cost bound rather than a timeout: peft matches a pattern key ``k`` against a module
name ``m`` with ``re.match(rf"(.*\\.)?({k})$", m)`` (``get_pattern_key``), a backtracking
engine; ``(.|.){0,22}Z`` alone takes seconds per module name. Python's ``re`` cannot be
interrupted, and a wall-clock timeout would make the same file usable on a quiet machine
and refused on a busy one. So each key is parsed (``re``'s own parser) and refused when the
number of ways it can match a name of up to ``MAX_NAME`` characters exceeds ``MAX_WAYS``:
a repeat counts each iteration count it can take, an alternation the sum of its branches,
a sequence the product. One unbounded repeat of one character (``.*``, ``[0-9]+``) costs
``MAX_NAME + 1`` ways and is allowed; two, or a repeated alternation, are not.
Back-references and look-arounds (which make the cost unbounded in other ways) are refused.
The same bound applies wherever the pattern is matched (our converter, peft's), since the
pattern itself is what is checked. Module names are bounded by the key-length cap in
``formats`` (``MAX_KEY_LEN``), which ``MAX_NAME`` equals.
"""
from __future__ import annotations

import math
import re

from re import _constants as _c, _parser as _p  # Python 3.11+ (the project's floor)

from ..errors import AdapterError

MAX_PATTERN_LEN = 256  # characters in one rank_pattern / alpha_pattern key
MAX_PATTERNS = 4096  # keys in one rank_pattern / alpha_pattern
MAX_NAME = 256  # the longest module name a pattern is matched against (= formats.MAX_KEY_LEN)
MAX_WAYS = 1024  # ways one key can match a MAX_NAME-character name (see above)
MAX_RANK = 65536

_ONE = {_c.LITERAL, _c.NOT_LITERAL, _c.ANY, _c.IN, _c.AT, _c.CATEGORY}
_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}
_REFUSED = {_c.GROUPREF: "back-references", _c.GROUPREF_EXISTS: "conditional groups",
            _c.ASSERT: "look-arounds", _c.ASSERT_NOT: "look-arounds"}


class _TooCostly(Exception):
    pass


def _ways(seq) -> int:
    """Ways ``seq`` can match (an upper bound), raising _TooCostly past MAX_WAYS."""
    total = 1
    for op, av in seq:
        if op in _ONE:
            n = 1
        elif op == _c.SUBPATTERN:
            n = _ways(av[-1])
        elif op == getattr(_c, "ATOMIC_GROUP", None):
            n = _ways(av)
        elif op == _c.BRANCH:
            n = sum(_ways(alt) for alt in av[1])
        elif op in _REPEATS:
            lo, hi, body = av
            hi = MAX_NAME if hi == _c.MAXREPEAT or hi > MAX_NAME else hi
            b = _ways(body)
            if lo > hi:
                n = 1
            elif b == 1:
                n = hi - lo + 1
            elif (hi + 1) * math.log(b) > math.log(MAX_WAYS * b):
                raise _TooCostly
            else:
                n = sum(b ** k for k in range(lo, hi + 1))
        elif op in _REFUSED:
            raise ValueError(f"{_REFUSED[op]} are not allowed")
        else:
            raise ValueError(f"unsupported construct {op}")
        total *= max(n, 1)
        if total > MAX_WAYS:
            raise _TooCostly
    return total


def check_pattern(key, where: str) -> None:
    """Refuse a pattern key that is not a string, too long, invalid or too costly to match."""
    if not isinstance(key, str):
        raise AdapterError(f"{where}: pattern keys must be strings", param="lora_path")
    shown = repr(key[:60]) + ("..." if len(key) > 60 else "")
    if len(key) > MAX_PATTERN_LEN:
        raise AdapterError(f"{where}: pattern {shown} is longer than {MAX_PATTERN_LEN} characters",
                           param="lora_path")
    try:
        parsed = _p.parse(key)
        _ways(parsed)
        re.compile(key)
    except _TooCostly:
        raise AdapterError(f"{where}: pattern {shown} is too costly to match (more than {MAX_WAYS} ways to "
                           "match a module name: nested or repeated alternations/repeats); use plain module "
                           "names or at most one '.*'", param="lora_path") from None
    except (re.error, ValueError, RecursionError, OverflowError) as exc:
        raise AdapterError(f"{where}: pattern {shown} is not a valid regex ({_first_line(exc)})",
                           param="lora_path") from None


def check_config(config, where: str) -> dict:
    """A LoRA config (PEFT adapter_config.json or one component of diffusers' metadata), checked."""
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: not a JSON object", param="lora_path")
    if "r" in config:
        _rank(config["r"], f"{where}: r")
    for field in ("lora_alpha", "alpha"):  # peft's LoRA / its LoHa and LoKr configs
        if field in config:
            _alpha(config[field], f"{where}: {field}")
    for field, value_check in (("rank_pattern", _rank), ("alpha_pattern", _alpha)):
        patterns = config.get(field)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise AdapterError(f"{where}: {field} must be an object of pattern -> value", param="lora_path")
        if len(patterns) > MAX_PATTERNS:
            raise AdapterError(f"{where}: {field} has {len(patterns)} keys (at most {MAX_PATTERNS})",
                               param="lora_path")
        for key, value in patterns.items():
            check_pattern(key, f"{where}: {field}")
            value_check(value, f"{where}: {field}[{key[:60]!r}]")
    for flag in ("use_rslora", "use_dora"):
        if flag in config and not isinstance(config[flag], bool) and config[flag] is not None:
            raise AdapterError(f"{where}: {flag} must be true or false", param="lora_path")
    return config


def _rank(value, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANK:
        raise AdapterError(f"{where} must be an integer from 1 to {MAX_RANK}, got {_short(value)}",
                           param="lora_path")


def _alpha(value, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"{where} must be a finite number, got {_short(value)}", param="lora_path")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _first_line(exc) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:120]

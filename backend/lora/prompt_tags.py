"""A1111-style ``<lora:NAME:WEIGHT>`` tags in a prompt: one parser for the UI, the HTTP API
and the CLI.

The tags are taken out of the text (the text encoder never sees them) and become adapter
entries ``{"name", "scale"}``; the weight is optional (none: the adapter's preferred weight, else 1.0). Pure text handling: no torch.
"""
from __future__ import annotations

import math
import re

from ..errors import InvalidParameter

TAG = re.compile(r"<lora:([^<>]*)>", re.IGNORECASE)


def count(prompt: str) -> int:
    """How many tags the text holds, in one linear pass (what the limits check before any is parsed)."""
    return prompt.lower().count("<lora:") if isinstance(prompt, str) else 0


def split(prompt: str) -> tuple[str, list[dict]]:
    """(the prompt without its tags, [{"name", "scale"}] in the order written)."""
    if not isinstance(prompt, str) or "<lora:" not in prompt.lower():
        return prompt, []
    adapters = []
    for match in TAG.finditer(prompt):
        body = match.group(1)
        name, _, rest = body.partition(":")
        name = name.strip()
        if not name:
            raise InvalidParameter(f"prompt: {match.group(0)!r} names no adapter (write <lora:NAME:WEIGHT>)",
                                   param="prompt")
        weight = rest.split(":")[0].strip() if rest else ""
        if not weight:  # <lora:NAME>: the adapter's preferred weight (its A1111 sidecar), else 1.0
            adapters.append({"name": name})
            continue
        try:
            scale = float(weight)
        except ValueError:
            raise InvalidParameter(f"prompt: the weight in {match.group(0)!r} is not a number",
                                   param="prompt") from None
        if not math.isfinite(scale):
            raise InvalidParameter(f"prompt: the weight in {match.group(0)!r} is not finite", param="prompt")
        adapters.append({"name": name, "scale": scale})
    return tidy(TAG.sub(" ", prompt)), adapters


# Both patterns start a match only where a run of blanks starts (the look-behind), so each character is
# looked at a bounded number of times: a bare ``\s+([,.;])`` retries every position of a long blank run
# and takes time quadratic in it.
_BLANKS_BEFORE_PUNCT = re.compile(r"(?<!\s)\s+([,.;])")
_BLANK_RUN = re.compile(r"(?<![ \t])[ \t]{2,}")


_COMMA_RUN = re.compile(r",(?: ?,)+")  # after the blanks are single: linear


def tidy(text: str) -> str:
    """A prompt with its tags taken out: no blanks before punctuation, single spaces, one comma where a
    tag stood between two ("a cat, <lora:x>, sitting" -> "a cat, sitting"), no stray commas at the ends
    ("a cat , <lora:x>" -> "a cat"). Linear in the text."""
    text = _BLANK_RUN.sub(" ", _BLANKS_BEFORE_PUNCT.sub(r"\1", text))
    return _COMMA_RUN.sub(",", text).strip().strip(",").strip()  # "a cat, <lora:x>, sitting": one comma


def merge(stack: list[dict] | None, tagged: list[dict]) -> list[dict]:
    """The request's adapters plus the prompt's; an adapter named both ways is refused by name."""
    stack = list(stack or [])
    names = {a.get("name") for a in stack if isinstance(a, dict)}
    for a in tagged:
        if a["name"] in names:
            raise InvalidParameter(f"prompt: <lora:{a['name']}> is also in the adapter list; name it once",
                                   param="prompt")
        names.add(a["name"])
        stack.append(a)
    return stack

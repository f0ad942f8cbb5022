"""A1111-style ``<lora:NAME:WEIGHT>`` (and ``<lora:NAME:TE:UNET>``) tags in a prompt: one parser for the UI, the HTTP API
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
    """(the prompt without its tags, [{"name", "scale"}] in the order written).

    The weights read as A1111 reads them (extensions-builtin/Lora/extra_networks_lora.py):
    ``<lora:NAME:TE:UNET>``, the first number the text encoders' weight and the second the denoisers'
    (the first when there is no second), or named, ``te=`` / ``unet=``. One weight for both is a plain
    scale; two that differ become ``{"text_encoder": TE, "denoisers": UNET}`` (backend/lora/schedule.py's
    groups)."""
    if not isinstance(prompt, str) or "<lora:" not in prompt.lower():
        return prompt, []
    adapters = []
    for match in TAG.finditer(prompt):
        tag = match.group(0)
        name, _, rest = match.group(1).partition(":")
        name = name.strip()
        if not name:
            raise InvalidParameter(f"prompt: {tag!r} names no adapter (write <lora:NAME:WEIGHT>)",
                                   param="prompt")
        positional, named = [], {}
        for field in (f.strip() for f in rest.split(":")) if rest.strip() else ():
            key, eq, value = field.partition("=")
            if eq:
                key = key.strip().lower()
                if key not in ("te", "unet"):
                    raise InvalidParameter(f"prompt: {tag!r}: {key}= is not supported here (te= and unet= are)",
                                           param="prompt")
                named[key] = _weight(value, tag)
            elif positional or field:
                positional.append(_weight(field, tag))
        if len(positional) > 2:
            raise InvalidParameter(f"prompt: {tag!r}: a third number (A1111's dynamic rank) is not supported; "
                                   "write <lora:NAME:TE:UNET>", param="prompt")
        if not positional and not named:  # <lora:NAME>: the adapter's preferred weight (its A1111 sidecar), else 1.0
            adapters.append({"name": name})
            continue
        te = named.get("te", positional[0] if positional else 1.0)
        unet = named.get("unet", positional[1] if len(positional) > 1 else te)
        adapters.append({"name": name, "scale": te if te == unet else {"text_encoder": te, "denoisers": unet}})
    return tidy(TAG.sub(" ", prompt)), adapters


def _weight(text: str, tag: str) -> float:
    try:
        scale = float(text.strip())
    except ValueError:
        raise InvalidParameter(f"prompt: the weight in {tag!r} is not a number", param="prompt") from None
    if not math.isfinite(scale):
        raise InvalidParameter(f"prompt: the weight in {tag!r} is not finite", param="prompt")
    return scale


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

"""Request bodies (pydantic) and how a body's generation fields are gathered.

Generation fields may sit at the top level of the JSON or inside a literal
``"extra_body"`` object (the seed's curl sends them that way; the openai client
flattens its ``extra_body=`` to the top level). Unknown generation fields are passed
on so the model's spec can name them in its 400.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import InvalidParameter
from ..limits import check_text


class _Text(BaseModel):
    """Every string in a body is checked first (a NUL byte or a lone surrogate is a 400 naming the
    field, not a 500 from the file system, SQLite or a tokenizer later)."""

    @model_validator(mode="before")
    @classmethod
    def _plain_text(cls, data):
        if isinstance(data, dict):
            for key, value in data.items():
                check_text(key, "body")
                check_text(value, str(key))
        return data

# OpenAI request keys that mean nothing for diffusion; accepted and ignored
IGNORED_KEYS = frozenset({"stream", "temperature", "top_p", "max_tokens", "max_completion_tokens", "user",
                          "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stop",
                          "modalities", "quality", "style", "background", "output_format", "moderation",
                          "stream_options", "metadata", "store", "parallel_tool_calls", "n_threads"})


class LoraSpec(BaseModel):
    """The per-request ``lora`` object, with vLLM-Omni's aliases."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = Field(None, validation_alias=AliasChoices("name", "lora_name", "adapter"))
    path: str | None = Field(None, validation_alias=AliasChoices("path", "local_path", "lora_path"))
    # a number, a step schedule, per expert, per-block weights (docs/lora.md): checked when the
    # service resolves the adapters, by backend/lora/schedule.py, naming lora[i].scale and the bad part;
    # none given: the adapter's preferred weight (its A1111 sidecar, backend/lora/sidecar.py), else 1.0
    scale: Any = Field(None, validation_alias=AliasChoices("scale", "lora_scale"))
    int_id: int | None = Field(None, validation_alias=AliasChoices("int_id", "lora_int_id"))

    def as_request(self) -> dict:
        return {"name": self.name, "path": self.path, "scale": self.scale, "int_id": self.int_id}


class _Body(_Text):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    extra_body: dict[str, Any] | None = None
    lora: LoraSpec | list[LoraSpec] | None = None
    n: int = Field(1, ge=1, le=8)

    def fields(self, exclude: frozenset = frozenset()) -> dict:
        """Generation fields from the top level and from ``extra_body`` (which wins)."""
        out = {k: v for k, v in (self.model_extra or {}).items() if k not in IGNORED_KEYS and k not in exclude}
        inner = dict(self.extra_body or {})
        inner.pop("lora", None)
        out.update({k: v for k, v in inner.items() if k not in IGNORED_KEYS and k not in exclude})
        return out

    @model_validator(mode="after")
    def _lora_in_extra_body(self):
        self.adapters()  # a bad extra_body.lora is refused with the body (400), before anything is saved
        return self

    def adapters(self) -> list[dict] | None:
        raw = self.lora
        if raw is None and self.extra_body and "lora" in self.extra_body:
            value = self.extra_body["lora"]
            try:
                raw = [LoraSpec.model_validate(v) for v in value] if isinstance(value, list) else \
                    LoraSpec.model_validate(value)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(["extra_body", "lora", *(str(p) for p in err.get("loc", ()))])
                raise InvalidParameter(f"{where}: {err.get('msg')} (an adapter object "
                                       '{"name", "path", "scale"} or a list of them)', param="extra_body.lora") \
                    from None
        if raw is None:
            return None
        return [s.as_request() for s in (raw if isinstance(raw, list) else [raw])]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)

    def prompt_and_image(self) -> tuple[str, str | None]:
        """The last user message's text, and its image (a data URL), if it carries one."""
        for msg in reversed(self.messages):
            if msg.role != "user":
                continue
            if isinstance(msg.content, str):
                return msg.content, None
            texts, image = [], None
            for part in msg.content or []:
                if part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                elif part.get("type") == "image_url":
                    url = part.get("image_url")
                    image = url.get("url") if isinstance(url, dict) else url
            return " ".join(texts), image
        raise InvalidParameter("messages must contain a user message with the prompt", param="messages")


class GenerationRequest(_Body):
    prompt: str
    size: str | None = None
    response_format: str = "b64_json"

    @field_validator("response_format")
    @classmethod
    def _b64_only(cls, v: str) -> str:
        if v != "b64_json":
            raise ValueError("only 'b64_json' is supported (results are returned inline)")
        return v

    def size_fields(self) -> dict:
        if self.size in (None, "", "auto"):
            return {}
        try:
            w, h = (int(x) for x in self.size.lower().split("x"))
        except ValueError:
            raise InvalidParameter(f"size must be 'WIDTHxHEIGHT' (e.g. '1024x1024'), got {self.size!r}",
                                   param="size") from None
        return {"width": w, "height": h}


class LoadAdapterRequest(_Text):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class _StackRequest(_Text):
    """A stack (the ``lora`` object or list, as in a generation request) and the ``name`` of what it becomes."""

    model_config = ConfigDict(extra="forbid")
    lora: LoraSpec | list[LoraSpec]
    name: str = Field(min_length=1)

    def adapters(self) -> list[dict]:
        return [s.as_request() for s in (self.lora if isinstance(self.lora, list) else [self.lora])]


class ExportAdapterRequest(_StackRequest):
    """``POST /v1/loras/export``: a stack written as one LoRA into the library under ``name``; ``portable``:
    every layer's weight folded into its factors (no per-layer alpha), for tools that read no header config;
    ``layout``: "diffusers" or "kohya" (sd-scripts' ``lora_unet_`` / ``lora_te*_`` names with ``.alpha``)."""

    portable: bool = False
    layout: Literal["diffusers", "kohya"] = "diffusers"


class BakeModelRequest(_StackRequest):
    """``POST /v1/models/bake``: the loaded model with a stack merged in, as ``baked:<name>``."""


class UnloadAdapterRequest(_Text):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def error_body(message: str, kind: str, param=None, code=None) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

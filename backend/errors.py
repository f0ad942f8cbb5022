"""Typed errors. Every error a user can cause is a StudioError with a message that
names the file, key or field at fault; front ends map ``http_status`` and ``kind``
onto their own shapes (OpenAI error JSON, exit code 2, a UI message).

Every error class is defined here and registered in ``ERRORS`` (class name -> class), so an
error crosses a process boundary (worker pipe, Ray stream, the job row) one way:
``exc.to_wire()`` there, ``StudioError.from_wire(d)`` here gives the same class, message,
param, status and type back."""
from __future__ import annotations

ERRORS: dict[str, type["StudioError"]] = {}  # class name -> class: every StudioError, for from_wire


class StudioError(Exception):
    """Base class: a problem the user can fix, with a one-line message."""

    http_status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        ERRORS[cls.__name__] = cls

    def to_wire(self) -> dict:
        """Plain JSON: {"class", "message", "status", "type", "param"} (the job row keeps all but message
        in ``error_detail``)."""
        return {"class": type(self).__name__, "message": self.message, "status": self.http_status,
                "type": self.kind, "param": self.param}

    def replacing(self, old: str, new: str) -> "StudioError":
        """The same error (class, param, status, type) with ``old`` in its message shown as ``new``: a
        server-side path (a staging copy, an upload's temporary file) as the name the user knows."""
        exc = type(self)(self.message.replace(old, new), param=self.param)
        exc.http_status, exc.kind = self.http_status, self.kind
        return exc

    @staticmethod
    def from_wire(d: dict, message: str | None = None) -> "StudioError":
        """The error ``to_wire`` described: its class (StudioError if unknown, e.g. a row written by an
        older version), message (``message`` if given: a job row keeps it apart), param, status, type."""
        cls = ERRORS.get(d.get("class") or "", StudioError)
        exc = cls(message if message is not None else d.get("message") or "the job failed", param=d.get("param"))
        if d.get("status") is not None and int(d["status"]) != cls.http_status:
            exc.http_status = int(d["status"])
        if d.get("type") and d["type"] != cls.kind:
            exc.kind = d["type"]
        return exc


ERRORS["StudioError"] = StudioError


class ServerError(StudioError):
    """A bug or a library failure (not the user's to fix): the message names the exception."""

    http_status = 500
    kind = "server_error"


class InvalidParameter(StudioError):
    """A generation field is unknown, of the wrong type or out of range."""


class ModelNotFound(StudioError):
    http_status = 404
    kind = "not_found_error"


class UnsupportedModel(StudioError):
    """The model loads, but its pipeline class is not one we support."""


class CorruptModel(StudioError):
    """A model directory exists but cannot be loaded."""


class AdapterError(StudioError):
    """An adapter file or folder is missing, unreadable or incompatible."""


class AdapterNotFound(StudioError):
    http_status = 404
    kind = "not_found_error"


class PathNotAllowed(StudioError):
    http_status = 403
    kind = "permission_error"


class ContractViolation(StudioError):
    """A request breaks the sampling contract of a loaded artifact or preset."""

    http_status = 422


class ShuttingDown(StudioError):
    """The server is stopping: a wait for a job ends before the job does (the job stays queued)."""

    http_status = 503
    kind = "server_unavailable"


class Cancelled(StudioError):
    """A generation was cancelled before it finished."""

    http_status = 409
    kind = "cancelled"


class StorageFull(StudioError):
    """The disk (or this process's file-size limit) is full: an output or upload could not be written."""

    http_status = 507
    kind = "insufficient_storage"


class PresetError(StudioError):
    """A preset file is malformed (names the file and the key)."""


class InsufficientMemory(StudioError):
    """The pristine copies of the written layers do not fit where they must be kept."""

    http_status = 507


class QueueFull(StudioError):
    http_status = 429
    kind = "rate_limit_error"


class JobNotFound(StudioError):
    http_status = 404
    kind = "not_found_error"


class StoreError(StudioError):
    """The job store cannot be used as it is (corrupt, or written by a newer LoRA Studio)."""

    http_status = 500
    kind = "server_error"


class WorkerStartError(StudioError):
    """The worker could not load the model it was started with."""


class Timeout(StudioError):
    """A job ran past its time limit, or a wait for one did."""

    http_status = 504
    kind = "timeout"


class BodyTooLarge(StudioError):
    http_status = 413


class BodyTooSlow(StudioError):
    http_status = 408


class LayerWriteFailed(Exception):
    """Internal to the LoRA engine (merge and unfused): writing one layer failed; the engine rolls
    back and turns it into an AdapterError naming the layer. Never crosses a process boundary."""

    def __init__(self, layer: str, cause: Exception):
        super().__init__(layer)
        self.layer, self.cause = layer, cause


class NonFinite(Exception):
    """Internal to the LoRA engine: a layer's new weights would not be finite (the cause above)."""


# errno values that mean "no room to write": the device is full, a quota, a file-size limit
STORAGE_ERRNOS = frozenset({28, 122, 27})  # ENOSPC, EDQUOT (Linux), EFBIG


def storage_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS

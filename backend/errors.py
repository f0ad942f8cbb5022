"""Typed errors. Every error a user can cause is a StudioError with a message that
names the file, key or field at fault; front ends map ``http_status`` and ``kind``
onto their own shapes (OpenAI error JSON, exit code 2, a UI message)."""
from __future__ import annotations


class StudioError(Exception):
    """Base class: a problem the user can fix, with a one-line message."""

    http_status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


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


# errno values that mean "no room to write": the device is full, a quota, a file-size limit
STORAGE_ERRNOS = frozenset({28, 122, 27})  # ENOSPC, EDQUOT (Linux), EFBIG


def storage_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS

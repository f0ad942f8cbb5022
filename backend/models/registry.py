"""The supported-pipeline registry: a pipeline class's request spec, read from its family.

The facts themselves (denoisers, output, defaults, request fields, LoRA routing, demo models)
live in one module per family under ``backend/families``; this module keeps the names the rest
of the backend imports.
"""
from __future__ import annotations

from ..families import COMMON_FIELDS, VIDEO_FIELDS, PipelineSpec, spec_for

__all__ = ["COMMON_FIELDS", "VIDEO_FIELDS", "PipelineSpec", "spec_for"]

from .registry import PipelineSpec, spec_for
from .resolve import ResolvedModel, resolve_model

__all__ = ["PipelineSpec", "ResolvedModel", "resolve_model", "spec_for"]

"""Distill backend: few-step LoRAs fused into the base once, with an exact way back.

``FusedBase`` owns the fused-weight lifecycle of one pipeline; ``support`` says which
pipelines it fuses into and routes files to denoisers; ``demo_files`` writes seeded
stand-ins in the publishers' key layouts; ``bench`` measures fuse/restore vs reload.
"""
from .lifecycle import FusedBase, FusedFile, FusedState
from .support import plan, support_for

__all__ = ["FusedBase", "FusedFile", "FusedState", "plan", "support_for"]

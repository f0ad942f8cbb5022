"""From a path on disk to adapter factors bound to a pipeline: read, convert, fit.

Everything here runs on CPU and never touches the model's weights, so it can run outside
the device critical section and a refused adapter leaves nothing behind.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .convert import convert
from .fit import Binding, FitReport, fit
from ..cpu_tasks import single_threaded
from .formats import AdapterRecord, file_stamp, read_tensors


@dataclass
class LoadedAdapter:
    """An adapter that fits the loaded pipeline: its record, fit and bound factors (CPU)."""

    name: str
    int_id: int
    record: AdapterRecord
    report: FitReport
    stamp: tuple[int, int]  # (mtime_ns, size) of the weights file when read
    identity: tuple | None = None  # (resolved weights file, sha256): the engine's cache key, set on insert

    @property
    def bindings(self) -> dict[str, Binding]:
        return self.report.bindings

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.bindings.values()
                   for f in b.layers.values() for t in f.tensors.values())

    def is_stale(self) -> bool:
        try:
            return file_stamp(self.record.file) != self.stamp
        except OSError:
            return True


def fit_adapter(path, pipeline_cls, denoisers: dict[str, torch.nn.Module], name: str | None = None) -> FitReport:
    """The fit report of an adapter against the given denoisers (meta-device skeletons work)."""
    if getattr(pipeline_cls, "__name__", "") == "MiniMaxH3ModularPipeline":  # contracts, layouts, partitions
        from ..minimax.adapters import fit_report

        return fit_report(path, denoisers, name=name)
    with single_threaded():  # hundreds of small-tensor ops: parallel regions only add barriers
        raw = read_tensors(path, name)
        converted = convert(raw, pipeline_cls, default_component=next(iter(denoisers), "transformer"))
        return fit(converted, denoisers, adapter=raw.record.name, file=str(raw.record.file))


def load_adapter(path, pipeline_cls, denoisers: dict[str, torch.nn.Module], *, name: str, int_id: int,
                 model: str) -> LoadedAdapter:
    """Read, convert and fit; raises AdapterError (with ``.report``) when it does not fit."""
    with single_threaded():  # hundreds of small-tensor ops: parallel regions only add barriers
        raw = read_tensors(path, name)
        converted = convert(raw, pipeline_cls, default_component=next(iter(denoisers), "transformer"))
        report = fit(converted, denoisers, adapter=name, file=str(raw.record.file))
    report.raise_if_refused(model)
    return LoadedAdapter(name=name, int_id=int_id, record=raw.record, report=report, stamp=raw.stamp)

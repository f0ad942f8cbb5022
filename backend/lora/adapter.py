"""From a path on disk to adapter factors bound to a pipeline: read, convert, fit.

Everything here runs on CPU and never touches the model's weights, so it can run outside
the device critical section and a refused adapter leaves nothing behind.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .family import LoRAFamily, hooks_for
from .fit import Binding, FitReport
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
    data: object = None  # the family's facts about the file (``family.Converted.data``: MiniMax-H3's contract)

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


def fit_adapter(path, pipeline_cls, denoisers: dict[str, torch.nn.Module], name: str | None = None,
                encoders: dict[str, torch.nn.Module] | None = None) -> FitReport:
    """The fit report of an adapter against the given denoisers and text encoders (meta-device skeletons
    work)."""
    return _read_and_fit(path, hooks_for(pipeline_cls), denoisers, name, encoders)[1]


def _read_and_fit(path, family: LoRAFamily, denoisers, name, encoders=None):
    """Read, convert (the family's hook) and fit (the shared report): (raw, report, converted)."""
    with single_threaded():  # hundreds of small-tensor ops: parallel regions only add barriers
        raw = read_tensors(path, name)
        converted = family.convert(raw, denoisers, encoders)
        report = family.fit(converted, denoisers, adapter=name or raw.record.name, file=str(raw.record.file),
                            encoders=encoders)
    return raw, report, converted


def load_adapter(path, pipeline_cls, denoisers: dict[str, torch.nn.Module], *, name: str, int_id: int,
                 model: str, family: LoRAFamily | None = None,
                 encoders: dict[str, torch.nn.Module] | None = None) -> LoadedAdapter:
    """Read, convert and fit; raises AdapterError (with ``.report``) when it does not fit."""
    raw, report, converted = _read_and_fit(path, family or hooks_for(pipeline_cls), denoisers, name, encoders)
    report.raise_if_refused(model)
    return LoadedAdapter(name=name, int_id=int_id, record=raw.record, report=report, stamp=raw.stamp,
                         data=converted.data)

"""Run records: the event schema, the append-only store and the pure metrics computed from it.

This package imports no torch and nothing from ffctl, so reports can be recomputed anywhere.
"""
from __future__ import annotations

from runs.events import Event, EventKind, RunStatus
from runs.metrics import FaultMetrics, RunMetrics, compute
from runs.store import RunStore, open_run

__all__ = [
    "Event",
    "EventKind",
    "FaultMetrics",
    "RunMetrics",
    "RunStatus",
    "RunStore",
    "compute",
    "open_run",
]

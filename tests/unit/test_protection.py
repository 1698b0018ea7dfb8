"""The unprotected window: when a node's ranks have no copy of their state on another node, it
is recorded (`protection_lost`) until the new neighbour reports holding their copies
(`protection_restored`), and the report sums the union of those windows."""
from __future__ import annotations

from typing import Any

import pytest

from ffctl.controller.protection import Protection
from ffctl.controller.state import JobState
from runs.events import EventKind
from runs.metrics import compute
from tests.helpers.events import StreamBuilder


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[EventKind, dict[str, Any]]] = []

    def __call__(self, kind: EventKind, /, t: float | None = None, **data: Any) -> None:
        self.events.append((kind, data))


def job_on(placement: dict[int, int]) -> JobState:
    job = JobState.for_world(2, 2)
    job.members = dict(placement)
    return job


def test_a_node_left_alone_with_ranks_is_unprotected_until_its_new_neighbour_holds_a_copy() -> None:
    # Node 1 was lost; its ranks were placed on node 0, the only node up.
    rec = Recorder()
    prot = Protection(job_on({0: 0, 1: 0, 2: 0, 3: 0}), rec, enabled=True)
    job = prot.job
    job.members = {0: 0, 1: 0, 2: 1, 3: 1}  # right after the loss: node 1's ranks not placed yet
    why = "no other node is up to hold a copy of its ranks' state"
    prot.wired({0: None})
    job.members = {0: 0, 1: 0, 2: 0, 3: 0}  # the recovery placed them on node 0
    prot.wired({0: None})
    prot.wired({0: None})  # wired again while still alone, nothing new: no event
    assert rec.events == [(EventKind.PROTECTION_LOST, {"node": 0, "ranks": [0, 1], "reason": why}),
                          (EventKind.PROTECTION_LOST, {"node": 0, "ranks": [0, 1, 2, 3], "reason": why})]
    prot.replicated(0)  # a report from before node 1 was back: not yet protected
    assert len(rec.events) == 2
    prot.wired({0: 1, 1: 0})  # node 1's agent is back: a neighbour, but no copy on it yet
    assert len(rec.events) == 2
    prot.replicated(1)  # another node's report says nothing of node 0's copies
    assert len(rec.events) == 2
    prot.replicated(0)
    (kind, data), = rec.events[2:]
    assert kind is EventKind.PROTECTION_RESTORED and data["node"] == 0 and data["unprotected_s"] >= 0


@pytest.mark.parametrize("enabled, placement", [(False, {0: 0, 1: 0}), (True, {0: 1, 1: 1})])
def test_no_window_without_copies_in_memory_or_without_ranks_on_the_node(enabled: bool,
                                                                          placement: dict[int, int]) -> None:
    rec = Recorder()
    Protection(job_on(placement), rec, enabled=enabled).wired({0: None})
    assert rec.events == []


def test_the_report_sums_the_union_of_the_windows_open_ones_to_the_end() -> None:
    b = StreamBuilder(start=1000.0)
    b.run_started(world_size=2, strategy="peer")
    b.emit(EventKind.PROTECTION_LOST, 10.0, node=0, ranks=[0, 1], reason="r")  # t=1010
    b.emit(EventKind.PROTECTION_LOST, 2.0, node=1, ranks=[2], reason="r")  # 1012, overlaps node 0's
    b.emit(EventKind.PROTECTION_LOST, 1.0, node=0, ranks=[0, 1, 3], reason="r")  # 1013: the same window
    b.emit(EventKind.PROTECTION_RESTORED, 2.0, node=0, unprotected_s=5.0)  # 1015
    b.emit(EventKind.PROTECTION_RESTORED, 2.0, node=1, unprotected_s=5.0)  # 1017
    b.emit(EventKind.PROTECTION_LOST, 3.0, node=0, ranks=[0], reason="r")  # 1020, open to the end
    b.run_finished("completed", dt=4.0)  # 1024
    rep = compute("r", b.events)
    assert rep.unprotected_s == pytest.approx((1017 - 1010) + (1024 - 1020))
    assert compute("r", [ev for ev in b.events if not ev.kind.value.startswith("protection")]).unprotected_s == 0

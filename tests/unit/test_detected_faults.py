"""Failures ffctl did not inject are faults of kind `detected` in the report.

A rank killed from outside, an agent that stopped beating, a crash of the script itself: the
controller detects and recovers from them like any injected fault, and `runs.metrics.compute`
turns every `failure_detected` event that no injected fault explains into a fault, measured from
the failure's onset (its `onset_t`) with the same lost-time model. One that an injected fault
explains stays that fault and is not counted twice. The streams are written by hand; the last
tests check that the coordinator records what the metrics need.
"""
from __future__ import annotations

from typing import Any

import pytest

from runs.events import Event, EventKind
from runs.metrics import DETECTED, RunMetrics, compute
from tests.helpers.events import STEP_TIME_S, StreamBuilder
from tests.unit.test_orchestrator import _cluster, _coordinator, _job, _rank_exit

WORLD = 4


def approx(value: float) -> Any:
    return pytest.approx(value, rel=1e-12, abs=1e-12)


def detected(b: StreamBuilder, failure_id: str, onset_t: float, onset: str, cause: str, ranks: list[int],
             nodes: list[int], gen: int = 0, dt: float = 0.0, explained_by: list[str] | None = None,
             fault_ids: list[str] | None = None) -> Event:
    """A `failure_detected` event as the coordinator writes it."""
    return b.emit(EventKind.FAILURE_DETECTED, dt, fault_ids=list(fault_ids or []), cause=cause, ranks=ranks,
                  nodes=nodes, gen=gen, failure_id=failure_id, onset_t=onset_t, onset=onset,
                  explained_by=list(explained_by if explained_by is not None else (fault_ids or [])))


def decided(b: StreamBuilder, failure_ids: list[str], gen: int, restore_step: int, dt: float = 0.25,
            fault_ids: list[str] | None = None) -> Event:
    return b.emit(EventKind.RECOVERY_DECIDED, dt, fault_ids=list(fault_ids or []), failure_ids=failure_ids, gen=gen,
                  restore_step=restore_step, restore_source="local-memory", strategy="peer")


def regrow(b: StreamBuilder, gen: int, restore_step: int) -> None:
    """The rest of a recovery once decided: spawn, rendezvous, restore."""
    b.ranks_spawned(gen, dt=1.0)
    b.rendezvous_done(gen, dt=0.5)
    b.restore_done(gen, restore_step, "local-memory", dt=0.25)


def only(m: RunMetrics) -> Any:
    (f,) = m.faults
    return f


def test_a_rank_killed_from_outside_is_a_detected_fault_with_its_lost_time() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    last = b.steps(1, 20)[-1]
    exit_seen = b.wait(0.125)
    det = detected(b, "d1", exit_seen, "reported", "process-exit", ranks=[1], nodes=[], dt=0.0625)
    decided(b, ["d1"], gen=1, restore_step=20)
    regrow(b, 1, 20)
    resumed = b.step(21, gen=1)
    b.steps(22, 30, gen=1)
    b.run_finished("completed", dt=0.25)
    m = compute("r", b.events)
    f = only(m)
    assert (f.fault_id, f.kind, f.target, f.cause, f.measured_from) == ("d1", DETECTED, "rank:1", "process-exit",
                                                                        "reported")
    assert f.injected_at == exit_seen and f.detected_at == det.t
    assert f.detection_s == approx(det.t - exit_seen)
    assert f.recovered and f.resumed_at == resumed.t
    assert f.recovery_s == approx(resumed.t - exit_seen)
    assert (f.at_step, f.restore_step, f.lost_steps, f.restore_source) == (20, 20, 0, "local-memory")
    # The same model as an injected kill: from the last commit before it to the first step back at
    # pace, less the one step that interval should take.
    assert f.lost_s == approx(resumed.t - last.t - STEP_TIME_S) and f.lost_s > 0
    assert f.lost_gpu_hours == approx(WORLD * f.lost_s / 3600.0)
    assert m.lost_gpu_hours_total == approx(f.lost_gpu_hours)
    assert m.to_dict()["faults"][0]["kind"] == "detected"


def test_a_node_that_stopped_beating_is_measured_from_its_last_heartbeat() -> None:
    """A stopped agent: its ranks go on committing until the heartbeat limit runs out. The fault
    counts from the last beat; the steps committed meanwhile were in flight and are lost again."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    last = b.steps(1, 20)[-1]
    beat = b.wait(0.125)
    b.steps(21, 22)  # the ranks go on until the node is declared lost
    det = detected(b, "d1", beat, "last-heartbeat", "node-lost", ranks=[], nodes=[1], dt=0.125)
    decided(b, ["d1"], gen=1, restore_step=21)
    regrow(b, 1, 21)
    b.steps(22, 22, gen=1)
    resumed = b.step(23, gen=1)
    b.steps(24, 30, gen=1)
    b.run_finished("completed", dt=0.25)
    f = only(compute("r", b.events))
    assert (f.kind, f.target, f.cause, f.measured_from) == (DETECTED, "node:1", "node-lost", "last-heartbeat")
    assert f.detection_s == approx(det.t - beat)
    assert f.at_step == 22 and f.lost_steps == 1  # 22 was committed before the loss was seen
    assert f.resumed_at == resumed.t and f.recovery_s == approx(resumed.t - beat)
    # From step 20's commit to step 23's (back at pace) three steps were gained.
    assert f.back_at_pace_at == resumed.t
    assert f.lost_s == approx(resumed.t - last.t - 3 * STEP_TIME_S) and f.lost_s > 0


def test_a_failure_an_injected_fault_explains_stays_that_fault() -> None:
    """kill-rank f1 is detected; while the job recovers, rank 2 fails too (its group torn down
    under it): the coordinator lays that to f1, and the report shows f1 alone, billed once."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 20)
    b.fault_injected("f1", at_step=20, dt=0.125)
    detected(b, "d1", b.t, "reported", "process-exit", ranks=[1], nodes=[], fault_ids=["f1"], dt=0.0625)
    decided(b, ["d1"], gen=1, restore_step=20, fault_ids=["f1"])
    detected(b, "d2", b.t + 0.5, "reported", "process-exit", ranks=[2], nodes=[], gen=1, dt=0.5,
             explained_by=["f1"])
    decided(b, ["d1", "d2"], gen=2, restore_step=20)
    regrow(b, 2, 20)
    b.steps(21, 30, gen=2)
    b.run_finished("completed", dt=0.25)
    m = compute("r", b.events)
    f = only(m)
    assert (f.fault_id, f.kind, f.cause, f.measured_from) == ("f1", "kill-rank", "process-exit", "injection")
    assert f.recovered and m.lost_gpu_hours_total == approx(f.lost_gpu_hours)


def test_a_failure_while_an_injected_fault_is_in_force_is_not_counted_again() -> None:
    """A partition of 5 s: detected, recovered, and the job fails again before it is reverted.
    The second failure names no injected fault (f1 was already detected), yet f1 explains it."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 20)
    b.fault_injected("f1", kind="net-partition", target="node:1", ranks=(), nodes=(1,), at_step=20, duration=5.0)
    detected(b, "d1", b.t, "last-progress", "hang", ranks=[], nodes=[], fault_ids=["f1"], dt=1.0)
    decided(b, ["d1"], gen=1, restore_step=20, fault_ids=["f1"])
    regrow(b, 1, 20)
    detected(b, "d2", b.t, "last-heartbeat", "node-lost", ranks=[], nodes=[1], gen=1, dt=1.0)
    decided(b, ["d2"], gen=2, restore_step=20)
    regrow(b, 2, 20)
    b.fault_reverted("f1", dt=0.25)
    b.steps(21, 30, gen=2)
    b.run_finished("completed", dt=0.25)
    assert [f.fault_id for f in compute("r", b.events).faults] == ["f1"]


def test_detected_and_injected_faults_are_listed_in_time_order_and_summed() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 10)
    detected(b, "d1", b.t, "reported", "process-exit", ranks=[3], nodes=[], dt=0.0625)
    decided(b, ["d1"], gen=1, restore_step=10)
    regrow(b, 1, 10)
    b.steps(11, 20, gen=1)
    b.fault_injected("f1", at_step=20, gen=1, dt=0.125)
    detected(b, "d2", b.t, "reported", "process-exit", ranks=[1], nodes=[], gen=1, fault_ids=["f1"], dt=0.0625)
    decided(b, ["d2"], gen=2, restore_step=20, fault_ids=["f1"])
    regrow(b, 2, 20)
    b.steps(21, 30, gen=2)
    b.run_finished("completed", dt=0.25)
    m = compute("r", b.events)
    assert [(f.fault_id, f.kind) for f in m.faults] == [("d1", DETECTED), ("f1", "kill-rank")]
    assert all(f.recovered and f.lost_s > 0 for f in m.faults)
    assert m.lost_gpu_hours_total == approx(sum(f.lost_gpu_hours for f in m.faults))


def test_a_detected_failure_that_stopped_the_job_is_lost_to_the_end() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    last = b.steps(1, 20)[-1]
    detected(b, "d1", b.t + 0.125, "reported", "process-exit", ranks=[1], nodes=[], dt=0.25)
    b.emit(EventKind.RECOVERY_FAILED, 0.5, fault_ids=[], failure_ids=["d1"], reason="crash loop")
    end = b.run_finished("failed", dt=0.25)
    f = only(compute("r", b.events))
    assert f.kind == DETECTED and not f.recovered and f.resumed_at is None
    assert f.lost_s == approx(end.t - last.t)


def test_an_older_record_without_failure_ids_ties_a_failure_to_the_next_recovery() -> None:
    """A record written before failures were numbered: no failure_id, no onset. The failure is
    measured from its detection and recovered by the next decision."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 20)
    det = b.failure_detected([], gen=0, cause="process-exit", ranks=[1], nodes=[], dt=0.25)
    b.recovery([], gen=1, restore_step=20)
    resumed = b.step(21, gen=1)
    b.steps(22, 30, gen=1)
    b.run_finished("completed", dt=0.25)
    f = only(compute("r", b.events))
    assert (f.fault_id, f.kind, f.measured_from, f.detection_s) == ("d1", DETECTED, "detection", 0.0)
    assert f.injected_at == det.t and f.resumed_at == resumed.t and f.lost_s > 0


def test_the_coordinator_numbers_failures_and_says_when_they_began() -> None:
    """What the metrics read: each failure's id, onset and the injected faults that explain it,
    and the failures each decision handled."""
    job = _job()
    cluster = _cluster(job)
    first = _rank_exit(job, 1, t=5.0)
    first.since, first.since_what = 4.5, "last-heartbeat"
    job.fail(first)
    cluster.blame = [[], []]
    cluster.on_await[1] = lambda: job.fail(_rank_exit(job, 3, t=6.0))
    _coordinator(cluster).recover()
    d1, d2 = cluster.recorded(EventKind.FAILURE_DETECTED)
    assert (d1["failure_id"], d1["onset_t"], d1["onset"], d1["explained_by"]) == ("d1", 4.5, "last-heartbeat", [])
    assert (d2["failure_id"], d2["onset_t"], d2["onset"], d2["explained_by"]) == ("d2", 6.0, "reported", [])
    assert [d["failure_ids"] for d in cluster.recorded(EventKind.RECOVERY_DECIDED)] == [["d1"], ["d1", "d2"]]


def test_a_failure_cutting_short_an_injected_faults_recovery_is_laid_to_it() -> None:
    job = _job()
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))
    cluster.blame = [["f1"], []]
    cluster.on_await[1] = lambda: job.fail(_rank_exit(job, 3, t=2.0))
    outcome = _coordinator(cluster).recover()
    d1, d2 = cluster.recorded(EventKind.FAILURE_DETECTED)
    assert d1["explained_by"] == ["f1"] and d2["fault_ids"] == [] and d2["explained_by"] == ["f1"]
    # The restart budget is as before: the second failure names no injected fault, so it counts.
    assert outcome.restarts == 1

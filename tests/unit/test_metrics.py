"""Recovery metrics computed from hand-written event streams (`runs.metrics.compute`).

Each scenario spells out a run's events on the controller clock and checks the figures docs/guides/reports.md
defines: detection_s, recovery_s (to the commit of step m+1), the breakdown, lost_steps,
lost_gpu_hours and the per-run totals, and the JSON shape of `ffctl report --json`.
"""
from __future__ import annotations

import json
import math
from typing import Any

import pytest

from wire.fault_spec import FaultKind
from runs.events import Event, EventKind, RestoreSource, RunStatus
from runs.metrics import BREAKDOWN_KEYS, FaultMetrics, RunMetrics, compute, final_losses
from tests.helpers.events import STEP_TIME_S, StreamBuilder, loss_at

WORLD = 4


def approx(value: float) -> Any:
    return pytest.approx(value, rel=1e-12, abs=1e-12)


def only_fault(m: RunMetrics) -> FaultMetrics:
    assert len(m.faults) == 1
    return m.faults[0]


def fault_by_id(m: RunMetrics, fault_id: str) -> FaultMetrics:
    matches = [f for f in m.faults if f.fault_id == fault_id]
    assert len(matches) == 1, [f.fault_id for f in m.faults]
    return matches[0]


def gpu_hours(seconds: float, world_size: int = WORLD) -> float:
    return world_size * seconds / 3600.0


# --------------------------------------------------------------------------------------------
# A run without faults
# --------------------------------------------------------------------------------------------


def fault_free_run() -> tuple[StreamBuilder, dict[int, float]]:
    b = StreamBuilder(start=1000.0)
    b.run_started(world_size=WORLD, strategy="peer")
    times = {1: 0.5, 2: 0.25, 3: 0.75, 4: 0.5, 5: 0.125, 6: 0.5, 7: 1.0, 8: 0.5}
    for step, step_time in times.items():
        b.step(step, step_time_s=step_time)
    b.run_finished("completed", dt=1.0, steps_completed=8)
    return b, times


def test_fault_free_run_losses_and_steps() -> None:
    b, _ = fault_free_run()
    m = compute("clean", b.events)
    assert m.run_id == "clean"
    assert m.status == "completed"
    assert m.strategy == "peer"
    assert m.world_size == WORLD
    assert m.steps_completed == 8
    assert m.loss_by_step == [[s, loss_at(s)] for s in range(1, 9)]
    assert m.final_loss == loss_at(8)
    assert m.faults == []
    assert m.lost_gpu_hours_total == 0.0
    assert m.spare_gpu_hours == 0.0


def test_fault_free_goodput_is_step_time_over_wall_time() -> None:
    b, times = fault_free_run()
    m = compute("clean", b.events)
    wall = b.events[-1].t - b.events[0].t
    assert wall == 1.0 + sum(times.values())  # 1 s of start-up/shutdown besides the steps
    assert m.wall_s == approx(wall)
    assert m.goodput == approx(sum(times.values()) / wall)
    assert 0.0 < m.goodput < 1.0


def test_no_events_at_all() -> None:
    m = compute("empty", [])
    assert m.status == "running"
    assert m.steps_completed == 0
    assert m.final_loss is None
    assert m.loss_by_step == []
    assert m.faults == []
    assert m.goodput is None


# --------------------------------------------------------------------------------------------
# One kill-rank fault under restart-disk, checkpoint every 10 steps
# --------------------------------------------------------------------------------------------


class DiskRecovery:
    """kill-rank at step 25, restored from the step-20 disk checkpoint, replay 21..25, resume 26."""

    def __init__(self) -> None:
        b = StreamBuilder(start=1000.0)
        self.b = b
        self.started = b.run_started(world_size=WORLD, strategy="restart-disk")
        for s in range(1, 26):
            b.step(s)
            if s % 10 == 0:
                b.snapshot(s, kind="disk", ranks=range(WORLD))
        self.injected = b.fault_injected("f1", at_step=25, kind="kill-rank", target="rank:1", dt=0.25)
        b.rank_exited(1, gen=0, dt=0.125)
        self.detected = b.failure_detected(["f1"], gen=0, dt=0.375)
        self.decided = b.recovery_decided(["f1"], gen=1, restore_step=20, restore_source="disk",
                                          strategy="restart-disk", dt=0.25)
        self.spawned = b.ranks_spawned(1, ranks=range(WORLD), dt=4.0)
        self.rendezvous = b.rendezvous_done(1, dt=1.0)
        self.restored = b.restore_done(1, step=20, source="disk", dt=2.0)
        self.replay = b.steps(21, 25, gen=1)
        self.resumed = b.step(26, gen=1)
        b.steps(27, 30, gen=1)
        self.finished = b.run_finished("completed", dt=0.5, steps_completed=30)
        self.metrics = compute("disk", b.events)


@pytest.fixture(scope="module")
def disk() -> DiskRecovery:
    return DiskRecovery()


def test_disk_detection_and_recovery_time(disk: DiskRecovery) -> None:
    f = only_fault(disk.metrics)
    assert f.fault_id == "f1"
    assert f.kind == "kill-rank"
    assert f.target == "rank:1"
    assert f.emulated is False
    assert f.injected_at == disk.injected.t
    assert f.detected_at == disk.detected.t
    assert f.resumed_at == disk.resumed.t
    assert f.detection_s == approx(0.5)
    # resumed = when step m+1 = 26 was committed by the new generation.
    assert f.recovery_s == approx(disk.resumed.t - disk.injected.t)
    assert f.recovery_s == approx(0.5 + 0.25 + 4.0 + 1.0 + 2.0 + 6 * STEP_TIME_S)
    assert f.recovered is True


def test_disk_breakdown_phases_add_up_to_recovery(disk: DiskRecovery) -> None:
    f = only_fault(disk.metrics)
    assert set(f.breakdown) == set(BREAKDOWN_KEYS)
    assert f.breakdown["detect"] == approx(disk.detected.t - disk.injected.t)
    assert f.breakdown["decide"] == approx(0.25)
    assert f.breakdown["spawn"] == approx(4.0)
    assert f.breakdown["rendezvous"] == approx(1.0)
    assert f.breakdown["restore"] == approx(2.0)
    # Replay of 21..25 plus the first new step 26.
    assert f.breakdown["replay"] == approx(disk.resumed.t - disk.restored.t)
    assert f.breakdown["replay"] == approx(6 * STEP_TIME_S)
    assert sum(f.breakdown.values()) == approx(f.recovery_s)


def test_disk_lost_steps_source_and_gpu_hours(disk: DiskRecovery) -> None:
    m = disk.metrics
    f = only_fault(m)
    assert f.at_step == 25
    assert f.restore_step == 20
    assert f.lost_steps == 5
    assert f.restore_source == "disk"
    # lost_s runs from the last commit before the fault (step 25) to the commit of 26, where the
    # job is back at its pace, less the one step of progress it made: recovery_s plus the part of
    # step 26 lost at the kill, less one step.
    last_before = disk.injected.t - 0.25
    assert f.pace_s == approx(STEP_TIME_S)
    assert f.back_at_pace_at == disk.resumed.t
    assert f.lost_s == approx(disk.resumed.t - last_before - STEP_TIME_S)
    assert f.lost_s == approx(f.recovery_s + 0.25 - STEP_TIME_S)
    assert f.lost_gpu_hours == approx(WORLD * f.lost_s / 3600.0)
    assert m.lost_gpu_hours_total == approx(f.lost_gpu_hours)


def test_disk_loss_by_step_keeps_the_replayed_values(disk: DiskRecovery) -> None:
    m = disk.metrics
    expected = {s: loss_at(s, gen=0) for s in range(1, 21)}
    expected.update({s: loss_at(s, gen=1) for s in range(21, 31)})
    assert m.loss_by_step == [[s, expected[s]] for s in range(1, 31)]
    # The first commits of 21..25 (generation 0) were rolled back and are gone.
    assert all(loss_at(s, 0) != loss_at(s, 1) for s in range(21, 26))
    assert m.steps_completed == 30
    assert m.final_loss == loss_at(30, gen=1)
    assert m.status == "completed"
    assert m.strategy == "restart-disk"


def test_disk_goodput_counts_each_final_step_once(disk: DiskRecovery) -> None:
    m = disk.metrics
    wall = disk.finished.t - disk.started.t
    # 30 committed steps; the 5 rolled-back commits of generation 0 are not useful work.
    assert m.goodput == approx(30 * STEP_TIME_S / wall)


def test_skipped_phases_take_no_time() -> None:
    """A warm spare already runs (no spawn) and a survivor-only rollback restores nothing new."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 8)
    inj = b.fault_injected("f", at_step=8, dt=0.25)
    det = b.failure_detected(["f"], gen=0, dt=0.125)
    decided = b.recovery_decided(["f"], gen=1, restore_step=8, dt=0.125)
    rdv = b.rendezvous_done(1, dt=0.75)
    resumed = b.step(9, gen=1)
    f = only_fault(compute("skip", b.events))
    assert f.breakdown["detect"] == approx(det.t - inj.t)
    assert f.breakdown["decide"] == approx(decided.t - det.t)
    assert f.breakdown["spawn"] == 0.0
    assert f.breakdown["rendezvous"] == approx(rdv.t - decided.t)
    assert f.breakdown["restore"] == 0.0
    assert f.breakdown["replay"] == approx(resumed.t - rdv.t)
    assert sum(f.breakdown.values()) == approx(f.recovery_s)


def test_final_losses_forgets_steps_past_the_restore_step() -> None:
    b = StreamBuilder()
    b.steps(1, 5)
    b.recovery_decided(["f"], gen=1, restore_step=3)
    assert final_losses(b.events) == {s: loss_at(s) for s in (1, 2, 3)}
    b.step(4, gen=1)
    assert final_losses(b.events) == {1: loss_at(1), 2: loss_at(2), 3: loss_at(3), 4: loss_at(4, 1)}


def test_a_restored_step_no_report_reached_keeps_the_loss_its_copies_recorded() -> None:
    """Every rank that trained step 4 was lost after its copy was held off-node and before its
    report went out: the restore of step 4 brings its loss into the record, and the job goes
    on at step 5 with no step missing."""
    b = StreamBuilder()
    b.steps(1, 3)
    b.recovery_decided(["f"], gen=1, restore_step=4)
    b.emit(EventKind.RESTORE_DONE, 0.1, gen=1, step=4, source="peer-memory", loss=0.625)
    b.step(5, gen=1)
    m = compute("r", b.events)
    assert m.loss_by_step == [[1, loss_at(1)], [2, loss_at(2)], [3, loss_at(3)], [4, 0.625], [5, loss_at(5, 1)]]
    # A report of the step, when one came, is the record's (a restore never overwrites it);
    # a restore_done without a loss, or with garbage in it, adds nothing.
    b2 = StreamBuilder()
    b2.steps(1, 4)
    b2.recovery_decided(["f"], gen=1, restore_step=4)
    b2.emit(EventKind.RESTORE_DONE, 0.1, gen=1, step=4, source="peer-memory", loss=9.0)
    assert final_losses(b2.events)[4] == loss_at(4)
    b3 = StreamBuilder()
    b3.steps(1, 3)
    b3.recovery_decided(["f"], gen=1, restore_step=4)
    b3.emit(EventKind.RESTORE_DONE, 0.1, gen=1, step=4, source="peer-memory", loss="0.5")
    b3.emit(EventKind.RESTORE_DONE, 0.1, gen=1, step=4, source="peer-memory", loss=None)
    assert 4 not in final_losses(b3.events)
    # A launch that resumed another run's checkpoint of step 4 (its generation 0 restores it)
    # did not train step 4, nor does a later restore of that step make it this run's.
    b4 = StreamBuilder()
    b4.emit(EventKind.RESTORE_DONE, 0.1, gen=0, step=4, source="disk", loss=0.5)
    b4.step(5)
    b4.recovery_decided(["f"], gen=1, restore_step=4)
    b4.emit(EventKind.RESTORE_DONE, 0.1, gen=1, step=4, source="local-memory", loss=0.5)
    b4.step(5, gen=1)
    assert final_losses(b4.events) == {5: loss_at(5, 1)}


# --------------------------------------------------------------------------------------------
# The race: the old generation commits m+1 after the injection, before the detection
# --------------------------------------------------------------------------------------------


def race_run() -> dict[str, Any]:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 25)
    injected = b.fault_injected("f1", at_step=25, dt=0.125)
    late = b.step(26, gen=0, step_time_s=0.25)  # old generation, still running
    detected = b.failure_detected(["f1"], gen=0, dt=0.25)
    # 26's snapshot had not reached the peer yet: restore 25, redo 26.
    rec = b.recovery(["f1"], gen=1, restore_step=25, restore_source="peer-memory")
    replay_26 = b.step(26, gen=1)  # generation 1 redoes 26: not yet past m
    resumed = b.step(27, gen=1)
    b.steps(28, 30, gen=1)
    b.run_finished("completed", dt=0.25)
    return {"b": b, "injected": injected, "late": late, "detected": detected, "rec": rec,
            "replay_26": replay_26, "resumed": resumed}


def test_race_step_after_injection_counts_toward_m() -> None:
    r = race_run()
    f = only_fault(compute("race", r["b"].events))
    assert f.at_step == 26
    assert f.restore_step == 25
    assert f.lost_steps == 1


def test_race_resumed_comes_from_the_new_generation() -> None:
    r = race_run()
    f = only_fault(compute("race", r["b"].events))
    # Neither the old generation's late 26 nor the new generation's replayed 26 is m+1.
    assert f.resumed_at == r["resumed"].t
    assert f.recovery_s == approx(r["resumed"].t - r["injected"].t)
    assert f.detection_s == approx(r["detected"].t - r["injected"].t)
    assert f.breakdown["replay"] == approx(r["resumed"].t - r["rec"]["restored"].t)
    assert sum(f.breakdown.values()) == approx(f.recovery_s)


def test_late_commit_record_of_the_old_generation_is_not_the_resumption() -> None:
    """A commit of the old generation that reaches the controller after the decision."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 25)
    injected = b.fault_injected("f1", at_step=25, dt=0.125)
    b.failure_detected(["f1"], gen=0, dt=0.25)
    b.recovery_decided(["f1"], gen=1, restore_step=25, dt=0.25)
    b.step(26, gen=0, step_time_s=0.125)  # straggler from generation 0
    b.ranks_spawned(1, dt=1.0)
    b.rendezvous_done(1, dt=0.5)
    b.restore_done(1, step=25, dt=0.25)
    resumed = b.step(26, gen=1)
    b.run_finished("completed", dt=0.25)
    m = compute("late", b.events)
    f = only_fault(m)
    assert f.at_step == 25
    assert f.resumed_at == resumed.t
    assert f.recovery_s == approx(resumed.t - injected.t)
    assert m.loss_by_step[-1] == [26, loss_at(26, gen=1)]


def test_race_in_a_later_generation() -> None:
    """Same race, but for a second fault hitting generation 1 (the injection carries no `gen`)."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("a", at_step=10, dt=0.125)
    b.failure_detected(["a"], gen=0, dt=0.125)
    b.recovery(["a"], gen=1, restore_step=10)
    b.steps(11, 40, gen=1)
    inj_b = b.fault_injected("b", at_step=40, dt=0.125)
    b.step(41, gen=1, step_time_s=0.25)  # generation 1 still commits 41
    b.failure_detected(["b"], gen=1, dt=0.25)
    b.recovery(["b"], gen=2, restore_step=40)
    b.step(41, gen=2)
    resumed_b = b.step(42, gen=2)
    b.run_finished("completed", dt=0.25)
    f = fault_by_id(compute("race2", b.events), "b")
    assert f.at_step == 41
    assert f.lost_steps == 1
    assert f.resumed_at == resumed_b.t
    assert f.recovery_s == approx(resumed_b.t - inj_b.t)


# --------------------------------------------------------------------------------------------
# A fault during the replay of another
# --------------------------------------------------------------------------------------------


class FaultDuringReplay:
    """f1 at step 25 restores to 20; f2 hits generation 1 at step 22, before f1 has resumed."""

    def __init__(self) -> None:
        b = StreamBuilder()
        self.b = b
        self.started = b.run_started(world_size=WORLD, strategy="restart-disk")
        self.gen0 = b.steps(1, 25)
        self.inj1 = b.fault_injected("f1", at_step=25, target="rank:1", dt=0.25)
        self.det1 = b.failure_detected(["f1"], gen=0, dt=0.5)
        self.rec1 = b.recovery(["f1"], gen=1, restore_step=20, restore_source="disk",
                               strategy="restart-disk", spawn_s=2.0, rendezvous_s=1.0, restore_s=1.0)
        self.gen1 = b.steps(21, 22, gen=1)
        self.inj2 = b.fault_injected("f2", at_step=22, target="rank:2", ranks=(2,), dt=0.25)
        self.det2 = b.failure_detected(["f2"], gen=1, ranks=(2,), dt=0.5)
        self.rec2 = b.recovery(["f2"], gen=2, restore_step=20, restore_source="disk",
                               strategy="restart-disk", spawn_s=2.0, rendezvous_s=1.0, restore_s=1.0)
        gen2 = b.steps(21, 30, gen=2)
        self.resumed2 = next(e for e in gen2 if e.get("step") == 23)
        self.resumed1 = next(e for e in gen2 if e.get("step") == 26)
        self.finished = b.run_finished("completed", dt=0.5)
        self.metrics = compute("replay", b.events)


@pytest.fixture(scope="module")
def overlap() -> FaultDuringReplay:
    return FaultDuringReplay()


def test_overlap_both_faults_measured(overlap: FaultDuringReplay) -> None:
    m = overlap.metrics
    assert [f.fault_id for f in m.faults] == ["f1", "f2"]
    f1, f2 = m.faults
    assert f1.detection_s == approx(0.5)
    assert f2.detection_s == approx(0.5)
    assert f1.recovered and f2.recovered


def test_overlap_first_fault_ends_at_its_own_m_plus_one(overlap: FaultDuringReplay) -> None:
    f1 = fault_by_id(overlap.metrics, "f1")
    assert f1.at_step == 25
    assert f1.lost_steps == 5
    # Generation 1 never reached 26; generation 2 did.
    assert f1.resumed_at == overlap.resumed1.t
    assert f1.recovery_s == approx(overlap.resumed1.t - overlap.inj1.t)
    assert sum(f1.breakdown.values()) == approx(f1.recovery_s)
    assert f1.lost_gpu_hours == approx(gpu_hours(f1.lost_s))


def test_overlap_second_fault_uses_the_job_state_it_hit(overlap: FaultDuringReplay) -> None:
    f2 = fault_by_id(overlap.metrics, "f2")
    # When f2 hit, the job (generation 1) had committed step 22; the rolled-back 23..25 of
    # generation 0 are not progress f2 destroyed.
    assert f2.at_step == 22
    assert f2.restore_step == 20
    assert f2.lost_steps == 2
    assert f2.resumed_at == overlap.resumed2.t
    assert f2.recovery_s == approx(overlap.resumed2.t - overlap.inj2.t)
    assert f2.breakdown["decide"] == approx(0.25)
    assert f2.breakdown["spawn"] == approx(2.0)
    assert sum(f2.breakdown.values()) == approx(f2.recovery_s)


def test_overlap_total_is_the_union_not_the_sum(overlap: FaultDuringReplay) -> None:
    m = overlap.metrics
    f1, f2 = m.faults
    t25, t22 = overlap.gen0[-1].t, overlap.gen1[-1].t
    # f2's window (step 22 of generation 1 to the commit of 23 in generation 2) lies inside f1's
    # (step 25 of generation 0 to the commit of 26 in generation 2): the time both cover is
    # split between them, so together they bill the union once.
    shared = (overlap.resumed2.t - t22) - 1 * STEP_TIME_S
    assert f2.lost_s == approx(shared / 2)
    assert f1.lost_s == approx((overlap.resumed1.t - t25) - 1 * STEP_TIME_S - shared / 2)
    assert f1.lost_s + f2.lost_s == approx((overlap.resumed1.t - t25) - 1 * STEP_TIME_S)
    assert m.lost_gpu_hours_total == approx(gpu_hours(f1.lost_s + f2.lost_s))
    assert m.loss_by_step == [[s, loss_at(s, 0 if s <= 20 else 2)] for s in range(1, 31)]


# --------------------------------------------------------------------------------------------
# Two separate faults in one run
# --------------------------------------------------------------------------------------------


def test_two_separate_faults_total_is_the_sum() -> None:
    b = StreamBuilder()
    b.run_started(world_size=8, strategy="peer")
    t10 = b.steps(1, 10)[-1].t
    inj_a = b.fault_injected("a", at_step=10, dt=0.25)
    b.failure_detected(["a"], gen=0, dt=0.125)
    b.recovery(["a"], gen=1, restore_step=10, restore_source="local-memory")
    res_a = b.step(11, gen=1)
    t20 = b.steps(12, 20, gen=1)[-1].t
    inj_b = b.fault_injected("b", kind="kill-node", target="node:1", ranks=(4, 5, 6, 7), nodes=(1,),
                             at_step=20, dt=0.25)
    b.failure_detected(["b"], gen=1, cause="heartbeat", ranks=(4, 5, 6, 7), nodes=(1,), dt=1.0)
    b.recovery(["b"], gen=2, restore_step=19, restore_source="replica")
    b.step(20, gen=2)
    res_b = b.step(21, gen=2)
    b.steps(22, 24, gen=2)
    b.run_finished("completed", dt=0.25)
    m = compute("two", b.events)
    fa, fb = fault_by_id(m, "a"), fault_by_id(m, "b")
    assert fa.recovery_s == approx(res_a.t - inj_a.t)
    assert fb.recovery_s == approx(res_b.t - inj_b.t)
    assert (fa.lost_steps, fa.restore_source) == (0, "local-memory")
    assert (fb.lost_steps, fb.restore_source) == (1, "replica")
    assert fb.kind == "kill-node" and fb.target == "node:1"
    assert fa.lost_s == approx(res_a.t - t10 - STEP_TIME_S)
    assert fb.lost_s == approx(res_b.t - t20 - STEP_TIME_S)
    assert fa.lost_gpu_hours == approx(gpu_hours(fa.lost_s, 8))
    assert fb.lost_gpu_hours == approx(gpu_hours(fb.lost_s, 8))
    assert m.lost_gpu_hours_total == approx(fa.lost_gpu_hours + fb.lost_gpu_hours)
    assert m.steps_completed == 24


# --------------------------------------------------------------------------------------------
# A fault that is never detected and does not stop the job
# --------------------------------------------------------------------------------------------


def test_undetected_slowdown_recovers_at_m_plus_one() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 12)
    inj = b.fault_injected("bw", kind="net-bandwidth", target="node:1", ranks=(), nodes=(1,),
                           at_step=12, dt=0.25)
    slow = b.step(13, step_time_s=3.0)  # the same generation, just slower
    b.steps(14, 15, step_time_s=3.0)
    b.fault_reverted("bw", dt=0.5)
    back = b.steps(16, 20)[0]
    b.run_finished("completed", dt=0.25)
    m = compute("bw", b.events)
    f = only_fault(m)
    assert f.kind == "net-bandwidth"
    assert f.detected_at is None
    assert f.detection_s is None
    assert f.resumed_at == slow.t
    assert f.recovery_s == approx(slow.t - inj.t)
    assert f.recovery_s == approx(3.0)
    assert f.recovered is True
    assert f.breakdown == {k: None for k in BREAKDOWN_KEYS}
    assert f.lost_steps == 0
    assert f.restore_step is None
    assert f.restore_source is None
    # Lost: three 3 s steps where 0.5 s ones were due, the 0.25 s before the fault hit and
    # the 0.5 s revert, until step 16 at the old pace: 10.25 s for 4 steps of 0.5 s.
    assert f.back_at_pace_at == back.t
    assert f.lost_s == approx(0.25 + 9.0 + 0.5 + 0.5 - 4 * STEP_TIME_S)
    assert f.lost_gpu_hours == approx(gpu_hours(f.lost_s))
    assert m.lost_gpu_hours_total == approx(gpu_hours(f.lost_s))
    assert m.loss_by_step == [[s, loss_at(s)] for s in range(1, 21)]


def test_a_kill_not_yet_detected_is_not_recovered_by_the_steps_in_flight_when_it_hit() -> None:
    # A node's loss takes a heartbeat timeout to notice; meanwhile the survivors' reports of the
    # step they were finishing when it hit arrive. A live report must not call that a recovery.
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 5)
    b.fault_injected("node", kind="kill-node", target="node:1", ranks=(1,), nodes=(1,), at_step=5,
                     breaks_job=True, dt=0.01)
    b.steps(6, 7, step_time_s=0.01)  # in flight when the kill landed
    f = only_fault(compute("live", b.events))
    assert f.recovered is False and f.resumed_at is None and f.recovery_s is None
    # Once it is detected and recovered from, it is measured as usual.
    b.failure_detected(["node"], gen=0, dt=1.0)
    decided = b.emit(EventKind.RECOVERY_DECIDED, 0.05, fault_ids=["node"], gen=1, restore_step=7,
                     restore_source="peer-memory", strategy="peer")
    resumed = b.step(8, gen=1, step_time_s=0.3)
    f = only_fault(compute("live", b.events))
    assert f.recovered is True and f.resumed_at == resumed.t and decided.t < resumed.t
    assert f.restore_source == "peer-memory" and f.at_step == 7 and f.lost_steps == 0


def test_rejected_messages_are_counted_with_those_a_flood_kept_out_of_the_record() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD)
    b.steps(1, 3)
    assert compute("r", b.events).messages_rejected == 0
    b.emit(EventKind.MESSAGE_REJECTED, 0.1, queue="ctl", index=4, reason="bad mac", raw="")
    b.emit(EventKind.MESSAGE_REJECTED, 0.1, queue="ctl", index=9, reason="bad mac", raw="", dropped_before=30)
    b.emit(EventKind.MESSAGE_REJECTED, 0.1, queue="snapshot channel", index=-1, reason="handshake",
           raw="", reported_by_node=1, unreported_before=12)
    m = compute("r", b.events)
    assert m.messages_rejected == 1 + 31 + 13
    assert m.to_dict()["messages_rejected"] == 45


def test_emulated_fault_is_reported_as_emulated() -> None:
    b = StreamBuilder()
    b.run_started(world_size=2)
    b.steps(1, 3)
    b.fault_injected("g", kind="gpu-error", target="rank:0", ranks=(0,), at_step=3, emulated=True)
    b.failure_detected(["g"], gen=0, cause="exception", ranks=(0,), dt=0.25)
    b.recovery(["g"], gen=1, restore_step=3, restore_source="local-memory")
    b.step(4, gen=1)
    f = only_fault(compute("emu", b.events))
    assert f.emulated is True
    assert f.kind == "gpu-error"


# --------------------------------------------------------------------------------------------
# A fault the job does not recover from
# --------------------------------------------------------------------------------------------


def test_recovery_failed_counts_until_the_run_ended() -> None:
    b = StreamBuilder()
    started = b.run_started(world_size=WORLD, strategy="none")
    last_step = b.steps(1, 15)[-1]
    inj = b.fault_injected("k", kind="kill-node", target="node:0", ranks=(0, 1), nodes=(0,),
                           at_step=15, dt=0.25)
    det = b.failure_detected(["k"], gen=0, cause="heartbeat", ranks=(0, 1), dt=1.0)
    b.recovery_failed(["k"], reason="strategy none", dt=0.25)
    end = b.run_finished("failed", dt=0.5, reason="recovery failed")
    m = compute("dead", b.events)
    f = only_fault(m)
    assert m.status == "failed"
    assert f.recovered is False
    assert f.recovery_s is None
    assert f.resumed_at is None
    assert f.detection_s == approx(det.t - inj.t)
    assert f.breakdown["detect"] == approx(1.0)
    assert f.breakdown["replay"] is None
    # Nothing was done after the last step before the fault: all of it to the end is lost.
    assert f.lost_s == approx(end.t - last_step.t)
    assert f.lost_gpu_hours == approx(gpu_hours(end.t - last_step.t))
    assert m.lost_gpu_hours_total == approx(gpu_hours(end.t - last_step.t))
    assert m.steps_completed == 15
    assert m.goodput == approx(15 * STEP_TIME_S / (end.t - started.t))


def test_recovery_failed_after_a_decision_is_not_recovered() -> None:
    """The decision and the phases before the failure are recorded; recovery_s stays None."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    last_step = b.steps(1, 5)[-1]
    inj = b.fault_injected("k", at_step=5, dt=0.25)
    b.failure_detected(["k"], gen=0, dt=0.25)
    b.recovery_decided(["k"], gen=1, restore_step=5, restore_source="peer-memory", dt=0.25)
    b.ranks_spawned(1, dt=1.0)
    b.recovery_failed(["k"], reason="checksum mismatch", dt=1.0)
    end = b.run_finished("failed", dt=0.5)
    f = only_fault(compute("dead2", b.events))
    assert f.recovered is False
    assert f.recovery_s is None
    assert f.restore_source == "peer-memory"
    assert f.breakdown["decide"] == approx(0.25)
    assert f.breakdown["spawn"] == approx(1.0)
    assert f.breakdown["replay"] is None
    assert inj.t > last_step.t
    assert f.lost_gpu_hours == approx(gpu_hours(end.t - last_step.t))


def test_unrecovered_fault_in_a_running_job_counts_until_the_last_event() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD)
    last_step = b.steps(1, 5)[-1]
    b.fault_injected("k", at_step=5, dt=0.25)
    last = b.failure_detected(["k"], gen=0, dt=0.75)
    m = compute("live", b.events)
    f = only_fault(m)
    assert m.status == "running"
    assert f.recovered is False
    assert f.lost_gpu_hours == approx(gpu_hours(last.t - last_step.t))
    assert m.lost_gpu_hours_total == approx(gpu_hours(last.t - last_step.t))


# --------------------------------------------------------------------------------------------
# Spares and status
# --------------------------------------------------------------------------------------------


def test_spare_gpu_hours_piecewise() -> None:
    b = StreamBuilder(start=0.0)
    b.run_started(world_size=WORLD)
    b.spares_held(node=0, count=3)
    b.spares_held(node=1, count=1)
    b.spares_held(node=0, count=1, dt=100.0)  # two spares on node 0 were used
    b.spares_held(node=1, count=0, dt=200.0)  # node 1 let its spare go at t=300
    b.run_finished("completed", dt=100.0)  # t=400
    m = compute("spares", b.events)
    seconds = 3 * 100 + 1 * 300 + 1 * 300 + 0 * 100
    assert m.spare_gpu_hours == approx(seconds / 3600.0)


@pytest.mark.parametrize("status", ["completed", "failed", "interrupted"])
def test_status_comes_from_run_finished(status: str) -> None:
    b = StreamBuilder()
    b.run_started()
    b.steps(1, 2)
    b.run_finished(status, dt=0.25)
    assert compute("s", b.events).status == status


def test_status_is_running_without_run_finished() -> None:
    b = StreamBuilder()
    b.run_started()
    b.steps(1, 2)
    m = compute("s", b.events)
    assert m.status == RunStatus.RUNNING.value == "running"
    assert m.wall_s == approx(2 * STEP_TIME_S)


def test_enum_valued_fields_read_as_their_values() -> None:
    """Events built in memory may carry the schema's str enums; figures read as plain values."""
    b = StreamBuilder()
    b.run_started(world_size=2)
    b.steps(1, 3)
    b.fault_injected("f", kind=FaultKind.KILL_RANK, at_step=3, dt=0.25)
    b.failure_detected(["f"], gen=0, dt=0.25)
    b.recovery(["f"], gen=1, restore_step=3, restore_source=RestoreSource.PEER_MEMORY)
    b.step(4, gen=1)
    b.run_finished(RunStatus.COMPLETED, dt=0.25)
    m = compute("enums", b.events)
    assert m.status == "completed"
    assert m.faults[0].kind == "kill-rank"
    out = json.loads(json.dumps(m.to_dict()))
    assert out["status"] == "completed"
    assert out["faults"][0]["kind"] == "kill-rank"
    assert out["faults"][0]["restore_source"] == "peer-memory"


# --------------------------------------------------------------------------------------------
# `ffctl report --json`
# --------------------------------------------------------------------------------------------

REPORT_FIELDS = {
    "run_id", "status", "strategy", "world_size", "steps_completed", "final_loss", "loss_by_step",
    "faults", "lost_gpu_hours_total", "spare_gpu_hours", "goodput",
}
FAULT_FIELDS = {
    "kind", "target", "injected_at", "detected_at", "resumed_at", "emulated", "detection_s",
    "recovery_s", "breakdown", "lost_steps", "restore_source", "lost_gpu_hours", "lost_s",
}


def test_to_dict_has_the_report_fields(disk: DiskRecovery) -> None:
    out = json.loads(json.dumps(disk.metrics.to_dict()))
    assert REPORT_FIELDS <= set(out)
    assert out["run_id"] == "disk"
    assert out["status"] == "completed"
    assert out["strategy"] == "restart-disk"
    assert out["world_size"] == WORLD
    assert out["steps_completed"] == 30
    assert len(out["faults"]) == 1
    fault = out["faults"][0]
    assert FAULT_FIELDS <= set(fault)
    assert set(fault["breakdown"]) == set(BREAKDOWN_KEYS)
    assert fault["kind"] == "kill-rank"
    assert fault["target"] == "rank:1"
    assert fault["emulated"] is False
    assert fault["injected_at"] == disk.injected.t
    assert fault["detected_at"] == disk.detected.t
    assert fault["resumed_at"] == disk.resumed.t
    assert fault["lost_steps"] == 5
    assert fault["restore_source"] == "disk"
    assert fault["recovery_s"] == approx(disk.resumed.t - disk.injected.t)
    assert out["lost_gpu_hours_total"] == approx(fault["lost_gpu_hours"])
    assert out["spare_gpu_hours"] == 0.0
    assert out["goodput"] == approx(disk.metrics.goodput)


def test_to_dict_loss_by_step_is_int_steps_and_exact_floats() -> None:
    awkward = [0.1 + 0.2, 1.0 / 3.0, math.pi * 1e-17, 2.0**-1074, 12345.678901234567]
    events = [Event(EventKind.RUN_STARTED, 0.0, {"world_size": 1, "strategy": "peer"})]
    for i, loss in enumerate(awkward, start=1):
        # A step number that arrived as a float still comes out an int.
        events.append(Event(EventKind.STEP, float(i), {"step": float(i), "loss": loss,
                                                        "step_time_s": 0.5, "gen": 0}))
    text = json.dumps(compute("exact", events).to_dict())
    out = json.loads(text)
    pairs = out["loss_by_step"]
    assert [p[0] for p in pairs] == [1, 2, 3, 4, 5]
    assert all(type(p[0]) is int for p in pairs)
    assert all(type(p[1]) is float for p in pairs)
    assert [p[1] for p in pairs] == awkward  # bit for bit
    assert '"loss_by_step": [[1, 0.30000000000000004]' in text
    assert out["final_loss"] == awkward[-1]


def test_straggler_commit_after_detection_under_recovery_none() -> None:
    """A rank killed right after a collective lets its peers commit that step; their report
    arrives after the detection. Under `none` the job did not recover: the straggler counts
    toward m, and is no resumption."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="none")
    b.steps(1, 16)
    b.fault_injected("f1", at_step=16, dt=0.125)
    b.failure_detected(["f1"], gen=0, dt=0.05)
    b.step(17, gen=0, step_time_s=0.125)
    b.recovery_failed(["f1"], reason="--recovery none", dt=0.05)
    b.run_finished("failed", dt=0.25)
    f = only_fault(compute("none", b.events))
    assert f.at_step == 17
    assert f.recovered is False and f.recovery_s is None and f.resumed_at is None


def test_an_abandoned_deeper_rollback_does_not_lose_a_committed_step() -> None:
    """Restore to 30 fails, restore to 29 fails, then disk brings back step 30: step 30's loss,
    committed before the fault, stands, and replay resumes at 31."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 30)
    b.failure_detected([], gen=0, dt=0.05)
    b.recovery_decided([], gen=1, restore_step=30, dt=0.05)
    b.recovery_decided([], gen=2, restore_step=29, dt=0.05)
    b.recovery_decided([], gen=3, restore_step=30, dt=0.05)
    b.steps(31, 40, gen=3)
    b.run_finished("completed", dt=0.05)
    losses = final_losses(b.events)
    assert sorted(losses) == list(range(1, 41))
    assert losses[30] == loss_at(30, 0)


def test_where_a_fault_landed_is_told_to_its_own_kind_only() -> None:
    """A replica corruption's landings (each holder's) belong to the corrupt-snapshot fault, not
    to the kill injected behind it; a phase kill's landing to the kill."""
    b = StreamBuilder()
    b.run_started(world_size=3, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("c", kind="corrupt-snapshot", target="rank:2", ranks=(2,), nodes=(2,), at_step=10)
    b.fault_injected("k", kind="kill-node", target="rank:2", ranks=(2,), nodes=(2,), at_step=10, dt=0.1)
    b.emit(EventKind.FAULT_LANDED, 0.01, rank=2, node=0, steps=[9, 10], where="replica")
    b.emit(EventKind.FAULT_LANDED, 0.01, rank=2, node=1, steps=[], where="replica")
    b.failure_detected(["k"], gen=0, cause="node-lost", ranks=(2,), nodes=(2,), dt=0.1)
    b.recovery(["k"], gen=1, restore_step=10, restore_source="disk")
    b.steps(11, 13, gen=1)
    b.fault_injected("p", kind="kill-rank", target="rank:1", ranks=(1,), nodes=(1,), at_step=13)
    b.emit(EventKind.FAULT_LANDED, 0.01, rank=1, node=1, gen=1, step=14, phase="collective")
    b.failure_detected(["p"], gen=1, dt=0.1)
    b.recovery(["p"], gen=2, restore_step=13, restore_source="local-memory")
    b.steps(14, 16, gen=2)
    b.run_finished("completed")
    m = compute("landed", b.events)
    assert fault_by_id(m, "c").landed == {"replicas": {"0": [9, 10], "1": []}}
    assert fault_by_id(m, "k").landed is None
    assert fault_by_id(m, "p").landed == {"step": 14, "phase": "collective"}


def test_a_seeded_pick_shows_the_rank_or_node_it_hit() -> None:
    # Chaos faults target `one`: the report says which rank (a node fault: which node) that was.
    b = StreamBuilder(start=1000.0)
    b.run_started(world_size=4, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("f1", at_step=10, target="one", ranks=(3,), nodes=(1,))
    b.fault_injected("f2", at_step=10, kind="kill-node", target="fixed:1", ranks=(2, 3), nodes=(1,))
    b.fault_injected("f3", at_step=10, target="rank:2", ranks=(2,), nodes=(1,))
    b.run_finished("completed", steps_completed=10)
    faults = {f["fault_id"]: f["target"] for f in compute("r", b.events).to_dict()["faults"]}
    assert faults == {"f1": "one -> rank:3", "f2": "fixed:1 -> node:1", "f3": "rank:2"}

"""lost_s of every fault kind, from hand-written event streams (`runs.metrics.compute`).

lost_s is the wall time the job lost against its own pace before the fault: from the last commit
before the injection until the job is back at that pace after the fault ended, less the time the
steps it gained meanwhile would have taken at that pace. These streams check it where recovery_s
sees nothing (a hang shorter than the detection threshold, a slowdown) as well as for kills, and
that overlapping faults are not billed twice.
"""
from __future__ import annotations

from typing import Any

import pytest

from runs.metrics import BACK_WINDOW, FaultMetrics, RunMetrics, compute
from tests.helpers.events import STEP_TIME_S, StreamBuilder

WORLD = 4


def approx(value: float) -> Any:
    return pytest.approx(value, rel=1e-12, abs=1e-12)


def fault(m: RunMetrics, fault_id: str) -> FaultMetrics:
    (f,) = [f for f in m.faults if f.fault_id == fault_id]
    return f


def test_kill_with_recovery_loses_about_its_recovery_time() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    last = b.steps(1, 20)[-1]
    inj = b.fault_injected("k", at_step=20, dt=0.125)
    b.failure_detected(["k"], gen=0, dt=0.25)
    b.recovery(["k"], gen=1, restore_step=20)
    resumed = b.step(21, gen=1)
    b.steps(22, 30, gen=1)
    b.run_finished("completed", dt=0.25)
    m = compute("kill", b.events)
    f = fault(m, "k")
    assert f.recovery_s == approx(resumed.t - inj.t)
    # Back at pace with step 21: the time from step 20 to 21 less the one step it should take.
    assert f.back_at_pace_at == resumed.t
    assert f.lost_s == approx(resumed.t - last.t - STEP_TIME_S)
    assert abs(f.lost_s - f.recovery_s) <= STEP_TIME_S
    assert f.lost_gpu_hours == approx(WORLD * f.lost_s / 3600.0)
    assert m.lost_gpu_hours_total == approx(f.lost_gpu_hours)


def test_hang_shorter_than_the_detection_threshold_is_billed() -> None:
    """A 3 s hang-rank: step m+1 was already reduced when it hit (recovery_s is tiny), the stall
    falls on m+2, nothing is detected; the job still lost close to 3 s."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("h", kind="hang-rank", at_step=10, dt=0.0625, duration=3.0)
    b.step(11, step_time_s=0.0625)  # reduced before the stop landed
    b.wait(3.0 - 0.125)
    b.fault_reverted("h")
    b.step(12, step_time_s=0.5)  # the stalled step finishes once the rank runs again
    b.steps(13, 20)
    b.run_finished("completed", dt=0.25)
    f = fault(compute("hang", b.events), "h")
    assert f.detected_at is None
    assert f.recovery_s is not None and f.recovery_s < 0.1
    assert f.lost_s >= 2.0
    # Exactly: from step 10 to step 12 took 0.0625 + 0.0625 + 2.875 + 0.5 s where 2 x 0.5 were due.
    assert f.lost_s == approx(0.0625 + 0.0625 + 2.875 + 0.5 - 2 * STEP_TIME_S)
    assert f.lost_gpu_hours > 0


def test_bandwidth_slowdown_that_breaks_nothing_is_billed() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("bw", kind="net-bandwidth", target="node:1", ranks=(), nodes=(1,), at_step=10)
    b.steps(11, 18, step_time_s=0.75)  # 8 steps, each 0.25 s slower
    b.fault_reverted("bw")
    b.steps(19, 30)
    b.run_finished("completed", dt=0.25)
    f = fault(compute("bw", b.events), "bw")
    assert f.detected_at is None and f.lost_steps == 0
    assert f.lost_s > 0
    assert f.lost_s == approx(8 * 0.25)


def test_a_fault_that_slows_nothing_costs_nothing() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("d", kind="net-delay", target="node:1", ranks=(), nodes=(1,), at_step=10)
    b.steps(11, 15)
    b.fault_reverted("d")
    b.steps(16, 25)
    b.run_finished("completed", dt=0.25)
    assert fault(compute("delay", b.events), "d").lost_s == 0.0


def test_a_job_that_never_gets_back_to_its_pace_is_billed_to_its_last_step() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("s", kind="straggler", at_step=10)
    b.steps(11, 20, step_time_s=1.0)
    b.fault_reverted("s")
    b.steps(21, 25, step_time_s=1.0)  # slower for good (a slower replacement, say)
    b.run_finished("completed", dt=5.0)
    f = fault(compute("slow", b.events), "s")
    assert f.back_at_pace_at is None
    # 15 steps of 1 s where 0.5 s was due; the 5 s shutdown after the last step is not billed.
    assert f.lost_s == approx(15 * 0.5)


def test_overlapping_faults_split_what_they_share() -> None:
    """A bandwidth fault still on when a rank is killed: the stretch both cover is split, so
    the two lost_s add up to the job's loss over the union of their windows."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    t10 = b.steps(1, 10)[-1].t
    b.fault_injected("bw", kind="net-bandwidth", target="node:1", ranks=(), nodes=(1,), at_step=10)
    slow = b.steps(11, 14, step_time_s=1.0)
    b.fault_injected("k", at_step=14, dt=0.25)
    b.failure_detected(["k"], gen=0, dt=0.25)
    b.recovery(["k"], gen=1, restore_step=14)
    resumed = b.step(15, gen=1, step_time_s=1.0)
    b.steps(16, 17, gen=1, step_time_s=1.0)
    b.fault_reverted("bw", dt=0.25)  # 17 -> 18 takes 0.75 s: not yet back at pace
    back = b.steps(18, 30, gen=1)[0]
    b.run_finished("completed", dt=0.25)
    m = compute("both", b.events)
    bw, k = fault(m, "bw"), fault(m, "k")
    t14 = slow[-1].t
    # Both measure against the job's pace before them (the median: 0.5 s; the slowed steps are
    # fewer) and it is back at that pace only with step 18, once bw is reverted. bw's window runs
    # from step 10, k's from step 14: from 14 on both cover the time and each carries half.
    assert bw.pace_s == k.pace_s == approx(STEP_TIME_S)
    assert bw.back_at_pace_at == k.back_at_pace_at == back.t
    shared = (back.t - t14) - 4 * STEP_TIME_S
    assert k.lost_s == approx(shared / 2)
    assert bw.lost_s == approx((t14 - t10) - 4 * STEP_TIME_S + shared / 2)
    # Not billed twice: together they are the loss over bw's window, which holds k's.
    alone_bw = (back.t - t10) - 8 * STEP_TIME_S
    assert bw.lost_s + k.lost_s == approx(alone_bw)
    assert k.lost_s >= resumed.t - t14 - 2 * STEP_TIME_S - (back.t - resumed.t) / 2
    assert m.lost_gpu_hours_total == approx(WORLD * (bw.lost_s + k.lost_s) / 3600.0)


def test_no_steps_before_the_fault_measures_against_the_pace_after_it() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    inj = b.fault_injected("k", at_step=0, dt=0.25)
    b.failure_detected(["k"], gen=0, dt=0.25)
    b.recovery(["k"], gen=1, restore_step=0, restore_source="disk")
    first = b.step(1, gen=1)
    b.steps(2, 10, gen=1)
    b.run_finished("completed", dt=0.25)
    f = fault(compute("early", b.events), "k")
    assert f.pace_s == approx(STEP_TIME_S)
    assert f.back_at_pace_at == first.t
    assert f.lost_s == approx(first.t - inj.t - STEP_TIME_S)


def test_fault_at_the_very_end_of_a_completed_run_costs_nothing() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("late", kind="net-delay", target="node:1", ranks=(), nodes=(1,), at_step=10, dt=0.25)
    b.fault_reverted("late", dt=0.5)
    b.run_finished("completed", dt=0.25)
    f = fault(compute("end", b.events), "late")
    assert f.lost_s == 0.0 and f.lost_gpu_hours == 0.0


def test_fault_near_the_end_bills_its_slow_steps() -> None:
    """Too few steps left to show the job back at pace: the slow ones are billed all the same."""
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("bw", kind="net-bandwidth", target="node:1", ranks=(), nodes=(1,), at_step=10)
    b.steps(11, 12, step_time_s=1.5)
    b.fault_reverted("bw", dt=0.0625)
    b.steps(13, 13 + BACK_WINDOW - 1)  # one commit short of a full window after the revert
    b.run_finished("completed", dt=0.25)
    f = fault(compute("near", b.events), "bw")
    assert f.back_at_pace_at is None
    assert f.lost_s == approx(2 * 1.0 + 0.0625)


def test_incomplete_run_bills_until_the_controller_s_last_event() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD, strategy="peer")
    last_step = b.steps(1, 10)[-1]
    b.fault_injected("k", at_step=10, dt=0.25)
    last = b.failure_detected(["k"], gen=0, dt=0.5)
    m = compute("cut", b.events, controller_alive=False)
    f = fault(m, "k")
    assert m.status == "incomplete"
    assert f.back_at_pace_at is None
    assert f.lost_s == approx(last.t - last_step.t)
    assert m.lost_gpu_hours_total == approx(WORLD * f.lost_s / 3600.0)


def test_lost_s_is_in_the_json() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD)
    b.steps(1, 5)
    b.fault_injected("k", at_step=5, dt=0.25)
    b.failure_detected(["k"], gen=0, dt=0.25)
    b.recovery(["k"], gen=1, restore_step=5)
    b.steps(6, 10, gen=1)
    b.run_finished("completed", dt=0.25)
    out = compute("json", b.events).to_dict()["faults"][0]
    assert {"lost_s", "pace_s", "back_at_pace_at", "lost_gpu_hours"} <= set(out)
    assert out["lost_s"] > 0

"""What the report makes of stragglers: an injected slow-rank is detected when the straggler
detector names its rank, and billed the time lost against the job's pace; a straggler no injected
fault explains is a fault of kind `detected` with cause "straggler", over when the detector saw
it back at pace; one replaced under `--straggler replace` is the detected failure, not twice."""
from __future__ import annotations

import pytest

from runs.events import EventKind
from runs.metrics import DETECTED, STRAGGLER, compute
from runs.projection import measure_run
from tests.helpers.events import STEP_TIME_S, StreamBuilder

WORLD = 4
SLOW = 3 * STEP_TIME_S


def straggle(b: StreamBuilder, first: int, last: int, fault_ids: list[str], rank: int = 1) -> tuple[float, float]:
    """Steps first..last at 3x the pace with the detector's events as the controller writes
    them; returns (onset_t, end_t)."""
    onset_t = b.t
    for step in range(first, last + 1):
        b.step(step, step_time_s=SLOW)
        if step == first + 2:
            b.emit(EventKind.STRAGGLER_DETECTED, 0.0, rank=rank, node=0, gen=0, factor=3.0, onset_step=first,
                   onset_t=onset_t, step=step, policy="wait", fault_ids=fault_ids)
    end_t = b.t
    return onset_t, end_t


def ended(b: StreamBuilder, onset_t: float, end_t: float, first: int, last: int, fault_ids: list[str],
          rank: int = 1) -> None:
    b.emit(EventKind.STRAGGLER_ENDED, 0.0, rank=rank, node=0, factor=3.0, onset_step=first, last_step=last,
           steps=last - first + 1, onset_t=onset_t, end_t=end_t, lost_s=(last - first + 1) * 2 * STEP_TIME_S,
           fault_ids=fault_ids)


def test_an_injected_slow_rank_is_detected_by_the_detector_and_billed_its_slowdown() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD)
    b.steps(1, 10)
    inj = b.fault_injected("f1", 10, kind="slow-rank", duration=10.0, breaks_job=False)
    onset_t, end_t = straggle(b, 11, 30, ["f1"])
    b.fault_reverted("f1")
    b.steps(31, 33)
    ended(b, onset_t, end_t, 11, 30, ["f1"])
    b.steps(34, 40)
    b.run_finished()
    (f,) = compute("r", b.events).faults
    assert f.kind == "slow-rank" and f.cause == STRAGGLER
    assert f.detection_s == pytest.approx(3 * SLOW)  # named at the third slow step
    assert f.recovered and f.lost_steps == 0
    # 20 steps at 3x the pace: 40 steps' time lost, and the detector's own count agrees.
    assert f.lost_s == pytest.approx(20 * 2 * STEP_TIME_S)
    (s,) = f.stragglers
    assert s["rank"] == 1 and s["factor"] == 3.0 and s["onset_step"] == 11 and s["step"] == 13
    assert s["detected_after_steps"] == 3 and s["lost_s"] == pytest.approx(f.lost_s)
    assert s["detected_at"] - inj.t == pytest.approx(f.detection_s)


def test_a_straggler_nobody_injected_is_a_detected_fault_until_back_at_pace() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD)
    b.steps(1, 10)
    onset_t, end_t = straggle(b, 11, 20, [])
    b.steps(21, 22)
    ended(b, onset_t, end_t, 11, 20, [])
    b.steps(23, 30)
    b.run_finished()
    (f,) = compute("r", b.events).faults
    assert (f.kind, f.cause, f.target, f.measured_from) == (DETECTED, STRAGGLER, "rank:1", "onset")
    assert f.injected_at == pytest.approx(onset_t) and f.at_step == 10
    assert f.resumed_at == pytest.approx(end_t) and f.recovered
    assert f.lost_s == pytest.approx(10 * 2 * STEP_TIME_S)
    assert compute("r", b.events).lost_gpu_hours_total == pytest.approx(WORLD * f.lost_s / 3600)
    # A slowdown stops nothing: the projection does not count it among the faults that stop a job.
    (cost,) = measure_run(compute("r", b.events).to_dict(), b.events).faults
    assert not cost.stops_job


def test_a_replaced_straggler_is_counted_once() -> None:
    b = StreamBuilder()
    b.run_started(world_size=WORLD)
    b.steps(1, 10)
    onset_t, end_t = straggle(b, 11, 14, [])
    b.emit(EventKind.FAILURE_DETECTED, 0.0, fault_ids=[], cause="straggler", ranks=[1], nodes=[], gen=0,
           failure_id="d1", onset_t=b.t, onset="reported", explained_by=[])
    b.run_finished()
    (f,) = compute("r", b.events).faults
    assert f.kind == DETECTED and f.fault_id == "d1" and f.cause == "straggler"


def test_the_fault_table_names_the_straggler() -> None:
    from ffctl.render.report import fault_fields

    b = StreamBuilder()
    b.run_started(world_size=WORLD)
    b.steps(1, 10)
    b.fault_injected("f1", 10, kind="slow-rank", duration=10.0, breaks_job=False)
    onset_t, end_t = straggle(b, 11, 20, ["f1"])
    ended(b, onset_t, end_t, 11, 20, ["f1"])
    b.steps(21, 25)
    b.run_finished()
    fields = dict(fault_fields(compute("r", b.events).to_dict()["faults"][0]))
    assert fields["straggler"] == "rank 1 3.0x from step 11, named at step 13, 10.00s lost waiting for it"
    assert fields["detection s"] != "not detected"
    b2 = StreamBuilder()
    b2.run_started(world_size=WORLD)
    b2.steps(1, 5)
    b2.fault_injected("f1", 5)
    b2.steps(6, 8)
    b2.run_finished()
    assert dict(fault_fields(compute("r", b2.events).to_dict()["faults"][0]))["straggler"] == "-"

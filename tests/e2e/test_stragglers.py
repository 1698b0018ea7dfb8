"""Stragglers end to end with the built-in GPT: a rank made 3x slower for 10 s is named by the
straggler detector within 5 steps, the report bills the time it cost within 20 % of what a
fault-free twin measures, and `--straggler replace` replaces a rank that stays too slow through
the normal recovery path, the losses bit for bit the twin's."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from runs.events import Event, EventKind
from tests.helpers.launch import Result, assert_nothing_left, launch, rid, run_ffctl, shm_left

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.exclusive]

# Two nodes of one rank: on a 2-core host each rank has a core, so a healthy step's time does not
# depend on which rank the scheduler happens to favour. `small` steps of 16 sequences take about
# 0.15 s here: 3x slower, 3 of them last over the second the detector wants before naming a rank.
JOB = ("--nnodes", "2", "--nproc-per-node", "1", "--model", "small", "--batch", "16", "--seed", "4")
STEPS = 50
# Late enough that the job's first, slower steps (workers warming up) are behind it: the sleep is
# a multiple of the rank's step time at the onset, and the report's pace is the job's before it.
FAULT_STEP = 20


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stragglers")


def _run(workdir: Path, prefix: str, *args: str) -> Result:
    run_id = rid(prefix)
    res = launch(workdir, run_id, *JOB, "--steps", str(STEPS), *args)
    assert res.returncode == 0, res.stderr
    assert not shm_left(run_id)
    return res


def _commits(events: list[Event]) -> dict[int, float]:
    """When the job committed each step (the record's `step` events, the last generation's)."""
    return {int(ev.get("step")): ev.t for ev in events if ev.kind is EventKind.STEP}


def _pace(commits: dict[int, float], steps: range | list[int]) -> float:
    return statistics.median(commits[s + 1] - commits[s] for s in steps if s in commits and s + 1 in commits)


@pytest.fixture(scope="module")
def twin(workdir: Path) -> Result:
    return _run(workdir, "twin")


def test_slow_rank_is_named_within_5_steps_and_its_lost_time_matches_the_twin(workdir: Path, twin: Result) -> None:
    res = _run(workdir, "slow", "--inject", f"slow-rank:rank=1,step={FAULT_STEP},factor=3,duration=10")
    assert_nothing_left(workdir)
    report = res.report
    # A sleep changes no arithmetic: every step's loss is the twin's, bit for bit.
    assert report["loss_by_step"] == twin.report["loss_by_step"]
    # The injected one; a shared host's load can also slow a rank for a few steps, and the
    # detector rightly names that too (a finding no fault explains).
    (fault,) = [f for f in report["faults"] if f["kind"] != "detected"]
    assert fault["kind"] == "slow-rank" and fault["cause"] == "straggler" and fault["reverted_by"] == "controller"
    (named,) = [ev for ev in res.events if ev.kind is EventKind.STRAGGLER_DETECTED and ev.get("fault_ids")]
    assert named.get("rank") == 1 and named.get("fault_ids") == [fault["fault_id"]]
    # Measured against the other rank's busy time then, not the asked 3x of the rank's own step
    # time at the onset: a shared host's load moves it.
    assert 2.0 <= named.get("factor") <= 10.0, named.data
    (straggler,) = fault["stragglers"]
    assert straggler["rank"] == 1 and straggler["lost_s"] is not None
    # Named within 5 steps of the slowdown. The slowdown itself starts a few steps after the
    # step that triggers it: controller, agent and the rank's next step start are a hop each,
    # and a step here is 0.1 s (3 steps late in a CI run on a loaded host, detected in 5).
    assert named.get("step") - straggler["onset_step"] <= 5, (named.data, straggler)
    assert 0 <= straggler["onset_step"] - fault["at_step"] <= 5, (straggler, fault["at_step"])

    # The twin's measure: how much longer the faulted run took from the fault's step to a few
    # steps past the slowdown. It measures the fault only where the host's load let both runs train at one pace: the
    # faulted run before its slowdown and from 3 steps after it, and the twin. Other work on a
    # shared 2-core host moves a run's pace by 2x within seconds (load average 7 seen here), and
    # then the difference measures the load: the twin runs again once, and if the paces still
    # differ the comparison is skipped, saying so (the detection checks above still hold).
    mine = _commits(res.events)
    last = max(mine)
    before = _pace(mine, range(2, FAULT_STEP))
    after = _pace(mine, range(straggler["last_step"] + 3, last)) if straggler["last_step"] + 4 < last else before
    theirs = _commits(twin.events)
    agree = lambda t: all(abs(_pace(t, range(2, STEPS)) / p - 1) <= 0.2 for p in (before, after))  # noqa: E731
    if not agree(theirs):
        theirs = _commits(_run(workdir, "twin2").events)
    if abs(after / before - 1) > 0.2 or not agree(theirs):
        pytest.skip(f"host load moved the pace: {before:.3f}s a step before the slowdown, {after:.3f}s after it, "
                    f"{_pace(theirs, range(2, STEPS)):.3f}s in the twin")
    # Up to a few steps past the slowdown: the steps after that add only the host's noise.
    end = min(last, straggler["last_step"] + 4)
    measured = (mine[end] - mine[FAULT_STEP]) - (theirs[end] - theirs[FAULT_STEP])
    # The twin's time for those steps against the faulted run's own pace around the slowdown:
    # paces within 20 % of each other still differ by seconds over a window of 60 steps, and
    # then the difference is the load's (seen with two busy loops beside the test: 4.9 s
    # measured for a slowdown the detector rightly billed 7.0 s).
    own = statistics.median([before, after]) * (end - FAULT_STEP)
    if abs((theirs[end] - theirs[FAULT_STEP]) - own) > 0.1 * measured:
        pytest.skip(f"host load moved the pace: the twin took {theirs[end] - theirs[FAULT_STEP]:.2f}s for steps "
                    f"{FAULT_STEP}-{end}, the faulted run's own pace says {own:.2f}s")
    # 3x for 10 s: two thirds of it lost, about 6.7 s.
    assert 4.0 < measured < 10.0, (measured, before, after)
    assert abs(fault["lost_s"] - measured) <= 0.2 * measured, (fault["lost_s"], measured, straggler)
    assert abs(straggler["lost_s"] - measured) <= 0.2 * measured, (straggler, measured)


def test_straggler_replace_replaces_a_rank_that_stays_too_slow(workdir: Path, twin: Result) -> None:
    # slow-node on node 1, whose one rank is rank 1: the node kind through the same path.
    res = _run(workdir, "repl", "--spares", "1", "--straggler", "replace:factor=2",
               "--inject", f"slow-node:node=1,step={FAULT_STEP},factor=4,duration=60")
    assert_nothing_left(workdir)
    events = res.events
    (failure,) = [ev for ev in events if ev.kind is EventKind.FAILURE_DETECTED]
    assert failure.get("cause") == "straggler" and failure.get("ranks") == [1]
    assert failure.get("fault_ids") == ["f1"]  # the injected slow-rank explains it: no restart spent
    (decided,) = [ev for ev in events if ev.kind is EventKind.RECOVERY_DECIDED]
    assert decided.get("ranks") == [1]
    # The replacement is not slow: the job went back to its pace and finished long before the
    # slowdown's 60 s were over; recovered from memory, every loss is the twin's.
    mine = _commits(events)
    assert mine[STEPS] - decided.t < 30
    assert res.report["loss_by_step"] == twin.report["loss_by_step"]
    (fault,) = res.report["faults"]
    assert fault["recovered"] and fault["restore_source"] in ("local-memory", "peer-memory")


def test_bad_straggler_policy_is_one_line_and_starts_nothing(workdir: Path) -> None:
    run_id = rid("badpol")
    proc = run_ffctl(workdir, "launch", "--run-id", run_id, "--straggler", "replace:factor=0.5")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--straggler 'replace:factor=0.5'" in lines[0], proc.stderr
    assert not (workdir / "runs" / run_id).exists()

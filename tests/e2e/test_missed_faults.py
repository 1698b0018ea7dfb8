"""Every requested fault ends as landed or missed, with the reason: a step trigger that can never
fire is refused before anything starts (exit 2, one line), or with `--allow-missed` runs and is
recorded `fault_missed`; a fault whose trigger the job never reached makes a completed run exit 5
(`--allow-missed`: 0), the reason on the console, in the record and in report.json."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ffctl.exits import EXIT_BAD_INPUT, EXIT_FAULT_MISSED
from runs.events import EventKind
from tests.helpers.launch import assert_nothing_left, launch, rid, run_ffctl

# Whole jobs launched, a few a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# A plain script that prints its steps (no torch: only the launch is under test), five of them.
PRINTS_STEPS = textwrap.dedent("""
    import time
    for step in range(1, 6):
        print(f"step {step} loss 1.0", flush=True)
        time.sleep(0.05)
""")
REGEX = r"^step (?P<step>\d+) loss (?P<loss>\S+)$"
LAYOUT = ("--nnodes", "2", "--nproc-per-node", "1")


def test_a_step_fault_a_plain_script_can_never_fire_is_refused_before_the_start(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(PRINTS_STEPS)
    run_id = rid("never")
    proc = run_ffctl(tmp_path, "launch", "--run-id", run_id, "--runs-dir", str(tmp_path / "runs"), *LAYOUT,
                     "--inject", "kill-rank:rank=1,step=3", "train.py", timeout=120)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "step=3 can never fire" in line and "--step-regex" in line and "--allow-missed" in line
    assert not (tmp_path / "runs" / run_id).exists()  # nothing started, nothing recorded


def test_allowed_the_unfireable_fault_runs_and_is_recorded_missed(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(PRINTS_STEPS)
    res = launch(tmp_path, rid("allow"), *LAYOUT, "--allow-missed", "--inject", "kill-rank:rank=1,step=3",
                 "train.py", timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    [missed] = [e for e in res.events if e.kind is EventKind.FAULT_MISSED]
    assert missed.get("fault_id") == "f1" and "reports no steps" in missed.get("reason")
    assert not any(e.kind is EventKind.FAULT_INJECTED for e in res.events)
    assert res.report["missed_faults"][0]["reason"] == missed.get("reason")
    assert "fault f1 MISSED" in res.stdout and "missed:" in res.stderr
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("allow", [False, True])
def test_a_fault_past_the_script_s_last_step_makes_the_run_exit_5(tmp_path: Path, allow: bool) -> None:
    (tmp_path / "train.py").write_text(PRINTS_STEPS)
    res = launch(tmp_path, rid("past"), *LAYOUT, "--step-regex", REGEX, *(["--allow-missed"] if allow else []),
                 "--inject", "kill-rank:rank=1,step=50", "train.py", timeout=240)
    assert res.returncode == (0 if allow else EXIT_FAULT_MISSED), res.stderr[-2000:]
    [missed] = [e for e in res.events if e.kind is EventKind.FAULT_MISSED]
    assert missed.get("reason") == "the job ended at step 5, before step 50"
    [end] = [e for e in res.events if e.kind is EventKind.RUN_FINISHED]
    assert end.get("status") == "completed"
    if not allow:
        assert "never took effect: exit 5" in res.stderr
    assert_nothing_left(tmp_path)

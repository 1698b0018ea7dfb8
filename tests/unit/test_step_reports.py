"""Steps of an unchanged script: `recovery.report_step` over a real store, `--step-regex` read off
a log as it grows, what the controller counts a step on, and the figures of a fault whose script
restores itself (with and without known steps), from hand-written event streams."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ffctl.agent.stepscan import StepRegexError, StepScanner, compile_step_regex, parse_line
from ffctl.controller.script import runs_the_library
from ffctl.controller.progress import Progress, StepReport
from wire import control, messages
from wire.jobenv import TOKEN_ENV, JobEnv
from recovery.steps import StepReporter
from runs.events import Event, EventKind
from runs.metrics import compute
from tests.helpers.store import loopback_store
from tests.unit.test_bad_inputs import assert_refused, run_cli

TOKEN = "c" * 64
REGEX = r"^step (?P<step>\d+) loss (?P<loss>\S+)$"


# -- report_step --------------------------------------------------------------------------------

def test_report_step_sends_a_sealed_step_report() -> None:
    store = loopback_store()
    port = store.port
    env = JobEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, node=0, run_id="r", store_host="127.0.0.1",
                 store_port=port, gen=2, token=TOKEN)
    reporter = StepReporter(env)
    reporter.report(7, 1.25)
    reporter.report(8, None)
    rx = control.Receiver(store, control.CTL_QUEUE, opener=control.Opener(TOKEN))
    got = [messages.decode(raw, messages.Limits(2, 1)) for raw in rx.poll()]
    assert [(m.kind, m.rank, m.gen, m.step, m.loss) for m in got] == [
        (messages.Kind.STEP, 1, 2, 7, 1.25), (messages.Kind.STEP, 1, 2, 8, None)]
    assert all(m.dt >= 0 for m in got)
    # A forged report (another token) is refused by the controller's receiver, never taken.
    refused: list[str] = []
    forged = StepReporter(JobEnv(**{**env.__dict__, "token": "d" * 64}))
    forged.report(9, 0.5)
    rx2 = control.Receiver(store, control.CTL_QUEUE, opener=control.Opener(TOKEN),
                           on_reject=lambda where, i, reason, raw: refused.append(reason))
    rx2.seen = rx.seen
    assert rx2.poll() == [] and refused


def test_report_step_refuses_a_step_that_is_not_a_count() -> None:
    env = JobEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node=0, run_id="r", store_host="127.0.0.1",
                 store_port=1, gen=0, token=TOKEN)
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="report_step"):
            StepReporter(env).report(bad, None)  # type: ignore[arg-type]


def test_report_step_outside_ffctl_does_nothing(tmp_path: Path) -> None:
    # As under torchrun: no job token, no run id. The call returns at once and sends nothing.
    code = ("import os, recovery.steps as s; os.environ.pop('FFCTL_TOKEN', None); "
            "s.report_step(1, 2.0); s.report_step(2); print(s._reporter)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFCTL_") and k != TOKEN_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr


def test_a_step_without_a_loss_decodes() -> None:
    raw = {"type": "step", "rank": 0, "node": 0, "gen": 0, "step": 3, "dt": 0.1}
    msg = messages.decode(raw, messages.Limits(1, 1))
    assert isinstance(msg, messages.Step) and msg.loss is None


# -- --step-regex ---------------------------------------------------------------------------------

def test_step_lines_are_read_as_the_log_grows(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    log.write_bytes(b"step 99 loss 1.0\n")  # an earlier worker's output: not this one's
    scanner = StepScanner(compile_step_regex(REGEX), [(log, log.stat().st_size)])
    with open(log, "ab") as fh:
        fh.write(b"hello\nstep 1 loss 2.5\nstep 2 loss na")
        fh.flush()
        assert [(s.step, s.loss) for s in scanner.poll()] == [(1, 2.5)]  # step 2's line is not finished
        fh.write(b"n\nstep 2 loss 9\nstep 1 loss 3\nstep 3 loss inf\n")
        fh.flush()
    seen = scanner.poll()
    assert [s.step for s in seen] == [2, 3] and str(seen[0].loss) == "nan" and seen[1].loss == float("inf")
    assert scanner.poll() == []


def test_steps_are_read_from_stdout_and_stderr_alike_and_each_counts_once(tmp_path: Path) -> None:
    # `logging` writes to stderr by default: a script's step lines may be there.
    out, err = tmp_path / "0.log", tmp_path / "0.err"
    out.write_bytes(b"")
    err.write_bytes(b"step 50 loss 1\n")  # an earlier generation's
    scanner = StepScanner(compile_step_regex(REGEX), [(out, 0), (err, err.stat().st_size)])
    with open(out, "ab") as o, open(err, "ab") as e:
        e.write(b"step 1 loss 2.0\nstep 2 loss 1.5\n")
        e.flush()
        assert [s.step for s in scanner.poll()] == [1, 2]
        o.write(b"step 2 loss 1.5\nstep 3 loss 1.0\n")  # step 2 again, in the other stream
        o.flush()
        assert [(s.step, s.loss) for s in scanner.poll()] == [(3, 1.0)]


def test_a_step_group_may_be_the_first_group_and_the_loss_may_be_missing() -> None:
    pattern = compile_step_regex(r"iter (\d+)")
    assert parse_line(pattern, "train iter 12 done") is not None
    assert parse_line(pattern, "train iter 12 done").step == 12  # type: ignore[union-attr]
    assert parse_line(pattern, "train iter 12 done").loss is None  # type: ignore[union-attr]
    assert parse_line(compile_step_regex(r"(?P<step>\S+)"), "١٢") is None  # not ASCII digits
    assert parse_line(pattern, "nothing here") is None


@pytest.mark.parametrize("text,why", [("(", "not a regular expression"), (r"step \d+", "no group for the step")])
def test_an_unusable_regex_is_refused(text: str, why: str) -> None:
    with pytest.raises(StepRegexError, match=why):
        compile_step_regex(text)


@pytest.mark.parametrize("args,why", [
    (["--step-regex", "(", "train.py"], "--step-regex '(': not a regular expression"),
    (["--step-regex", r"step \d+", "train.py"], "no group for the step"),
    (["--step-regex", r"step (\d+)"], "only for a script"),
])
def test_launch_refuses_a_bad_step_regex_before_starting(tmp_path: Path, args: list[str], why: str) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    code, printed = run_cli(["launch", *args], tmp_path / "runs", tmp_path)
    assert_refused(code, printed, why)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ffctl-runs").exists()


# -- which scripts run the library ----------------------------------------------------------------

@pytest.mark.parametrize("source,library", [
    ("from recovery import Job\n", True),
    ("from recovery import report_step\n", False),
    ("from recovery.steps import report_step\n", False),
    ("from recovery import report_step  # one line\n", False),
    ("import recovery\nrecovery.report_step(1)\n", False),
    ("import recovery\njob = recovery.Job.from_env()\n", True),
    ("from recovery import (\n    Job,\n    report_step,\n)\n", True),
    ("import torch\n", False),
])
def test_a_script_that_only_reports_steps_is_an_unchanged_script(source: str, library: bool) -> None:
    assert runs_the_library(source) is library


# -- what a step counts on ------------------------------------------------------------------------

def test_a_script_step_counts_on_the_ranks_that_report_steps() -> None:
    lib, script = Progress(), Progress()
    script.every_rank_reports = False
    for p in (lib, script):
        p.report(StepReport(0, 5, 0, None, 0.1))  # only rank 0 reports
    assert lib.everywhere([0, 1]) == 0  # the library: every rank must have committed it
    assert script.everywhere([0, 1]) == 5  # a script reporting from rank 0 only


# -- the figures of a fault in a script that restores itself --------------------------------------

def _ev(what: EventKind, t: float, **data: Any) -> Event:
    return Event(what, t, data)


def _script_run(steps: bool) -> list[Event]:
    evs = [_ev(EventKind.RUN_STARTED, 0.0, world_size=2, strategy="peer", plain_script=True),
           _ev(EventKind.RANKS_SPAWNED, 1.0, gen=0, ranks=[0, 1])]
    t = 1.0
    if steps:
        for s in range(1, 13):
            t += 0.2
            evs.append(_ev(EventKind.STEP, t, step=s, loss=1.0 / s, step_time_s=0.2, gen=0, rank=0))
    evs += [_ev(EventKind.FAULT_INJECTED, t + 0.05, fault_id="f1", kind="kill-rank", target="rank:1",
                at_step=12 if steps else 0, gen=0),
            _ev(EventKind.FAILURE_DETECTED, t + 0.1, fault_ids=["f1"], cause="process-exit", ranks=[1], gen=0),
            _ev(EventKind.RECOVERY_DECIDED, t + 0.2, fault_ids=["f1"], gen=1, restore_step=None,
                restore_source="script", ranks=[0, 1]),
            _ev(EventKind.RANKS_SPAWNED, t + 0.5, gen=1, ranks=[0, 1], started_by={"0": "template", "1": "template"})]
    t += 0.5
    if steps:
        for s in range(11, 21):  # back from its checkpoint of step 10
            t += 0.2
            evs.append(_ev(EventKind.STEP, t, step=s, loss=1.0 / s, step_time_s=0.2, gen=1, rank=0))
    evs.append(_ev(EventKind.RUN_FINISHED, t + 0.1, status="completed", steps_completed=20 if steps else 0))
    return evs


def test_a_script_fault_with_known_steps_counts_the_steps_it_trains_again() -> None:
    (f,) = compute("r", _script_run(steps=True)).faults
    assert f.restore_source == "script" and f.restore_step == 10 and f.lost_steps == 2
    assert f.step_known and f.recovery_until == "step"
    # Recovered when step 13 (m+1) was completed again, replay included.
    assert f.recovery_s == pytest.approx(0.5 + 3 * 0.2 - 0.05)
    assert f.lost_s > 0


def test_a_script_fault_without_steps_ends_when_its_workers_are_up() -> None:
    rep = compute("r", _script_run(steps=False))
    (f,) = rep.faults
    assert not f.step_known and f.recovery_until == "workers-up" and f.recovered
    assert f.recovery_s == pytest.approx(0.45) and f.lost_s == pytest.approx(0.45)
    # What it trains again is the script's own business: unknown, never a false 0.
    assert f.restore_step is None and f.lost_steps is None
    assert rep.strategy == "torchrun-restart" and rep.goodput is None
    assert rep.to_dict()["faults"][0]["recovery_until"] == "workers-up"


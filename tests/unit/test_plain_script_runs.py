"""How an unchanged torchrun script (a plain script: restart-only recovery) is scheduled and
reported: a step trigger is the script's step, not bounded by --steps (the built-in GPT's length);
the live view shows its step without a total; the report says what its restart really did (the
group restarted, the script restoring itself or starting over, the steps it trained again, a
goodput only from steps it reported); and `ffctl launch --help` shows the `[rank N]:` prefix.

Event streams are written by hand as the controller records a plain script's run: steps reported
from rank 0 only, `recovery_decided` with restore_source "script" and no restore step (the script
restores itself), the first step of each generation timed from the workers' start.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from wire.fault_spec import parse_injection
from ffctl.cli.app import main
from ffctl.render.live import LiveView, _table, step_text
from ffctl.render.report import markdown_report, render_comparison, render_report
from ffctl.launch_spec import LaunchSpec, SpecError
from runs.events import EventKind
from runs.metrics import SCRIPT_RESTART, compute, run_strategy
from tests.helpers.events import StreamBuilder, loss_at
from tests.unit.test_bad_inputs import assert_refused, run_cli

STEP_S = 0.5
START_UP_S = 3.0  # the first step a generation reports is timed from the workers' start


# -- step triggers: the script's steps, not --steps ------------------------------------------------

def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('step 1 loss 0.5')\n")
    return path


def test_a_step_trigger_in_a_script_is_not_bounded_by_steps(tmp_path: Path) -> None:
    fault = parse_injection("kill-rank:rank=1,step=300", scheduled=True)
    spec = LaunchSpec(nnodes=1, nproc_per_node=2, script=(str(_script(tmp_path)),), injects=(fault,))
    assert spec.steps == 60  # the built-in GPT's default, which says nothing of the script
    assert spec.validate() is spec


def test_a_step_trigger_past_the_built_in_gpt_s_steps_is_refused() -> None:
    fault = parse_injection("kill-rank:rank=1,step=300", scheduled=True)
    with pytest.raises(SpecError, match="at step 300: the run has only 60 steps"):
        LaunchSpec(nnodes=1, nproc_per_node=2, injects=(fault,)).validate()
    LaunchSpec(nnodes=1, nproc_per_node=2, steps=300, injects=(fault,)).validate()


def test_dry_run_of_a_script_takes_a_fault_at_its_step_300(tmp_path: Path) -> None:
    _script(tmp_path)
    code, printed = run_cli(["launch", "--dry-run", "--nnodes", "1", "--nproc-per-node", "2",
                             "--step-regex", r"step (?P<step>\d+)", "--inject", "kill-rank:rank=1,step=300",
                             "train.py"], tmp_path / "runs", tmp_path)
    assert code == 0, printed
    head = printed.splitlines()[0]
    # No "60 steps": the plan names the script's own steps and the recovery it will really get.
    # (the run id, a time stamp, may hold "60" itself: only the plan's own words are read)
    assert "the script's own steps" in head and "60 steps" not in head, head
    assert f"recovery {SCRIPT_RESTART}" in head, head
    assert "kill-rank rank:1 @step=300 (fires on the script's own reported step" in printed, printed
    assert not (tmp_path / "runs").exists()
    # Without a step source the trigger could never fire: refused, one line, nothing started.
    code, printed = run_cli(["launch", "--dry-run", "--nnodes", "1", "--nproc-per-node", "2",
                             "--inject", "kill-rank:rank=1,step=300", "train.py"], tmp_path / "runs", tmp_path)
    assert_refused(code, printed, "step=300 can never fire")


def test_launch_of_the_built_in_gpt_still_refuses_a_step_past_its_steps(tmp_path: Path) -> None:
    code, printed = run_cli(["launch", "--nnodes", "1", "--nproc-per-node", "2",
                             "--inject", "kill-rank:rank=1,step=300"], tmp_path / "runs", tmp_path)
    assert_refused(code, printed, "the run has only 60 steps")


# -- the live view: a script's step without a total -------------------------------------------------

def _state(step: int, steps: int | None, phase: str = "running") -> dict[str, Any]:
    return {"run_id": "r", "phase": phase, "gen": 0, "step": step, "steps": steps, "loss": 0.25,
            "steps_per_s": 2.0, "fault": None, "strategy": SCRIPT_RESTART, "notices": ()}


def _printed(states: list[dict[str, Any]]) -> list[str]:
    buf = io.StringIO()
    view = LiveView(Console(file=buf, force_terminal=False, width=200, color_system=None))
    for state in states:
        view(state)
    return buf.getvalue().splitlines()


def test_the_live_view_shows_a_script_s_step_without_a_total() -> None:
    assert step_text(_state(12, None)) == "12"
    assert step_text(_state(12, 60)) == "12/60"
    assert _printed([_state(12, None)]) == ["[running] gen 0 step 12 loss 0.2500"]
    assert _printed([_state(12, 60)]) == ["[running] gen 0 step 12/60 loss 0.2500"]
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(_table(_state(12, None)))
    assert "12/" not in buf.getvalue() and " 12 " in buf.getvalue()


def test_the_progress_lines_of_a_script_thin_out_as_its_steps_grow() -> None:
    # Without a total, a line per step up to 9, per ten up to 90, per hundred from 100: a
    # 250-step script prints 19 lines, one of a million steps no flood.
    lines = _printed([_state(s, None) for s in range(1, 251)])
    steps = [int(line.split(" step ")[1].split()[0]) for line in lines]
    assert steps == [*range(1, 10), *range(10, 100, 10), 100, 200]
    # With a total (the built-in GPT), a line per tenth of the run as before.
    lines = _printed([_state(s, 60) for s in range(1, 61)])
    assert [line.split(" step ")[1].split()[0] for line in lines] == [f"{s}/60" for s in (1, *range(6, 61, 6))]


# -- the report of a plain script's restart --------------------------------------------------------

def _plain_run(before: range, after: range | None, strategy: str = "peer", finish: str = "completed",
               reported: bool = True, late: int | None = None) -> StreamBuilder:
    """A plain script of 2 ranks killed after reporting the steps `before` (none if `reported` is
    false); its group restarted (the controller runs restart-memory in place of peer) and the
    script reports `after` (None: nothing, it failed again before its first line). `late`: a
    step of the killed generation whose line is read only after the restart was decided."""
    b = StreamBuilder(start=1000.0)
    b.emit(EventKind.RUN_STARTED, world_size=2, strategy=strategy, nnodes=1, nproc_per_node=2, steps=60,
           plain_script=True, script=["train.py"])
    b.emit(EventKind.RANKS_SPAWNED, 0.25, gen=0, ranks=[0, 1])

    def report(steps: range, gen: int) -> None:
        for i, s in enumerate(steps):
            b.step(s, gen=gen, step_time_s=START_UP_S if i == 0 else STEP_S)

    if reported:
        report(before, 0)
    at = before[-1] if reported else 0
    b.fault_injected("f1", at_step=at, dt=0.25, gen=0, breaks_job=True)
    b.rank_exited(1, gen=0, dt=0.125)
    b.failure_detected(["f1"], gen=0, cause="process-exit")
    b.emit(EventKind.RECOVERY_DECIDED, 0.125, fault_ids=["f1"], gen=1, restore_step=None,
           restore_source="script", strategy="restart-memory", ranks=[0, 1])
    if late is not None:
        b.step(late, gen=0, step_time_s=0.0625)
    b.emit(EventKind.RANKS_SPAWNED, 0.5, gen=1, ranks=[0, 1], started_by={"0": "template", "1": "template"})
    if after is not None and reported:
        report(after, 1)
    b.run_finished(finish, dt=0.25)
    return b


def test_a_script_that_started_over_lost_every_step_it_had_reported() -> None:
    # No checkpoint of its own: counting from 0, it reported 0..12, and after the restart 0 again.
    b = _plain_run(range(0, 13), range(0, 21))
    rep = compute("r", b.events)
    (f,) = rep.faults
    assert f.at_step == 12 and f.step_known
    assert f.restore_source == "none" and f.restore_step is None  # nothing restored; never -1
    assert f.lost_steps == 13  # steps 0..12, all trained again
    assert f.recovered and f.resumed_at == next(ev.t for ev in b.events if ev.kind is EventKind.STEP
                                                and ev.get("gen") == 1 and ev.get("step") == 13)
    assert rep.strategy == SCRIPT_RESTART  # what really ran, not the "peer" --recovery asked for
    # The record's steps are those of the run that finished: the new generation's.
    assert rep.steps_completed == 20 and rep.step_known
    assert rep.loss_by_step == [[s, loss_at(s, 1)] for s in range(0, 21)]
    assert rep.final_loss == loss_at(20, 1)
    # Goodput from the steps it reported: 21 final steps of 0.5 s (the first one's start-up is no
    # training: it counts at the median), over the whole wall time.
    assert rep.goodput == pytest.approx(21 * STEP_S / rep.wall_s)


def test_a_step_read_after_the_restart_was_decided_was_trained_before_it() -> None:
    # Both ranks finished step 16 before rank 1 was killed; the line was read after the decision.
    b = _plain_run(range(0, 16), range(0, 21), late=16)
    (f,) = compute("r", b.events).faults
    assert f.at_step == 16 and f.lost_steps == 17 and f.restore_source == "none"
    assert f.resumed_at == next(ev.t for ev in b.events if ev.kind is EventKind.STEP
                                and ev.get("gen") == 1 and ev.get("step") == 17)
    assert compute("r", b.events).loss_by_step == [[s, loss_at(s, 1)] for s in range(0, 21)]


def test_a_script_that_resumed_from_its_checkpoint_lost_the_steps_after_it() -> None:
    # Counting from 1, checkpoint at 10: it reports 11 first after the restart.
    rep = compute("r", _plain_run(range(1, 13), range(11, 21)).events)
    (f,) = rep.faults
    assert f.restore_source == "script" and f.restore_step == 10 and f.lost_steps == 2
    assert rep.steps_completed == 20
    assert rep.loss_by_step == [[s, loss_at(s, 0 if s <= 10 else 1)] for s in range(1, 21)]
    assert rep.goodput == pytest.approx(20 * STEP_S / rep.wall_s)


def test_a_restart_that_reports_no_step_leaves_the_restore_unknown() -> None:
    rep = compute("r", _plain_run(range(1, 13), None, finish="failed").events)
    (f,) = rep.faults
    assert f.restore_source == "script" and f.restore_step is None and f.lost_steps is None
    assert not f.recovered


def test_a_script_first_heard_of_after_its_restart_has_unknown_lost_steps() -> None:
    # Its lines before the fault never arrived: what it lost is unknown, not 0; restore step 11.
    b = _plain_run(range(1, 13), range(12, 21))
    b.events = [ev for ev in b.events if not (ev.kind is EventKind.STEP and ev.get("gen") == 0)]
    (f,) = compute("r", b.events).faults
    assert f.restore_source == "script" and f.restore_step == 11 and f.lost_steps is None


def test_a_script_that_reports_no_steps_has_no_goodput_and_no_step_figures() -> None:
    rep = compute("r", _plain_run(range(1, 13), range(1, 21), reported=False).events)
    (f,) = rep.faults
    assert not f.step_known and f.lost_steps is None and f.restore_step is None
    assert rep.goodput is None and not rep.step_known
    assert rep.strategy == SCRIPT_RESTART


def test_the_steps_that_stand_after_a_start_over_are_the_new_ones() -> None:
    # Started over after step 12 and failed for good at step 5: 5 steps stand, not 12.
    rep = compute("r", _plain_run(range(1, 13), range(1, 6), finish="failed").events)
    assert rep.steps_completed == 5
    assert rep.loss_by_step == [[s, loss_at(s, 1)] for s in range(1, 6)]


def test_the_strategy_of_a_run() -> None:
    assert run_strategy("peer", plain_script=True) == SCRIPT_RESTART
    assert run_strategy("restart-disk", plain_script=True) == SCRIPT_RESTART
    assert run_strategy("none", plain_script=True) == "none"  # still stops at the first failure
    assert run_strategy("peer", plain_script=False) == "peer"
    b = StreamBuilder()
    b.run_started(world_size=2, strategy="peer")
    b.steps(1, 4)
    b.run_finished()
    rep = compute("r", b.events)
    assert rep.strategy == "peer" and rep.goodput == pytest.approx(4 * STEP_S / rep.wall_s)


def _rendered(report: dict[str, Any]) -> dict[str, str]:
    buf = io.StringIO()
    render_report(report, Console(width=100, file=buf, force_terminal=False, color_system=None))
    fields: dict[str, str] = {}
    for line in buf.getvalue().splitlines():
        words = line.split("  ")
        key, value = words[0].strip(), "  ".join(words[1:]).strip()
        if key and value:
            fields.setdefault(key, value)
    return fields


def test_the_report_of_a_script_without_steps_says_unknown_never_zero() -> None:
    report = compute("r", _plain_run(range(1, 13), range(1, 21), reported=False).events).to_dict()
    shown = _rendered(report)
    assert shown["strategy"] == SCRIPT_RESTART
    assert shown["steps"] == "-" and shown["goodput"] == "-"
    assert shown["step"] == "-" and shown["lost steps"] == "-" and shown["restore source"] == "script"
    md = markdown_report(report)
    assert f"| strategy | {SCRIPT_RESTART} |" in md and "| goodput | - |" in md and "| steps | - |" in md
    buf = io.StringIO()
    render_comparison([report, report], Console(width=160, file=buf, color_system=None))
    lost = next(line for line in buf.getvalue().splitlines() if line.strip().startswith("lost steps"))
    assert lost.split()[2:] == ["-", "-"]


def test_the_report_of_a_script_that_started_over() -> None:
    shown = _rendered(compute("r", _plain_run(range(0, 13), range(0, 21)).events).to_dict())
    assert shown["strategy"] == SCRIPT_RESTART and shown["steps"] == "20"
    assert shown["step"] == "12" and shown["lost steps"] == "13" and shown["restore source"] == "none"
    assert shown["goodput"] not in ("-", "0.000")


# -- --help: the [rank N]: prefix survives rich's markup --------------------------------------------

def test_launch_help_shows_the_rank_prefix() -> None:
    with CliRunner().isolation(env={"COLUMNS": "400", "TERM": "dumb"}) as (out, _err, _):
        with pytest.raises(SystemExit) as exc:
            main(["launch", "--help"])
        text = out.getvalue().decode()
    assert exc.value.code == 0
    flowing = " ".join(text.split())  # help wraps at 80 columns whatever the terminal's width
    assert flowing.count("prefixed") == 3, text  # --redirects, --tee, --local-ranks-filter
    assert flowing.count("prefixed [rank N]:") == 3, text
    assert "prefixed :" not in text and "\\[" not in text


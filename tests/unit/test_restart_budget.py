"""The restart budget and the crash-loop guard (`ffctl.controller.coordinator.restart_verdict`), and how a
failed rank is described on screen and in the root cause."""
from __future__ import annotations

import pytest

from ffctl.controller.failures import Failure
from ffctl.controller.script import uses_recovery_library
from ffctl.controller.coordinator import RankFailure, Verdict, describe, error_line, restart_verdict, root_cause, signal_name
from ffctl.launch_spec import LaunchSpec, SpecError
from ffctl.render.report import root_cause_lines

BOOM = (1, 10, "RuntimeError: boom")


def test_failures_within_the_budget_are_recovered_and_counted() -> None:
    for used in range(3):
        assert restart_verdict(3, used, False, (1, 10 + used, "x"), (1, 9 + used, "x")) == Verdict(None, True)


def test_the_failure_after_the_budget_stops_the_job() -> None:
    verdict = restart_verdict(3, 3, False, (1, 10, "x"), (1, 9, "x"))
    assert verdict.counted and verdict.stop == "restart budget spent: 3 of --max-restarts 3 used"


def test_max_restarts_zero_stops_at_the_first_failure() -> None:
    assert restart_verdict(0, 0, False, BOOM, None).stop is not None


def test_injected_faults_never_spend_the_budget_nor_trip_the_guard() -> None:
    # The chaos experiment itself: the hundredth injected kill is recovered like the first.
    assert restart_verdict(3, 3, True, BOOM, BOOM) == Verdict(None, False)
    assert restart_verdict(0, 0, True, None, None) == Verdict(None, False)


def test_the_same_failure_after_a_restore_is_a_crash_loop_even_within_budget() -> None:
    verdict = restart_verdict(10, 1, False, BOOM, BOOM)
    assert verdict.stop is not None and verdict.stop.startswith("crash loop: rank 1 failed again at step 10")
    assert "RuntimeError: boom" in verdict.stop


@pytest.mark.parametrize("current", [
    (2, 10, "RuntimeError: boom"),  # another rank
    (1, 11, "RuntimeError: boom"),  # another step
    (1, 10, "RuntimeError: boom at attempt 2"),  # another error
])
def test_a_different_failure_is_not_a_crash_loop(current: tuple[object, ...]) -> None:
    assert restart_verdict(10, 1, False, current, BOOM) == Verdict(None, True)


def test_failures_naming_no_rank_are_bounded_by_the_budget_only() -> None:
    assert restart_verdict(3, 1, False, None, None) == Verdict(None, True)
    assert restart_verdict(3, 3, False, None, None).stop is not None


def test_plain_script_failures_compare_without_a_step() -> None:
    sig = RankFailure(1, 0, "h", 1.0, exitcode=1, error="ValueError: bad").signature()
    assert sig == (1, None, "ValueError: bad")
    assert RankFailure(1, 0, "h", 1.0, exitcode=-11).signature() == (1, None, "SIGSEGV")
    assert restart_verdict(3, 1, False, sig, sig).stop is not None


def test_one_line_per_failed_rank() -> None:
    exc = RankFailure(1, 0, "h", 1.0, step=10, step_exact=True, exitcode=1, error="RuntimeError: boom")
    assert exc.summary() == "rank 1 (node 0) failed at step 10: exit code 1: RuntimeError: boom"
    raised = RankFailure(1, 0, "h", 1.0, step=10, step_exact=True, error="RuntimeError: boom")
    assert raised.summary() == "rank 1 (node 0) failed at step 10: RuntimeError: boom"
    killed = RankFailure(3, 1, "h", 1.0, step=21, exitcode=-9, error="some unrelated last log line")
    assert killed.summary() == "rank 3 (node 1) failed after step 20: SIGKILL"
    plain = RankFailure(1, 0, "h", 1.0, exitcode=2, error="")
    assert plain.summary() == "rank 1 (node 0) failed: exit code 2"
    assert signal_name(-11) == "SIGSEGV" and signal_name(1) is None


def test_error_line_is_the_exception_ending_the_last_traceback() -> None:
    tail = ["step 3 ok", "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
            "    raise RuntimeError('boom')", "RuntimeError: boom", "[W shutdown] ProcessGroupGloo leaked", ""]
    assert error_line(tail) == "RuntimeError: boom"
    assert error_line(["a", "Segmentation fault (core dumped)", "  "]) == "Segmentation fault (core dumped)"
    assert error_line([]) == ""


def test_root_cause_is_the_first_observed_rank_failure() -> None:
    first = RankFailure(1, 0, "hostA", 100.0, step=10, step_exact=True, pid=42, exitcode=1,
                        error="RuntimeError: boom", tail=["Traceback (most recent call last):", "RuntimeError: boom"])
    later = RankFailure(0, 0, "hostA", 100.5, step=10, exitcode=-6, error="")
    failure = Failure("step-error+process-exit", {0, 1}, t=100.0, rank_failures={0: later, 1: first})
    cause = root_cause(failure)
    assert (cause["rank"], cause["host"], cause["exitcode"], cause["pid"], cause["step"]) == (1, "hostA", 1, 42, 10)
    assert cause["others"] == [later.summary()]
    assert describe(failure) == f"{later.summary()}; {first.summary()}"
    text = "\n".join(root_cause_lines(cause, "ffctl launch FAILED"))
    assert "Root Cause (first observed failure):" in text
    assert "rank      : 1 (node 0)" in text and "host      : hostA" in text
    assert "exitcode  : 1 (pid: 42)" in text and "    RuntimeError: boom" in text
    sig = root_cause_lines(root_cause(Failure("process-exit", {0}, rank_failures={0: later})), "x")
    assert "  exitcode  : -6 (signal SIGABRT; pid: -)" in sig


def test_a_failure_naming_no_rank_still_has_a_root_cause() -> None:
    cause = root_cause(Failure("node-lost", nodes={1}, t=5.0))
    assert cause["summary"] == "node(s) [1] lost" and cause["nodes"] == [1]
    assert "  failure   : node(s) [1] lost" in root_cause_lines(cause, "x")


def test_merged_failures_keep_the_first_report_of_each_rank() -> None:
    raised = RankFailure(1, 0, "h", 1.0, step=10, step_exact=True, error="E")
    exited = RankFailure(1, 0, "h", 2.0, exitcode=1)
    a = Failure("step-error", {1}, rank_failures={1: raised})
    a.merge(Failure("process-exit", {1}, rank_failures={1: exited}))
    assert a.rank_failures == {1: raised} and a.cause == "step-error+process-exit"


def test_max_restarts_must_not_be_negative() -> None:
    assert LaunchSpec(max_restarts=0).validate().max_restarts == 0
    with pytest.raises(SpecError, match="--max-restarts -1"):
        LaunchSpec(max_restarts=-1).validate()


def test_plain_scripts_are_told_from_library_scripts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plain = tmp_path / "plain.py"
    plain.write_text("import torch.distributed as dist\nraise SystemExit(1)\n")
    lib = tmp_path / "lib.py"
    lib.write_text("import os\nfrom recovery import Job\n")
    assert uses_recovery_library(()) and uses_recovery_library(("-m", "ffctl.workload.train"))
    assert not uses_recovery_library((str(plain),))
    assert uses_recovery_library((str(lib), "--steps", "3"))


def test_the_error_of_a_dead_rank_is_read_from_its_stderr_first_then_its_stdout() -> None:
    from ffctl.controller.failures import error_and_tail

    out = ["step 1", "step 2"]
    trace = ["Traceback (most recent call last):", '  File "t.py", line 3', "ValueError: bad batch", "Warning at exit"]
    assert error_and_tail(out, trace) == ("ValueError: bad batch", trace)
    # A script that prints its traceback to stdout itself.
    assert error_and_tail([*out, *trace[:3]], ["UserWarning: x"])[0] == "ValueError: bad batch"
    # No traceback: an abort's message on stderr names it, shown after the last lines of stdout.
    assert error_and_tail(out, ["terminate called without an active exception"]) == (
        "terminate called without an active exception", [*out, "terminate called without an active exception"])
    # Nothing on stderr: the last line printed (a SIGKILLed rank's).
    assert error_and_tail(out, []) == ("step 2", out)

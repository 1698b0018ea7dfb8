"""A rank that fails at every attempt: the job stops by itself within the restart budget, exits 1
and prints the failed rank's error and its root cause, under every strategy and for a plain script
(one that does not use the recovery library)."""
from __future__ import annotations

from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import Result, assert_nothing_left, launch, rid, shm_left

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAIL_AT = 3

# The built-in GPT workload (ffctl.workload.train, its model, data and step function), except
# that rank 1 raises at step FAIL_AT, at every attempt. With ATTEMPT_IN_ERROR set the error names
# the attempt, so no two failures are the same and only the budget can stop the job.
BUILTIN_FAILING = '''
import os
import sys

from recovery import Job
from ffctl.workload import train

_run = Job.run


def run(self, step_fn, steps):
    def failing(ctx):
        if ctx.rank == 1 and ctx.step == {fail_at}:
            attempt = f" (attempt {{os.environ['TORCHELASTIC_RESTART_COUNT']}})" if os.environ.get("ATTEMPT_IN_ERROR") else ""
            raise RuntimeError(f"boom at step {{ctx.step}}{{attempt}}")
        return step_fn(ctx)
    return _run(self, failing, steps)


Job.run = run
train.main(sys.argv[1:])
'''.format(fail_at=FAIL_AT)

# A plain torchrun-style script: no recovery library, rank 1 fails, rank 0 keeps working.
PLAIN_FAILING = '''
import os
import time

if os.environ["RANK"] == "1":
    time.sleep(0.5)
    raise ValueError("plain script failed on rank 1")
time.sleep(120)
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("crashloop")
    (d / "failing_gpt.py").write_text(BUILTIN_FAILING)
    (d / "plain_failing.py").write_text(PLAIN_FAILING)
    return d


def _check_stopped(res: Result, workdir: Path, error: str, max_restarts: int) -> list:
    """What every stopped job shows: exit 1, rank 1 and its error on screen, a root cause on
    stderr, a failed record with the cause, at most `max_restarts` recoveries, nothing left."""
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "Root Cause (first observed failure):" in res.stderr, out
    assert "rank      : 1 (node 0)" in res.stderr, out
    assert error in res.stderr, out
    # The live view said which rank failed, and why, as it happened.
    assert any(line.startswith("ffctl: rank 1 (node 0) failed") and error in line for line in res.stdout.splitlines()), out
    events = res.events
    decided = [e for e in events if e.kind is EventKind.RECOVERY_DECIDED]
    assert len(decided) <= max_restarts, [e.data for e in decided]
    (failed,) = [e for e in events if e.kind is EventKind.RECOVERY_FAILED]
    (finished,) = [e for e in events if e.kind is EventKind.RUN_FINISHED]
    assert finished.get("status") == "failed" and finished.get("reason") == failed.get("reason")
    cause = finished.get("root_cause")
    assert cause["rank"] == 1 and cause["node"] == 0 and error in cause["error"], cause
    assert cause["exitcode"] == 1, cause  # it raised: the process exited with 1
    assert any(error in line for line in cause["tail"]), cause
    assert res.report["status"] == "failed"
    assert_nothing_left(workdir)
    assert not shm_left(res.run_id or "")
    return decided


@pytest.mark.parametrize("strategy", ["peer", "restart-memory", "restart-disk", "none"])
def test_builtin_workload_failing_every_attempt_stops(workdir: Path, strategy: str) -> None:
    extra = ["--ckpt-every", "2"] if strategy == "restart-disk" else []
    res = launch(workdir, rid(f"loop-{strategy}"), "--nnodes", "1", "--nproc-per-node", "2",
                 "--recovery", strategy, *extra, "failing_gpt.py", "--model", "tiny", "--steps", "8")
    error = f"RuntimeError: boom at step {FAIL_AT}"
    decided = _check_stopped(res, workdir, error, max_restarts=3)
    assert f"rank 1 (node 0) failed at step {FAIL_AT}: {error}" in res.stdout
    if strategy == "none":
        assert decided == [] and "--recovery none" in res.stderr
    else:
        # Restored once, then the same rank failed at the same step with the same error.
        assert len(decided) == 1, [e.data for e in decided]
        assert "crash loop: rank 1 failed again at step 3" in res.stderr


def test_budget_stops_failures_that_differ(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTEMPT_IN_ERROR", "1")  # reaches the ranks through the local agents
    res = launch(workdir, rid("budget"), "--nnodes", "1", "--nproc-per-node", "2", "--recovery", "restart-memory",
                 "--max-restarts", "2", "failing_gpt.py", "--model", "tiny", "--steps", "8")
    decided = _check_stopped(res, workdir, "RuntimeError: boom at step 3 (attempt 2)", max_restarts=2)
    assert len(decided) == 2
    assert "restart budget spent: 2 of --max-restarts 2 used" in res.stderr
    failures = [e for e in res.events if e.kind is EventKind.FAILURE_DETECTED]
    assert [f.get("detail") for f in failures] == [f"RuntimeError: boom at step 3 (attempt {g})" for g in range(3)]


def test_plain_script_failing_every_attempt_stops(workdir: Path) -> None:
    res = launch(workdir, rid("plain"), "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
                 "plain_failing.py")
    error = "ValueError: plain script failed on rank 1"
    decided = _check_stopped(res, workdir, error, max_restarts=1)
    # As torchrun does: restarted once (no crash-loop guard for a plain script), then the budget.
    assert len(decided) == 1 and "restart budget spent: 1 of --max-restarts 1 used" in res.stderr
    assert f"rank 1 (node 0) failed: exit code 1: {error}" in res.stdout
    spawned = [e for e in res.events if e.kind is EventKind.RANKS_SPAWNED]
    assert [e.get("gen") for e in spawned] == [0, 1]  # counted as started once its process was up


# examples/ddp/with_ffctl.py's training with a loss check as Megatron-LM has one (a non-finite
# loss raises), and a restored state that goes bad: a rank started again after a failure (its
# TORCHELASTIC_RESTART_COUNT above 0) has one weight turned to NaN before its first step, as a
# replica-assembled checkpoint did in Megatron-LM#5281. Each restore therefore ends in the same
# NaN at the same step, on the same rank.
NAN_AFTER_RESTORE = '''
import math
import os
import sys

import torch

sys.path.insert(0, {examples!r})
import with_ffctl
from recovery import Job

_register = Job.register_ddp


def register_ddp(self, model, optimizer, **kw):
    batches = _register(self, model=model, optimizer=optimizer, **kw)
    poisoned = []
    forward = model.forward

    def going_bad(*a, **k):
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not poisoned:
            poisoned.append(True)
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        return forward(*a, **k)
    model.forward = going_bad
    return batches


_run = Job.run


def run(self, step_fn, steps):
    def with_loss_check(ctx):
        loss = step_fn(ctx)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {{loss}} at step {{ctx.step}}")
        return loss
    return _run(self, with_loss_check, steps)


Job.register_ddp = register_ddp
Job.run = run
sys.argv = [sys.argv[0], "--steps", "24"]
with_ffctl.main()
'''


def test_a_job_that_nans_after_every_restore_stops_within_three_cycles(workdir: Path) -> None:
    """The loop breaker on a restored state that trains into NaN: an injected kill of rank 1, its
    replacement's first step NaNs and raises, the next replacement NaNs at the same step with the
    same error, and the job stops there (3 recoveries at most) with the NaN as its root cause."""
    examples = str(Path(__file__).resolve().parents[2] / "examples" / "ddp")
    (workdir / "nan_after_restore.py").write_text(NAN_AFTER_RESTORE.format(examples=examples))
    res = launch(workdir, rid("nan-loop"), "--nnodes", "1", "--nproc-per-node", "2", "--spares", "1",
                 "--inject", "kill-rank:rank=1,step=6", "nan_after_restore.py")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    failures = [e for e in res.events if e.kind is EventKind.FAILURE_DETECTED and "FloatingPointError" in str(e.get("detail"))]
    assert len(failures) == 2, [e.data for e in res.events if e.kind is EventKind.FAILURE_DETECTED]
    # Same rank, same step, same error: each the first step after a restore.
    assert len({(tuple(f.get("ranks")), f.get("detail")) for f in failures}) == 1, [f.data for f in failures]
    assert failures[0].get("ranks") == [1] and "loss is nan at step" in str(failures[0].get("detail")), failures[0].data
    step = int(str(failures[0].get("detail")).rsplit(" ", 1)[1])
    decided = [e for e in res.events if e.kind is EventKind.RECOVERY_DECIDED]
    assert 2 <= len(decided) <= 3, [e.data for e in decided]  # the injected kill's, then the first NaN's
    assert f"crash loop: rank 1 failed again at step {step}" in res.stderr, out
    (finished,) = [e for e in res.events if e.kind is EventKind.RUN_FINISHED]
    cause = finished.get("root_cause")
    assert finished.get("status") == "failed" and cause["rank"] == 1, finished.data
    assert "FloatingPointError: loss is nan" in cause["error"], cause
    assert "Root Cause (first observed failure):" in res.stderr, out
    assert_nothing_left(workdir)
    assert not shm_left(res.run_id or "")

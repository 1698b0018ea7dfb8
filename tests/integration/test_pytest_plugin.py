"""ffctl's pytest plugin: the `ffctl_jobs` fixture drives a real job (launch, inject, wait for the
recovery, report), and tears everything down when a test fails or pytest is interrupted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ffctl.testing.jobs import Jobs
from runs.events import EventKind
from runs.store import iter_events
from tests.helpers.launch import shm_left

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_plugin_is_registered(pytestconfig: pytest.Config) -> None:
    plugin = pytestconfig.pluginmanager.get_plugin("ffctl")
    assert plugin is not None and plugin.__name__ == "ffctl.testing.pytest_plugin"


def test_inject_into_a_running_job_and_wait_for_its_recovery(ffctl_jobs: Jobs) -> None:
    job = ffctl_jobs.launch("--nnodes", "2", "--nproc-per-node", "1", "--steps", "100000", "--spares", "1")
    job.wait_step(5)
    fid = job.inject("kill-node", node=1)
    fault = job.wait_recovered(fid, timeout=120)
    assert fault["kind"] == "kill-node" and fault["target"] == "node:1"
    assert fault["restore_source"] == "peer-memory" and fault["lost_steps"] <= 1
    job.wait_step(fault["at_step"] + 10)  # it trains on after the recovery
    assert job.stop() == 130, job.stderr[-3000:]
    report = job.report()
    assert report["status"] == "interrupted" and report["steps_completed"] >= fault["at_step"] + 10
    assert [f["fault_id"] for f in report["faults"]] == [fid]
    # What the fixture computed while the job ran is what the job itself wrote at its end.
    written = json.loads((job.record / "report.json").read_text())
    assert written["faults"][0]["recovery_s"] == fault["recovery_s"]


# Run by a pytest of its own: the first test fails while its job (from a scenario) runs, the
# second is interrupted (SIGINT to that pytest) while its job (from arguments) runs.
INNER = '''
import time
from pathlib import Path

def test_fails_while_its_job_runs(ffctl_jobs):
    job = ffctl_jobs.scenario(Path(__file__).with_name("long.toml"))
    job.wait_step(3)
    assert 1 == 2, "failed on purpose"

def test_interrupted_while_its_job_runs(ffctl_jobs):
    job = ffctl_jobs.launch("--nnodes", "2", "--nproc-per-node", "1", "--steps", "100000")
    job.wait_step(3)
    Path(__file__).with_name("ready").write_text(job.run_id)
    time.sleep(600)
'''
LONG = '[launch]\nnnodes = 2\nnproc_per_node = 1\nsteps = 100000\n[expect]\ncompletes = true\n'


def _left_under(base: Path) -> list[str]:
    """ffctl processes working under `base` (the inner pytest's temporary folders)."""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "ffctl" in " ".join(proc.info["cmdline"] or []) and Path(proc.cwd()).is_relative_to(base):
                left.append(" ".join(proc.info["cmdline"]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            continue
    return left


def test_jobs_are_torn_down_when_a_test_fails_or_pytest_is_interrupted(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "long.toml").write_text(LONG)
    base = tmp_path / "basetemp"
    out = (tmp_path / "inner.log").open("w")
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(base),
                              "-o", "timeout=0", "test_inner.py"], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                             # A user's pytest at a terminal: Ctrl-C interrupts it, whatever the
                             # disposition this runner inherited (a background job's is ignore).
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "ready").exists():
            assert inner.poll() is None, (tmp_path / "inner.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "inner.log").read_text()
            time.sleep(0.2)
        inner.send_signal(signal.SIGINT)
        inner.wait(timeout=120)
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        out.close()
    log = (tmp_path / "inner.log").read_text()
    assert "failed on purpose" in log and "KeyboardInterrupt" in log, log
    runs = sorted(p for p in base.glob("ffctl-jobs[0-9]*/runs/*") if p.is_dir())  # (not the -current link, nor .gitignore)
    assert len(runs) == 2, runs
    for run in runs:
        finished = [ev for ev in iter_events(run / "events.jsonl") if ev.kind is EventKind.RUN_FINISHED]
        # Stopped as Ctrl-C stops a job, not killed: the record is closed and says so.
        assert finished and finished[-1].get("status") == "interrupted", run
        assert not shm_left(run.name)
    assert not _left_under(base)
    assert "FfctlTeardownWarning" not in log  # nothing had to be removed by force
    assert os.environ.get("FFCTL_TESTING_JOB") is None

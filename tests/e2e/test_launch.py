"""`ffctl launch` / `report` / `inject` as a user runs them: real processes, real gloo, real kills."""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import (
    TIMEOUT, assert_nothing_left, faults_beyond_load, ffctl_argv, launch, rid, run_ffctl, shm_left, start_launch, stop_at_end,
    wait_event, wait_step,
)

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("launch")


@pytest.fixture(scope="module")
def baseline(workdir: Path) -> list[list[float]]:
    """A fault-free 2x2 run of 60 steps, seed 0: the reference every fault run is held to."""
    res = launch(workdir, rid("base"), "--steps", "60", "--seed", "0")
    assert res.returncode == 0, res.stderr
    assert res.report["status"] == "completed"
    assert res.report["steps_completed"] == 60
    assert len(res.report["loss_by_step"]) == 60
    assert_nothing_left(workdir)
    return res.report["loss_by_step"]


def test_same_seed_same_losses(workdir: Path, baseline: list[list[float]]) -> None:
    again = launch(workdir, rid("again"), "--steps", "60", "--seed", "0", "--recovery", "restart-disk", "--ckpt-every", "20")
    assert again.returncode == 0, again.stderr
    assert again.report["loss_by_step"] == baseline
    other = launch(workdir, rid("seed1"), "--steps", "10", "--seed", "1")
    assert other.report["loss_by_step"] != baseline[:10]
    assert_nothing_left(workdir)


def test_restart_disk_recovers_a_killed_rank_and_a_killed_node(workdir: Path, baseline: list[list[float]]) -> None:
    # Both kinds in one job (a rank at step 25, its node at step 45): each restarts the whole
    # group from the newest checkpoint, and each is billed on its own.
    run_id = rid("disk")
    res = launch(workdir, run_id, "--nnodes", "2", "--nproc-per-node", "2", "--steps", "60",
                 "--recovery", "restart-disk", "--ckpt-every", "10",
                 "--inject", "kill-rank:rank=1,step=25", "--inject", "kill-node:node=1,step=45")
    assert res.returncode == 0, res.stderr
    rep = res.report
    assert rep["status"] == "completed" and rep["steps_completed"] == 60
    assert [f["kind"] for f in faults_beyond_load(rep)] == ["kill-rank", "kill-node"]
    for f in faults_beyond_load(rep):
        assert f["recovery_s"] > 0 and f["lost_gpu_hours"] > 0
        assert f["lost_s"] > 0 and f["lost_gpu_hours"] == pytest.approx(4 * f["lost_s"] / 3600)
        assert f["detection_s"] is not None and 0 < f["detection_s"] < f["recovery_s"]
        assert f["restore_source"] == "disk"
        assert f["restore_step"] % 10 == 0 and 0 <= f["lost_steps"] <= 10
        assert sum(abs(v or 0) for v in f["breakdown"].values()) == pytest.approx(f["recovery_s"], rel=1e-6)
    assert [f["restore_step"] for f in faults_beyond_load(rep)] == [20, 40]
    # Restarted from a checkpoint, every rank recomputes the lost steps bit for bit.
    assert rep["loss_by_step"] == baseline
    # report recomputes the same figures from the events alone.
    out = run_ffctl(workdir, "report", run_id, "--json")
    assert out.returncode == 0
    assert [f["recovery_s"] for f in json.loads(out.stdout)["faults"]] == [f["recovery_s"] for f in rep["faults"]]
    assert_nothing_left(workdir)
    assert not shm_left(run_id)


def test_recovery_none_lets_the_job_fail(workdir: Path) -> None:
    res = launch(workdir, rid("none"), "--steps", "60", "--recovery", "none", "--inject", "kill-rank:rank=2,step=15")
    assert res.returncode == 1
    rep = res.report
    assert rep["status"] == "failed"
    assert 15 <= rep["steps_completed"] < 60
    (f,) = faults_beyond_load(rep)
    assert f["recovered"] is False and f["recovery_s"] is None and f["detection_s"] is not None
    failed = [e for e in res.events if e.kind is EventKind.RECOVERY_FAILED]
    assert failed and "--recovery none" in failed[0].get("reason")
    assert_nothing_left(workdir)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node 0"),
        (["--inject", "melt-gpu:rank=1"], "'melt-gpu'"),
        (["--inject", "kill-rank:rank=9,step=5"], "rank 9"),
        (["--inject", "kill-node:node=4,step=5"], "node 4"),
        (["--recovery", "sometimes"], "'sometimes'"),
        (["--recovery", "restart-disk"], "--ckpt-every"),
        (["--steps", "abc"], "abc"),
    ],
)
def test_bad_launch_input_is_one_line_and_exit_2(workdir: Path, args: list[str], needle: str) -> None:
    run_id = rid("bad")
    res = launch(workdir, run_id, *args, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert not (workdir / "runs" / run_id).exists()
    assert_nothing_left(workdir, within=2)


def test_unwritable_runs_dir(workdir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    proc = run_ffctl(tmp_path, "launch", "--runs-dir", str(blocker / "runs"), "--steps", "5", timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and str(blocker) in proc.stderr
    assert_nothing_left(tmp_path, within=2)


def test_unknown_run_id(workdir: Path) -> None:
    for args in (["report", "no-such-run"], ["inject", "kill-rank", "--run", "no-such-run", "--rank", "0"]):
        proc = run_ffctl(workdir, *args, timeout=60)
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "no-such-run" in proc.stderr


def test_ctrl_c_leaves_a_complete_interrupted_record(workdir: Path) -> None:
    run_id = rid("intr")
    # Started as a script's background job is: with SIGINT ignored, which a child inherits.
    # `kill -INT` must stop it all the same (torchrun's agent sets its own handler too).
    proc = subprocess.Popen(ffctl_argv("launch", "--run-id", run_id, "--runs-dir", str(workdir / "runs"),
                                       "--steps", "100000", "--spares", "1"),
                            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    with stop_at_end(proc, timeout=60) as stopped:
        wait_step(workdir / "runs", run_id, 5)
    assert stopped.code == 130
    rep = json.loads((workdir / "runs" / run_id / "report.json").read_text())
    assert rep["status"] == "interrupted" and rep["steps_completed"] >= 5
    assert_nothing_left(workdir)
    assert not shm_left(run_id)


def test_adhoc_inject_from_another_terminal(workdir: Path) -> None:
    run_id = rid("adhoc")
    proc = start_launch(workdir, run_id, "--steps", "100000", "--spares", "1")
    with stop_at_end(proc) as stopped:
        wait_step(workdir / "runs", run_id, 10)
        dry = run_ffctl(workdir, "inject", "kill-node", "--run", run_id, "--node", "1", "--dry-run", timeout=60)
        assert dry.returncode == 0 and "kill -KILL" in dry.stdout
        bad = run_ffctl(workdir, "inject", "kill-rank", "--run", run_id, "--rank", "7", timeout=60)
        assert bad.returncode == 2 and "rank 7" in bad.stderr
        # A fault of ten minutes, undone by its id (chaosd's recover): the rank's pace comes back
        # at once; a second revert and an unknown id are one line each, exit 2.
        slow = run_ffctl(workdir, "inject", "slow-rank", "--run", run_id, "--rank", "0", "-o", "factor=2",
                         "--duration", "10m", timeout=60)
        assert slow.returncode == 0 and "as f1" in slow.stdout, slow.stderr
        undo = run_ffctl(workdir, "inject", "revert", "f1", "--run", run_id, timeout=60)
        assert undo.returncode == 0 and "reverted f1" in undo.stdout, undo.stderr
        wait_event(workdir / "runs" / run_id / "events.jsonl",
                   lambda ev: ev.kind is EventKind.FAULT_REVERTED and ev.get("fault_id") == "f1", 60)
        for fault, why in (("f1", "reverted already"), ("f9", "no fault f9")):
            again = run_ffctl(workdir, "inject", "revert", fault, "--run", run_id, timeout=60)
            assert again.returncode == 2 and why in again.stderr and again.stderr.count("\n") == 1, again.stderr
        out = run_ffctl(workdir, "inject", "kill-node", "--run", run_id, "--node", "1", timeout=60)
        assert out.returncode == 0, out.stderr
        # Trained again past the restore: the fault has all its figures; Ctrl-C ends the job.
        restored = wait_event(workdir / "runs" / run_id / "events.jsonl",
                              lambda ev: ev.kind is EventKind.RESTORE_DONE, 240)
        wait_step(workdir / "runs", run_id, int(restored.get("step")) + 5)
    assert stopped.code == 130, stopped.stderr
    rep = json.loads((workdir / "runs" / run_id / "report.json").read_text())
    assert rep["status"] == "interrupted"
    slowed, f = faults_beyond_load(rep)  # the dry run and the refused one injected nothing
    assert slowed["kind"] == "slow-rank" and slowed["fault_id"] == "f1"
    assert f["kind"] == "kill-node" and f["target"] == "node:1" and f["recovered"]
    assert_nothing_left(workdir)


def test_controller_sigkill_keeps_record_and_takes_everything_down(workdir: Path) -> None:
    run_id = rid("kill9")
    proc = start_launch(workdir, run_id, "--steps", "100000", "--spares", "1")
    try:
        wait_step(workdir / "runs", run_id, 5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    events_path = workdir / "runs" / run_id / "events.jsonl"
    # Every line written is intact and readable; the agents notice and stop every rank.
    raw = [line for line in events_path.read_text().splitlines() if line]
    assert all(json.loads(line) for line in raw)
    steps = [json.loads(line)["step"] for line in raw if json.loads(line)["event"] == "step"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5
    assert_nothing_left(workdir, within=30)
    # The controller is gone without a run_finished: the run is incomplete, not running, and
    # `ffctl report` exits 1 so a script does not take it for a run that ended.
    out = run_ffctl(workdir, "report", run_id, "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["status"] == "incomplete"



def test_a_second_run_with_the_same_id_on_this_host_is_refused(
        workdir: Path, baseline: list[list[float]], tmp_path: Path) -> None:
    # Two runs given the same id (say, two CI jobs with `--run-id ci`) would share shared-memory
    # slot names on this host: the second must stop before it wipes or writes the first's slots.
    run_id = rid("same")
    first = start_launch(workdir, run_id, "--steps", "100000", "--seed", "0", "--spares", "1",
                         "--inject", "kill-rank:rank=1,step=40")
    with stop_at_end(first, timeout=60) as stopped:
        wait_step(workdir / "runs", run_id, 3)
        other = tmp_path / "other"
        other.mkdir()
        second = launch(other, run_id, "--steps", "60", "--seed", "0", timeout=120)
        wait_step(workdir / "runs", run_id, 70)  # recovered from the kill at 40 meanwhile
    # Refused before anything starts (it once took 22 s and left a failed record): one line,
    # exit 2, no record, and the other run's shared-memory key named nowhere.
    assert second.returncode == 2, second.stdout + second.stderr
    [line] = second.stderr.strip().splitlines()
    assert f"run id '{run_id}' is in use on this host" in line, second.stderr
    assert not (other / "runs" / run_id).exists()
    assert re.search(r"ffctl-[^/\s]*-[0-9a-f]{32}", second.stderr) is None
    assert stopped.code == 130
    rep = json.loads((workdir / "runs" / run_id / "report.json").read_text())
    # The first run recovered from its own slots, untouched: same losses as the fault-free run.
    assert rep["loss_by_step"][:60] == baseline
    (f,) = faults_beyond_load(rep)
    assert f["restore_source"] == "local-memory" and f["resumed_at"] is not None
    assert_nothing_left(workdir)
    assert_nothing_left(other)
    assert not shm_left(run_id)

ENV_SCRIPT = '''
import json, os, sys
from recovery import Job
job = Job.from_env()
keys = [k for k in os.environ if k.startswith("MALLOC_")]
with open(sys.argv[1], "w") as fh:
    json.dump({k: os.environ[k] for k in keys}, fh)
job.run(lambda ctx: 0.0, 2)
'''


@pytest.mark.parametrize("flag, host_env, expected", [
    ([], {}, {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}),
    (["--release-freed-memory"], {}, {}),
    ([], {"MALLOC_ARENA_MAX": "2"}, {"MALLOC_ARENA_MAX": "2"}),  # the host's choice wins
])
def test_ranks_keep_freed_memory_unless_told_or_configured(
        workdir: Path, tmp_path: Path, flag: list[str], host_env: dict[str, str], expected: dict[str, str]) -> None:
    script, out = tmp_path / "env_dump.py", tmp_path / "env.json"
    script.write_text(ENV_SCRIPT)
    # Whatever allocator this machine chose would win over ffctl's defaults: start from none.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    proc = subprocess.run(
        ffctl_argv("launch", "--run-id", rid("malloc"), "--runs-dir", str(workdir / "runs"), "--nnodes", "1",
                   "--nproc-per-node", "1", "--recovery", "none", *flag, str(script), str(out)),
        cwd=workdir, capture_output=True, text=True, timeout=TIMEOUT, env={**env, **host_env})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == expected
    assert_nothing_left(workdir)

"""Run `ffctl` as a user does (a real subprocess) and read back what it recorded."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from runs.events import Event, EventKind
from runs.store import iter_events

TIMEOUT = 420.0


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    runs_dir: Path
    run_id: str | None

    @property
    def report(self) -> dict[str, Any]:
        assert self.run_id is not None
        return json.loads((self.runs_dir / self.run_id / "report.json").read_text())

    @property
    def events(self) -> list[Event]:
        assert self.run_id is not None
        return list(iter_events(self.runs_dir / self.run_id / "events.jsonl"))


def rid(prefix: str) -> str:
    """A run id no other test (or concurrent test run) uses: shared memory names include it."""
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def ffctl_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "ffctl", *args]


def run_ffctl(cwd: Path, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ffctl_argv(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "FFCTL_RUNS_DIR": str(cwd / "runs")})


def launch(cwd: Path, run_id: str, *args: str, timeout: float = TIMEOUT) -> Result:
    proc = run_ffctl(cwd, "launch", "--run-id", run_id, "--runs-dir", str(cwd / "runs"), *args, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr, cwd / "runs", run_id)


def start_launch(cwd: Path, run_id: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ffctl_argv("launch", "--run-id", run_id, "--runs-dir", str(cwd / "runs"), *args),
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@dataclass
class Stopped:
    """How a launch stopped by `stop_at_end` ended (filled in once its block is over)."""

    code: int | None = None
    stdout: str = ""
    stderr: str = ""


@contextlib.contextmanager
def stop_at_end(proc: subprocess.Popen[str], sig: int = signal.SIGINT, timeout: float = 120.0) -> Iterator[Stopped]:
    """Run the block against a running `ffctl launch`, then stop it with `sig` (Ctrl-C by
    default) and collect its exit code and output. If the block fails, or the launch does not
    stop in time, it is killed: nothing outlives the test."""
    stopped = Stopped()
    try:
        yield stopped
        proc.send_signal(sig)
        stopped.stdout, stopped.stderr = proc.communicate(timeout=timeout)
        stopped.code = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def wait_event(events_path: Path, pred: Any, timeout: float = 180.0) -> Event:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in iter_events(events_path):
            if pred(ev):
                return ev
        time.sleep(0.1)
    raise AssertionError(f"no matching event in {events_path} after {timeout:g}s")


def wait_step(runs_dir: Path, run_id: str, step: int, timeout: float = 180.0) -> Event:
    return wait_event(runs_dir / run_id / "events.jsonl",
                      lambda ev: ev.kind is EventKind.STEP and ev.get("step") >= step, timeout)


def faults_beyond_load(report: dict[str, Any]) -> list[dict[str, Any]]:
    """A report's faults without the stragglers a loaded host made: a rank the detector named
    while the host was busy and that came back to pace by itself is reported (rightly) and is no
    failure; a test that counts faults counts the others."""
    return [f for f in report["faults"]
            if not (f["kind"] == "detected" and f.get("cause") == "straggler" and f.get("recovered"))]


def crashes(events: list[Event]) -> list[Event]:
    """Rank exits nobody asked for other than a fault's SIGKILL: a rank that died on its own
    (a signal, an abort at interpreter exit) even though the run went on or completed."""
    return [e for e in events if e.kind is EventKind.RANK_EXITED and not e.get("expected")
            and e.get("exitcode") not in (-9, None)]


def processes_in(cwd: Path) -> list[psutil.Process]:
    """ffctl processes (controller, agents, ranks, spares) whose working directory is `cwd`."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if "ffctl" in cmd and Path(proc.cwd()) == cwd:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            continue
    return found


def assert_nothing_left(cwd: Path, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    left = processes_in(cwd)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_in(cwd)
    for proc in left:  # do not leak into the next test even when this one fails
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes outlived the run: {[' '.join(p.info['cmdline'] or []) for p in left]}"


def shm_left(run_id: str) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"ffctl-{run_id}-*"))


# torch's own teardown now and then aborts a gloo script at interpreter exit, after
# destroy_process_group has returned and the script's output is all out ("terminate called
# without an active exception", SIGABRT): measured under plain torchrun, 7 of 25 runs of a small
# DDP script on the 2-core host under load. Either launcher then rightly reports a failed rank.
# Tests that compare what a script prints run such a run (and only such a run) again.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def launcher_env(tmpdir: Path | None = None) -> dict[str, str]:
    """This environment without what would give torchrun or ffctl launch a layout of its own
    (this machine's PET_* or a worker's variables), for tests that compare the two. `tmpdir`:
    torchrun's, whose agent leaves a `torchelastic_*` directory behind in it after every run."""
    drop = ("PET_", "TORCHELASTIC_", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return env | ({"TMPDIR": str(tmpdir)} if tmpdir is not None else {})


def _retrying_exit_abort(argv: Callable[[], list[str]], whole: Callable[[str], bool],
                         cwd: Path, attempts: int = 5, tmpdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `argv()` again while a run failed only by torch's abort at exit, its stdout `whole`."""
    for _ in range(attempts):
        proc = subprocess.run(argv(), cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                              env=launcher_env(tmpdir))
        if proc.returncode == 0 or TORCH_EXIT_ABORT not in proc.stdout + proc.stderr or not whole(proc.stdout):
            break
    return proc


def torchrun_script(cwd: Path, argv: list[str], whole: Callable[[str], bool]) -> subprocess.CompletedProcess[str]:
    """`torchrun ARGV` in `cwd`, as a user runs it (see TORCH_EXIT_ABORT), with a TMPDIR of its
    own, removed after it. A short one: a DataLoader worker passes each batch's tensors through a
    Unix socket made there, and a path past 108 bytes (a pytest worker's temporary folder, three
    levels down) fails the worker's send and leaves the script waiting for that batch forever."""
    tmpdir = Path(tempfile.mkdtemp(prefix="ffctl-tr-"))
    try:
        return _retrying_exit_abort(lambda: [sys.executable, "-m", "torch.distributed.run", *argv], whole, cwd,
                                    tmpdir=tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def ffctl_launch_script(cwd: Path, prefix: str, argv: list[str],
                        whole: Callable[[str], bool]) -> tuple[subprocess.CompletedProcess[str], str]:
    """`ffctl launch ARGV` in `cwd` under a run id starting with `prefix` (a fresh one per
    attempt, see TORCH_EXIT_ABORT); the run and the id of its record in `cwd/runs`."""
    ids: list[str] = []

    def attempt() -> list[str]:
        ids.append(rid(prefix))
        return ffctl_argv("launch", "--run-id", ids[-1], "--runs-dir", str(cwd / "runs"), *argv)

    return _retrying_exit_abort(attempt, whole, cwd), ids[-1]

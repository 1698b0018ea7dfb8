"""Real ffctl jobs driven from a test: launch one (from `ffctl launch` arguments or a scenario
file), inject faults into it while it runs, wait for a step or a recovery, read its report, and
tear everything down however the test ends.

Each job is `python -m ffctl launch ...` (or `ffctl run SCENARIO`) in a session of its own, its
output in files beside the record (a pipe nobody reads would stall it). Every process it starts
inherits a marker variable unique to the job, so `Jobs.close` finds whatever is left (agents,
ranks, spares, dead man's switches) even when the controller died, after first stopping the job
as Ctrl-C would and removing what it set up (its network rules, qdiscs and sandbox namespaces,
scoped to its own run ids; its run directories in /dev/shm). If the test process itself is killed,
the kernel sends the controller SIGTERM (`PR_SET_PDEATHSIG`), which stops the job cleanly too.

Only the standard library and the torch-free `runs` package are imported here at load time; the
injection client (which uses torch's TCPStore) and the scenario loader are imported when used.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from runs import shm
from runs.events import Event, EventKind
from runs.metrics import compute
from runs.store import iter_events

MARKER = "FFCTL_TESTING_JOB"
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 60.0  # a clean stop (SIGINT): the controller ends the ranks and removes the sandbox
POLL_S = 0.1


class JobError(AssertionError):
    """The job did not do what the test waited for (it ended first, or time ran out); the
    message carries the end of its output. An AssertionError, so pytest shows it as a failure."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # If the test process dies without tearing down, the controller gets SIGTERM, which ends the
    # job as Ctrl-C does (ranks stopped, sandbox removed, record closed).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:24] or "job"


def marked_pids(token: str) -> list[int]:
    """Processes (other than this one) whose environment holds MARKER=`token`."""
    needle = f"{MARKER}={token}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read() + b"\0":
                    found.append(int(entry))
        except OSError:
            continue
    return found


class Job:
    """One job. `run_id` is its run (a scenario with `matches_fault_free` adds `<run_id>-twin`)."""

    def __init__(self, argv: list[str], run_id: str, runs_dir: Path, workdir: Path,
                 env: dict[str, str] | None = None, scenario: Path | None = None) -> None:
        self.run_id = run_id
        self.runs_dir = runs_dir
        self.scenario = scenario
        self.token = uuid.uuid4().hex
        self.stdout_path = workdir / f"{run_id}.out"
        self.stderr_path = workdir / f"{run_id}.err"
        self.argv = argv
        full_env = {**os.environ, **(env or {}), MARKER: self.token, "FFCTL_RUNS_DIR": str(runs_dir)}
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, cwd=workdir, env=full_env, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        self._closed = False

    # --- what it recorded ---------------------------------------------------------------------

    @property
    def record(self) -> Path:
        return self.runs_dir / self.run_id

    @property
    def run_ids(self) -> list[str]:
        return [self.run_id, f"{self.run_id}-twin"]

    def events(self, run_id: str | None = None) -> list[Event]:
        path = self.runs_dir / (run_id or self.run_id) / "events.jsonl"
        return list(iter_events(path)) if path.exists() else []

    def report(self, run_id: str | None = None) -> dict[str, Any]:
        """`ffctl report --json` of the run as recorded so far (computed from its events)."""
        rid = run_id or self.run_id
        return compute(rid, self.events(rid)).to_dict()

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def _tail(self) -> str:
        return f"\n--- stderr (end) ---\n{self.stderr[-3000:]}\n--- stdout (end) ---\n{self.stdout[-2000:]}"

    # --- waiting ------------------------------------------------------------------------------

    def wait_event(self, pred: Callable[[Event], bool], timeout: float = 120.0, what: str = "the event") -> Event:
        """The first recorded event `pred` accepts; JobError when the job ends or time runs out first."""
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.events():
                if pred(ev):
                    return ev
            if self.proc.poll() is not None:
                # It may have written the event just before ending: look once more.
                for ev in self.events():
                    if pred(ev):
                        return ev
                raise JobError(f"run {self.run_id} ended (exit {self.proc.returncode}) before {what}{self._tail()}")
            if time.monotonic() > deadline:
                raise JobError(f"run {self.run_id}: no {what} within {timeout:g}s{self._tail()}")
            time.sleep(POLL_S)

    def wait_step(self, step: int, timeout: float = 120.0) -> Event:
        """Wait until the job has committed `step`."""
        return self.wait_event(lambda ev: ev.kind is EventKind.STEP and int(ev.get("step")) >= step, timeout,
                               f"step {step}")

    def wait_recovered(self, fault_id: str | None = None, timeout: float = 120.0) -> dict[str, Any]:
        """Wait until the fault (default: the newest one injected) is recovered from; its figures
        as `ffctl report --json` gives them (detection_s, recovery_s, lost_s, ...)."""
        deadline = time.monotonic() + timeout
        while True:
            faults = self.report()["faults"]
            match = [f for f in faults if fault_id is None or f["fault_id"] == fault_id]
            if match and match[-1]["recovered"]:
                return match[-1]
            if self.proc.poll() is not None:
                raise JobError(f"run {self.run_id} ended (exit {self.proc.returncode}) before fault "
                               f"{fault_id or '(newest)'} was recovered from: {match[-1:] or 'no such fault'}"
                               f"{self._tail()}")
            if time.monotonic() > deadline:
                raise JobError(f"run {self.run_id}: fault {fault_id or '(newest)'} not recovered within {timeout:g}s"
                               f"{self._tail()}")
            time.sleep(POLL_S * 2)

    def wait(self, timeout: float = 300.0) -> int:
        """Wait for the job to end by itself; its exit code (JobError when it does not in time)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise JobError(f"run {self.run_id} still running after {timeout:g}s{self._tail()}") from None

    # --- acting on it -------------------------------------------------------------------------

    def inject(self, kind: str, *, rank: int | None = None, node: int | None = None, host: str | None = None,
               duration: float | None = None, timeout: float = 30.0, **options: str | int | float) -> str:
        """Inject a fault now, as `ffctl inject KIND --run ID ...` does (the job's controller
        applies and records it); the fault's id. Options are the kind's own (rate="2mbit")."""
        from ffctl.controller import client
        from wire.fault_spec import parse_injection
        from runs.store import open_run

        fields = [f"{k}={v}" for k, v in (("rank", rank), ("node", node), ("host", host)) if v is not None]
        if duration is not None:
            fields.append(f"duration={duration:.6f}".rstrip("0").rstrip("."))
        fields += [f"{k}={v}" for k, v in options.items()]
        spec_text = kind + (":" + ",".join(fields) if fields else "")
        spec = parse_injection(spec_text, scheduled=False)  # a bad spec fails here, with its own message
        reply = client.request(open_run(self.runs_dir, self.run_id), spec, False, timeout=timeout)
        if not reply.ok:
            raise JobError(f"run {self.run_id}: inject {spec_text} refused: {reply.error}")
        return str(reply.fault_id)

    def stop(self, timeout: float = STOP_GRACE_S) -> int:
        """Stop the job as Ctrl-C does (its record ends `interrupted`); its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(timeout=10.0)

    def checks(self) -> list[Any]:
        """A scenario job's expectations against its report (and its twin's): `ffctl run`'s
        verdicts, as `ffctl.launch.scenario.Check` values."""
        if self.scenario is None:
            raise ValueError("checks() is for a job started from a scenario")
        from ffctl.launch.scenario import evaluate, load

        sc = load(self.scenario)
        twin = self.report(f"{self.run_id}-twin") if sc.wants_twin else None
        return evaluate(sc.expect, self.report(), twin)

    # --- tearing down -------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Leave nothing behind: stop the job, remove its network rules, qdiscs and sandbox (as
        root, scoped to its runs), kill what is left of its processes, remove its snapshot files.
        Returns what had to be removed by force (empty when the job cleaned up after itself)."""
        if self._closed:
            return []
        self._closed = True
        forced: list[str] = []
        if self.proc.poll() is None:
            self.stop()
        if os.geteuid() == 0:  # without root no run can have set rules or namespaces up
            from ffctl.exits import BadInput, InfraError
            from ffctl.launch.cleanup import revert_everything

            for rid in self.run_ids:
                try:
                    lines = revert_everything(None, dry_run=False, run_id=rid)
                except (BadInput, InfraError) as exc:
                    forced.append(f"revert of run {rid} failed: {exc}")
                    continue
                forced += [f"run {rid}: {line}" for line in lines if "removed " in line]
        deadline = time.monotonic() + 10.0
        left = marked_pids(self.token)
        while left and time.monotonic() < deadline:  # the agents' own exit takes a moment
            time.sleep(0.2)
            left = marked_pids(self.token)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                forced.append(f"killed process {pid}")
            except ProcessLookupError:
                pass
        for rid in self.run_ids:
            # The job's own, whatever holds them: a process killed just above may not have let
            # go of its lock yet.
            for path in shm.own_run_dirs(run_id=rid):
                shm.remove_run_dir(path)
                forced.append(f"removed {path}")
        return forced


class Jobs:
    """The jobs of one test (the `ffctl_jobs` fixture): start them with `launch` or `scenario`;
    `close` tears down every one of them."""

    def __init__(self, workdir: Path, name: str = "job") -> None:
        self.workdir = workdir
        self.runs_dir = workdir / "runs"
        self.name = _slug(name)
        self.jobs: list[Job] = []

    def _run_id(self, run_id: str | None) -> str:
        return run_id or f"{self.name}-{uuid.uuid4().hex[:6]}"

    def launch(self, *args: str, run_id: str | None = None, env: dict[str, str] | None = None) -> Job:
        """`ffctl launch ARGS` (options first, then a script and its arguments, as on the
        command line), running in the background."""
        rid = self._run_id(run_id)
        argv = [sys.executable, "-m", "ffctl", "launch", "--run-id", rid, "--runs-dir", str(self.runs_dir), *args]
        job = Job(argv, rid, self.runs_dir, self.workdir, env)
        self.jobs.append(job)
        return job

    def scenario(self, path: str | Path, *, run_id: str | None = None, env: dict[str, str] | None = None) -> Job:
        """`ffctl run SCENARIO` in the background: its faults, its fault-free twin if it asks for
        one; `wait()` gives `ffctl run`'s exit code, `checks()` the verdicts."""
        rid = self._run_id(run_id)
        path = Path(path).absolute()
        argv = [sys.executable, "-m", "ffctl", "run", str(path), "--run-id", rid, "--runs-dir", str(self.runs_dir),
                "--junit", str(self.workdir / f"{rid}.xml")]
        job = Job(argv, rid, self.runs_dir, self.workdir, env, scenario=path)
        self.jobs.append(job)
        return job

    def close(self) -> list[str]:
        """Tear down every job, even when one's teardown fails; what had to be forced."""
        forced: list[str] = []
        errors: list[BaseException] = []
        for job in self.jobs:
            try:
                forced += job.close()
            except Exception as exc:  # the others must still go
                errors.append(exc)
        if errors:
            raise errors[0]
        return forced

"""The worker supervisor: starts a node's rank workers, stops them, and sees them exit.

A worker starts from a warm spare when one is ready, else as a fork of the worker template, else
as a fresh interpreter, with torchrun's environment and the job token over a private pipe. The
job's first workers wait for the template's first warm-up (see `request_spawn`). A worker's exit
is seen within one poll of the agent's loop and reported with the end of its log and the error
its script recorded when it was not asked for. As the child subreaper the agent also inherits
what dead workers leave behind; the supervisor reaps those, and restarts a template that died.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from ffctl.agent.config import AgentConfig
from ffctl.agent.proctree import as_processes, kill_tree
from ffctl.agent.sparepool import SparePool
from ffctl.agent.stepwatch import StepWatch
from ffctl.agent.template import STACKS_SIGNAL, Assignment, ForkedSpare, ForkedWorker, Template, TemplateError
from wire import messages
from wire.jobenv import ERROR_FILE_ENV

log = logging.getLogger(__name__)

# How long the job's first workers wait for the template's first warm-up before starting cold.
FIRST_WARMUP_WAIT_S = 30.0
# What of a failed rank's log goes to the controller with its exit.
LOG_TAIL_LINES = 20
LOG_TAIL_BYTES = 16384
# How long a rank is given to write its stacks (`STACKS_SIGNAL`) before it is stopped.
STACKS_WRITE_S = 0.5
LOG_LINE_CHARS = 400
# What of a rank's stacks goes to the controller (all of them stay in the file beside its log).
STACKS_BYTES = 1 << 20
STACKS_LINES = 400


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _stacks_then_kill(procs: list[psutil.Process], grace: float, keep: Callable[[], None]) -> None:
    """Have each rank write its Python stacks to its stderr log (where it was stuck), `keep`
    them, then end it as `kill_tree` does."""
    for proc in procs:
        try:
            proc.send_signal(STACKS_SIGNAL)
        except psutil.Error:
            pass
    time.sleep(STACKS_WRITE_S)
    try:
        keep()
    finally:
        kill_tree(procs, grace)


def keep_stacks(log_dir: Path, rank: int, gen: int, err_from: int) -> tuple[list[str], str | None]:
    """What the rank wrote to its stderr log from byte `err_from` on (its stacks, asked for just
    before), bounded, and the file beside its log that now keeps them: `<rank>.gen<gen>.stacks`,
    created new (O_EXCL, O_NOFOLLOW: a name planted there is refused, not written through)."""
    try:
        with open(os.open(log_dir / f"{rank}.err", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as fh:
            fh.seek(err_from)
            data = fh.read(STACKS_BYTES)
    except OSError:
        return [], None
    lines = python_stacks(data.decode("utf-8", errors="replace").splitlines())
    if not lines:
        return [], None
    path = log_dir / f"{rank}.gen{gen}.stacks"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    except OSError:
        return [line[:LOG_LINE_CHARS] for line in lines[:STACKS_LINES]], None
    return [line[:LOG_LINE_CHARS] for line in lines[:STACKS_LINES]], str(path)


_HEADERS = ("Thread 0x", "Current thread 0x")


def python_stacks(lines: list[str]) -> list[str]:
    """The last stack dump in `lines` (what `faulthandler` writes: a "Thread 0x..." or "Current
    thread 0x..." header per thread, each followed by its "  File ..." frames and a blank line),
    or nothing."""
    starts = [i for i, line in enumerate(lines) if line.startswith(_HEADERS)]
    if not starts:
        return []
    first = starts[-1]
    while first > 0 and (not lines[first - 1].strip() or lines[first - 1].startswith(("  File ", *_HEADERS))):
        first -= 1
    # Frames just above the dump may be another traceback's: the dump starts at a header.
    return lines[min(i for i in starts if i >= first):]


@dataclass
class Worker:
    rank: int
    gen: int
    proc: subprocess.Popen[bytes] | ForkedWorker | ForkedSpare
    expected_exit: bool = False
    report_tail: bool = False  # report the end of its log with its exit, even an expected one
    stacks: list[str] = field(default_factory=list)  # what it wrote when asked for its stacks
    stacks_file: str | None = None  # ... kept beside its log


# Below this much free shared memory, a SIGBUS is taken for a full /dev/shm: a rank writing its
# snapshot slot past the end of what tmpfs could give it gets SIGBUS, not an error it can report.
SHM_FULL_BYTES = 64 << 20


def shm_full(shm_dir: str) -> str | None:
    """What a rank's SIGBUS most likely was, when the filesystem of the run's shared-memory
    directory is (nearly) full: said so, with the free space, instead of a bare signal."""
    try:
        st = os.statvfs(os.path.dirname(shm_dir.rstrip("/")) or "/dev/shm")
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= SHM_FULL_BYTES:
        return None
    return (f"SIGBUS with {os.path.dirname(shm_dir.rstrip('/')) or '/dev/shm'} full ({free >> 20} MiB free of "
            f"{(st.f_blocks * st.f_frsize) >> 20} MiB): a snapshot slot could not be written")


def read_error_file(path: Path) -> str | None:
    """The error message in a torchelastic error file (`{"message": {"message": ...}}` as torch's
    `@record` writes it, or `{"message": "..."}`), bounded; None when there is none."""
    try:
        # Never blocks (a FIFO where the file goes is refused) and never raises: a worker's
        # script wrote it, and the agent reads it on its one loop.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = json.loads(fh.read(1 << 20).decode("utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    return (msg.strip()[:500] or None) if isinstance(msg, str) else None


class WorkerSupervisor:
    """One node's rank workers: the live ones by rank, and the spawns held for the template."""

    def __init__(self, cfg: AgentConfig, template: Template | None, spares: SparePool,
                 steps: StepWatch | None, base_env: Callable[[], dict[str, str]],
                 stopping: threading.Event, report: Callable[..., None]) -> None:
        self.cfg = cfg
        self.template = template
        self.spares = spares
        self.steps = steps
        self.base_env = base_env  # the workers' base environment
        self.stopping = stopping
        self.report = report  # report(kind, **fields), to the controller
        self.workers: dict[int, Worker] = {}
        self.lock = threading.Lock()
        # Spawn commands held until the template's first warm-up is over: (gen, ranks, received).
        self._held: list[tuple[int, list[dict[str, Any]], float]] = []
        self._orphans_at = 0.0

    # -- starting ------------------------------------------------------------------------------
    def first_warmup(self) -> bool:
        """Whether the template is still on its first warm-up (started with the agent)."""
        return (self.template is not None and self.template.starts == 1 and self.template.alive()
                and not self.template.is_ready())

    def request_spawn(self, gen: int, ranks: list[dict[str, Any]]) -> None:
        """Start the ranks now, or once the template's first warm-up is over."""
        if self.first_warmup():
            # The job's first workers, while the template imports torch: started cold now, each
            # would import torch beside it, and on a host with fewer cores than processes all of
            # them would take about twice as long as the template alone and a fork. Replacements
            # after a template died do not wait: they start cold at once (recorded as such).
            self._held.append((gen, list(ranks), time.monotonic()))
            return
        self.spawn(gen, ranks)

    def drop_held(self, ranks: set[int]) -> None:
        """A held worker told to stop is never started; the controller, which waits for every
        rank it asked for to start or to be dropped before it opens the next generation, is told."""
        for gen, held, _ in self._held:
            dropped = sorted(int(spec["rank"]) for spec in held if int(spec["rank"]) in ranks)
            if dropped:
                held[:] = [spec for spec in held if int(spec["rank"]) not in ranks]
                self.report(messages.Spawned, gen=gen, pids={}, dropped=dropped)

    def spawn_held(self) -> None:
        """Start the held workers once the template is warm (or died, or took too long)."""
        if not self._held:
            return
        if self.first_warmup() and time.monotonic() - self._held[0][2] < FIRST_WARMUP_WAIT_S:
            return
        held, self._held = self._held, []
        for gen, ranks, received in held:
            if ranks:  # all of them may have been killed meanwhile
                self.spawn(gen, ranks, received)

    def spawn(self, gen: int, ranks: list[dict[str, Any]], received: float | None = None) -> None:
        if gen > 0:
            self.spares.replacement_started()
        pids: dict[str, int] = {}
        how: dict[str, str] = {}
        took: dict[str, float] = {}
        for spec in ranks:
            rank = int(spec["rank"])
            # How long the worker took to start counts from the command (a held one's wait too).
            t0 = time.monotonic() if received is None else received
            assignment: dict[str, Any] = {
                "env": {**self.cfg.worker_env, **spec["env"],
                        ERROR_FILE_ENV: str(self.error_file(rank, gen)),
                        # Where the rank's slots and in-step faults are: known to this host's
                        # processes only, never sent through the store.
                        "FFCTL_SHM_DIR": self.cfg.shm_dir, "FFCTL_FAULT_DIR": self.cfg.shm_dir},
                "argv": list(self.cfg.worker_argv),
                "log": os.path.abspath(Path(self.cfg.log_dir) / f"{rank}.log"),
                "err": os.path.abspath(Path(self.cfg.log_dir) / f"{rank}.err"),
                "cwd": self.cfg.cwd,
                # The token goes to the rank here, over a private pipe (the spare's stdin or FIFO,
                # or the template's), never through the store, and the worker hands it to the
                # library without putting it in its environment (wire.jobenv.hand_token).
                "token": self.cfg.token,
            }
            if self.steps is not None:
                # The worker appends to its log: its steps are what it writes from here on.
                self.steps.watch(rank, gen, Path(assignment["log"]), Path(assignment["err"]))
            proc, how[str(rank)] = self._start(assignment)
            took[str(rank)] = round(time.monotonic() - t0, 6)
            with self.lock:
                self.workers[rank] = Worker(rank, gen, proc)
            pids[str(rank)] = proc.pid
        self.report(messages.Spawned, gen=gen, pids=pids, how=how, start_s=took)

    def _start(
        self, assignment: dict[str, Any],
    ) -> tuple[subprocess.Popen[bytes] | ForkedWorker | ForkedSpare, str]:
        """Start one worker: a warm spare if one is ready, else a fork of the template, else a
        fresh interpreter (the oldest spare still warming up, or a new one). Says which."""
        line = (json.dumps(assignment) + "\n").encode()
        forked = self.spares.assign_forked(line)
        if forked is not None:
            return forked, "spare"
        proc = self.spares.take_ready()
        how = "spare"
        if proc is None:
            if self.template is not None and self.template.is_ready():
                env = {**self.base_env(), **assignment["env"]}
                job = Assignment(env, tuple(assignment["argv"]), assignment["log"], assignment["cwd"],
                                 assignment["token"], assignment["err"])
                try:
                    return self.template.fork(job), "template"
                except TemplateError as exc:
                    log.warning("ffctl agent %d: %s; starting the worker cold", self.cfg.node, exc)
            proc = self.spares.take_any()
            how = "cold"
        assert isinstance(proc, subprocess.Popen) and proc.stdin is not None
        proc.stdin.write(line)
        proc.stdin.close()
        return proc, how

    # -- stopping and exits --------------------------------------------------------------------
    def kill(self, ranks: list[int], grace: float, tail: bool = False) -> None:
        with self.lock:
            targets = [self.workers[r] for r in ranks if r in self.workers]
            for w in targets:
                w.expected_exit = True
                w.report_tail = tail
        procs = as_processes([w.proc.pid for w in targets])
        if not tail:
            threading.Thread(target=kill_tree, args=(procs, grace), daemon=True).start()
            return
        log_dir = Path(self.cfg.log_dir)
        ends = {w.rank: _size(log_dir / f"{w.rank}.err") for w in targets}

        def keep() -> None:  # before the kill, so the exit (reaped after it) carries them
            for w in targets:
                w.stacks, w.stacks_file = keep_stacks(log_dir, w.rank, w.gen, ends[w.rank])

        threading.Thread(target=_stacks_then_kill, args=(procs, grace, keep), daemon=True).start()

    def live(self) -> dict[int, int]:
        """The live ranks and their generations."""
        with self.lock:
            return {rank: w.gen for rank, w in self.workers.items()}

    def reap(self) -> None:
        with self.lock:
            for rank, w in list(self.workers.items()):
                code = w.proc.poll()
                if code is None:
                    continue
                del self.workers[rank]
                # The end of its log says why it failed; read here, so it reaches the controller
                # from any host. Exits asked for (a kill, the end of the run) need none.
                wanted = w.report_tail or not (w.expected_exit or code == 0)
                tail = self.log_tail(rank) if wanted else []
                err_tail = self.log_tail(rank, "err") if wanted else []
                error = None if w.expected_exit or code == 0 else read_error_file(self.error_file(rank, w.gen))
                if code == -signal.SIGBUS and not w.expected_exit:
                    error = shm_full(self.cfg.shm_dir) or error
                self.report(messages.RankExited, rank=rank, gen=w.gen, pid=w.proc.pid, exitcode=code,
                            expected=w.expected_exit, host=socket.gethostname(), log_tail=tail,
                            **({"err_tail": err_tail} if err_tail else {}),
                            **({"stacks": w.stacks} if w.stacks else {}),
                            **({"stacks_file": w.stacks_file} if w.stacks_file else {}),
                            **({"error": error} if error else {}))

    def error_file(self, rank: int, gen: int) -> Path:
        """Where torch's `@record` writes the rank's error (torchrun's TORCHELASTIC_ERROR_FILE):
        one file per rank and generation, beside its log."""
        # Absolute, as torchrun hands it out: a script that changes directory before it fails
        # still writes it where it is looked for.
        return Path(os.path.abspath(self.cfg.log_dir)) / f"{rank}.gen{gen}.error.json"

    def log_tail(self, rank: int, stream: str = "log", lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last `lines` lines of the rank's stdout log (`stream` "log") or its stderr log
        ("err"); all of its generations write to them."""
        try:
            with open(os.open(Path(self.cfg.log_dir) / f"{rank}.{stream}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - LOG_TAIL_BYTES))
                data = fh.read(LOG_TAIL_BYTES)
        except OSError:
            return []
        text = data.decode("utf-8", errors="replace").splitlines()
        return [line[:LOG_LINE_CHARS] for line in text[-lines:]]

    def stop_all(self, grace: float) -> None:
        """Take every worker and spare down (the agent's shutdown), and report the exits."""
        procs = [w.proc for w in self.workers.values()] + self.spares.spares
        kill_tree(as_processes([p.pid for p in procs]), grace)
        for p in procs:
            p.poll()
        try:
            self.reap()
        except Exception:
            pass

    # -- the template and what dead workers leave ----------------------------------------------
    def tend_template(self) -> None:
        """Restart a template that died; until it is warm again, workers start cold."""
        if self.template is not None and not self.template.alive() and not self.stopping.is_set():
            code = self.template.proc.returncode if self.template.proc is not None else None
            log.warning("ffctl agent %d: worker template exited (%s); restarting it", self.cfg.node, code)
            self.template.start()

    def reap_orphans(self) -> None:
        """As the subreaper we inherit whatever a dead worker left (its own children): reap the
        ones that ended, so none stays a zombie. Not every poll: listing children reads /proc."""
        now = time.monotonic()
        if self.template is None or now - self._orphans_at < 1.0:
            return
        self._orphans_at = now
        known = {w.proc.pid for w in self.workers.values()} | {p.pid for p in self.spares.spares}
        if self.template.proc is not None:
            known.add(self.template.proc.pid)
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for child in children:
            try:
                if child.pid not in known and child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                pass

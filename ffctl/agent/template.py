"""The worker template: a fork server that starts a node's workers in milliseconds.

The agent starts one template (`python -m ffctl.agent.template`) with the workers' base environment.
It imports torch and the recovery library and pays the first optimizer step's lazy imports
once, then waits for requests on stdin (one JSON line each: a request id, the worker's full
environment, argv, log path and working directory) and answers each on stdout with the new
worker's pid. A fresh interpreter needs seconds to get that far; a fork needs milliseconds.

Safety of fork: a process may only fork safely while it runs one thread. The template starts
no thread, opens no socket, creates no gloo context, touches no device and runs no parallel
region, so no OpenMP/intra-op pool exists (its warm-up step is a one-element tensor, and it
checks that it is still single-threaded before serving: otherwise it refuses to serve and the
agent starts workers the slow way). Everything a worker owns is created after the fork, in the
child: its environment, process group, signal handlers and device.

Each worker is forked twice (template -> short-lived intermediate -> worker): the intermediate
exits at once, so the worker is re-parented to the agent, which has made itself the child
subreaper (`set_child_subreaper`). The agent then reaps and watches its workers as its own
children (`ForkedWorker.poll`), and a worker dies with the agent (PR_SET_PDEATHSIG), exactly
like a worker the agent started itself.

An agent that is itself a fork of a warm process (the host template of a local launch,
`ffctl.agent.host_template`) does not start `python -m ffctl.agent.template`: while it still has
one thread, it forks its template from itself (`warm_for`, `_fork_template`), warm at once. The
child raises `Become` to leave the agent's frames and runs from the top of the process's stack,
so that the template, and every worker it forks, ends as an interpreter does.

Environment variables that libraries read when they load (glibc's `MALLOC_*`, OpenMP's
`OMP_NUM_THREADS`) are the same for every worker of a node: they are in the template's own
environment, set when the agent starts it.
"""
from __future__ import annotations

import builtins
import ctypes
import faulthandler
import importlib.machinery
import importlib.util
import io
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from ffctl.agent import diagnostics
from ffctl.agent.teardown import guard_ddp_teardown

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
READY = b"ready\n"
REPARENT_TIMEOUT_S = 5.0
# Set in a spare forked from the template (ffctl.agent.spare): the FIFO its assignment comes on.
SPARE_FIFO_ENV = "FFCTL_SPARE_FIFO"
# Makes a worker write every thread's Python stack to its stderr log (`faulthandler`, which works
# while the main thread is stuck in C++ holding the GIL). The exit barrier sends it to a rank
# before stopping it, so that the root cause says where the rank was stuck. A real-time signal:
# torch, gloo and scripts leave these alone.
STACKS_SIGNAL = signal.SIGRTMIN + 2


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.prctl(option, value, 0, 0, 0) == 0


def set_child_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (the template's workers)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies; exit now if `parent` is already gone."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1 or (parent is not None and os.getppid() != parent):
        os._exit(1)


def threads_now() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def warm_up() -> None:
    """Pay torch's start-up costs: the import, and the ~800 modules the first optimizer step
    imports lazily (about two seconds on a CPU host). One element: no parallel region runs.

    torch imports numpy when it is installed, and numpy's OpenBLAS starts its thread pool as it
    loads (one thread per core), which would make the template unsafe to fork. The pool is sized
    to one thread, as torchrun's OMP_NUM_THREADS=1 sizes it whenever a node runs more than one
    process; a forked worker inherits that pool (a fresh interpreter would size it from its own
    environment)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch

    import recovery.job  # noqa: F401
    # Distributed tensors (what `fully_shard` makes): half a second that a forked FSDP worker,
    # a replacement above all, would otherwise pay at its first step. The library itself loads
    # them only when used, so the CLI and the agents never do.
    import torch.distributed.tensor
    # And torch's state-dict API, through which the library takes and loads an FSDP rank's
    # state: its import and its first calls (which import more) are 50-100 ms that a replacement
    # paid between joining and restoring. Taken on a plain module: no process group here.
    from torch.distributed.checkpoint import state_dict as dcp

    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)
    p.sum().backward()
    opt.step()
    lin = torch.nn.Linear(1, 1)
    lin_opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, foreach=False)
    dcp.set_model_state_dict(lin, dcp.get_model_state_dict(lin))
    dcp.set_optimizer_state_dict(lin, lin_opt, dcp.get_optimizer_state_dict(lin, lin_opt))


# What this process warmed up with, when it is a host template (ffctl.agent.host_template) or a
# node agent forked from one: (environment, working directory, interpreter). A worker template
# started for exactly these is forked from this process instead of importing torch again.
_warm: list[tuple[dict[str, str], str, str]] = []


def mark_warm(env: dict[str, str], cwd: str, python: str) -> None:
    """Record that this process has run `warm_up` with `env` (the environment it was started
    with: what libraries read as they load), in `cwd`, as `python`."""
    _warm[:] = [(dict(env), os.path.realpath(cwd), python)]


def warm_for(env: dict[str, str], cwd: str | None, python: str) -> bool:
    """Whether a worker template for (env, cwd, python) may be this process's fork: warmed up
    for the same, and still single-threaded (a fork of a threaded process can deadlock)."""
    return bool(_warm) and _warm[0] == (env, os.path.realpath(cwd or os.getcwd()), python) and threads_now() == 1


@dataclass(frozen=True)
class Assignment:
    """What a worker runs: `argv` is ("-m", module, args...) or (script, args...)."""

    env: dict[str, str]
    argv: tuple[str, ...]
    log: str = ""
    cwd: str = ""
    # The job token: handed to the recovery library in the worker, never put in its environment.
    token: str = ""
    # Where its stderr goes, kept apart from its stdout as torchrun keeps a rank's stdout.log and
    # stderr.log; empty: with its stdout in `log`.
    err: str = ""

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Assignment:
        env, argv = raw.get("env"), raw.get("argv")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("env must map strings to strings")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("argv must be a non-empty list of strings")
        if argv[0] == "-m" and len(argv) < 2:
            raise ValueError("argv '-m' needs a module name")
        token = raw.get("token") or ""
        if not isinstance(token, str):
            raise ValueError("token must be a string")
        return cls(env, tuple(argv), str(raw.get("log") or ""), str(raw.get("cwd") or ""), token,
                   str(raw.get("err") or ""))


def _unbuffered_stdio() -> None:
    """`python -u`, as torchrun starts every worker: stdout and stderr reach the log as they are
    written, so a rank killed mid-run has printed everything it printed (block-buffered output
    to a file is lost with the process) and `--step-regex` sees each line when it is written."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                  encoding=getattr(old, "encoding", None) or "utf-8",
                                  errors=getattr(old, "errors", None) or "strict")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _main_module(argv: tuple[str, ...]) -> tuple[types.ModuleType, types.CodeType, list[str], str]:
    """The `__main__` module, its code, `sys.argv` and `sys.path[0]` that `python SCRIPT ARGS`
    or `python -m MODULE ARGS` would start with (absolute `__file__`, the script's folder or the
    working directory first on the path, a package's `__main__` submodule for `-m PACKAGE`)."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if argv[0] == "-m":
        name = argv[1]
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            name = f"{name}.__main__"
            spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            raise ImportError(f"No module named {argv[1]}")
        code = spec.loader.get_code(spec.name)
        if code is None:
            raise ImportError(f"No code object available for {argv[1]}")
        main.__dict__.update(__file__=spec.origin, __cached__=spec.cached, __loader__=spec.loader,
                             __package__=spec.parent, __spec__=spec)
        return main, code, [spec.origin or argv[1], *argv[2:]], os.getcwd()
    path = os.path.abspath(argv[0])
    with io.open_code(path) as fh:
        code = compile(fh.read(), path, "exec", dont_inherit=True)
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    return main, code, list(argv), os.path.dirname(path)


# The `sys.path[0]` entry that the template itself (or the last program run here) put first:
# a program's own entry replaces it, as a fresh interpreter has only its own.
_path0: list[str] = [sys.path[0]] if sys.path else []
# Every `__main__` module this process ran: held until the interpreter exits.
_mains: list[types.ModuleType] = []


def run_assignment(job: Assignment) -> None:
    """Run the worker's program in this process as a fresh interpreter would run it: stdout to
    its log and stderr to its own (or to the log), unbuffered, its own working directory, `sys.argv`, `sys.path[0]` and a real
    `__main__` module. Returns or raises as the program does (SystemExit included).

    The program's globals live in `sys.modules["__main__"]` until the interpreter exits, as
    under `python SCRIPT`: `runpy.run_path` runs it in a temporary module whose namespace is
    freed when it returns, while the interpreter is fully alive. A script whose globals hold a
    DDP model then frees its gloo group right there, with the GIL held, and gloo's worker thread,
    freeing the last work's tensors, waits for that GIL while the group's destructor joins it:
    the rank never exits (about 1 run in 4 of a plain DDP script). Freed at interpreter exit
    instead, the same race ends as it does under torchrun (the thread cannot take the GIL any
    more, and torch aborts now and then at exit)."""
    if job.log:
        # O_NOFOLLOW: a name planted in the logs directory is refused, never written through.
        fd = os.open(job.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if job.err:
        fd = os.open(job.err, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    if job.cwd:
        os.chdir(job.cwd)
    if job.token:
        from wire.jobenv import hand_token

        hand_token(job.token)
    _unbuffered_stdio()
    faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True)  # fd 2: its stderr log, set above
    guard_ddp_teardown()  # a DDP model freed as the script ends must not deadlock it (teardown.py)
    main, code, argv, path0 = _main_module(job.argv)
    sys.argv = argv
    if sys.path and _path0 and sys.path[0] == _path0[0]:
        sys.path[0] = path0
    else:
        sys.path.insert(0, path0)
    _path0[:] = [path0]
    _mains.append(main)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _become_worker(job: Assignment, agent: int) -> None:
    """In the forked worker: shed the template's state and take the worker's."""
    # Its logging is its script's, as under `python SCRIPT`.
    while _diagnostics:
        diagnostics.detach(_diagnostics.pop())
    # The template's stdin and stdout are its pipes to the agent: not the worker's.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as CPython sets it at start-up
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    # Wait to be adopted by the agent (the intermediate exits right after forking us), then die
    # with it as a worker it had started itself would.
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != agent and time.monotonic() < deadline:
        time.sleep(0.0005)
    die_with_parent(agent)
    os.environ.clear()
    os.environ.update(job.env)


def _fork_worker(job: Assignment, agent: int) -> int | None:
    """Double-fork a worker. Returns its pid in the template, None in the worker itself."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate
        os.close(r)
        worker = os.fork()
        if worker == 0:
            os.close(w)
            return None
        os.write(w, str(worker).encode())
        os._exit(0)
    os.close(w)
    try:
        raw = b""
        while chunk := os.read(r, 32):
            raw += chunk
    finally:
        os.close(r)
    os.waitpid(middle, 0)
    if not raw:
        raise OSError("the intermediate process died before forking the worker")
    return int(raw)


def serve(requests: IO[bytes], replies: IO[bytes], agent: int) -> Assignment | None:
    """Answer fork requests until stdin closes. Returns None in the template (time to exit)
    and the assignment in a forked worker, which the caller then runs."""
    for line in requests:
        reply: dict[str, Any]
        try:
            raw = json.loads(line)
            req = raw.get("id") if isinstance(raw, dict) else None
            job = Assignment.from_json(raw)
        except (ValueError, AttributeError) as exc:
            reply = {"id": None, "error": f"bad request: {exc}"}
        else:
            try:
                pid = _fork_worker(job, agent)
            except OSError as exc:
                reply = {"id": req, "error": f"fork failed: {exc}"}
            else:
                if pid is None:
                    _become_worker(job, agent)
                    return job
                reply = {"id": req, "pid": pid}
        replies.write((json.dumps(reply) + "\n").encode())
        replies.flush()
    return None


# The template's diagnostics handler (`main`), taken off in a forked worker.
_diagnostics: list[logging.Handler] = []


def main() -> int:
    _diagnostics.append(diagnostics.to_stderr())
    agent = os.getppid()
    die_with_parent(agent)
    # The agent stops the template with SIGTERM: leave quietly, whatever we were doing.
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    warm_up()
    if threads_now() != 1:
        # Forking a multi-threaded process can deadlock the child; the agent starts its
        # workers the slow way instead.
        log.error("template: %d threads after warm-up: refusing to fork", threads_now())
        return 3
    os.write(1, READY)
    job = serve(sys.stdin.buffer, sys.stdout.buffer, agent)
    if job is None:
        return 0
    return run_as_main(job)


def run_as_main(job: Assignment) -> int:
    """Run the assignment and end as `python PROGRAM` ends: SystemExit as raised; an uncaught
    exception through `sys.excepthook` (the program's own, if it set one), its traceback
    starting at the program's frames, exit status 1."""
    try:
        run_assignment(job)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        # Drop the launcher's own frames (this module's, a spare's) before the program's.
        ours = os.path.dirname(os.path.abspath(__file__))
        while (tb is not None and tb.tb_next is not None
               and os.path.dirname(tb.tb_frame.f_code.co_filename) == ours):
            tb = tb.tb_next
        sys.excepthook(type(exc), exc, tb)
        return 1
    return 0


# -- the agent's side ---------------------------------------------------------------------------


class ForkedWorker:
    """A worker forked by the template and adopted by this process: the part of
    `subprocess.Popen` the agent uses (`pid`, `poll`, `wait`, `returncode`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Not (yet) our child: the intermediate has not exited, or we are not the
                # subreaper. Alive as long as the pid exists.
                try:
                    os.kill(self.pid, 0)
                    return None
                except ProcessLookupError:
                    self.returncode = -signal.SIGKILL  # gone without a status we could read
                    return self.returncode
            if pid == 0:
                return None
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


class ForkedSpare:
    """A spare forked from the template: warm from birth (it inherited the template's imports),
    waiting for its assignment on a FIFO of the agent's. The part of `subprocess.Popen` the agent
    uses, plus `assign`."""

    def __init__(self, worker: ForkedWorker, fifo: Path) -> None:
        self.worker = worker
        self.fifo = fifo

    @property
    def pid(self) -> int:
        return self.worker.pid

    @property
    def returncode(self) -> int | None:
        return self.worker.returncode

    def poll(self) -> int | None:
        return self.worker.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.worker.wait(timeout)

    def assign(self, line: bytes) -> bool:
        """Hand it its assignment; False when it is not listening (yet, or any more)."""
        try:
            # Non-blocking open fails at once (ENXIO) unless the spare has the FIFO open.
            fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            os.set_blocking(fd, True)  # the line may exceed the pipe's atomic size
            write_all(fd, line)
        except OSError:
            return False
        finally:
            os.close(fd)
            self.fifo.unlink(missing_ok=True)
        return True


class ForkedProcess(ForkedWorker):
    """A child this process forked itself, with pipes to its stdin and stdout: the part of
    `subprocess.Popen` `Template` uses."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        super().__init__(pid)
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Become(BaseException):
    """Raised in a child a warm process forked (a host template's agent, an agent's worker
    template): the caller's frames unwind, and the top of the process's stack (the host
    template's `main`) runs `target` and exits with its status as `python -m MODULE` would,
    interpreter finalization included (atexit handlers, buffered files), which a worker's
    script relies on. A BaseException, so that no `except Exception` on the way keeps it."""

    def __init__(self, target: Callable[[], int]) -> None:
        super().__init__("a forked child leaving its parent's frames")
        self.target = target


def enter_child(fds: tuple[int, int, int], env: dict[str, str], cwd: str | None) -> None:
    """In a child a warm process forked: take `fds` as stdin, stdout and stderr and nothing else
    of the parent's descriptors (its pipes, other children's stdins), `env` and `cwd`, fresh
    `sys` streams, and none of the parent's diagnostics handlers (bound to its stderr)."""
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
    os.closerange(3, 1 << 16)
    if cwd:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    for handler in list(logging.getLogger(diagnostics.LOGGER).handlers):
        diagnostics.detach(handler)


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to blocking `fd` (a pipe takes a long line in several writes)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _template_from_fork(fds: tuple[int, int, int], env: dict[str, str], cwd: str | None) -> int:
    """In the forked child: become what `python -m ffctl.agent.template` is after its warm-up."""
    enter_child(fds, env, cwd)
    return main()


def _fork_template(env: dict[str, str], cwd: str | None, log: Path) -> ForkedProcess:
    """This warm process's fork as a worker template: what `python -m ffctl.agent.template`
    becomes after its warm-up, in milliseconds instead of seconds."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        raise Become(lambda: _template_from_fork((req_r, rep_w, err), env, cwd))
    for fd in (req_r, rep_w, err):
        os.close(fd)
    return ForkedProcess(pid, os.fdopen(req_w, "wb"), os.fdopen(rep_r, "rb"))


class TemplateError(Exception):
    """The template is not running or did not answer: start the worker the slow way."""


class Template:
    """The agent's handle on its template process. Not thread-safe: one caller at a time."""

    def __init__(self, python: str, env: dict[str, str], cwd: str | None, log: Path) -> None:
        self.python, self.env, self.cwd, self.log = python, env, cwd, log
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.ready = False
        self._req = 0
        self.starts = 0

    def start(self) -> None:
        """Start (or restart) the template; it becomes ready in the background."""
        self.stop()
        if warm_for(self.env, self.cwd, self.python):
            self.proc = _fork_template(self.env, self.cwd, self.log)
        else:
            with open(os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644), "ab") as log:
                self.proc = subprocess.Popen(
                    [self.python, "-m", "ffctl.agent.template"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=log, env=self.env, cwd=self.cwd or None,
                )
        self.ready = False
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_ready(self) -> bool:
        """Whether it has warmed up (never blocks)."""
        if self.ready or not self.alive():
            return self.ready and self.alive()
        assert self.proc is not None and self.proc.stdout is not None
        if select.select([self.proc.stdout], [], [], 0)[0]:
            self.ready = self.proc.stdout.readline() == READY
        return self.ready

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if not self.alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def fork(self, job: Assignment, timeout: float = 5.0) -> ForkedWorker:
        if not self.is_ready():
            raise TemplateError("the template is not ready")
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self._req += 1
        request = {"id": self._req, "env": job.env, "argv": list(job.argv), "log": job.log, "cwd": job.cwd,
                   "token": job.token, "err": job.err}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise TemplateError(f"the template is gone: {exc}") from None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TemplateError(f"the template did not answer within {timeout:g}s")
        line = self.proc.stdout.readline()
        try:
            reply = json.loads(line)
        except ValueError:
            raise TemplateError(f"the template answered {line[:80]!r}") from None
        if reply.get("id") != self._req or "pid" not in reply:
            raise TemplateError(f"the template refused: {reply.get('error', reply)}")
        return ForkedWorker(int(reply["pid"]))

    def fork_spare(self, env: dict[str, str], fifo: Path, log: str, cwd: str) -> ForkedSpare:
        """Fork a spare that waits on `fifo` (made here) for its assignment."""
        os.mkfifo(fifo, 0o600)
        try:
            worker = self.fork(Assignment({**env, SPARE_FIFO_ENV: str(fifo)},
                                          ("-m", "ffctl.agent.spare"), log, cwd))
        except BaseException:
            fifo.unlink(missing_ok=True)
            raise
        return ForkedSpare(worker, fifo)

    def stop(self, timeout: float = 2.0) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        self.ready = False
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())

"""The one way a backend ends a local child process it started (an agent, an agent step's
`srun`, the simulator): ask, wait up to a deadline, force, reap.

Every such child is asked the same way: its stdin is closed. EOF on stdin is the agent's
lost-controller signal (it stops its workers and exits), srun passes it on to the step's task,
and the simulator ends on it. A signal would not do: the children run in sessions of their own
(so a Ctrl-C reaches the controller only), and an agent must get the chance to stop its workers
in order. What follows when the deadline passes is the caller's `escalate` (a scheduler's own
cancel, which reaches the processes of the step on its node), then SIGKILL, then the reap.

And the one way a backend says whether such a child runs at all (`running`): the controller asks
before it takes a local agent's silence for a lost node.
"""
from __future__ import annotations

import subprocess
from typing import IO, Any, Callable

import psutil

# What a process that is neither stopped nor gone shows.
_NOT_RUNNING = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}


def running(pid: int) -> bool:
    """Whether this host's process `pid` runs (or waits for the CPU, or sleeps): neither stopped
    (SIGSTOP, a tracer) nor ended. The caller knows `pid` is still its child's (not reaped)."""
    try:
        return psutil.Process(pid).status() not in _NOT_RUNNING
    except psutil.Error:
        return False


def stop_process(proc: subprocess.Popen[Any], timeout: float, *, escalate: Callable[[float], bool] | None = None,
                 log: IO[Any] | None = None) -> int | None:
    """End `proc`: close its stdin, wait up to `timeout`; then `escalate(timeout)` if given (True:
    the process ended), else or then SIGKILL and wait again. Closes `log` (the child's output
    file) in any case. Idempotent; returns the exit status (None: still not reaped)."""
    try:
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass  # a broken pipe: the child is gone or going
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        if escalate is not None and escalate(timeout):
            return proc.wait(timeout=timeout)
        proc.kill()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None  # in uninterruptible sleep; the caller's sweep comes later
    finally:
        if log is not None:
            log.close()

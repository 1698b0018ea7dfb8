"""The one way a backend ends a local child process it started (an agent, an agent step's
`srun`, the simulator): ask, wait up to a deadline, force, reap.

Every such child is asked the same way: its stdin is closed. EOF on stdin is the agent's
lost-controller signal (it stops its workers and exits), srun passes it on to the step's task,
and the simulator ends on it. A signal would not do: the children run in sessions of their own
(so a Ctrl-C reaches the controller only), and an agent must get the chance to stop its workers
in order. What follows when the deadline passes is the caller's `escalate` (a scheduler's own
cancel, which reaches the processes of the step on its node), then SIGKILL, then the reap.
"""
from __future__ import annotations

import subprocess
from typing import IO, Any, Callable


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

"""A worker process, warm or cold: `python -m ffctl.agent.spare`.

It imports torch and the recovery library first, then waits on stdin for its assignment (one
JSON line: environment, argv, log path) and runs the training script in-process. The agent
keeps a few of these ready (`--spares`) so a replacement skips interpreter and torch start-up;
a cold start is the same process assigned at once. It dies with its agent (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys


def die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)


def warm_up() -> None:
    """Pay torch's start-up costs now: the import, and the lazy imports the first optimizer
    construction triggers (about a second on a CPU host)."""
    import torch

    import recovery  # noqa: F401

    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)
    p.sum().backward()
    opt.step()


def main() -> None:
    die_with_parent()
    warm_up()
    # Tell the agent this spare is warm; stdout is a pipe to the agent until assignment.
    os.write(1, b"ready\n")
    line = sys.stdin.readline()
    if not line:
        return  # released unassigned
    assignment = json.loads(line)
    os.environ.update(assignment["env"])
    log = assignment.get("log")
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    argv: list[str] = assignment["argv"]
    os.chdir(assignment.get("cwd") or os.getcwd())
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

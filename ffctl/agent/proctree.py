"""Process trees: how the agent stops a worker or a spare together with whatever it started.

A worker's script may start processes of its own (data-loader workers, a shell); stopping the
worker alone would leave them running. SIGTERM goes to the whole tree first (SIGCONT before it,
so a stopped process can act on it), then SIGKILL to what is left after the grace period.
"""
from __future__ import annotations

import signal

import psutil


def kill_tree(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM every process and its descendants, wait `grace`, SIGKILL what is left."""
    everyone: list[psutil.Process] = []
    for proc in procs:
        try:
            everyone += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for proc in everyone:
        try:
            proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(everyone, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


def as_processes(pids: list[int]) -> list[psutil.Process]:
    """The processes of `pids` that still exist."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return procs

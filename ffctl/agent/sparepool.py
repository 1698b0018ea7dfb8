"""The node's pool of warm spares: worker processes started ahead of need (`--spares`).

A spare is either forked from the worker template (warm from birth, waiting on a FIFO for its
assignment) or a fresh interpreter (`python -m ffctl.agent.spare`) that imports torch and says
`ready` on its stdout. A replacement taken from the pool skips interpreter and torch start-up.
The pool is topped up as spares are used or die, and the controller is told how many are ready.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from ffctl.agent.config import AgentConfig
from ffctl.agent.proctree import kill_tree
from ffctl.agent.template import ForkedSpare, Template, TemplateError
from wire import messages
from runs import shm

log = logging.getLogger(__name__)

SPARE_REFILL_DELAY_S = 5.0

Spare = subprocess.Popen[bytes] | ForkedSpare


class SparePool:
    """One node's spares, and what the controller was last told of them."""

    def __init__(self, cfg: AgentConfig, template: Template | None, base_env: Callable[[], dict[str, str]],
                 stopping: threading.Event, report: Callable[..., None]) -> None:
        self.python, self.cwd, self.log_dir, self.wanted = cfg.python, cfg.cwd, cfg.log_dir, cfg.spares
        self.node = cfg.node
        self.template = template
        self.base_env = base_env  # the workers' base environment
        self.stopping = stopping
        self.report = report  # report(kind, **fields), to the controller
        self.spares: list[Spare] = []
        self.warm: set[subprocess.Popen[bytes]] = set()
        self.reported: tuple[int, int, bool] = (-1, -1, False)
        self.last_spawn = float("-inf")
        # The FIFOs forked spares wait on: the node's (under its claim), owner-only, removed at
        # shutdown, or by the controller's sweep when the node was killed.
        self._fifos = shm.spare_dir(cfg.shm_dir, cfg.run_id, cfg.node)
        shutil.rmtree(self._fifos, ignore_errors=True)
        self._fifos.mkdir(mode=0o700)
        self._n = 0

    def replacement_started(self) -> None:
        """A replacement worker just started: fresh spares wait a while (see `top_up`)."""
        self.last_spawn = time.monotonic()

    def start_fresh(self) -> subprocess.Popen[bytes]:
        """A fresh interpreter that imports torch, then waits on stdin for its assignment."""
        out = open(os.open(Path(self.log_dir) / "spares.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                           0o644), "ab")
        try:
            proc = subprocess.Popen(
                [self.python, "-m", "ffctl.agent.spare"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=out, cwd=self.cwd or None,
                env=self.base_env(),
            )
        finally:
            out.close()
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        return proc

    def _fork(self) -> ForkedSpare | None:
        assert self.template is not None
        self._n += 1
        try:
            return self.template.fork_spare(self.base_env(), self._fifos / f"spare-{self._n}",
                                            str(Path(self.log_dir) / "spares.log"), self.cwd)
        except (TemplateError, OSError) as exc:
            log.warning("ffctl agent %d: forking a spare: %s", self.node, exc)
            return None

    def is_ready(self, proc: Spare) -> bool:
        if isinstance(proc, ForkedSpare):
            return True  # warm from birth; `assign` finds out whether it listens yet
        if proc in self.warm:
            return True
        assert proc.stdout is not None
        try:
            if proc.stdout.read(6):
                self.warm.add(proc)
                return True
        except (BlockingIOError, OSError, ValueError):
            pass
        return False

    def top_up(self) -> None:
        self.spares = [p for p in self.spares if p.poll() is None]
        forking = self.template is not None and self.template.is_ready()
        # A spare forked from the template costs nothing to speak of: refill at once, so faults
        # close together never find the pool empty. A fresh one spends seconds of CPU importing
        # torch; right after a replacement that would slow the recovering job, so it waits.
        settling = time.monotonic() - self.last_spawn < SPARE_REFILL_DELAY_S
        # A template still warming up will fork the spares in a moment: no fresh ones meanwhile.
        warming = self.template is not None and self.template.alive() and not forking
        while not warming and len(self.spares) < self.wanted and not self.stopping.is_set() and (forking or not settling):
            spare = self._fork() if forking else self.start_fresh()
            if spare is None:
                break
            self.spares.append(spare)
        ready = sum(1 for p in self.spares if self.is_ready(p))
        # A warm template starts replacements as fast as a spare: the controller places the
        # ranks of a lost node where one is warm.
        template = self.template is not None and self.template.is_ready()
        if (ready, len(self.spares), template) != self.reported:
            self.reported = (ready, len(self.spares), template)
            self.report(messages.Spares, count=ready, total=len(self.spares), template=template)

    def assign_forked(self, line: bytes) -> ForkedSpare | None:
        """Hand the assignment to a forked spare, if one listens. Every forked spare is taken
        out of the pool: one that does not listen (still starting, or gone) is of no use."""
        for spare in [p for p in self.spares if isinstance(p, ForkedSpare)]:
            self.spares.remove(spare)
            if spare.assign(line):
                return spare
            kill_tree([psutil.Process(spare.pid)] if psutil.pid_exists(spare.pid) else [], 0.5)
            spare.poll()
        return None

    def take_ready(self) -> Spare | None:
        """The first spare that is warm, taken out of the pool; None when none is."""
        ready = [p for p in self.spares if self.is_ready(p)]
        if not ready:
            return None
        self.spares.remove(ready[0])
        return ready[0]

    def take_any(self) -> Spare:
        """The oldest spare still warming up, or a new fresh one."""
        return self.spares.pop(0) if self.spares else self.start_fresh()

    def close(self) -> None:
        shutil.rmtree(self._fifos, ignore_errors=True)

"""The step watch: the steps a script prints, read off its workers' logs (`--step-regex`).

For a script that prints its progress but does not call `recovery.report_step`, the agent reads
each worker's log from where it stood when the worker started (`ffctl.agent.stepscan` parses the
lines) and reports every new step to the controller, as a rank that reports its own steps would.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

from ffctl.agent.stepscan import StepScanner
from wire import messages

STEP_SCAN_S = 0.1  # how often workers' logs are read


class StepWatch:
    """The step scanners of one node's workers, one per rank (the newest generation's)."""

    def __init__(self, pattern: re.Pattern[str], report: Callable[..., None]) -> None:
        self.pattern = pattern
        self.report = report  # report(kind, **fields), to the controller
        self.scanners: dict[int, tuple[int, StepScanner, float]] = {}  # rank -> (gen, scanner, last step at)
        self._scanned_at = 0.0

    def watch(self, rank: int, gen: int, *logs: Path) -> None:
        """Read the rank's steps from what its logs (stdout's, stderr's) get from now on (the
        worker appends to them)."""
        offsets = [(log, log.stat().st_size if log.exists() else 0) for log in logs]
        self.scanners[rank] = (gen, StepScanner(self.pattern, offsets), time.monotonic())

    def poll(self) -> None:
        """Report the steps the workers printed since the last look."""
        now = time.monotonic()
        if not self.scanners or now - self._scanned_at < STEP_SCAN_S:
            return
        self._scanned_at = now
        for rank, (gen, scanner, last_at) in list(self.scanners.items()):
            seen = scanner.poll()
            if not seen:
                continue
            # The time since the previous step was seen, shared among the steps seen together.
            dt = (now - last_at) / len(seen)
            self.scanners[rank] = (gen, scanner, now)
            for found in seen:
                self.report(messages.Step, rank=rank, gen=gen, step=found.step, dt=dt, loss=found.loss)


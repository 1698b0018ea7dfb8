"""`report_step`: one line that tells ffctl which step an unchanged training script has finished.

A script that does not run its loop through `Job` still gets step-triggered faults
(`--inject kill-rank:rank=1,step=20`), lost steps and a loss curve in its report once its loop
calls `recovery.report_step(step, loss)` after each step. Under ffctl the call sends a sealed
`step` report to the controller, as `Job` does for its own steps; started by torchrun (or by
nothing at all) it does nothing, so the same script runs unchanged everywhere.

The script restores itself (from its own checkpoint, or from scratch): it reports the steps it
trains after a restart again, and ffctl counts those it had already reported as lost.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

from wire import control, messages
from wire.jobenv import JobEnv, job_token

# A report must never stall training for long: the controller's store answers in milliseconds,
# and a store that is gone (the controller stopped) makes the call give up rather than block.
CONNECT_TIMEOUT_S = 10.0


class StepReporter:
    """Sends a rank's step reports over one store connection, opened on first use."""

    def __init__(self, env: JobEnv) -> None:
        self.env = env
        self._store: Any = None
        self._sealer = control.Sealer(env.token, f"rank/{env.rank}")
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._broken = False

    def report(self, step: int, loss: float | None) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"report_step: step {step!r} is not a non-negative integer")
        if loss is not None:
            loss = float(loss)  # a tensor's .item() or a number; NaN and inf are facts worth reporting
        with self._lock:
            now = time.monotonic()
            dt, self._last = now - self._last, now
            if self._broken:
                return
            try:
                if self._store is None:
                    self._store = control.connect(self.env.store_host, self.env.store_port, CONNECT_TIMEOUT_S)
                msg = messages.Step(rank=self.env.rank, node=self.env.node, gen=self.env.gen, step=step,
                                    loss=loss, dt=max(0.0, dt))
                control.send(self._store, control.CTL_QUEUE, msg, self._sealer)
            except Exception:  # the controller is gone: training goes on regardless
                self._broken = True


_reporter: StepReporter | None = None
_checked = False


def _from_env() -> StepReporter | None:
    global _reporter, _checked
    if not _checked:
        _checked = True
        if job_token() and os.environ.get("FFCTL_RUN_ID"):
            _reporter = StepReporter(JobEnv.from_env())
    return _reporter


def report_step(step: int, loss: float | None = None) -> None:
    """Tell ffctl that this rank has finished training `step` (with `loss`, when given).

    Call it once per step, after the optimizer step. Outside ffctl it does nothing."""
    reporter = _from_env()
    if reporter is not None:
        reporter.report(step, loss)

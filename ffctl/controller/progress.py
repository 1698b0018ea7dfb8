"""The controller's ledger of training progress: which step reports become STEP events.

Every rank reports each step it committed (once its snapshot is durable). The run record keeps
one STEP event per (generation, step): the first report of it. A report from an older generation
normally says nothing the record needs, because the new generation restores an earlier step and
trains the rest again. The exception is a step the recovery restored although none of its reports
had arrived yet (every slot of it was complete, the reports were still on their way): that late
report is the only record of the step's loss, so it is kept.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class StepReport:
    gen: int
    step: int
    rank: int
    loss: float | None  # None: a script that reports its steps without a loss
    dt: float


class Progress:
    def __init__(self) -> None:
        self.gen = 0
        self.restore_step = 0  # the step the current generation started from
        self.committed_step = 0  # the newest step written to the record
        self.last_loss: float | None = None
        self.step_times: list[float] = []
        self._recorded: dict[int, int] = {}  # gen -> newest step written for it
        self._rank_step: dict[int, int] = {}  # rank -> newest step it reported in this generation
        # The library reports every rank's steps. An unchanged script reports them itself
        # (`recovery.report_step`, `--step-regex`), often from rank 0 only: then the ranks that
        # have reported a step at all are the ones a step counts on.
        self.every_rank_reports = True
        self.reporters: set[int] = set()

    def open(self, gen: int, restore_step: int) -> None:
        """A new generation starts from `restore_step`."""
        self.gen, self.restore_step = gen, restore_step
        self._rank_step = {}

    def report(self, rep: StepReport) -> bool:
        """Take a rank's report; True when it is to be written as a STEP event."""
        if rep.gen != self.gen:
            # Late: kept only when the current generation restored that very step (see above).
            late = rep.gen < self.gen and rep.step <= self.restore_step
            if late and rep.step > self._recorded.get(rep.gen, -1):
                self._recorded[rep.gen] = rep.step
                return True
            return False
        self._rank_step[rep.rank] = max(rep.step, self._rank_step.get(rep.rank, 0))
        self.reporters.add(rep.rank)
        if rep.step <= self._recorded.get(rep.gen, -1):
            return False
        self._recorded[rep.gen] = rep.step
        self.committed_step, self.last_loss = rep.step, rep.loss
        self.step_times.append(rep.dt)
        return True

    def everywhere(self, ranks: list[int]) -> int:
        """The newest step every one of `ranks` has committed in this generation (of a script that
        reports its own steps: every one of them that reports steps at all)."""
        if not self.every_rank_reports:
            ranks = [r for r in ranks if r in self.reporters]
        return min((self._rank_step.get(r, 0) for r in ranks), default=0)

    def started(self, gen: int | None = None) -> bool:
        """Whether generation `gen` (default: the current one) has committed a step yet."""
        return (self.gen if gen is None else gen) in self._recorded

    def median_step_s(self, last: int = 50) -> float:
        recent = self.step_times[-last:]
        return statistics.median(recent) if recent else 0.0

    def hang_limit(self, floor_s: float) -> float:
        """How long without a step is a hang (DESIGN.md): max(10 x median step time, floor)."""
        return max(10 * self.median_step_s(), floor_s)

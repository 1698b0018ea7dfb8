"""The controller's ledger of training progress: which step reports become STEP events.

Every rank reports each step it committed (once its snapshot is durable). The run record keeps
one STEP event per (generation, step): the first report of it. A report from an older generation
normally says nothing the record needs, because the new generation restores an earlier step and
trains the rest again. The exception is a step the recovery restored although none of its reports
had arrived yet (every slot of it was complete, the reports were still on their way): that late
report is the only record of the step's loss, so it is kept.

With `--verify-restore` (`verify`) the ledger also keeps every rank's loss of the newest
`LOSS_WINDOW` steps as first reported, and a generation that restored an older step than the
newest it could (`verify_until`) has each rank's loss of every step it trains again, up to
`verify_until`, compared with the rank's own earlier one, bit for bit (`check_replay`).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Steps whose losses the replay check keeps: a memory restore goes back two snapshots at most.
LOSS_WINDOW = 64


@dataclass(frozen=True)
class StepReport:
    gen: int
    step: int
    rank: int
    loss: float | None  # None: a script that reports its steps without a loss
    dt: float


@dataclass(frozen=True)
class Replay:
    """A rank's report of a step trained again after a restore, against its report before the
    fault: `before` None when there was none to compare (the rank's report never arrived)."""

    gen: int
    step: int
    rank: int
    before: float | None
    after: float | None
    compared: bool

    @property
    def matched(self) -> bool:
        return self.compared and same_loss(self.before, self.after)


def same_loss(a: float | None, b: float | None) -> bool:
    """Equal bit for bit (a NaN equals a NaN: both runs diverged alike)."""
    if a is None or b is None:
        return a is b
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


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
        self.verify = False  # --verify-restore
        self.verify_until = 0  # the current generation's steps up to this one are replays to check
        self._losses: dict[int, dict[int, float | None]] = {}  # step -> rank -> loss first reported
        self._replay: dict[int, bool] = {}  # rank -> no replayed step of it differed
        self._checked: set[int] = set()  # ranks with a replayed step compared with an earlier loss

    def open(self, gen: int, restore_step: int, verify_until: int = 0) -> None:
        """A new generation starts from `restore_step` (and trains again, to check them, the
        steps up to `verify_until`)."""
        self.gen, self.restore_step = gen, restore_step
        if self.verify:
            # Every step trained again is checked where a rank's earlier loss exists: beyond the
            # newest step held everywhere too, up to the newest any rank reported.
            verify_until = max(verify_until, max(self._losses, default=0))
        self.verify_until = verify_until if verify_until > restore_step else 0
        self._replay, self._checked = {}, set()
        self._rank_step = {}

    def check_replay(self, rep: StepReport) -> Replay | None:
        """Keep the rank's loss of the step (the first report of it), and when the step is one
        the current generation trains again to verify its restore, compare it with the rank's
        loss before the fault."""
        if not self.verify or rep.gen != self.gen:
            return None
        by_rank = self._losses.get(rep.step)
        if by_rank is None:
            by_rank = self._losses[rep.step] = {}
            while len(self._losses) > LOSS_WINDOW:
                del self._losses[min(self._losses)]
        replayed = self.restore_step < rep.step <= self.verify_until
        compared = replayed and rep.rank in by_rank
        before = by_rank.get(rep.rank) if compared else None
        by_rank.setdefault(rep.rank, rep.loss)
        if not replayed:
            return None
        found = Replay(rep.gen, rep.step, rep.rank, before, rep.loss, compared)
        self._replay[rep.rank] = self._replay.get(rep.rank, True) and (found.matched or not compared)
        if compared:
            self._checked.add(rep.rank)
        return found

    def replay_compared(self, rank: int) -> bool:
        """Whether a replayed step of `rank` had an earlier loss of the rank to compare with."""
        return rank in self._checked

    def replay_verified(self, ranks: set[int]) -> bool | None:
        """Once each of `ranks` has reported the last replayed step: whether every rank had a
        replayed step compared and none differed (None before that, or with nothing to check)."""
        if not self.verify_until or not ranks <= set(self._replay):
            return None
        if any(self._rank_step.get(r, 0) < self.verify_until for r in ranks):
            return None
        return all(self._replay[r] for r in ranks) and ranks <= self._checked

    def report(self, rep: StepReport) -> bool:
        """Take a rank's report; True when it is to be written as a STEP event."""
        if rep.gen != self.gen:
            # Late: kept only when the current generation restored that very step (see above).
            late = rep.gen < self.gen and rep.step <= self.restore_step
            return late and self._first_of(rep)
        self._rank_step[rep.rank] = max(rep.step, self._rank_step.get(rep.rank, 0))
        self.reporters.add(rep.rank)
        if not self._first_of(rep):
            return False
        self.committed_step, self.last_loss = rep.step, rep.loss
        self.step_times.append(rep.dt)
        return True

    def checkpointed(self, rep: StepReport) -> bool:
        """A step every rank wrote to disk (`rep`: the last rank's commit of it): True when it
        is to be written as a STEP event, because no rank's report of it has been. It is
        committed (a restore may start after it), but no rank is taken to hold it in memory:
        that is what its own report says, once the snapshot is durable."""
        if rep.gen != self.gen or not self._first_of(rep):
            return False
        self.committed_step, self.last_loss = rep.step, rep.loss
        return True

    def _first_of(self, rep: StepReport) -> bool:
        """Whether `rep` is the first word of a step newer than its generation's recorded ones
        (noted if so: the step is recorded once)."""
        if rep.step <= self._recorded.get(rep.gen, -1):
            return False
        self._recorded[rep.gen] = rep.step
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

"""Straggler detection: which rank the others wait for, named from the ranks' step reports.

Every rank of a synchronous job takes the same wall time per step: the fast ranks wait in the
collectives for the slow one. So the signal is a rank's busy time, its step time (`dt`) less the
time it spent blocked in the step's collectives (`wait`, both in `wire.messages.Step`). A
rank's excess at a step is its busy time beyond the median of the other ranks' (the time they
waited for it), and its factor is its step time over that step time less the excess (how much
longer the step took than it would have with this rank as fast as the others). A rank is slow at
a step when its factor is at least `SLOW_RATIO` and its excess at least `MIN_EXCESS_S`;
`ONSET_STEPS` slow steps in a row lasting `ONSET_S` in all make it a straggler, and `END_STEPS`
normal ones in a row end it. The first `WARMUP_STEPS` steps of a generation after a recovery are not
judged (see there). The excesses of its slow steps add up to the time the slowdown lost. With `--straggler
replace`, a rank whose factor reaches the policy's for the policy's number of steps in a row is
handed back as one to replace.

Pure: the controller feeds `report` and records what it returns; nothing here reads a clock.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ffctl.launch_spec import StragglerPolicy

SLOW_RATIO = 1.5  # the factor that makes a step slow
ONSET_STEPS = 3  # slow steps in a row that make a straggler (one or two are noise: a page fault, a GC,
# a rank descheduled on a loaded host)
# ... and how long they must last: on a loaded host a rank descheduled for a few short steps is
# twice as slow for half a second (seen on the 2-core test host in fault-free runs), which is
# noise to a job, not a straggler to act on.
ONSET_S = 1.0
END_STEPS = 2  # normal steps in a row that end it
# An excess below this is timer and scheduling noise (a page fault, a context switch), whatever
# factor it makes of a step of a few milliseconds.
MIN_EXCESS_S = 0.005
# Steps of a generation after the first that are not judged. A rank started again warms up in its
# first steps (its restored state paged in, the allocator and autograd's lazy set-up), most of all
# on a host loaded by other work, and the survivors wait for it: that is the recovery's cost, and
# the report already bills it to the fault recovered from (its lost time runs until the job is back
# at pace), not a straggler of its own. A rank still slow after these steps is named as usual.
WARMUP_STEPS = 10
# Steps kept while waiting for every rank's report; older incomplete steps are dropped (a rank
# that stopped reporting is the failure detectors' business, not this one's).
KEEP_STEPS = 32


@dataclass(frozen=True)
class Straggling:
    """A straggler detected: `rank` has been slow since `onset_step` (begun at `onset_t`, the
    first slow step's start), `factor` times the healthy ranks' busy time (the median over the
    slow steps so far), noticed when `step` was complete."""

    rank: int
    onset_step: int
    onset_t: float
    factor: float
    step: int
    gen: int


@dataclass(frozen=True)
class Recovered:
    """The straggler `rank` is back at the others' pace: slow from `onset_step` to `last_step`
    (ended by `end_t`, the last slow step's end), `factor` the median over those steps, `lost_s`
    the time the job lost waiting for it (see the module doc)."""

    rank: int
    onset_step: int
    last_step: int
    onset_t: float
    end_t: float
    factor: float
    lost_s: float
    steps: int


@dataclass(frozen=True)
class Replace:
    """`--straggler replace`: `rank` took over the policy's factor times the median busy time
    for the policy's steps in a row (`factor` the median over them): treat it as failed."""

    rank: int
    factor: float
    step: int


Finding = Straggling | Recovered | Replace


@dataclass
class _Episode:
    rank: int
    onset_step: int
    onset_t: float
    ratios: list[float] = field(default_factory=list)
    lost_s: float = 0.0
    end_t: float = 0.0
    last_step: int = 0
    announced: bool = False
    normal_run: int = 0  # normal steps in a row since the last slow one
    over_policy: int = 0  # steps in a row over the replace policy's factor
    replaced: bool = False


@dataclass
class _Step:
    busy: dict[int, float] = field(default_factory=dict)
    start: dict[int, float] = field(default_factory=dict)  # when each rank's step began
    end: dict[int, float] = field(default_factory=dict)


class StragglerDetector:
    """Fed every rank's step reports (`report`), says when a straggler appears, when it is back
    at pace (with the time it cost) and, under a replace policy, when to replace it."""

    def __init__(self, world_size: int, policy: StragglerPolicy | None = None) -> None:
        self.world_size = world_size
        self.policy = policy or StragglerPolicy()
        self.gen = -1
        self._steps: dict[int, _Step] = {}
        self._done = 0  # the newest step evaluated in this generation
        self._judged_from = 0  # the first step of this generation that is judged (WARMUP_STEPS)
        self._open: dict[int, _Episode] = {}  # rank -> its slowdown under way

    def report(self, gen: int, step: int, rank: int, dt: float, wait: float | None, t: float) -> list[Finding]:
        """Rank `rank` committed `step` of generation `gen` in `dt` seconds, `wait` of them in
        collectives; `t` is when the report arrived. Returns what this step made known."""
        if wait is None or gen < self.gen:
            return []  # no busy time (a script reporting its own steps), or an older generation
        if gen > self.gen:
            # A new generation replays from its restore step and may have replaced the
            # straggler: measurements start over (an episode under way ends with what it had).
            ended = self._close_all()
            after_recovery = self.gen >= 0  # the first generation has no recovery to bill a warm-up to
            self.gen, self._steps, self._done = gen, {}, 0
            self._judged_from = step + WARMUP_STEPS if after_recovery else 0
            return ended + self.report(gen, step, rank, dt, wait, t)
        if step <= self._done:
            return []
        entry = self._steps.setdefault(step, _Step())
        entry.busy[rank] = max(0.0, dt - wait)
        entry.start[rank], entry.end[rank] = t - dt, t
        for old in [s for s in self._steps if s < step - KEEP_STEPS]:
            del self._steps[old]
        out: list[Finding] = []
        # Steps complete in order: a later step's reports may arrive before an earlier one's last.
        while True:
            ready = [s for s, e in self._steps.items() if len(e.busy) >= self.world_size]
            if not ready or min(ready) != min(self._steps):
                break
            s = min(ready)
            out += self._evaluate(s, self._steps.pop(s))
            self._done = s
        return out

    def close(self) -> list[Finding]:
        """The job ended: every slowdown under way ends with what it had."""
        return self._close_all()

    def _close_all(self) -> list[Finding]:
        out: list[Finding] = []
        for ep in list(self._open.values()):
            if ep.announced:
                out.append(self._recovered(ep))
        self._open.clear()
        return out

    def _evaluate(self, step: int, entry: _Step) -> list[Finding]:
        if self.world_size < 2 or step < self._judged_from:
            return []
        out: list[Finding] = []
        excess: dict[int, float] = {}
        ratios: dict[int, float] = {}
        for rank, busy in entry.busy.items():
            excess[rank] = busy - statistics.median([b for r, b in entry.busy.items() if r != rank])
            dt = entry.end[rank] - entry.start[rank]
            # (Floored: a rank that did all of a step's work while the others did next to none.)
            ratios[rank] = dt / max(dt - excess[rank], MIN_EXCESS_S)
        slow = {r for r, q in ratios.items() if q >= SLOW_RATIO and excess[r] >= MIN_EXCESS_S}
        for rank in sorted(entry.busy):
            ep = self._open.get(rank)
            if rank in slow:
                if ep is None:
                    ep = self._open[rank] = _Episode(rank, step, entry.start[rank])
                ep.ratios.append(ratios[rank])
                ep.lost_s += excess[rank]
                ep.end_t, ep.last_step, ep.normal_run = entry.end[rank], step, 0
                if not ep.announced and len(ep.ratios) >= ONSET_STEPS and ep.end_t - ep.onset_t >= ONSET_S:
                    ep.announced = True
                    out.append(Straggling(rank, ep.onset_step, ep.onset_t, _median(ep.ratios), step, self.gen))
                if self.policy.replaces and not ep.replaced:
                    ep.over_policy = ep.over_policy + 1 if ratios[rank] >= self.policy.factor else 0
                    # Only a named straggler is replaced: a burst too short to name is noise,
                    # and replacing a rank costs a recovery.
                    if ep.announced and ep.over_policy >= self.policy.steps:
                        ep.replaced = True
                        out.append(Replace(rank, _median(ep.ratios[-self.policy.steps:]), step))
            elif ep is not None:
                ep.normal_run += 1
                ep.over_policy = 0
                if not ep.announced or ep.normal_run >= END_STEPS:
                    del self._open[rank]  # a lone slow step was noise; a straggler is over
                    if ep.announced:
                        out.append(self._recovered(ep))
        return out

    @staticmethod
    def _recovered(ep: _Episode) -> Recovered:
        return Recovered(ep.rank, ep.onset_step, ep.last_step, ep.onset_t, ep.end_t, _median(ep.ratios),
                         ep.lost_s, len(ep.ratios))


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0

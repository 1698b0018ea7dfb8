"""The controller's fault scheduler: fires scheduled faults at their trigger (a step, a time, or a
seeded MTBF chaos schedule), applies ad hoc ones, and reverts revertible ones after their duration.

A fault is checked before anything is written or touched: it is planned under its fault id
against the live topology, a network fault between nodes that only share this machine's loopback
is refused (those need `--sandbox netns`), and the family's preflight probes the target hosts
read-only (netem missing, iptables unusable, no such interface). A refused fault is never
recorded as injected. One that passes is written to the record (fault_injected) before its first
command runs; its dead man's switches are armed, then it is applied, and a fault that fails half
way is reverted and recorded as fault_failed. Every revertible fault ends: after its duration, or
after the library's default when it has none.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from fault_injectors import FaultSpec, FaultSpecError, PlanError, Transport, TransportError, deadman, network
from fault_injectors.plan import FaultPlan, HostCommand, Role
from fault_injectors.schedule import parse_chaos
from fault_injectors.process import in_step_fault_path
from wire.fault_spec import PHASE_LEAD_S, PHASE_LEAD_STEPS, FaultFamily, FaultKind
from ffctl.controller.cluster import FaultCluster
from ffctl.controller.faultplan import chaos_faults, plan_fault
from ffctl.controller.state import JobState, Phase
from runs.events import EventKind
from runs.shm import redact

# A scheduled fault waits while an earlier one is still unseen (not detected, not reverted, not
# survived), so faults do not pile onto one another and each seeded pick sees the whole world;
# never longer than this.
SETTLE_MAX_S = 60.0
# A fault is survived when the job still commits steps this long after the longest any detector
# takes to notice a broken job (the hang limit). Counting steps instead would be fooled: steps
# already in flight when the fault hit keep arriving for a moment.
SURVIVE_MARGIN_S = 2.0


def phase_lead(median_step_s: float) -> int:
    """How many steps ahead of its step a kill at a phase is armed, at the job's pace."""
    if median_step_s <= 0:
        return PHASE_LEAD_STEPS
    return max(PHASE_LEAD_STEPS, math.ceil(PHASE_LEAD_S / median_step_s))


def _lands_in_step(spec: FaultSpec) -> bool:
    """A kill armed in the rank ahead of its step: it takes effect when it lands there."""
    return spec.kind is FaultKind.KILL_RANK and bool(spec.option("phase"))


def _due(spec: FaultSpec, committed_step: int, elapsed: float, lead: int) -> bool:
    trig = spec.trigger
    # A kill at a phase lands in step `trig.step` itself: the rank arms it `lead` steps ahead.
    lead = lead if _lands_in_step(spec) else 0
    return (trig.step is not None and committed_step >= trig.step - lead) or (
        trig.t is not None and elapsed >= trig.t) or (trig.step is None and trig.t is None)


def _trigger_order(spec: FaultSpec) -> tuple[int, float]:
    trig = spec.trigger
    return (trig.step if trig.step is not None else -1, trig.t if trig.t is not None else -1.0)


@dataclass
class ActiveFault:
    fault_id: str
    spec: FaultSpec  # carries the fault id (`spec.fault_id`, set by deadman.with_fault_id)
    plan: FaultPlan
    injected_t: float
    gen: int
    detected: bool = False
    revert_at: float | None = None
    reverted: bool = False
    reverted_t: float | None = None
    applied_t: float | None = None  # when the fault took effect (applying can take seconds)
    armed: bool = False  # a kill waiting in its rank for its step: no effect until it lands
    armed_step: int = 0  # the job's committed step when it was armed


def revert_refusal(fault_id: str, fault: ActiveFault | None, waiting: bool) -> str | None:
    """Why fault `fault_id` (`fault`, None when none was injected; `waiting`: scheduled still)
    cannot be reverted now, in one line; None when it can."""
    if fault is None:
        return f"{fault_id} has not been injected yet" if waiting else f"this run has no fault {fault_id}"
    if not fault.plan.revertible:
        return f"{fault_id} ({fault.spec.kind.value}) has nothing to revert"
    if fault.reverted:
        return f"{fault_id} ({fault.spec.kind.value}) is reverted already"
    return None


@dataclass
class Injector:
    """Fires, applies and reverts faults: plans them against `cluster.topology()`, writes them to
    the record through `cluster`, reads the job's progress and placement from `job`."""

    cluster: FaultCluster
    job: JobState
    transport_for: Callable[[HostCommand], Transport]
    scheduled: list[FaultSpec] = field(default_factory=list)
    timed: list[tuple[float, FaultSpec]] = field(default_factory=list)  # (seconds after start, spec)
    faults: list[ActiveFault] = field(default_factory=list)
    _count: int = 0
    _chaos: Iterator[tuple[float, FaultSpec]] | None = None
    _chaos_next: tuple[float, FaultSpec] | None = None
    _seen_step: int = -1
    _progress_t: float = 0.0  # when the committed step last moved
    chaos: str | None = None  # a `--chaos` schedule
    hang_min_s: float = 5.0  # the floor of the hang limit (a fault outlasting it was survived)
    trained_from: float | None = None  # when the job's first step committed (`since_training`)

    def __post_init__(self) -> None:
        # Scheduled faults get their ids up front, in the order given, so the ids (and the chain
        # names and owner tags derived from them) that `--dry-run` printed are the ones used.
        self.scheduled = [deadman.with_fault_id(s, self._take_id()) for s in self.scheduled]
        self.timed = [(t, deadman.with_fault_id(s, self._take_id())) for t, s in self.timed]
        if self.chaos:
            # Drawn lazily: an MTBF schedule has no end unless `until=` gives one.
            self._chaos = chaos_faults(parse_chaos(self.chaos))
            self._chaos_next = next(self._chaos, None)

    # -- ids ----------------------------------------------------------------------------------
    def _peek_id(self) -> str:
        return f"f{self._count + 1}"

    def _take_id(self) -> str:
        self._count += 1
        return f"f{self._count}"

    # -- scheduling ---------------------------------------------------------------------------
    def _ready(self) -> bool:
        """Every rank placed and nothing failing: a fault now sees the whole world, so a seeded
        target pick is the same from run to run."""
        return self.job.pending is None and self.job.placed()

    def _survived(self, fault: ActiveFault) -> bool:
        """The job carries on: it committed a step after the fault was reverted, or longer after
        the fault took effect than any detector needs (a kill still armed has not)."""
        if fault.armed:
            return False
        if fault.reverted_t is not None and self._progress_t > fault.reverted_t:
            return True
        hang_limit = self.job.progress.hang_limit(self.hang_min_s)
        # Counted from when it took effect: a partition applied over SSH takes seconds, during
        # which the job rightly goes on, and must not pass for a fault it survived.
        since = fault.applied_t if fault.applied_t is not None else fault.injected_t
        return self._progress_t - since > hang_limit + SURVIVE_MARGIN_S

    def _settled(self) -> bool:
        now = time.time()
        return all(f.detected or f.reverted or self._survived(f) or self._missed(f)
                   or now - f.injected_t > SETTLE_MAX_S for f in self.faults)

    def _missed(self, fault: ActiveFault) -> bool:
        """A kill still armed well past the step it lands in (its own, or the next one when it was
        armed late): the phase it waits for is not in the job's steps (`backward` in a step
        function without DDP), and later faults need not wait for it."""
        lands = max(fault.spec.trigger.step or 0, fault.armed_step)
        return fault.armed and self._seen_step > lands + PHASE_LEAD_STEPS

    def since_training(self, from_ranks_start: bool) -> float:
        """Seconds since the job's first committed step, or with `from_ranks_start` (a plain
        script) since its ranks started: where `t=` and `--chaos` count from, so that a start-up
        of seconds on a loaded host never puts a fault before the first step. -1 until then.
        A plain script's clock starts with its ranks, whether or not it reports steps: whether it
        will is known only when it does (its `report_step` may sit behind a flag)."""
        now = time.time()
        if self.trained_from is None and (self.job.progress.started()
                                          or (from_ranks_start and self.job.phase is Phase.RUNNING)):
            self.trained_from = now
        return -1.0 if self.trained_from is None else now - self.trained_from

    def _draw_chaos(self, elapsed: float) -> None:
        while self._chaos is not None and self._chaos_next is not None and self._chaos_next[0] <= elapsed:
            t, spec = self._chaos_next
            self.timed.append((t, deadman.with_fault_id(spec, self._take_id())))
            self._chaos_next = next(self._chaos, None)

    def tick(self, elapsed: float) -> None:
        """Fire what is due, `elapsed` seconds after the start; revert what has run its time."""
        # A fault "at step k" lands once every rank has committed step k (and made it durable),
        # not when the first one has: the job has completed step k, and no copy of it is still
        # in flight when the fault hits. During a replay after a recovery that is the new
        # generation's progress, so a fault waits until the replay reaches its step.
        committed_step = self.job.progress.everywhere(sorted(self.job.members))
        if committed_step != self._seen_step:
            self._seen_step, self._progress_t = committed_step, time.time()
        self.revert_due()
        if not self._ready():
            return
        self._draw_chaos(elapsed)
        if not self._settled():
            return
        # Due faults fire in trigger order, those sharing the first due trigger together (two
        # kills at one step are one event); a later one waits until these have been seen, so
        # faults that came due during a long recovery do not all land at once.
        # A kill armed ahead of its step never overtakes a fault due before it: it would hold
        # that one back until it landed.
        lead = phase_lead(self.job.progress.median_step_s())
        next_step = min((s.trigger.step for s in self.scheduled if s.trigger.step is not None), default=None)
        due = [s for s in self.scheduled if _due(s, committed_step, elapsed, lead)
               and (s.trigger.step is None or s.trigger.step == next_step)]
        if due:
            first = min(due, key=_trigger_order).trigger
            for spec in [s for s in due if s.trigger == first]:
                self.scheduled.remove(spec)
                self.inject(spec)
            return
        self.timed.sort(key=lambda item: item[0])
        if self.timed and elapsed >= self.timed[0][0]:
            self.inject(self.timed.pop(0)[1])

    def revert_due(self) -> None:
        """Revert every fault whose duration is over. Called from the controller's pump too, so a
        fault ends on time while a recovery is waiting on it (a partition, a downed link)."""
        now = time.time()
        for fault in self.faults:
            if fault.revert_at is not None and not fault.reverted and now >= fault.revert_at:
                self.revert(fault)

    def record_missed(self, steps_unknown: bool, elapsed: float) -> list[str]:
        """At the run's end: every fault asked for that never took effect, recorded
        `fault_missed` with the reason. `steps_unknown`: the job reports no steps (a plain
        script without --step-regex). Returns their ids."""
        last = max(self._seen_step, self.job.progress.everywhere(sorted(self.job.members)))
        missed: list[tuple[FaultSpec, str]] = []
        for spec in self.scheduled:
            trig = spec.trigger
            if trig.step is not None and steps_unknown:
                why = (f"step={trig.step}: the script reports no steps (recovery.report_step or --step-regex), "
                       f"so no step trigger can fire")
            elif trig.step is not None and last < trig.step:
                why = f"the job ended at step {last}, before step {trig.step}"
            elif trig.t is not None and elapsed < 0:
                why = f"t={trig.t:g} counts from the job's first step (a script's: its ranks' start), which never came"
            elif trig.t is not None and elapsed < trig.t:
                why = f"the job ended at t={elapsed:.1f}, before t={trig.t:g}"
            else:
                why = f"due ({trig}), held back behind earlier faults until the job ended at step {last}"
            missed.append((spec, why))
        missed += [(spec, f"due at t={t:g}, held back behind earlier faults until the job ended") for t, spec in self.timed]
        for fault in self.faults:
            if fault.armed:
                missed.append((fault.spec, f"armed in its rank for step {fault.spec.trigger.step}; its phase "
                                            f"{fault.spec.option('phase')} never came before the job ended"))
        for spec, why in missed:
            self.cluster.record(EventKind.FAULT_MISSED, fault_id=spec.fault_id, kind=spec.kind.value,
                                target=str(spec.target), trigger=str(spec.trigger), reason=why)
        return [str(spec.fault_id) for spec, _ in missed]

    # -- injection ----------------------------------------------------------------------------
    def plan(self, spec: FaultSpec) -> FaultPlan:
        """The checked plan `spec` would run now (for `--dry-run`): touches nothing, raises
        FaultSpecError (FaultUnsupported included) with one line."""
        plan = plan_fault(spec, self.cluster.topology(), spec.fault_id or self._peek_id())
        network.preflight(plan, self.transport_for)
        return plan

    def inject(self, spec: FaultSpec, *, raise_refused: bool = False) -> tuple[ActiveFault | None, str | None]:
        """Apply a fault now. Returns (fault, None), (fault, error) when applying failed (recorded
        and reverted), or (None, error) when it was refused before anything was touched: then
        nothing is recorded as injected. With `raise_refused`, a refusal raises FaultSpecError
        and is not recorded at all (an ad hoc request: its caller tells the user)."""
        try:
            plan = self.plan(spec)
        except FaultSpecError as exc:
            if raise_refused:
                raise
            self.cluster.record(EventKind.FAULT_FAILED, fault_id=spec.fault_id or self._take_id(),
                            kind=spec.kind.value, target=str(spec.target), trigger=str(spec.trigger),
                            error=str(exc), refused=True)
            return None, str(exc)
        fault_id = deadman.fault_id(plan.spec)
        if spec.fault_id is None:
            self._take_id()
        fault = ActiveFault(fault_id, plan.spec, plan, time.time(), self.job.gen)
        self.cluster.record(
            EventKind.FAULT_INJECTED, fault_id=fault_id, kind=spec.kind.value, target=str(spec.target),
            trigger=str(spec.trigger), ranks=list(plan.ranks), nodes=list(plan.nodes),
            at_step=self.job.progress.committed_step, gen=self.job.gen, emulated=plan.emulated,
            breaks_job=spec.kind.breaks_job,
            duration=deadman.duration_of(spec) if plan.revertible else None,
            commands=[redact(str(c)) for c in plan.apply], guarded=bool(plan.deadman),
        )
        self.faults.append(fault)
        try:
            deadman.apply_guarded(plan, self.transport_for)
        except (PlanError, TransportError, OSError) as exc:
            # apply_guarded has reverted what was applied and cancelled the switches.
            self.cluster.record(EventKind.FAULT_FAILED, fault_id=fault_id, error=str(exc))
            fault.detected = fault.reverted = True  # nothing to detect: it never took effect
            return fault, str(exc)
        fault.applied_t = time.time()
        fault.armed, fault.armed_step = _lands_in_step(plan.spec), self._seen_step
        if plan.revertible:
            # The duration counts from when the fault took effect: applying over SSH can take
            # seconds, and a 3 s partition must partition for 3 s.
            fault.revert_at = time.time() + deadman.duration_of(spec)
        return fault, None

    def revert(self, fault: ActiveFault) -> None:
        fault.reverted, fault.reverted_t = True, time.time()
        try:
            deadman.revert_guarded(fault.plan, self.transport_for)
        except (PlanError, TransportError, OSError) as exc:
            # The switch stays armed when the revert failed: it reverts after duration + grace.
            self.cluster.record(EventKind.FAULT_FAILED, fault_id=fault.fault_id, error=f"revert: {exc}")
            return
        self.cluster.record(EventKind.FAULT_REVERTED, fault_id=fault.fault_id)

    def revert_by_id(self, fault_id: str, dry_run: bool = False) -> str | None:
        """Revert fault `fault_id` now (`ffctl inject revert FAULT`); None when done (or with
        `dry_run`, when it could be), else why not, in one line."""
        fault = next((f for f in self.faults if f.fault_id == fault_id), None)
        waiting = any(s.fault_id == fault_id for s in [*self.scheduled, *(spec for _, spec in self.timed)])
        why = revert_refusal(fault_id, fault, waiting)
        if why is None and fault is not None and not dry_run:
            self.revert(fault)
        return why

    def revert_all(self) -> None:
        for fault in self.faults:
            if fault.plan.revertible and not fault.reverted:
                self.revert(fault)
        self._drop_unfired()

    def _drop_unfired(self) -> None:
        """Remove the fault files of in-step faults no step picked up (the job ended first), so
        nothing of the run is left in the hosts' shared memory."""
        topo = self.cluster.topology()
        for fault in self.faults:
            if not (fault.spec.kind is FaultKind.CRASH_RANK
                    or fault.spec.kind.family in (FaultFamily.GPU, FaultFamily.STRAGGLER)):
                continue
            for rank in fault.plan.ranks:
                cmd = next((c for c in fault.plan.apply if c.role is Role.IN_STEP and c.about == str(rank)), None)
                if cmd is None:
                    continue
                try:
                    # The rank's mailbox: every fault file in it ($1.XXXXXXXX), none of another rank's.
                    self.transport_for(cmd).run(("sh", "-c", 'rm -f -- "$1".????????', "sh",
                                                 in_step_fault_path(topo, rank)), timeout=10.0)
                except (TransportError, OSError):
                    pass

    def landed(self, rank: int, **where: Any) -> None:
        """A kill armed in `rank` reached its step and phase (`where`, recorded): it takes
        effect now."""
        self.cluster.record(EventKind.FAULT_LANDED, rank=rank, **where)
        fault = next((f for f in self.faults if f.armed and rank in f.plan.ranks), None)
        if fault is not None:
            fault.armed, fault.applied_t = False, time.time()

    def attribute(self, ranks: set[int], nodes: set[int], strict: bool = False) -> list[str]:
        """Faults a detected failure is blamed on: undetected faults that hit these ranks or nodes,
        else every undetected fault (a partition shows up as a hang anywhere). A fault the job has
        survived (a bandwidth limit, one reverted before it did harm) is not blamed for a later
        failure: a fault that breaks the job is noticed within the hang limit. `strict`: only faults
        that hit these ranks or nodes."""
        open_faults = [f for f in self.faults if not f.detected and not self._survived(f)]
        hits = [f for f in open_faults if set(f.plan.ranks) & ranks or set(f.plan.nodes) & nodes]
        # A kill armed in its rank explains that rank's failure (its word that it landed may be
        # lost with the controller out of reach), but nothing elsewhere: it has done nothing yet.
        open_faults = [f for f in open_faults if not f.armed]
        # A straggler replaced under `--straggler replace`: the slow fault in force on it explains
        # it, however long ago it was detected.
        hits += [f for f in self.faults if f.spec.kind.family is FaultFamily.STRAGGLER and not f.reverted
                 and set(f.plan.ranks) & ranks and f not in hits]
        chosen = hits if hits or strict else open_faults
        for f in chosen:
            f.detected, f.armed = True, False
        return [f.fault_id for f in chosen]

    def explain_straggler(self, rank: int, onset_t: float) -> list[str]:
        """The slow-rank and slow-node faults that explain a straggler on `rank` whose slowdown
        began at `onset_t`: applied to that rank before it (a second of slack: the rank's clock
        and ours), and not reverted before it. They count as detected."""
        hits = [f for f in self.faults if f.spec.kind.family is FaultFamily.STRAGGLER and rank in f.plan.ranks
                and f.injected_t <= onset_t + 1.0 and (f.reverted_t is None or f.reverted_t >= onset_t)]
        for f in hits:
            f.detected = True
        return [f.fault_id for f in hits]

    def describe_current(self) -> str | None:
        live = [f for f in self.faults if not f.reverted and (not f.detected or f.revert_at)]
        if not live:
            return None
        f = live[-1]
        return f"{f.spec.kind.value} {f.spec.target}"

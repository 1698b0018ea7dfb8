"""The controller's fault scheduler: fires scheduled faults at their trigger, applies ad hoc ones,
and reverts revertible ones after their duration.

Every fault is written to the record (fault_injected) before its first command runs; a fault
that cannot be applied is recorded as fault_failed with the reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from fault_injectors import FaultSpec, FaultSpecError, PlanError, Transport, make_plan, run_commands
from fault_injectors.plan import FaultPlan, HostCommand
from runs.events import EventKind

if TYPE_CHECKING:
    from ffctl.controller import Controller


@dataclass
class ActiveFault:
    fault_id: str
    spec: FaultSpec
    plan: FaultPlan
    injected_t: float
    gen: int
    detected: bool = False
    revert_at: float | None = None
    reverted: bool = False


@dataclass
class Injector:
    ctl: Controller
    transport_for: Callable[[HostCommand], Transport]
    scheduled: list[FaultSpec] = field(default_factory=list)
    timed: list[tuple[float, FaultSpec]] = field(default_factory=list)  # (seconds after start, spec)
    faults: list[ActiveFault] = field(default_factory=list)
    _count: int = 0

    def tick(self, committed_step: int, elapsed: float) -> None:
        for spec in list(self.scheduled):
            trig = spec.trigger
            due = (trig.step is not None and committed_step >= trig.step) or (
                trig.t is not None and elapsed >= trig.t) or (trig.step is None and trig.t is None)
            if due:
                self.scheduled.remove(spec)
                self.inject(spec)
        for item in list(self.timed):
            if elapsed >= item[0]:
                self.timed.remove(item)
                self.inject(item[1])
        now = time.time()
        for fault in self.faults:
            if fault.revert_at is not None and not fault.reverted and now >= fault.revert_at:
                self.revert(fault)

    def plan(self, spec: FaultSpec) -> FaultPlan:
        return make_plan(spec, self.ctl.topology())

    def inject(self, spec: FaultSpec) -> tuple[ActiveFault | None, str | None]:
        """Apply a fault now. Returns (fault, None) or (None, one-line error)."""
        self._count += 1
        fault_id = f"f{self._count}"
        try:
            plan = self.plan(spec)
        except FaultSpecError as exc:
            self.ctl.record(EventKind.FAULT_FAILED, fault_id=fault_id, kind=spec.kind.value,
                            target=str(spec.target), error=str(exc))
            return None, str(exc)
        fault = ActiveFault(fault_id, spec, plan, time.time(), self.ctl.gen)
        self.ctl.record(
            EventKind.FAULT_INJECTED, fault_id=fault_id, kind=spec.kind.value, target=str(spec.target),
            trigger=str(spec.trigger), ranks=list(plan.ranks), nodes=list(plan.nodes),
            at_step=self.ctl.committed_step, gen=self.ctl.gen, emulated=plan.emulated,
            duration=spec.duration, commands=[str(c) for c in plan.apply],
        )
        self.faults.append(fault)
        try:
            for cmd in plan.deadman:
                self.transport_for(cmd).spawn_detached(cmd.argv, timeout=10.0)
            run_commands(plan.apply, self.transport_for)
        except (PlanError, OSError) as exc:
            self.ctl.record(EventKind.FAULT_FAILED, fault_id=fault_id, error=str(exc))
            fault.detected = True  # nothing to detect: it never took effect
            return fault, str(exc)
        if plan.revertible and spec.duration is not None:
            fault.revert_at = fault.injected_t + spec.duration
        return fault, None

    def revert(self, fault: ActiveFault) -> None:
        fault.reverted = True
        try:
            run_commands(fault.plan.revert, self.transport_for)
        except (PlanError, OSError) as exc:
            self.ctl.record(EventKind.FAULT_FAILED, fault_id=fault.fault_id, error=f"revert: {exc}")
            return
        self.ctl.record(EventKind.FAULT_REVERTED, fault_id=fault.fault_id)

    def revert_all(self) -> None:
        for fault in self.faults:
            if fault.plan.revertible and not fault.reverted:
                self.revert(fault)

    def attribute(self, ranks: set[int], nodes: set[int]) -> list[str]:
        """Faults a detected failure is blamed on: undetected faults that hit these ranks or nodes,
        else every undetected fault (a partition shows up as a hang anywhere)."""
        open_faults = [f for f in self.faults if not f.detected]
        hits = [f for f in open_faults if set(f.plan.ranks) & ranks or set(f.plan.nodes) & nodes]
        chosen = hits or open_faults
        for f in chosen:
            f.detected = True
        return [f.fault_id for f in chosen]

    def describe_current(self) -> str | None:
        live = [f for f in self.faults if not f.reverted and (not f.detected or f.revert_at)]
        if not live:
            return None
        f = live[-1]
        return f"{f.spec.kind.value} {f.spec.target}"

    def summary(self) -> list[dict[str, Any]]:
        return [{"fault_id": f.fault_id, "kind": f.spec.kind.value} for f in self.faults]

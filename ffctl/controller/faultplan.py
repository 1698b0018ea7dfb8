"""Fault planning: what a fault spec becomes against a topology, and the chaos schedule.

Pure (no store, no transport, no clock): the fault scheduler (`ffctl.controller.injector`) runs
exactly these plans, and `launch --dry-run` prints them, without importing the scheduler.
"""
from __future__ import annotations

import ipaddress
from typing import Iterator

from fault_injectors import FaultSpec, FaultSpecError, deadman, make_plan
from fault_injectors.plan import FaultPlan, Topology
from fault_injectors.schedule import ChaosSpec, iter_mtbf
from wire.fault_spec import FaultFamily
from fault_injectors.targets import resolve


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_local_network(spec: FaultSpec, topo: Topology) -> None:
    """Refuse a network fault on a node that is only this machine's loopback.

    Local nodes without a sandbox share one network stack: a partition cannot tell them apart
    and a link-down would take this machine's loopback (and the controller) down with it.
    """
    if spec.kind.family is not FaultFamily.NETWORK:
        return
    for n in resolve(spec, topo)[1]:
        place = topo.node(n)
        if place.netns is None and _loopback(place.address):
            raise FaultSpecError(
                f"{spec.kind.value} on node {n}: local nodes share this machine's network "
                f"({place.address}); use --sandbox netns for network faults between them"
            )


def plan_fault(spec: FaultSpec, topo: Topology, fault_id: str) -> FaultPlan:
    """What the injector runs for `spec` as `fault_id`: tagged with the id, checked, and with a dead
    man's switch whenever it is revertible (pure: `--dry-run` prints exactly this)."""
    spec = deadman.with_fault_id(spec, fault_id)
    check_local_network(spec, topo)
    plan = make_plan(spec, topo)
    if plan.revertible:
        # A no-op for network plans, which come guarded.
        plan = deadman.guard(plan, topo.run_id, record_dir=topo.record_dir)
    return plan


def chaos_faults(chaos: ChaosSpec) -> Iterator[tuple[float, FaultSpec]]:
    """The chaos schedule in time order (seconds after the start), ending at `until` if given."""
    for t, spec in iter_mtbf(chaos.mtbf, chaos.seed, chaos.kinds, chaos.duration):
        if chaos.until is not None and t >= chaos.until:
            return
        yield t, spec

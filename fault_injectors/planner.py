"""Turn a `FaultSpec` into a `FaultPlan` for a topology, and run plans through transports."""
from __future__ import annotations

from typing import Callable

from fault_injectors import node, process
from fault_injectors.plan import FaultPlan, HostCommand, Topology
from fault_injectors.spec import FaultFamily, FaultSpec, FaultSpecError
from fault_injectors.targets import resolve
from fault_injectors.transport import CommandResult, Transport

Planner = Callable[[FaultSpec, Topology, tuple[int, ...], tuple[int, ...]], FaultPlan]
_PLANNERS: dict[FaultFamily, Planner] = {
    FaultFamily.PROCESS: process.plan,
    FaultFamily.NODE: node.plan,
}


def register(family: FaultFamily, planner: Planner) -> None:
    _PLANNERS[family] = planner


def make_plan(spec: FaultSpec, topo: Topology) -> FaultPlan:
    ranks, nodes = resolve(spec, topo)
    planner = _PLANNERS.get(spec.kind.family)
    if planner is None:
        raise FaultSpecError(f"fault kind {spec.kind.value!r} is not available in this build")
    return planner(spec, topo, ranks, nodes)


class PlanError(Exception):
    """A command of a plan failed; the message names the host and the command."""


def run_commands(
    commands: tuple[HostCommand, ...], transport_for: Callable[[HostCommand], Transport], timeout: float = 30.0
) -> list[CommandResult]:
    results = []
    for cmd in commands:
        result = transport_for(cmd).run(cmd.argv, timeout=timeout)
        results.append(result)
        if not result.ok and not cmd.allow_fail:
            raise PlanError(f"on {cmd.host}: {result.describe()}")
    return results

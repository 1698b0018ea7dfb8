"""Turn a `FaultSpec` into a `FaultPlan` for a topology, and run plans through transports.

Each fault family is planned by one module, named in `PLANNERS`: a new family is a module and a line.
"""
from __future__ import annotations

from typing import Callable

from fault_injectors import corruption, gpu, network, node, process, straggler
from fault_injectors.plan import FaultPlan, PlanError, Topology, run_commands
from wire.fault_spec import FaultFamily, FaultSpec, FaultSpecError
from fault_injectors.targets import resolve

Planner = Callable[[FaultSpec, Topology, tuple[int, ...], tuple[int, ...]], FaultPlan]
PLANNERS: dict[FaultFamily, Planner] = {
    FaultFamily.PROCESS: process.plan,
    FaultFamily.NODE: node.plan,
    FaultFamily.GPU: gpu.plan,
    FaultFamily.NETWORK: network.plan,
    FaultFamily.STRAGGLER: straggler.plan,
    FaultFamily.STATE: corruption.plan,
}


def make_plan(spec: FaultSpec, topo: Topology) -> FaultPlan:
    ranks, nodes = resolve(spec, topo)
    planner = PLANNERS.get(spec.kind.family)
    if planner is None:
        raise FaultSpecError(f"fault kind {spec.kind.value!r} is not available in this build")
    return planner(spec, topo, ranks, nodes)


__all__ = ["PLANNERS", "PlanError", "Planner", "make_plan", "run_commands"]

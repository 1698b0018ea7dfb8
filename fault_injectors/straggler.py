"""Straggler faults: slow-rank and slow-node, a rank (or every rank of a node) made `factor` times
slower for `duration` seconds.

Mechanism: a sleep inside the rank's step, through the in-step fault file (`process.in_step_command`;
the rank side is `recovery.faults.InStepFaults`). The rank measures its own step time before the
slowdown and then sleeps (factor - 1) times that at the start of every step. A sleep was chosen
over a CPU quota or a busy sibling process because it is deterministic (the factor is what was
asked, whatever else the host runs), needs no cgroup, root or free core, and works the same on
every backend (local, netns, SSH, Slurm) and on CPU and GPU hosts alike: a GPU rank that sleeps
before launching its work is as late to the collective as one whose device runs slow.

The fault text is `slow:<factor>:<seconds>`; the rank ends the slowdown by itself after the
seconds (so it ends even if the controller dies), and the revert (`slow:off`) ends it at once.
"""
from __future__ import annotations

from dataclasses import replace

from fault_injectors.deadman import duration_of
from fault_injectors.plan import FaultPlan, Topology
from fault_injectors.process import in_step_command
from wire.fault_spec import FaultFamily, FaultSpec, FaultSpecError, slow_factor

OFF = "slow:off"


def fault_text(spec: FaultSpec) -> str:
    """What the rank's fault file says (`recovery.faults.InStepFaults` reads it)."""
    return f"slow:{slow_factor(spec):g}:{duration_of(spec):g}"


def plan(spec: FaultSpec, topo: Topology, ranks: tuple[int, ...], nodes: tuple[int, ...]) -> FaultPlan:
    if spec.kind.family is not FaultFamily.STRAGGLER:
        raise FaultSpecError(f"{spec.kind.value!r} is not a straggler fault")
    if not ranks:  # slow-node: every rank the node runs now
        ranks = tuple(r.rank for n in nodes for r in topo.ranks_of(n))
    text = fault_text(spec)
    apply = tuple(in_step_command(topo, r, text) for r in ranks)
    # The rank may be gone by the revert (replaced, or the job ended): nothing is left to undo.
    revert = tuple(replace(in_step_command(topo, r, OFF), allow_fail=True) for r in ranks)
    return FaultPlan(spec, ranks, nodes, apply=apply, revert=revert)

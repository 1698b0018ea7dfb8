"""Node faults: kill-node (the agent and every worker of a node) and reboot-node.

reboot-node also wipes the node's snapshot memory, as a power cycle would; the controller brings
an empty agent back on the host afterwards.
"""
from __future__ import annotations

from fault_injectors.plan import FaultPlan, HostCommand, Topology
from fault_injectors.spec import FaultKind, FaultSpec
from runs.shm import node_prefix


def shm_prefix(shm_dir: str, run_id: str, node: int) -> str:
    """Name prefix of a node's snapshot slots in the run's shared-memory directory (the agent
    owns them)."""
    return f"{shm_dir.rstrip('/')}/{node_prefix(run_id, node)}"


def is_node_kill(cmd: HostCommand) -> bool:
    """Whether `cmd` is a node kill's first command (its agent and workers SIGKILLed): a backend
    that kills nodes its own way (a Slurm step cancel) recognises it by this."""
    return cmd.argv[:2] == ("kill", "-KILL") and cmd.allow_fail


def plan(spec: FaultSpec, topo: Topology, ranks: tuple[int, ...], nodes: tuple[int, ...]) -> FaultPlan:
    apply: list[HostCommand] = []
    for n in nodes:
        place = topo.node(n)
        pids = [str(place.agent_pid)] + [str(r.pid) for r in topo.ranks_of(n)]
        # The agent first: it must not see its workers die and report them as rank faults.
        apply.append(HostCommand(n, place.host, ("kill", "-KILL", *pids), place.netns, allow_fail=True))
        if spec.kind is FaultKind.REBOOT_NODE:
            apply.append(
                HostCommand(
                    n, place.host,
                    ("sh", "-c", 'rm -f -- "$1"*', "sh", shm_prefix(topo.fault_dir, topo.run_id, n)),
                    place.netns,
                )
            )
    return FaultPlan(spec, ranks, nodes, apply=tuple(apply))

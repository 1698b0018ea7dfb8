"""Node faults: kill-node (the agent and every worker of a node) and reboot-node.

reboot-node also wipes the node's snapshot memory, as a power cycle would; the controller brings
an empty agent back on the host afterwards. kill-node with drain=yes also drains the node in the
scheduler (``scontrol update ... state=drain``, Slurm backend only), with a reason that names ffctl,
the run and the fault, so that the launch's end and `ffctl inject revert --all` find it to resume.
"""
from __future__ import annotations

from fault_injectors.plan import FaultPlan, HostCommand, Role, Topology, pid_arg
from wire.fault_spec import FaultKind, FaultSpec
from runs.shm import node_prefix


def shm_prefix(shm_dir: str, run_id: str, node: int) -> str:
    """Name prefix of a node's snapshot slots in the run's shared-memory directory (the agent
    owns them)."""
    return f"{shm_dir.rstrip('/')}/{node_prefix(run_id, node)}"


DRAIN_REASON_PREFIX = "ffctl:"


def drain_reason(run_id: str, fault_id: str) -> str:
    """The reason a drained node carries: ``ffctl:<run>:<fault>`` (the sweep's mark)."""
    return f"{DRAIN_REASON_PREFIX}{run_id}:{fault_id}"


def drain_argv(host: str, reason: str) -> tuple[str, ...]:
    return ("scontrol", "update", f"nodename={host}", "state=drain", f"reason={reason}")


def resume_argv(host: str) -> tuple[str, ...]:
    return ("scontrol", "update", f"nodename={host}", "state=resume")


def is_node_drain(cmd: HostCommand) -> bool:
    """Whether `cmd` drains a node in the scheduler (run where the scheduler's client is)."""
    return cmd.role is Role.NODE_DRAIN


def is_node_kill(cmd: HostCommand) -> bool:
    """Whether `cmd` is a node kill's first command (its agent and workers SIGKILLed): a backend
    that kills nodes its own way (a Slurm step cancel) recognises it by this."""
    return cmd.role is Role.NODE_KILL


def plan(spec: FaultSpec, topo: Topology, ranks: tuple[int, ...], nodes: tuple[int, ...]) -> FaultPlan:
    apply: list[HostCommand] = []
    for n in nodes:
        place = topo.node(n)
        # A node is killed through its agent: one that is starting again (after an earlier node
        # fault) has no pid yet, and the fault is refused rather than sent to a process group.
        pids = [pid_arg(place.agent_pid, f"node {n}'s agent")] + [
            pid_arg(r.pid, f"rank {r.rank}") for r in topo.ranks_of(n)]
        # The agent first: it must not see its workers die and report them as rank faults.
        apply.append(HostCommand(n, place.host, ("kill", "-KILL", *pids), place.netns, allow_fail=True,
                                 role=Role.NODE_KILL))
        if spec.option("drain") == "yes":
            # After the kill: the node's steps are gone, and the scheduler gives it no new work.
            reason = drain_reason(topo.run_id, spec.fault_id or "f?")
            apply.append(HostCommand(n, place.host, drain_argv(place.host, reason), role=Role.NODE_DRAIN, about=reason))
        if spec.kind is FaultKind.REBOOT_NODE:
            apply.append(
                HostCommand(
                    n, place.host,
                    ("sh", "-c", 'rm -f -- "$1"*', "sh", shm_prefix(topo.fault_dir, topo.run_id, n)),
                    place.netns,
                )
            )
    return FaultPlan(spec, ranks, nodes, apply=tuple(apply))

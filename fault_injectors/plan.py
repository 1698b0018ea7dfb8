"""Pure fault plans: which commands run on which host to apply and to revert a fault.

A plan is data, computed from a `FaultSpec` and a `Topology` without touching anything, so
`--dry-run` prints exactly what `execute` would run.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from wire.fault_spec import FaultSpec, FaultSpecError
from fault_injectors.transport import CommandResult, Transport



def pid_arg(pid: int | None, what: str) -> str:
    """`pid` as `kill` takes it. 0 and the negative numbers are process groups, not processes
    (`kill -KILL 0` is the caller's own group, -1 every process it may signal): a fault against a
    process that has not reported its pid yet (an agent starting again) is refused, never turned
    into one of those."""
    if pid is None or pid <= 0:
        raise FaultSpecError(f"{what} has no process yet (pid {pid}): nothing to signal; it is starting")
    return str(pid)

@dataclass(frozen=True)
class RankPlace:
    rank: int
    node: int
    pid: int


@dataclass(frozen=True)
class NodePlace:
    node: int
    host: str  # name used to reach the host (hostfile entry, or "localhost")
    address: str  # address the node's ranks and agent listen on
    agent_pid: int
    netns: str | None = None  # local sandbox namespace of the node, if any
    interface: str | None = None  # the node's link to the others (veth in the sandbox)


@dataclass(frozen=True)
class Topology:
    """Where a run's pieces are, as the controller knows it when a fault is planned."""

    run_id: str
    nodes: tuple[NodePlace, ...]
    ranks: tuple[RankPlace, ...]
    controller_address: str = "127.0.0.1"
    store_port: int = 0
    ssh_port: int = 22
    # The run's private shared-memory directory on the hosts (`runs.shm.run_dir`): its slots,
    # and where a rank picks up an emulated in-step fault.
    fault_dir: str = "/dev/shm/ffctl-<run>-<key>"
    has_gpu: bool = False  # False: GPU faults run emulated inside the step
    # The run directory as the target hosts see it; dead man's switches record their reverts there.
    record_dir: str | None = None

    def node(self, node: int) -> NodePlace:
        for place in self.nodes:
            if place.node == node:
                return place
        raise KeyError(node)

    def rank(self, rank: int) -> RankPlace:
        for place in self.ranks:
            if place.rank == rank:
                return place
        raise KeyError(rank)

    def ranks_of(self, node: int) -> tuple[RankPlace, ...]:
        return tuple(r for r in self.ranks if r.node == node)


class Role(str, Enum):
    """The commands of a plan that something looks for."""

    NODE_KILL = "node-kill"  # a node's agent and workers SIGKILLed (a Slurm step is cancelled instead)
    NODE_DRAIN = "node-drain"  # the scheduler told to give the node no more work; `about`: the reason
    IN_STEP = "in-step"  # a fault file for the step hook of rank `about`
    DEADMAN = "deadman"  # a dead man's switch; `about` is its owner tag
    SWEEP = "sweep"  # a step of `ffctl inject revert --all`; `about` names it (fault_injectors.revert.Sweep)


@dataclass(frozen=True)
class HostCommand:
    node: int
    host: str
    argv: tuple[str, ...]
    netns: str | None = None
    allow_fail: bool = False  # e.g. killing a process that already exited
    # What the command is, for whoever looks for one in a plan (a backend that kills nodes its
    # own way, the injector cleaning up, a switch's cancel): never guessed from its argv.
    # `about` says which: the rank of an in-step command, the owner tag of a switch, a drain's
    # reason, the step of a sweep.
    role: Role | None = field(default=None, compare=False)
    about: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        prefix = f"ip netns exec {shlex.quote(self.netns)} " if self.netns else ""
        return f"[{self.host}] {prefix}{shlex.join(self.argv)}"


@dataclass(frozen=True)
class FaultPlan:
    """Apply and revert commands for one fault on resolved targets."""

    spec: FaultSpec
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    apply: tuple[HostCommand, ...]
    revert: tuple[HostCommand, ...] = ()
    emulated: bool = False
    # Installed on the target host before apply; reverts by itself after duration + grace.
    deadman: tuple[HostCommand, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def revertible(self) -> bool:
        return bool(self.revert)

    def describe(self) -> list[str]:
        lines = [f"# {self.spec.kind.value} on ranks {list(self.ranks)} nodes {list(self.nodes)}"]
        lines += [f"apply:  {c}" for c in self.apply]
        lines += [f"guard:  {c}" for c in self.deadman]
        lines += [f"revert: {c}" for c in self.revert]
        lines += [f"note:   {n}" for n in self.notes]
        return lines


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

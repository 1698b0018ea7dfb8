"""The node-backend protocol: the one seam between ffctl and how nodes run.

A backend starts a node's agent from its `AgentConfig` and says where each node is (host,
address, network namespace, interface), whether its hosts have a GPU, where the run's files
live on them, how far their clocks are from ours, how a fault's command reaches a host, what
node-local leftovers to sweep once the agents are gone, and what it leaves on the machines for
the record (`NodeBackend`: all the controller calls; the controller imports this module and never
a backend). The launch drives the rest of a backend's life (`LaunchBackend`): `prepare` the
nodes, `attach` the run record, `release` whatever was built, and say beforehand what `start`
will run (`agent_launch`), which is how `ffctl launch --dry-run` prints the very argv each
agent is started with: `start` runs the `AgentLaunch` that `agent_launch` returns, nothing else.

Backends (`ffctl.backends`, one module each): `local`, `netns`, `ssh`, `slurm`; the simulated
nodes of `ffctl.sim.nodes` implement `NodeBackend` too. A Kubernetes backend would be one more
module and one entry in `ffctl.backends.BACKENDS`. This module imports no backend.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from fault_injectors.plan import HostCommand
from fault_injectors.transport import Transport
from ffctl.agent.config import AgentConfig

if TYPE_CHECKING:
    from ffctl.launch_spec import LaunchSpec
    from runs.store import RunStore


class AgentProcess(Protocol):
    """The controller's handle on one started agent."""

    pid: int  # on the agent's host (0 where the backend cannot tell)

    def poll(self) -> int | None:
        """The agent's exit status, or None while it runs."""
        ...

    def stop(self, timeout: float) -> None:
        """End the agent (it shuts its workers down first), waiting at most about `timeout`
        before killing it; idempotent."""
        ...

    def running_here(self) -> bool:
        """Whether the agent is a process of the controller's own host and network (nothing
        between them that a fault can cut: no network namespace, no remote link) and runs now:
        alive and not stopped. A silent heartbeat is then the host's load, not a lost node
        (`ffctl.controller.watchdog`). False wherever the backend cannot tell."""
        ...


@dataclass(frozen=True)
class AgentLaunch:
    """What a backend runs to start one node's agent: the argv handed to its process start
    (`subprocess.Popen` here, a step's `srun`, an SSH transport's `start`) and where it runs.
    The dry run prints it; `start` runs it."""

    node: int
    argv: tuple[str, ...]
    where: str  # "on localhost", "over SSH on h1", "as a step (srun --overlap) on Slurm node n1"

    def describe(self) -> str:
        return f"`{shlex.join(self.argv)}` {self.where}"


class NodeBackend(Protocol):
    @property
    def run_dir(self) -> str | None:
        """Where this run's files (checkpoints, logs, dead man's switch records) live on the
        hosts; None: on this machine, inside the run record itself."""
        ...

    def start(self, cfg: AgentConfig) -> AgentProcess:
        """Start node `cfg.node`'s agent (again, after a node fault); raises InfraError when
        the node cannot take one."""
        ...

    def host(self, node: int) -> str:
        """The node's host name as faults and the record name it."""
        ...

    def address(self, node: int) -> str:
        """The address the node's agent and ranks listen on."""
        ...

    def netns(self, node: int) -> str | None:
        """The network namespace the node runs in on its host, if any."""
        ...

    def interface(self, node: int) -> str | None:
        """The network interface of `address` (gloo is pinned to it; link faults act on it)."""
        ...

    def has_gpu(self) -> bool:
        """Whether GPU faults act on a real device (else they run emulated, and say so)."""
        ...

    def spare_nodes(self) -> int:
        """How many idle hosts a lost node can come back on (a scheduler's spare nodes); 0 where
        a lost node can only come back on its own host."""
        ...

    def clock_offset(self, node: int) -> float | None:
        """The node's clock minus ours as measured before the run; None: not measured (the
        agent's own report is used)."""
        ...

    def transport_for(self, cmd: HostCommand) -> Transport:
        """How a fault's command reaches its host (its namespace included)."""
        ...

    def sweep(self, run_id: str, nodes: Sequence[int]) -> None:
        """After every agent has stopped: remove what the run may have left on the nodes'
        hosts that an agent killed with its node could not (its shared-memory names)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Fields for the run record's `run.json`: what this backend set up and leaves if the
        controller is killed (e.g. the sandbox's namespaces, the hosts' run directories)."""
        ...


class LaunchBackend(NodeBackend, Protocol):
    """A node backend as the launch drives it. Made by its factory (`ffctl.backends.BACKENDS`)
    from the launch spec alone, building and connecting nothing, so the dry run can ask it what
    it would run; `prepare` checks and builds what the nodes need (leaving nothing behind when it
    fails) and returns the address the controller's store listens on; `attach` is told the run
    record once it exists; `release` undoes `prepare` however the run ended (the record is None
    when it was never created)."""

    def agent_launch(self, node: int) -> AgentLaunch:
        """What the next `start` of `node`'s agent runs (before `prepare`: what the first will)."""
        ...

    def scheduled_hosts(self) -> list[str] | None:
        """The hosts a scheduler gave the nodes, known before `prepare`, which mount this run
        record's filesystem (the record is written there directly); None for nodes on this
        machine or reached over SSH."""
        ...

    def plan_notes(self, spec: LaunchSpec) -> list[str]:
        """What the dry run adds about how this backend carries the spec out (a scheduler's own
        way with a node fault); [] where there is nothing to add."""
        ...

    def admit(self, requeue_bound: int) -> None:
        """Before anything is built: a scheduler's job requeued more often than `requeue_bound`
        raises NoRequeue (exit 4: do not requeue); other backends admit every launch."""
        ...

    def prepare(self) -> str: ...

    def attach(self, record: RunStore) -> None: ...

    def release(self, record: RunStore | None) -> None: ...

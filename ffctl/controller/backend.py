"""What the controller needs from a node backend: the one seam between it and how nodes run.

A backend starts a node's agent from its `AgentConfig` and says where each node is (host,
address, network namespace, interface), whether its hosts have a GPU, where the run's files
live on them, how far their clocks are from ours, how a fault's command reaches a host, what
node-local leftovers to sweep once the agents are gone, and what it leaves on the machines for
the record. The controller calls exactly these and nothing else: it never imports a backend.

Backends today: local processes (`ffctl.launch.nodes.LocalNodes`), local processes inside network
namespaces (`ffctl.launch.sandbox.SandboxNodes`), SSH (`ffctl.hosts.ssh.nodes.SSHNodes`) and Slurm
job steps (`ffctl.launch.slurm.SlurmNodes`). A Kubernetes backend is one more module implementing
this protocol (plus the launch-side lifecycle of `ffctl.launch.plan.LaunchBackend`) and one entry
in the launch's map.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from fault_injectors.plan import HostCommand
from fault_injectors.transport import Transport
from ffctl.agent.config import AgentConfig


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

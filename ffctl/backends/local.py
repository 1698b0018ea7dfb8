"""The local node backend (`--backend local`): every node's agent a subprocess on this machine.

`LocalNodes` implements `ffctl.backends.protocol.LaunchBackend`. The netns sandbox
(`ffctl.backends.netns.SandboxNodes`) is the same backend with each node in its own namespace.
A `LocalAgent` is the controller's handle on one agent: its pid, whether it still runs, and its
stdin, held open for the agent's lifetime (the agent exits when it closes).

Agents are forked warm from the launch's host template (`ffctl.backends.host_template`) where it
can serve them, so that a node coming back after a fault does not import torch on the cores the
training ranks share with it; a `ForkedAgent` is the same handle on such an agent. Nodes in
network namespaces of their own (the sandbox) are started as fresh interpreters inside them.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Sequence

from fault_injectors.plan import HostCommand
from fault_injectors.transport import LocalTransport, Transport
from ffctl.agent.config import AgentConfig, agent_argv
from ffctl.agent.workerenv import worker_env
from ffctl.backends.children import running, stop_process
from ffctl.backends.host_template import ForkedAgent, HostTemplate, host_template_argv
from ffctl.backends.protocol import AgentLaunch
from ffctl.launch_spec import LaunchSpec
from runs import shm
from runs.store import RunStore

# "0": start every agent as a fresh interpreter, as before the host template (a check's baseline).
HOST_TEMPLATE_ENV = "FFCTL_HOST_TEMPLATE"


class LocalAgent:
    def __init__(self, proc: subprocess.Popen[bytes], log: IO[bytes], netns: str | None = None) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._log = log
        self._netns = netns

    def poll(self) -> int | None:
        return self.proc.poll()

    def running_here(self) -> bool:
        # In a network namespace of its own, a link between it and the controller can be cut
        # (link-down, a partition): its silence must stay a lost node.
        return self._netns is None and self.poll() is None and running(self.pid)

    def stop(self, timeout: float) -> None:
        stop_process(self.proc, timeout, log=self._log)


def local_agent_argv(netns: str | None = None) -> list[str]:
    """A local node's agent: this interpreter, inside the node's network namespace if it has one."""
    argv = agent_argv(sys.executable)
    return ["ip", "netns", "exec", netns, *argv] if netns else argv


class LocalNodes:
    """Every node is an agent process on this machine; `namespaces` maps nodes to network
    namespaces (the sandbox's)."""

    run_dir: str | None = None  # the run's files are in the record itself

    def __init__(self, log_dir: Path | None = None, addresses: dict[int, str] | None = None,
                 namespaces: dict[int, str] | None = None, interfaces: dict[int, str] | None = None,
                 controller_address: str = "127.0.0.1") -> None:
        self.log_dir = log_dir
        self._addresses = addresses or {}
        self._netns = namespaces or {}
        self._ifaces = interfaces or {}
        self.controller_address = controller_address
        # The run's shared-memory directory on this machine, held (its holder lock) from the
        # first agent's start to the sweep, so `revert --all` never takes it between agents.
        self._shm_dir: str | None = None
        self._shm_hold: int | None = None
        # Forks this machine's node agents warm (ffctl.agent.host_template), from the first
        # start to the sweep.
        self._template: HostTemplate | None = None

    @classmethod
    def for_launch(cls, spec: LaunchSpec, run_id: str) -> LocalNodes:
        return cls(controller_address=spec.address)

    # -- the launch's lifecycle -----------------------------------------------------------------
    def prepare(self) -> str:
        """Nothing to check or build on this machine: the store listens where the spec says."""
        return self.controller_address

    def attach(self, record: RunStore) -> None:
        self.log_dir = record.path / "logs"

    def release(self, record: RunStore | None) -> None:
        """Nothing to undo: the controller stopped the agents and swept their names (and ended
        the host template; ended here too if the launch never got that far)."""
        self._close_template()

    def _close_template(self) -> None:
        if self._template is not None:
            self._template.close()  # after the agents: it holds their stdins
            self._template = None

    def agent_launch(self, node: int) -> AgentLaunch:
        return AgentLaunch(node, tuple(local_agent_argv(self.netns(node))), "on localhost")

    def scheduled_hosts(self) -> list[str] | None:
        return None

    def plan_notes(self, spec: LaunchSpec) -> list[str]:
        if self._netns or not spec.worker_template or os.environ.get(HOST_TEMPLATE_ENV) == "0":
            return []
        return [f"each agent is forked from one host template (`{shlex.join(host_template_argv(sys.executable))}`, "
                "started once on localhost with the workers' environment), which imports torch once for every node: "
                "a node back after a fault starts warm instead of taking seconds of CPU from the ranks "
                f"({HOST_TEMPLATE_ENV}=0 starts each agent as shown)"]

    def admit(self, requeue_bound: int) -> None:
        """No scheduler requeues a local job."""

    # -- NodeBackend --------------------------------------------------------------------------
    def address(self, node: int) -> str:
        return self._addresses.get(node, "127.0.0.1")

    def host(self, node: int) -> str:
        return "localhost"

    def netns(self, node: int) -> str | None:
        return self._netns.get(node)

    def interface(self, node: int) -> str | None:
        return self._ifaces.get(node, "lo" if node not in self._netns else None)

    def has_gpu(self) -> bool:
        """Local nodes have this machine's devices: without one, GPU faults run emulated."""
        import torch

        return bool(torch.cuda.is_available())

    def clock_offset(self, node: int) -> float | None:
        return None  # one clock: the agents' reports say so themselves

    def spare_nodes(self) -> int:
        return 0  # a lost node comes back on this machine

    def transport_for(self, cmd: HostCommand) -> Transport:
        return LocalTransport(cmd.host, cmd.netns)

    def describe(self) -> dict[str, Any]:
        return {}

    def sweep(self, run_id: str, nodes: Sequence[int]) -> None:
        """Remove the run's shared-memory directory (slots, fault files, spares' FIFOs) unless a
        live process (an agent that did not stop) still holds one of its locks."""
        self._close_template()
        if self._shm_hold is not None:
            os.close(self._shm_hold)  # our own hold ends here
            self._shm_hold = None
        if self._shm_dir is not None and not shm.in_use(self._shm_dir):
            shm.remove_run_dir(Path(self._shm_dir))

    def _hold_shm(self, shm_dir: str) -> None:
        if self._shm_dir is not None:
            return
        self._shm_dir = shm_dir
        shm.ensure_private_dir(shm_dir)  # a bad one is refused here, before any agent
        self._shm_hold = shm.hold(shm.holder_path(shm_dir))

    def _host_template(self, cfg: AgentConfig) -> HostTemplate | None:
        """The launch's host template, started with the first node it can serve; None for a
        node it cannot: one in a network namespace of its own, one without a worker template,
        or one whose workers run another interpreter, directory or environment than it
        warmed up with (their libraries would load differently)."""
        if (self.netns(cfg.node) is not None or not cfg.template or cfg.standby or cfg.python != sys.executable
                or os.environ.get(HOST_TEMPLATE_ENV) == "0"):
            return None
        env = worker_env(os.environ, cfg.worker_env, cfg.keep_freed_memory)
        if self._template is None:
            assert self.log_dir is not None
            self._template = HostTemplate(sys.executable, env, cfg.cwd or None, self.log_dir / "host-template.log")
            self._template.start()
        template = self._template
        if (template.env, template.cwd) != (env, cfg.cwd or None):
            return None
        return template

    def start(self, cfg: AgentConfig) -> LocalAgent | ForkedAgent:
        if self.log_dir is None:
            raise RuntimeError("LocalNodes.start before attach(): no log directory")
        self._hold_shm(cfg.shm_dir)
        argv = list(self.agent_launch(cfg.node).argv)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        template = self._host_template(cfg)
        if template is not None:
            forked = template.start_agent(dict(os.environ), cfg.cwd, self.log_dir / f"agent-{cfg.node}.log",
                                          cfg.to_json())
            if forked is not None:
                return forked
        log = open(self.log_dir / f"agent-{cfg.node}.log", "ab")
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=log, stderr=log, cwd=cfg.cwd or None,
            # Own session: a Ctrl-C on the terminal reaches the controller only, which then
            # stops the agents in order instead of every rank dying at once.
            start_new_session=True, env=dict(os.environ),
        )
        assert proc.stdin is not None
        proc.stdin.write((cfg.to_json() + "\n").encode())
        proc.stdin.flush()
        return LocalAgent(proc, log, self.netns(cfg.node))

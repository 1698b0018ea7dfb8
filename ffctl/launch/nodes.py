"""Starting node agents: as local subprocesses (optionally inside a sandbox network namespace).

A `NodeProcess` is the controller's handle on one agent: its pid, whether it is still running,
and its stdin, which the controller holds open for the agent's lifetime (the agent exits when
it closes). Remote agents over SSH provide the same handle.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Protocol

from ffctl.agent.agent import AgentConfig


class NodeProcess(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def stop(self, timeout: float) -> None:
        """Close stdin (the agent shuts down), wait, then kill."""
        ...


class NodeLauncher(Protocol):
    def start(self, cfg: AgentConfig) -> NodeProcess: ...

    def address(self, node: int) -> str:
        """Address the node's agent and ranks listen on."""
        ...

    def host(self, node: int) -> str: ...

    def netns(self, node: int) -> str | None: ...

    def interface(self, node: int) -> str | None: ...


class LocalNodeProcess:
    def __init__(self, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._log = log

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout)
        self._log.close()


class LocalNodes:
    """Every node is an agent process on this machine; `netns` maps nodes to sandbox namespaces."""

    def __init__(self, log_dir: Path, addresses: dict[int, str] | None = None,
                 namespaces: dict[int, str] | None = None, interfaces: dict[int, str] | None = None) -> None:
        self.log_dir = log_dir
        self._addresses = addresses or {}
        self._netns = namespaces or {}
        self._ifaces = interfaces or {}

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

    def start(self, cfg: AgentConfig) -> LocalNodeProcess:
        argv = [sys.executable, "-m", "ffctl.agent"]
        ns = self.netns(cfg.node)
        if ns:
            argv = ["ip", "netns", "exec", ns, *argv]
        self.log_dir.mkdir(parents=True, exist_ok=True)
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
        return LocalNodeProcess(proc, log)

"""The simulated node backend: the controller's agent starts go to one simulated-agent process.

`SimNodes` implements the controller's `NodeBackend` (`ffctl.backends.protocol`) as every other
backend does, so the controller runs unchanged: `start(cfg)` hands the agent's configuration to
the `python -m ffctl.sim` process (started with the first agent) and returns a `SimAgent`
handle, whose `poll` and `stop` are answered by that process. Nodes are named `sim<N>` on
127.0.0.1; no fault command ever reaches one (the bench loses a node from inside the simulator).
The process's `killed`, `step` and `summary` lines are kept for the bench (`events`), each with
this process's CPU time at its arrival, so the controller's CPU can be set beside the
simulator's over the same stretch.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Sequence

from fault_injectors.plan import HostCommand
from fault_injectors.transport import Transport
from ffctl.agent.config import AgentConfig
from ffctl.backends.children import stop_process
from ffctl.exits import InfraError
from ffctl.sim.agents import SimSpec


class SimAgent:
    """The controller's handle on one simulated agent (one incarnation of a node's)."""

    def __init__(self, nodes: SimNodes, node: int, incarnation: int) -> None:
        self._nodes = nodes
        self.node = node
        self.incarnation = incarnation
        self.pid = nodes.pid

    def poll(self) -> int | None:
        return self._nodes.exit_code(self.node, self.incarnation)

    def running_here(self) -> bool:
        return False  # a simulated agent stands for one on a host of its own

    def stop(self, timeout: float) -> None:
        if self.poll() is not None:
            return
        self._nodes.send({"op": "stop", "node": self.node, "incarnation": self.incarnation})
        self._nodes.wait_exit(self.node, self.incarnation, timeout)


class SimNodes:
    """Every node a simulated agent in one `python -m ffctl.sim` process."""

    run_dir: str | None = None  # the run's files are in the record itself

    def __init__(self, spec: SimSpec, log: Path) -> None:
        self.spec = spec
        self.log_path = log
        self.proc: subprocess.Popen[str] | None = None
        self.pid = 0
        self._log: IO[str] | None = None
        self._cond = threading.Condition()
        self._exits: dict[tuple[int, int], int] = {}  # (node, incarnation) -> exit code
        self.events: list[dict[str, Any]] = []  # killed, step marks, summary; with our CPU time
        self._reader: threading.Thread | None = None

    # -- the simulator process ------------------------------------------------------------------
    def _ensure(self) -> subprocess.Popen[str]:
        if self.proc is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "a")
            self.proc = subprocess.Popen([sys.executable, "-m", "ffctl.sim", self.spec.to_json()],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                         bufsize=1, start_new_session=True)
            self.pid = self.proc.pid
            self._reader = threading.Thread(target=self._read, name="sim-reader", daemon=True)
            self._reader.start()
        return self.proc

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            ev["controller_cpu_s"] = time.process_time()
            ev["received"] = time.time()
            with self._cond:
                if ev.get("ev") == "exited":
                    self._exits[(int(ev["node"]), int(ev["incarnation"]))] = int(ev["code"])
                else:
                    self.events.append(ev)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def send(self, op: dict[str, Any]) -> None:
        proc = self._ensure()
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(op) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise InfraError(f"the simulated-agent process ended (see {self.log_path})") from None

    def exit_code(self, node: int, incarnation: int) -> int | None:
        with self._cond:
            code = self._exits.get((node, incarnation))
        if code is None and self.proc is not None and self.proc.poll() is not None:
            return self.proc.returncode or -1  # the whole simulator is gone
        return code

    def wait_exit(self, node: int, incarnation: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: (node, incarnation) in self._exits
                                or (self.proc is not None and self.proc.poll() is not None), timeout)

    def finish(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """End the simulator (its stdin closes) and return its summary."""
        if self.proc is None:
            return None
        stop_process(self.proc, timeout)
        if self._reader is not None:
            self._reader.join(timeout=timeout)
        if self._log is not None:
            self._log.close()
        return next((e for e in self.events if e.get("ev") == "summary"), None)

    # -- the controller's NodeBackend ---------------------------------------------------------------
    def start(self, cfg: AgentConfig) -> SimAgent:
        self.send({"op": "start", "cfg": cfg.to_json()})
        return SimAgent(self, cfg.node, cfg.incarnation)

    def host(self, node: int) -> str:
        return f"sim{node}"

    def address(self, node: int) -> str:
        return "127.0.0.1"

    def netns(self, node: int) -> str | None:
        return None

    def interface(self, node: int) -> str | None:
        return None

    def has_gpu(self) -> bool:
        return False

    def spare_nodes(self) -> int:
        return 0  # a lost node comes back as a new simulated agent of its own

    def clock_offset(self, node: int) -> float | None:
        return 0.0  # one machine, one clock

    def transport_for(self, cmd: HostCommand) -> Transport:
        raise InfraError(f"simulated node {cmd.host}: no fault command reaches a simulated node")

    def sweep(self, run_id: str, nodes: Sequence[int]) -> None:
        """Nothing to sweep: a simulated agent makes no shared memory."""

    def describe(self) -> dict[str, Any]:
        return {"backend": "sim", "simulated": {"steps": self.spec.steps, "step_s": self.spec.step_s}}

"""The node agents as the controller runs them: one per node, started through the node backend.

Each agent's configuration (what it runs as ranks, where it logs, its store and token), its
starts and restarts (each a new incarnation, with a queue of its own), the wait until agents are
up, the ring of replica holders wired between them, commands sent to each, the clock offsets
their own timestamps are converted with, and the topology faults are planned against.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Callable

from fault_injectors import NodePlace, RankPlace, Topology
from ffctl.agent.config import TERM_GRACE_S, AgentConfig
from ffctl.backends.protocol import NodeBackend
from ffctl.controller.cluster import FatalRun, RecoveryAbandoned
from ffctl.controller.decide import ring_holders
from ffctl.controller.plane import ControlPlane
from ffctl.controller.protection import Protection
from ffctl.controller.state import JobState, NodeState, Phase
from ffctl.controller.watchdog import AGENT_START_TIMEOUT
from ffctl.launch_spec import LaunchSpec
from wire import control, messages
from wire.jobenv import Strategy


# Pump the control plane until `cond()` holds or `timeout` passes (`Cluster.wait_for`).
WaitFor = Callable[..., bool]


class Fleet:
    def __init__(self, spec: LaunchSpec, job: JobState, launcher: NodeBackend, plane: ControlPlane,
                 wait_for: WaitFor, run_id: str, record_dir: Path, shm_dir: str, protection: Protection) -> None:
        self.spec = spec
        self.job = job
        self.launcher = launcher
        self.plane = plane
        self.wait_for = wait_for
        self.run_id = run_id
        self.record_dir = record_dir
        # The run's private shared-memory directory, the same name on every host (drawn by the
        # controller); it reaches the agents only in their own configuration.
        self.shm_dir = shm_dir
        self.clock_offsets: dict[int, float] = {}  # node -> its clock minus ours (seconds)
        self.wired: dict[int, tuple[int, tuple[tuple[str, int], ...]]] = {}  # node -> (incarnation, holders) last sent
        self.protection = protection

    def incarnation(self, node: int) -> int:
        st = self.job.nodes.get(node)
        return st.incarnation if st is not None else 0

    def config(self, node: int, incarnation: int) -> AgentConfig:
        spec = self.spec
        argv = tuple(spec.script) if spec.script else (
            "-m", "ffctl.workload.train", "--model", spec.model, "--steps", str(spec.steps),
            "--seed", str(spec.seed), "--optimizer", spec.optimizer, "--parallel", spec.parallel,
            "--batch", str(spec.batch))
        if not spec.script and spec.parallel == "hsdp":
            # The mesh is the job's layout, whatever node a replacement rank runs on later.
            argv += ("--shard-ranks", str(spec.nproc_per_node))
        # LOCAL_WORLD_SIZE (each rank gets its own too) lets the agent apply torchrun's
        # OMP_NUM_THREADS rule to the worker template, which loads OpenMP before any rank exists.
        env = {"GLOO_SOCKET_IFNAME": self.launcher.interface(node) or "lo",
               "LOCAL_WORLD_SIZE": str(spec.nproc_per_node), **dict(spec.extra_env)}
        return AgentConfig(
            run_id=self.run_id, node=node, nnodes=spec.nnodes, store_host=spec.address,
            store_port=self.plane.port, address=self.launcher.address(node), token=self.plane.token,
            log_dir=str((self.record_dir / "logs" / str(node)).absolute()), worker_argv=argv, worker_env=env,
            cwd=str(Path.cwd()), spares=spec.spares, incarnation=incarnation,
            shm_dir=self.shm_dir,
            keep_freed_memory=spec.keep_freed_memory, step_regex=spec.step_regex or "",
            snapshot_slots=spec.snapshot_slots,
            template=spec.worker_template,
            term_grace=float(dict(spec.torchrun).get("shutdown_timeout") or TERM_GRACE_S),
        )

    def send(self, node: int, msg: messages.Message) -> None:
        self.plane.send(control.agent_queue(node, self.incarnation(node)), msg)

    def start(self, node: int) -> None:
        st = self.job.nodes.get(node)
        incarnation = 0
        if st is not None:
            st.proc.stop(timeout=2.0)
            incarnation = st.incarnation + 1
        proc = self.launcher.start(self.config(node, incarnation))
        # The previous agent's last beat stays in the key until the new one beats: already read.
        self.job.nodes[node] = NodeState(node, proc, incarnation=incarnation,
                                         hb_raw=st.hb_raw if st is not None else None)

    def wait(self, nodes: list[int]) -> None:
        # An agent that said it was up and is lost again before the others are (its beats held
        # back on a loaded host, or killed) is started again by the recovery it interrupts, not
        # waited for until the timeout stops the job.
        def lost_again() -> set[int]:
            pending = self.job.pending
            return pending.nodes & set(nodes) if pending is not None else set()

        settled = lambda: all(self.job.nodes[n].up or self.job.nodes[n].failed for n in nodes)  # noqa: E731
        ok = self.wait_for(lambda: settled() or bool(lost_again()), AGENT_START_TIMEOUT, "agents starting",
                           abandon_on_failure=False)
        gone = lost_again()
        if gone and not settled():
            # An agent that gives up starting says why just before it exits, and its exit may be
            # seen first: a moment for its word, which names the cause (e.g. the node is busy).
            self.wait_for(lambda: all(self.job.nodes[n].failed for n in gone), 1.0, "agents starting",
                          abandon_on_failure=False)
        for n in nodes:  # one that gave up stops the job in its own words, lost or not
            if self.job.nodes[n].failed:
                raise FatalRun(f"node {n}: {self.job.nodes[n].failed}")
        if gone and not settled():
            if self.job.phase is not Phase.RECOVERING:  # the job's own start: nothing to go back to
                raise FatalRun(f"node(s) {sorted(gone)} lost while the agents started "
                               f"(see {self.record_dir / 'logs'})")
            raise RecoveryAbandoned("agents starting")
        if not ok:
            missing = [n for n in nodes if not self.job.nodes[n].up]
            raise FatalRun(f"agent of node(s) {missing} did not start within {AGENT_START_TIMEOUT:g}s "
                           f"(see {self.record_dir / 'logs'})")
        for n in nodes:
            self.job.nodes[n].hb_seen = time.monotonic()
        self.wire_ring()

    def wire_ring(self) -> None:
        live = sorted(n for n, st in self.job.nodes.items() if st.up)
        holders: dict[int, int | None] = {}
        memory = self.spec.recovery in (Strategy.PEER, Strategy.RESTART_MEMORY)
        for n in live:
            # The next --snapshot-copies nodes on the ring hold the node's copies.
            ring = ring_holders(n, live, self.spec.snapshot_copies) if memory else []
            holders[n] = ring[0] if ring else None
            peers = [p for p in (self.job.nodes[h].peer for h in ring) if p is not None]
            # Only to agents whose neighbours changed (or that are new): a node lost from a ring
            # of a thousand changes a few agents' neighbours, not a thousand.
            wired = (self.incarnation(n), tuple(peers))
            if self.wired.get(n) == wired:
                continue
            self.wired[n] = wired
            self.send(n, messages.Neighbor(holders=tuple(peers)))
        self.protection.wired(holders)

    def agent_time(self, node: int, t: float) -> float:
        """A timestamp taken on `node`'s clock, on the controller's clock."""
        return t - self.clock_offsets.get(node, 0.0)

    def host(self, node: int) -> str:
        host = self.launcher.host(node)
        # Local nodes (netns sandboxes too) run on this machine: name it as torchrun would.
        return socket.gethostname() if host == "localhost" else host

    def topology(self) -> Topology:
        nodes = tuple(
            NodePlace(n, self.launcher.host(n), self.launcher.address(n), st.pid,
                      self.launcher.netns(n), self.launcher.interface(n))
            for n, st in sorted(self.job.nodes.items())
        )
        ranks = tuple(RankPlace(r, self.job.members[r], pid) for r, pid in sorted(self.job.pids.items()) if pid)
        # GPU faults act on the device where the backend says the hosts have one, else emulated.
        return Topology(self.run_id, nodes, ranks, controller_address=self.spec.address,
                        store_port=self.plane.port, has_gpu=self.launcher.has_gpu(), fault_dir=self.shm_dir,
                        record_dir=self.launcher.run_dir or str(self.record_dir.absolute()))

    def stop(self) -> None:
        """Stop every agent (and with it its ranks), then sweep what one killed could not."""
        for n, st in self.job.nodes.items():
            try:
                if st.up and self.plane.store is not None:
                    self.send(n, messages.Stop())
            except Exception:
                pass
        for st in self.job.nodes.values():
            st.proc.stop(timeout=15.0)
        try:
            # Agents wipe their slots on the way out; one SIGKILLed with its node cannot.
            self.launcher.sweep(self.run_id, sorted(self.job.nodes))
        except Exception:
            pass

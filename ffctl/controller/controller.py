"""The controller: the `ffctl launch` process.

It hosts torch's TCPStore (the control plane), starts one agent per node, opens generations,
detects failures (a rank's exit, a lost node, a hang, an error raised in a step), hands each to
the recovery coordinator (`ffctl.controller.coordinator`) for the selected strategy, fires scheduled faults,
shows live progress and is the only writer of the run record.
"""
from __future__ import annotations

import datetime
import json
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from fault_injectors import NodePlace, RankPlace, Topology
from fault_injectors.plan import HostCommand
from ffctl.agent.config import TERM_GRACE_S, AgentConfig
from ffctl.controller.cluster import FatalRun, RecoveryAbandoned
from ffctl.controller.coordinator import RecoveryCoordinator
from ffctl.controller.failures import Cause, Failure, RankFailure, error_line
from ffctl.controller.state import JobState, NodeState, Phase
from ffctl.controller.decide import Decision, ring_holder
from ffctl.controller.injector import Injector
from ffctl.controller.script import uses_recovery_library
from ffctl.controller.stragglers import Finding, Replace, StragglerDetector, Straggling
from ffctl.spec import LIBRARY_MAX_RESTARTS, PLAIN_MAX_RESTARTS, LaunchSpec
from ffctl.controller.backend import NodeBackend
from ffctl.controller.progress import StepReport
from recovery import control, disk, messages
from recovery.jobenv import JobEnv, Strategy
from recovery.plan import Disk, GenerationPlan
from recovery.throttle import Throttle
from runs import shm
from runs.events import EventKind, RestoreSource, RunStatus
from runs.metrics import compute, run_strategy
from runs.store import RunStore, controller_identity

AGENT_START_TIMEOUT = 60.0
PHASE_TIMEOUT = 120.0
STARTUP_HANG_S = 120.0
STARTUP_HEARTBEAT_S = 10.0
# How often each node's heartbeat key is read (its agent beats every 0.2 s); with many nodes, at
# most one key per HEARTBEAT_READ_PER_NODE_S (0.2 s per key at 1,024 nodes: about 5,000 reads a
# second, a tenth of a core, where every 0.05 s would be 20,000 and more time than there is).
HEARTBEAT_READ_S = 0.05
HEARTBEAT_READ_PER_NODE_S = 0.0002
# Messages handled per batch, and the time a pump spends on batches before it reads heartbeats.
PUMP_BATCH = 64
PUMP_BUDGET_S = 0.05
# How often the keys the controller owns (the current generation and its plan) are checked, and
# written again if someone changed or deleted them.
GUARD_S = 0.1
# How long the control store may fail every call before the run is given up (a store error is
# recorded and the connection opened again; the server is this process, so it is not gone).
STORE_LOST_S = 60.0
# How long after some ranks finished (exit 0) the ones still running are named on screen.
EXIT_NOTICE_S = 5.0
# How long the exit barrier waits, once it stopped lingering ranks, for their exits (and logs).
EXIT_STOP_WAIT_S = 15.0


class Controller:
    def __init__(self, spec: LaunchSpec, record: RunStore, nodes: NodeBackend,
                 view: Callable[[dict[str, Any]], None] | None = None,
                 transport_for: Callable[[HostCommand], Any] | None = None) -> None:
        self.spec = spec
        self.rec = record
        self.launcher = nodes
        self.view = view or (lambda state: None)
        self.token = record.token()
        # The run's private shared-memory directory, the same name on every host: drawn here, so
        # nobody can make it first; it reaches the agents only in their own configuration.
        self.shm_dir = shm.new_run_dir(record.run_id)
        self.job = JobState.for_world(spec.world_size, spec.nproc_per_node)
        self.clock_offsets: dict[int, float] = {}  # node -> its clock minus ours (seconds)
        self.started = time.time()
        self.notice: str | None = None  # the newest line of `notices`
        self.notices: list[str] = []  # said on screen once each: a failed rank, a fallback, a fatal reason
        self.root_cause: dict[str, Any] | None = None  # the failure that stopped the job
        self.plain_script = not uses_recovery_library(spec.script)
        self.training_api: str | None = None  # what the ranks' library says (`training` message)
        # torchrun's default for an unchanged script is no restart; the library keeps ffctl's.
        self.max_restarts = spec.max_restarts if spec.max_restarts is not None else (
            PLAIN_MAX_RESTARTS if self.plain_script else LIBRARY_MAX_RESTARTS)
        self._incarnation: dict[int, int] = {}
        self._signals: list[int] = []  # received, to pass on to the ranks (`_forward_signals`)
        self._view_at = 0.0
        self.injector = Injector(self, self.job, transport_for or nodes.transport_for,
                                 scheduled=[s for s in spec.injects], chaos=spec.chaos, hang_min_s=spec.hang_min_s)
        self.store: dist.TCPStore | None = None  # what the controller calls the store through
        self._server: dist.TCPStore | None = None  # the store's server (this process hosts it)
        self._guarded: dict[str, bytes] = {}  # key -> the value the controller last wrote there
        self._guard_at = 0.0
        # Heartbeat reads (`_read_heartbeats`): reads earned and not made yet, when they were
        # last counted, and where on the ring of up nodes the next one is.
        self._hb_credit, self._hb_checked, self._hb_cursor = 0.0, 0.0, 0
        self._wired: dict[int, tuple[int, tuple[str, int] | None]] = {}  # node -> (incarnation, neighbour) last sent
        self._store_failing_since: float | None = None
        self._rdzv_stores: dict[int, dist.TCPStore] = {}  # gen -> an unchanged script's rendezvous store
        # The exit barrier: (gen, since when some of its ranks finished, whether that was said).
        self._exit_wait: tuple[int, float, bool] | None = None
        self._lingering: dict[int, list[str] | None] = {}  # rank stopped by the barrier -> its log's end
        self.inbox: control.Receiver | None = None
        # An unchanged script gets torchrun's restart: every worker stopped and the group started
        # again (it cannot take part in an in-place recovery), and no crash-loop guard: torchrun
        # restarts a failing group until --max-restarts is spent.
        strategy = spec.recovery
        if self.plain_script and strategy == Strategy.PEER:
            strategy = Strategy.RESTART_MEMORY
        self.coordinator = RecoveryCoordinator(self, self.job, strategy, self.max_restarts)
        self.coordinator.crash_loop_guard = not self.plain_script
        self.coordinator.script_restores_itself = self.plain_script
        self.job.progress.every_rank_reports = not self.plain_script
        self.stragglers = StragglerDetector(spec.world_size, spec.straggler_policy)

    # -- record & view ------------------------------------------------------------------------
    def record(self, kind: EventKind, /, t: float | None = None, **data: Any) -> None:
        self.rec.append(kind, t=t, **data)

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._view_at < 0.1:
            return
        self._view_at = now
        med = self.job.progress.median_step_s(last=20)
        self.view({
            "run_id": self.rec.run_id, "phase": self.job.phase.value, "gen": self.job.gen, "step": self.job.progress.committed_step,
            # --steps is the built-in GPT's length: a script's step is shown without a total.
            "steps": None if self.spec.script else self.spec.steps, "loss": self.job.progress.last_loss,
            "steps_per_s": (1.0 / med) if med else None,
            "fault": self.injector.describe_current(),
            "strategy": run_strategy(self.spec.recovery, self.plain_script),
            "notice": self.notice, "notices": tuple(self.notices),
        })

    def has_gpu(self) -> bool:
        return self.launcher.has_gpu()

    def spare_nodes(self) -> int:
        return self.launcher.spare_nodes()

    def announce(self, line: str) -> None:
        """Say `line` on screen once (the live view prints each notice as it comes)."""
        self.notices.append(line)
        self.notice = line
        self.show(force=True)

    # -- plumbing -----------------------------------------------------------------------------
    def _listen_store(self) -> dist.TCPStore:
        """A TCPStore server on a free port of the controller's address (and nowhere else)."""
        # Bind the listening socket ourselves: torch's TCPStore would listen on every interface.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.spec.address, 0))
        sock.listen(1024)
        try:
            store = dist.TCPStore(
                self.spec.address, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=30), master_listen_fd=sock.fileno(),
            )
        except BaseException:
            sock.close()
            raise
        # The store's server owns the descriptor now and closes it when the store goes; closing
        # it here as well could close whatever file has reused the number by then.
        sock.detach()
        return store

    def _rendezvous_store(self, gen: int) -> int:
        """The port of generation `gen`'s rendezvous store for an unchanged script (MASTER_PORT).

        torch's env:// rendezvous under an agent (TORCHELASTIC_USE_AGENT_STORE) keeps no prefix
        per restart, since torchrun's agent hosts a new store for every round: a group restarted
        on the old store would find the failed round's addresses and connect to dead peers. So
        each generation gets a store of its own, and the script's keys stay out of ffctl's
        control plane. Older generations' stores close once their ranks are gone (at the next
        generation's, the ranks of the one before have been stopped)."""
        store = self._rdzv_stores.get(gen)
        if store is None:
            for old in [g for g in self._rdzv_stores if g < gen - 1]:
                del self._rdzv_stores[old]  # its server closes with it
            store = self._rdzv_stores[gen] = self._listen_store()
        return int(store.port)

    def _start_store(self) -> None:
        self.store = self._server = self._listen_store()
        # Everything the store carries is sealed with the job token, which never travels in it.
        self.sealer = control.Sealer(self.token, "controller")
        self.limits = control.Limits(self.spec.world_size, self.spec.nnodes)
        self._rejects = Throttle(self.REJECTS_PER_S)
        # Heartbeats are opened apart from the queue: each channel's sequence only goes up.
        self._hb_opener = control.Opener(self.token)
        # Every rank and agent may be mid-send at once: only a longer run of unwritten indices
        # is a counter pushed forward by a stranger.
        gap = max(256, 4 * (self.spec.world_size + self.spec.nnodes))
        self.inbox = control.Receiver(self.store, control.CTL_QUEUE, opener=control.Opener(self.token),
                                      on_reject=self._rejected, max_gap=gap)
        # Who and where the controller is, so a report can tell a live run from one whose
        # controller was killed; and what the backend leaves if it is (a sandbox's namespaces).
        self.rec.update_run_info(controller={"address": self.spec.address, "port": self.store.port,
                                             **controller_identity()}, **self.launcher.describe())

    @property
    def port(self) -> int:
        assert self.store is not None
        return self.store.port

    def topology(self) -> Topology:
        nodes = tuple(
            NodePlace(n, self.launcher.host(n), self.launcher.address(n), st.pid,
                      self.launcher.netns(n), self.launcher.interface(n))
            for n, st in sorted(self.job.nodes.items())
        )
        ranks = tuple(RankPlace(r, self.job.members[r], pid) for r, pid in sorted(self.job.pids.items()) if pid)
        # GPU faults act on the device where the backend says the hosts have one, else emulated.
        return Topology(self.rec.run_id, nodes, ranks, controller_address=self.spec.address,
                        store_port=self.port, has_gpu=self.launcher.has_gpu(), fault_dir=self.shm_dir,
                        record_dir=self.launcher.run_dir or str(self.rec.path.absolute()))

    def _agent_config(self, node: int) -> AgentConfig:
        argv = tuple(self.spec.script) if self.spec.script else (
            "-m", "ffctl.workload.train", "--model", self.spec.model, "--steps", str(self.spec.steps),
            "--seed", str(self.spec.seed), "--optimizer", self.spec.optimizer, "--parallel", self.spec.parallel,
            "--batch", str(self.spec.batch))
        if not self.spec.script and self.spec.parallel == "hsdp":
            # The mesh is the job's layout, whatever node a replacement rank runs on later.
            argv += ("--shard-ranks", str(self.spec.nproc_per_node))
        # LOCAL_WORLD_SIZE (each rank gets its own too) lets the agent apply torchrun's
        # OMP_NUM_THREADS rule to the worker template, which loads OpenMP before any rank exists.
        env = {"GLOO_SOCKET_IFNAME": self.launcher.interface(node) or "lo",
               "LOCAL_WORLD_SIZE": str(self.spec.nproc_per_node), **dict(self.spec.extra_env)}
        return AgentConfig(
            run_id=self.rec.run_id, node=node, nnodes=self.spec.nnodes, store_host=self.spec.address,
            store_port=self.port, address=self.launcher.address(node), token=self.token,
            log_dir=str((self.rec.path / "logs" / str(node)).absolute()), worker_argv=argv, worker_env=env,
            cwd=str(Path.cwd()), spares=self.spec.spares, incarnation=self._incarnation.get(node, 0),
            shm_dir=self.shm_dir,
            keep_freed_memory=self.spec.keep_freed_memory, step_regex=self.spec.step_regex or "",
            # restart-disk stays what torchrun users have: every worker a fresh interpreter.
            template=self.spec.recovery != Strategy.RESTART_DISK,
            term_grace=float(dict(self.spec.torchrun).get("shutdown_timeout") or TERM_GRACE_S),
        )

    def _rank_env(self, rank: int, gen: int) -> dict[str, str]:
        node = self.job.members[rank]
        local = sorted(r for r, n in self.job.members.items() if n == node)
        memory = self.spec.recovery in (Strategy.PEER, Strategy.RESTART_MEMORY)
        env = JobEnv(
            rank=rank, world_size=self.spec.world_size, local_rank=local.index(rank),
            local_world_size=len(local), node=node, run_id=self.rec.run_id,
            store_host=self.spec.address, store_port=self.port, gen=gen, strategy=self.spec.recovery,
            ckpt_dir=self._ckpt_dir(), ckpt_every=self.spec.ckpt_every,
            replicate=memory and self.spec.nnodes > 1, pg_timeout=self.spec.pg_timeout,
            role=self.spec.role, max_restarts=self.max_restarts,
            master_port=self._rendezvous_store(gen) if self.plain_script else 0,
        )
        # No token: this travels through the store. The agent adds it where the rank starts.
        out = env.to_env()
        if dict(self.spec.torchrun).get("virtual_local_rank"):
            # torchrun's --virtual-local-rank: every worker is local rank 0 of the devices it sees.
            out["LOCAL_RANK"] = "0"
            if self.launcher.has_gpu():
                out["CUDA_VISIBLE_DEVICES"] = str(local.index(rank))
        return out

    def _ckpt_dir(self) -> str:
        # Remote hosts keep checkpoints in their own run dir, not in our record.
        remote = self.launcher.run_dir
        return f"{remote}/checkpoints" if remote else str(self.rec.path / "checkpoints")

    def agent_time(self, node: int, t: float) -> float:
        """A timestamp taken on `node`'s clock, on the controller's clock."""
        return t - self.clock_offsets.get(node, 0.0)

    def send(self, node: int, msg: messages.Message) -> None:
        assert self.store is not None
        blocked = control.send(self.store, control.agent_queue(node, self._incarnation.get(node, 0)), msg,
                               self.sealer)
        if blocked is not None:
            # The agent's queue counter was tampered with and its agent did not repair it: the
            # command is lost, and the phase waiting on it times out and says so.
            self._rejected(blocked.queue, -1, f"{msg.kind.value} not sent: {blocked.reason}", blocked.raw)

    def abort_generation(self, gen: int) -> None:
        assert self.store is not None
        # Sealed: ranks ignore (and report) an abort flag anyone else wrote.
        keys, values = control.abort_values(self.sealer, gen, self.spec.world_size)
        self.store.multi_set(keys, values)

    def attribute_faults(self, ranks: set[int], nodes: set[int]) -> list[str]:
        return self.injector.attribute(ranks, nodes)

    # How many refused messages a second are recorded one by one; beyond that they are counted,
    # so a flood of garbage cannot turn into a flood of fsync'd record lines.
    REJECTS_PER_S = 20

    def _rejected(self, queue: str, index: int, reason: str, raw: bytes | str, **who: Any) -> None:
        """A message that failed authentication or decoding: recorded (rate-limited) and dropped."""
        dropped = self._rejects.admit()
        if dropped is None:
            return
        raw_text = raw if isinstance(raw, str) else control.short_repr(raw)
        self.record(EventKind.MESSAGE_REJECTED, queue=queue, index=index, reason=reason, raw=raw_text,
                    **({"dropped_before": dropped} if dropped else {}), **who)

    # -- messages -----------------------------------------------------------------------------
    def _fail(self, failure: Failure) -> None:
        self.job.fail(failure)

    def pump(self) -> None:
        assert self.inbox is not None
        try:
            # Messages in batches, for at most PUMP_BUDGET_S: a burst of thousands (every rank's
            # abort and join at once) must not keep the heartbeats unread for a second, which
            # would count nodes that beat all along as lost.
            deadline = time.monotonic() + PUMP_BUDGET_S
            while True:
                batch = self.inbox.poll(max_items=PUMP_BATCH)
                for msg in batch:
                    self._handle(msg)
                if len(batch) < PUMP_BATCH or time.monotonic() > deadline:
                    break
            self._check_nodes()
            self._guard()
            self._store_failing_since = None
        except RuntimeError as exc:  # torch's store errors (DistError is one)
            self._store_failed(exc)
        if self._signals:
            self._forward_signals()
        # Faults end on time even while a recovery waits on them (a partition, a downed link).
        self.injector.revert_due()

    def _forward_signals(self) -> None:
        """Pass the signals the launch received (a scheduler's preemption notice) on to every
        live rank, on its node (`kill -SIG` through the backend, a Slurm step there), and record
        it: the script decides what a notice means (checkpoint, finish), as under the scheduler."""
        topo = self.topology()
        while self._signals:
            name = signal.Signals(self._signals.pop(0)).name
            for place in topo.nodes:
                pids = [str(r.pid) for r in topo.ranks_of(place.node)]
                if pids:
                    cmd = HostCommand(place.node, place.host, ("kill", f"-{name[3:]}", *pids), place.netns,
                                      allow_fail=True)
                    self.launcher.transport_for(cmd).run(cmd.argv, timeout=30.0)
            self.record(EventKind.SIGNAL_FORWARDED, signal=name, ranks=[r.rank for r in topo.ranks],
                        by="scheduler")

    def _store_failed(self, exc: RuntimeError) -> None:
        """A store call failed: recorded, then, after a short wait, a fresh connection to our own
        server. Only a store that fails every call for STORE_LOST_S ends the run (with a reason)."""
        now = time.monotonic()
        if self._store_failing_since is None:
            self._store_failing_since = now
        first = (str(exc).splitlines() or [""])[0][:200]
        self._rejected("store", -1, f"control store error: {type(exc).__name__}: {first}", b"")
        if now - self._store_failing_since > STORE_LOST_S:
            raise FatalRun(f"the control store failed every call for {STORE_LOST_S:g}s: {first}")
        time.sleep(0.05)
        assert self._server is not None and self.inbox is not None
        try:
            self.store = control.connect(self.spec.address, int(self._server.port), timeout=30.0)
        except RuntimeError:
            return  # tried again on the next failure
        self.inbox.store = self.store

    def _guard(self) -> None:
        """Write again what someone changed or deleted of the keys the controller owns (the
        current generation's pointer and plan): a rank joining later must find them."""
        now = time.monotonic()
        if now - self._guard_at < GUARD_S or self.store is None:
            return
        self._guard_at = now
        for key, value in self._guarded.items():
            raw = control.read(self.store, key)
            if raw != value:
                why = "deleted" if raw is None else "overwritten"
                self._rejected(key, -1, f"{key} {why} by someone else: written again", raw or b"")
                self.store.set(key, value)

    def _handle(self, raw: dict[str, Any]) -> None:
        # Every field is checked before any is used: a sealed message from one of our own
        # processes with a bad value is still refused, never a crash.
        try:
            msg = messages.decode(raw, self.limits)
        except messages.DecodeError as exc:
            self._rejected(control.CTL_QUEUE, -1, exc.reason, json.dumps(raw)[:200].encode())
            return
        self._dispatch(msg)

    def _dispatch(self, msg: messages.Message) -> None:
        handler = self.HANDLERS.get(msg.kind)  # type: ignore[call-overload]
        if handler is None:
            # A valid message nobody here acts on is recorded, never dropped unseen.
            self._rejected(control.CTL_QUEUE, -1, f"unhandled: no handler for {msg.kind.value!r}",
                           json.dumps(msg.to_dict())[:200].encode(), unhandled=True)
            return
        try:
            handler(self, msg)
        except (KeyError, ValueError, TypeError) as exc:
            self._rejected(control.CTL_QUEUE, -1, f"{msg.kind.value}: {type(exc).__name__}: {exc}"[:200],
                           json.dumps(msg.to_dict())[:200].encode())

    # -- message handlers: one per kind, each given its decoded message -------------------------
    def _on_step(self, msg: messages.Step) -> None:
        rep = StepReport(msg.gen, msg.step, msg.rank, None if msg.loss is None else float(msg.loss), float(msg.dt))
        if rep.gen == self.job.gen:
            self.job.last_progress = time.monotonic()
        if self.job.progress.report(rep):
            self.record(EventKind.STEP, t=time.time(), step=rep.step, loss=rep.loss,
                        step_time_s=rep.dt, gen=rep.gen, rank=rep.rank)
        for finding in self.stragglers.report(msg.gen, msg.step, msg.rank, float(msg.dt),
                                              None if msg.wait is None else float(msg.wait), time.time()):
            self._on_straggler(finding)

    def _on_straggler(self, f: Finding) -> None:
        """Record what the straggler detector found; under `--straggler replace`, fail the rank."""
        node = self.job.members.get(f.rank)
        if isinstance(f, Replace):
            self.announce(f"rank {f.rank} is {f.factor:.1f}x slower than the others: replaced (--straggler replace)")
            self._fail(Failure(Cause.STRAGGLER, {f.rank}, t=time.time(),
                               detail=f"rank {f.rank} {f.factor:.1f}x slower than the median at step {f.step}"))
            return
        ids = self.injector.explain_straggler(f.rank, f.onset_t)
        if isinstance(f, Straggling):
            self.announce(f"straggler: rank {f.rank} (node {node}) is {f.factor:.1f}x slower since step {f.onset_step}")
            self.record(EventKind.STRAGGLER_DETECTED, rank=f.rank, node=node, gen=f.gen, factor=f.factor,
                        onset_step=f.onset_step, onset_t=f.onset_t, step=f.step,
                        policy=str(self.spec.straggler_policy), fault_ids=ids)
        else:
            self.record(EventKind.STRAGGLER_ENDED, rank=f.rank, node=node, factor=f.factor, onset_step=f.onset_step,
                        last_step=f.last_step, steps=f.steps, onset_t=f.onset_t, end_t=f.end_t, lost_s=f.lost_s,
                        fault_ids=ids)

    def _on_agent_failed(self, msg: messages.AgentFailed) -> None:
        self.job.nodes[msg.node].failed = msg.reason

    def _on_agent_up(self, msg: messages.AgentUp) -> None:
        now = time.time()
        st = self.job.nodes[msg.node]
        st.pid, st.peer, st.up = msg.pid, (msg.peer_address, int(msg.peer_port)), True  # type: ignore[arg-type]
        # Events stay stamped on receipt with our clock; the offset is what converts the
        # agent's own stamps. Measured NTP-style before the start (SSH hosts) when we can,
        # else estimated from this message (its latency counts as offset).
        measured = self.launcher.clock_offset(st.node)
        offset = float(measured) if measured is not None else float(msg.time) - now
        self.clock_offsets[st.node] = offset
        self.record(EventKind.AGENT_STARTED, t=now, node=st.node, host=msg.host, pid=st.pid,
                    clock_offset_s=offset, clock_offset_source="ntp" if measured is not None else "receipt",
                    agent_up_at=self.agent_time(st.node, float(msg.time)))
        st.hb_seen = time.monotonic()
        if self.job.phase != "starting":
            self.wire_ring()  # a node came back: it holds replicas again

    def _on_spares(self, msg: messages.Spares) -> None:
        st = self.job.nodes[msg.node]
        st.spares_total = msg.count if msg.total is None else msg.total
        if msg.count != st.spares or bool(msg.template) != st.template:
            # Whether the node's worker template is warm is on record too: a template that died
            # and was restarted shows as a gap, during which replacements start cold.
            st.spares, st.template = msg.count, bool(msg.template)
            self.record(EventKind.SPARES_HELD, t=time.time(), node=st.node, count=st.spares,
                        template=st.template)

    def _on_spawned(self, msg: messages.Spawned) -> None:
        for r, pid in msg.pids.items():
            self.job.pids[int(r)] = pid
        self.job.gen_msgs.setdefault(("spawned", msg.gen), set()).update(int(r) for r in msg.pids)
        for r, how in (msg.how or {}).items():
            self.job.started_by[(msg.gen, int(r))] = (how, (msg.start_s or {}).get(r))

    def _on_step_error(self, msg: messages.StepError) -> None:
        now = time.time()
        trace = _lines(msg.traceback)
        self.record(EventKind.RANK_EXITED, t=now, node=msg.node, rank=msg.rank, error=msg.error,
                    gen=msg.gen, reason="error-in-step", step=msg.step, traceback=trace)
        if self.job.pids.get(msg.rank):
            rf = RankFailure(msg.rank, msg.node, self._host(msg.node), now, step=msg.step,
                             step_exact=msg.step is not None, pid=self.job.pids.get(msg.rank),
                             error=msg.error or "", tail=trace)
            self.job.rank_failed[rf.rank] = rf
            self._fail(Failure("step-error", {rf.rank}, t=now, detail=str(msg.error),
                               rank_failures={rf.rank: rf}))

    def _on_generation_report(self, msg: messages.Started | messages.Joined | messages.Done
                              | messages.AbortSeen) -> None:
        # Keyed by the kind's value: an enum member does not hash as its string does.
        self.job.gen_msgs.setdefault((msg.kind.value, msg.gen), set()).add(msg.rank)

    def _on_restored(self, msg: messages.Restored) -> None:
        self.job.gen_msgs.setdefault(("restored", msg.gen), set()).add(msg.rank)
        if msg.how:
            self.job.restore_how.setdefault(msg.gen, {})[msg.rank] = msg.how

    def _on_aborted(self, msg: messages.Aborted) -> None:
        self.job.gen_msgs.setdefault(("aborted", msg.gen), set()).add(msg.rank)

    def _on_restore_failed(self, msg: messages.RestoreFailed) -> None:
        self.job.gen_msgs.setdefault(("restore_failed", msg.gen), set()).add(msg.rank)
        # That copy is never offered again: the next decision picks another or disk.
        self.job.bad_sources.add((msg.rank, msg.step, msg.source))
        self._fail(Failure("restore-failed", {msg.rank}, t=time.time(), detail=str(msg.reason)))

    def _on_ckpt(self, msg: messages.Ckpt) -> None:
        got = self.job.ckpt_reports.setdefault(msg.step, set())
        got.add(msg.rank)
        if len(got) == self.spec.world_size:
            if self.launcher.run_dir is None:  # remote checkpoints: hosts' dirs
                disk.mark_complete(self.rec.path / "checkpoints", msg.step)
            self.job.disk_step = max(self.job.disk_step or 0, msg.step)
            self.record(EventKind.SNAPSHOT_TAKEN, t=time.time(), step=msg.step, kind="disk", ranks=sorted(got))

    def _on_replicated(self, msg: messages.Replicated) -> None:
        # Every agent says this about once a second: written without an fsync of its own (the
        # next event's covers it), else a thousand nodes cost a thousand fsyncs a second.
        self.rec.append(EventKind.SNAPSHOT_TAKEN, t=time.time(), sync=False, step=msg.step, kind="memory",
                        node=msg.node, ranks=msg.ranks)

    def _on_inventory(self, msg: messages.Inventory) -> None:
        self.job.inventories[(msg.node, msg.req)] = msg

    def _on_agent_error(self, msg: messages.AgentError) -> None:
        # A command the agent accepted and could not carry out.
        self.record(EventKind.MESSAGE_REJECTED, t=time.time(), queue="agent", index=-1, node=msg.node,
                    reason=msg.error[:500], raw="")

    def _on_refusal(self, msg: messages.Refusal) -> None:
        # An agent or rank refused something it read (its queue, a plan, an abort flag).
        self._rejected(msg.where[:200], -1 if msg.index is None else msg.index, msg.reason[:500],
                       (msg.raw or "")[:200], reported_by_node=msg.node,
                       **({"reported_by_rank": msg.rank} if msg.rank is not None else {}),
                       **({"unreported_before": msg.unreported} if msg.unreported else {}))

    def _on_training(self, msg: messages.Training) -> None:
        self.training_api = msg.api

    def _on_heartbeat(self, msg: messages.Heartbeat) -> None:
        # From the node's key (`_read_heartbeat`) or, while that key is written over, the queue;
        # sealed either way, and news only when newer than the last from its agent process.
        st = self.job.nodes[msg.node]
        current = self._incarnation.get(msg.node, 0)
        if msg.incarnation > current:
            raise ValueError(f"heartbeat of agent incarnation {msg.incarnation}, node {msg.node} runs {current}")
        if msg.incarnation == current and st.up:
            st.hb_seen = time.monotonic()
        # (An older incarnation's beat is what the node's previous agent left in its key: no news.)

    def training_path(self) -> str:
        """Which path the run took, for the record: "built-in", "ddp", "fsdp" or "library" (a
        script on the recovery library, by what its ranks said) or "script" (an unchanged script)."""
        if not self.spec.script:
            return "built-in"
        if self.training_api is None:
            return "script"
        return self.training_api if self.training_api in ("ddp", "fsdp") else "library"

    def _on_rank_exited(self, msg: messages.RankExited) -> None:
        now = time.time()
        rank, pid, code = msg.rank, msg.pid, msg.exitcode
        tail = _lines(msg.log_tail)
        self.record(EventKind.RANK_EXITED, t=now, node=msg.node, rank=rank, pid=pid, exitcode=code,
                    gen=msg.gen, expected=bool(msg.expected), **({"log_tail": tail} if tail else {}),
                    **({"error_file": msg.error} if msg.error else {}))
        if rank in self._lingering and msg.expected:
            self._lingering[rank] = tail  # stopped by the exit barrier: what it was doing
        if self.job.pids.get(rank) != pid:
            return  # a process of an earlier generation, already replaced
        self.job.pids[rank] = None
        if msg.expected or rank in self.job.gen_msgs.get(("done", self.job.gen), set()):
            return
        if code == 0 and (self.plain_script or not self._ever_announced(rank)):
            # A script without the recovery library has no other way to say it finished; and a
            # rank that ends cleanly without ever announcing itself (the library's `started`)
            # ran no library, whatever its source looked like.
            self.job.gen_msgs.setdefault(("done", msg.gen), set()).add(rank)
            return
        node = msg.node
        rf = self.job.rank_failed.get(rank)
        if rf is not None and rf.pid == pid and rf.exitcode is None:
            rf.exitcode = code  # the end of the exception it reported: keep its traceback
            rf.tail = rf.tail or tail
        else:
            host = msg.host if msg.host is not None else self._host(node)
            rf = RankFailure(rank, node, host[:255], now, step=self._failing_step(rank), pid=pid,
                             exitcode=code, error=(msg.error or error_line(tail))[:500], tail=tail)
            self.job.rank_failed[rank] = rf
        self._fail(Failure("process-exit", {rank}, t=now, detail=f"exit code {code}", rank_failures={rank: rf}))

    # Every kind of report has its handler (a unit test holds this table to `messages.Kind`).
    HANDLERS: dict[messages.Kind, Callable[[Controller, Any], None]] = {
        messages.Kind.STEP: _on_step,
        messages.Kind.STARTED: _on_generation_report,
        messages.Kind.JOINED: _on_generation_report,
        messages.Kind.RESTORED: _on_restored,
        messages.Kind.DONE: _on_generation_report,
        messages.Kind.ABORT_SEEN: _on_generation_report,
        messages.Kind.ABORTED: _on_aborted,
        messages.Kind.RESTORE_FAILED: _on_restore_failed,
        messages.Kind.ERROR: _on_step_error,
        messages.Kind.CKPT: _on_ckpt,
        messages.Kind.AGENT_FAILED: _on_agent_failed,
        messages.Kind.AGENT_UP: _on_agent_up,
        messages.Kind.AGENT_ERROR: _on_agent_error,
        messages.Kind.SPARES: _on_spares,
        messages.Kind.SPAWNED: _on_spawned,
        messages.Kind.RANK_EXITED: _on_rank_exited,
        messages.Kind.REPLICATED: _on_replicated,
        messages.Kind.INVENTORY: _on_inventory,
        messages.Kind.INJECT_REQUEST: lambda self, msg: self._adhoc_inject(msg),
        messages.Kind.REJECTED: _on_refusal,
        messages.Kind.TRAINING: _on_training,
        messages.Kind.HEARTBEAT: _on_heartbeat,
    }

    def _ever_announced(self, rank: int) -> bool:
        """Whether the rank has spoken the library's protocol in any generation."""
        return any(rank in ranks for (kind, _), ranks in self.job.gen_msgs.items() if kind in ("started", "joined"))

    def _failing_step(self, rank: int) -> int | None:
        """The step a rank that exited was most likely in: the one after its newest commit in this
        generation (or after the restore step). Unknown for a script that reports no steps."""
        if self.plain_script:
            return None
        return max(self.job.progress.restore_step, self.job.progress.everywhere([rank])) + 1

    def _host(self, node: int) -> str:
        host = self.launcher.host(node)
        # Local nodes (netns sandboxes too) run on this machine: name it as torchrun would.
        return socket.gethostname() if host == "localhost" else host

    def _check_nodes(self) -> None:
        assert self.store is not None
        now = time.monotonic()
        self._read_heartbeats(now)
        for n, st in self.job.nodes.items():
            if not st.up:
                continue
            if st.proc.poll() is not None:
                st.up = False
                self.record(EventKind.NODE_LOST, node=n, reason="agent-exit")
                self._fail(Failure(Cause.NODE_LOST, nodes={n}, since_what="agent-exit"))
                continue
            if now - st.hb_seen > self._heartbeat_limit():
                st.up = False
                self.record(EventKind.NODE_LOST, node=n, reason="heartbeat")
                # It began with the silence: the last genuine beat is the failure's onset.
                self._fail(Failure(Cause.NODE_LOST, nodes={n}, since=_wall(st.hb_seen),
                                   since_what="last-heartbeat"))

    def _read_heartbeats(self, now: float) -> None:
        """Read the up nodes' heartbeat keys, each once per period, round the ring a share per
        pump: the reads are spread evenly, so a thousand nodes' keys never hold up the messages
        for tens of milliseconds at a time."""
        up = [st for st in self.job.nodes.values() if st.up]
        if not up:
            return
        period = max(HEARTBEAT_READ_S, HEARTBEAT_READ_PER_NODE_S * len(up))
        self._hb_credit = min(float(len(up)), self._hb_credit + len(up) * (now - self._hb_checked) / period)
        self._hb_checked = now
        reads = int(self._hb_credit)
        self._hb_credit -= reads
        for i in range(reads):
            st = up[(self._hb_cursor + i) % len(up)]
            st.hb_read_at = now
            self._read_heartbeat(st)
        self._hb_cursor = (self._hb_cursor + reads) % len(up)

    def _read_heartbeat(self, st: NodeState) -> None:
        """Take the node's heartbeat key: a sealed beat of its current agent, newer than the last
        one, is a sign of life; anything else there is refused and recorded (once per value)."""
        assert self.store is not None
        key = control.heartbeat_key(st.node)
        raw = control.read(self.store, key)
        if raw is None or raw == st.hb_raw:
            return  # no beat yet, or none since the last read (a deleted key: its agent says so)
        st.hb_raw = raw
        try:
            beat = messages.Heartbeat.from_dict(self._hb_opener.open(raw, key), self.limits)
            if beat.node != st.node:
                raise messages.DecodeError(f"heartbeat of node {beat.node} under {key}")
            self._on_heartbeat(beat)
        except (control.Rejected, messages.DecodeError) as exc:
            self._rejected(key, -1, exc.reason, raw)
        except (KeyError, ValueError) as exc:
            self._rejected(key, -1, str(exc)[:200], raw)

    def _heartbeat_limit(self) -> float:
        # While the job starts, every host imports torch in several processes at once and an
        # agent can be starved of CPU for more than a second; a node lost then costs nothing to
        # wait for, so allow a longer silence until the first step is committed.
        if self.job.gen == 0 and not self.job.progress.started(0):
            return max(self.spec.heartbeat_timeout, STARTUP_HEARTBEAT_S)
        return self.spec.heartbeat_timeout

    def _check_hang(self) -> None:
        if self.job.phase is not Phase.RUNNING or self.job.pending is not None or self.plain_script:
            return  # (a plain script reports no steps: no progress to judge)
        if not self.job.progress.started():
            limit = STARTUP_HANG_S
        else:
            limit = self.job.progress.hang_limit(self.spec.hang_min_s)
        if time.monotonic() - self.job.last_progress > limit:
            self._fail(Failure(Cause.HANG, detail=f"no step progress for {limit:.1f}s",
                               since=_wall(self.job.last_progress), since_what="last-progress"))

    def _adhoc_inject(self, msg: messages.InjectRequest) -> None:
        from fault_injectors.spec import FaultSpecError, parse_spec

        assert self.store is not None
        try:
            spec = parse_spec(msg.spec)
            if msg.dry_run:
                reply = {"ok": True, "plan": self.injector.plan(spec).describe()}
            else:
                fault, err = self.injector.inject(spec, raise_refused=True)
                reply = {"ok": err is None, "error": err, "fault_id": fault.fault_id if fault else None}
        except FaultSpecError as exc:
            reply = {"ok": False, "error": str(exc), "bad_input": True}
        key = f"inject/reply/{msg.req}"  # req is checked alphanumeric (messages.InjectRequest)
        self.store.set(key, self.sealer.seal(key, {"type": "inject_reply", **reply}))

    # -- waiting ------------------------------------------------------------------------------
    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str, abandon_on_failure: bool = True) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            self.pump()
            if abandon_on_failure and self.job.pending is not None:
                raise RecoveryAbandoned(what)
            if time.monotonic() > deadline:
                return False
            self.show()
            time.sleep(0.005)
        return True

    # -- lifecycle ----------------------------------------------------------------------------
    def start_agent(self, node: int) -> None:
        st = self.job.nodes.get(node)
        if st is not None:
            st.proc.stop(timeout=2.0)
            self._incarnation[node] = self._incarnation.get(node, 0) + 1
        proc = self.launcher.start(self._agent_config(node))
        # The previous agent's last beat stays in the key until the new one beats: already read.
        self.job.nodes[node] = NodeState(node, proc, hb_raw=st.hb_raw if st is not None else None)

    def wait_agents(self, nodes: list[int]) -> None:
        settled = lambda: all(self.job.nodes[n].up or self.job.nodes[n].failed for n in nodes)  # noqa: E731
        ok = self.wait_for(settled, AGENT_START_TIMEOUT, "agents starting", abandon_on_failure=False)
        for n in nodes:
            if self.job.nodes[n].failed:
                raise FatalRun(f"node {n}: {self.job.nodes[n].failed}")
        if not ok:
            missing = [n for n in nodes if not self.job.nodes[n].up]
            raise FatalRun(f"agent of node(s) {missing} did not start within {AGENT_START_TIMEOUT:g}s "
                           f"(see {self.rec.path / 'logs'})")
        for n in nodes:
            self.job.nodes[n].hb_seen = time.monotonic()
        self.wire_ring()

    def wire_ring(self) -> None:
        live = sorted(n for n, st in self.job.nodes.items() if st.up)
        for n in live:
            holder = ring_holder(n, live) if self.spec.recovery in (Strategy.PEER, Strategy.RESTART_MEMORY) else None
            peer = self.job.nodes[holder].peer if holder is not None else None
            # Only to agents whose neighbour changed (or that are new): a node lost from a ring
            # of a thousand changes one agent's neighbour, not a thousand.
            wired = (self._incarnation.get(n, 0), peer)
            if self._wired.get(n) == wired:
                continue
            self._wired[n] = wired
            self.send(n, messages.Neighbor(address=peer[0] if peer else None, port=peer[1] if peer else None))

    def _spawn(self, gen: int, ranks: list[int]) -> None:
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.job.members[r], []).append(r)
        for node, rs in by_node.items():
            self.send(node, messages.Spawn(gen=gen, ranks=[{"rank": r, "env": self._rank_env(r, gen)} for r in rs]))

    def open_generation(self, gen: int, decision: Decision | None, respawn: list[int]) -> None:
        assert self.store is not None
        plan = decision.plan if decision else GenerationPlan.fresh(gen, self.spec.world_size, self.spec.recovery)
        self.job.gen = gen
        self.job.progress.open(gen, plan.restore_step)
        self._guarded = control.publish_plan(self.store, gen, plan, self.sealer)
        self._spawn(gen, respawn)

    def await_generation(self, gen: int, respawn: list[int], restore_step: int, source: RestoreSource) -> None:
        world = set(self.job.members)
        # Spawned means started and ready to join (torch imported), not merely forked. A plain
        # script says nothing: its process being up is all there is.
        said = "spawned" if self.plain_script else "started"
        # (A rank that already ended cleanly without a word ran no library: it is done, see
        # _on_rank_exited, and nothing more is to be waited for from it.)
        done = lambda: self.job.gen_msgs.get(("done", gen), set())  # noqa: E731
        spawned = lambda: set(respawn) <= self.job.gen_msgs.get((said, gen), set()) | done()  # noqa: E731
        if not self.wait_for(spawned, PHASE_TIMEOUT, "spawn"):
            raise FatalRun(f"ranks {sorted(respawn)} were not spawned within {PHASE_TIMEOUT:g}s")
        # How each started (a warm spare, a fork of the template, a fresh interpreter) and how
        # long its agent took to start it.
        started = {str(r): self.job.started_by.get((gen, r), (None, None)) for r in respawn}
        self.record(EventKind.RANKS_SPAWNED, gen=gen, ranks=sorted(respawn),
                    pids={str(r): self.job.pids.get(r) for r in respawn},
                    started_by={r: how for r, (how, _) in started.items() if how},
                    start_s={r: s for r, (_, s) in started.items() if s is not None})
        if self.plain_script or world <= done():
            self.job.last_progress = time.monotonic()
            return  # its rendezvous is torch's own (MASTER_ADDR), unseen here
        joined = lambda: world <= self.job.gen_msgs.get(("joined", gen), set())  # noqa: E731
        if not self.wait_for(joined, PHASE_TIMEOUT, "rendezvous"):
            self._fail(Failure(Cause.RENDEZVOUS_TIMEOUT, world - self.job.gen_msgs.get(("joined", gen), set())))
            raise RecoveryAbandoned("rendezvous")
        self.record(EventKind.RENDEZVOUS_DONE, gen=gen)
        if restore_step > 0:
            restored = lambda: world <= self.job.gen_msgs.get(("restored", gen), set())  # noqa: E731
            if not self.wait_for(restored, PHASE_TIMEOUT, "restore"):
                self._fail(Failure(Cause.RESTORE_TIMEOUT))
                raise RecoveryAbandoned("restore")
            how = self.job.restore_how.get(gen, {})
            # Which ranks kept their live state, received it from one that did, or gathered it.
            self.record(EventKind.RESTORE_DONE, gen=gen, step=restore_step, source=source,
                        transfer={k: sorted(r for r, h in how.items() if h == k) for k in sorted(set(how.values()))})
        self.job.last_progress = time.monotonic()

    def _resumed(self) -> Decision | None:
        """Generation 0 of a launch that resumes an earlier run (a requeued Slurm job): the
        launch put that run's newest complete disk checkpoint in this record, and every rank
        restores it; None: a fresh start (a plain script restores itself, from its own files)."""
        steps = disk.complete_steps(self.rec.path / "checkpoints")
        if not steps or self.plain_script:
            return None
        self.job.disk_step = steps[-1]
        plan = GenerationPlan(gen=0, world_size=self.spec.world_size, strategy=Strategy(self.spec.recovery),
                              restore_step=steps[-1], sources={r: Disk() for r in sorted(self.job.members)})
        return Decision(plan, RestoreSource.DISK)

    def run(self) -> RunStatus:
        status, reason = RunStatus.FAILED, ""
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        # A scheduler's preemption notice (sbatch --signal=B:USR2@90) goes on to the ranks.
        forwarded = {s: signal.signal(s, lambda signum, _: self._signals.append(signum)) for s in FORWARDED_SIGNALS}
        try:
            self._start_store()
            self.record(EventKind.RUN_STARTED, world_size=self.spec.world_size, strategy=self.spec.recovery,
                        nnodes=self.spec.nnodes, nproc_per_node=self.spec.nproc_per_node,
                        steps=self.spec.steps, seed=self.spec.seed, model=self.spec.model,
                        script=list(self.spec.script), spares=self.spec.spares, ckpt_every=self.spec.ckpt_every,
                        max_restarts=self.max_restarts, plain_script=self.plain_script,
                        role=self.spec.role, torchrun=dict(self.spec.torchrun))
            for n in range(self.spec.nnodes):
                self.start_agent(n)
            self.wait_agents(list(range(self.spec.nnodes)))
            first = self._resumed()
            self.open_generation(0, first, sorted(self.job.members))
            self.job.enter(Phase.RUNNING)
            try:
                self.await_generation(0, sorted(self.job.members), first.restore_step if first else 0,
                                      first.restore_source if first else RestoreSource.NONE)
            except RecoveryAbandoned:
                pass  # a rank failed while starting: the loop recovers it
            self.job.last_progress = time.monotonic()
            status = self._loop()
        except KeyboardInterrupt:
            status, reason = RunStatus.INTERRUPTED, "interrupted"
        except FatalRun as exc:
            status, reason = RunStatus.FAILED, exc.reason
            self.root_cause = exc.root_cause or self.root_cause
        except Exception as exc:  # recorded, then re-raised: the record must say how it ended
            status, reason = RunStatus.FAILED, f"controller error: {type(exc).__name__}: {exc}"
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            for s, handler in forwarded.items():
                signal.signal(s, handler)
            self.job.enter(Phase(status.value))
            self.show(force=True)
            for finding in self.stragglers.close():  # a slowdown still under way at the end
                self._on_straggler(finding)
            self._teardown()
            self.record(EventKind.RUN_FINISHED, status=status.value, steps_completed=self.job.progress.committed_step,
                        reason=reason, path=self.training_path(), api=self.training_api,
                        **({"root_cause": self.root_cause} if status is RunStatus.FAILED and self.root_cause else {}))
            self.rec.close()  # the events still waiting for a full disk first, if it takes them now
            try:
                self.rec.write_json("report.json", compute(self.rec.run_id, self.rec.events()).to_dict())
            except OSError as exc:
                # A full runs disk ends nothing: `ffctl report` computes the same from the events.
                print(f"ffctl: report.json not written ({exc.strerror or exc}); `ffctl report "
                      f"{self.rec.run_id}` computes it from the record", file=sys.stderr)
        return status

    def _loop(self) -> RunStatus:
        world = set(self.job.members)
        while True:
            self.pump()
            self._check_hang()
            self.injector.tick(time.time() - self.started)  # (a step trigger waits for every rank)
            if self.job.pending is not None:
                self.job.enter(Phase.RECOVERING)
                self.coordinator.recover()
                self.job.enter(Phase.RUNNING)
            for n, due in list(self.job.deferred_restarts.items()):
                if time.monotonic() >= due:
                    del self.job.deferred_restarts[n]
                    self.start_agent(n)
            if world <= self.job.gen_msgs.get(("done", self.job.gen), set()):
                return RunStatus.COMPLETED
            self._check_exit_barrier(world)
            self.show()
            time.sleep(0.005)

    def _check_exit_barrier(self, world: set[int]) -> None:
        """Some ranks of the generation finished (exit 0) while others still run: say so after
        a few seconds, and once they have lingered `exit_barrier_timeout` seconds stop them and
        fail the run naming them, with the end of their logs. A job never waits forever for a
        rank whose peers have nothing left to do with it."""
        done = self.job.gen_msgs.get(("done", self.job.gen), set())
        if not done or world <= done or self.job.pending is not None:
            self._exit_wait = None
            return
        now = time.monotonic()
        if self._exit_wait is None or self._exit_wait[0] != self.job.gen:
            self._exit_wait = (self.job.gen, now, False)
        gen, since, said = self._exit_wait
        waited, limit = now - since, self.spec.exit_barrier_timeout
        left, finished = sorted(world - done), sorted(done)
        if not said and waited >= min(EXIT_NOTICE_S, limit):
            self._exit_wait = (gen, since, True)
            self.record(EventKind.EXIT_BARRIER, gen=gen, ranks=left, finished=finished, waited_s=round(waited, 3),
                        timeout_s=limit)
            self.announce(f"{_rank_list(left)} still running {waited:.0f}s after {_rank_list(finished)} "
                          f"finished: stopped at {limit:g}s (--exit-barrier-timeout)")
        if waited < limit:
            return
        self._lingering = {r: None for r in left}
        by_node: dict[int, list[int]] = {}
        for r in left:
            by_node.setdefault(self.job.members[r], []).append(r)
        for node, ranks in by_node.items():
            if self.job.nodes[node].up:
                self.send(node, messages.Kill(ranks=ranks, tail=True))
        self.wait_for(lambda: all(self._lingering[r] is not None for r in left), EXIT_STOP_WAIT_S,
                      "exit barrier", abandon_on_failure=False)
        rank = left[0]
        tail = self._lingering.get(rank) or []
        last = next((line for line in reversed(tail) if line.strip()), "")
        node = self.job.members[rank]
        error = (f"still running {waited:.0f}s after {_rank_list(finished)} exited 0; stopped by the exit "
                 f"barrier (--exit-barrier-timeout {limit:g})")
        summary = f"rank {rank} (node {node}): {error}; its last line: {last!r}"
        cause = {"cause": "exit-barrier", "t": time.time(), "rank": rank, "node": node, "host": self._host(node),
                 "ranks": left, "finished": finished, "lingered_s": round(waited, 3), "last_line": last,
                 "error": error, "summary": summary, "tail": tail[-20:],
                 "others": [f"rank {r} (node {self.job.members[r]}) still running too" for r in left[1:]]}
        raise FatalRun(f"exit barrier: {_rank_list(left)} still running {waited:.0f}s after the others finished",
                       root_cause=cause)

    def _teardown(self) -> None:
        try:
            self.injector.revert_all()
        except Exception:
            pass
        for n, st in self.job.nodes.items():
            try:
                if st.up and self.store is not None:
                    self.send(n, messages.Stop())
            except Exception:
                pass
        for st in self.job.nodes.values():
            st.proc.stop(timeout=15.0)
        try:
            # Agents wipe their slots on the way out; one SIGKILLed with its node cannot.
            self.launcher.sweep(self.rec.run_id, sorted(self.job.nodes))
        except Exception:
            pass
        self._rdzv_stores.clear()
        self.store = self._server = None  # its server closes the listening socket


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _wall(monotonic_t: float) -> float:
    """A `time.monotonic()` reading as wall-clock time (the record's clock)."""
    return time.time() - (time.monotonic() - monotonic_t)


def _lines(value: Any, limit: int = 50) -> list[str]:
    """A list of text lines from a message field, bounded; anything else gives none."""
    if not isinstance(value, list):
        return []
    return [line[:500] for line in value[-limit:] if isinstance(line, str)]


# Signals passed on to the ranks: those a scheduler sends as a notice (Slurm's --signal).
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt

"""The controller: the `ffctl launch` process.

It hosts torch's TCPStore (the control plane), starts one agent per node, opens generations,
detects failures (a rank's exit, a lost node, a hang, an error raised in a step), hands each to
the recovery coordinator (`ffctl.controller.coordinator`) for the selected strategy, fires
scheduled faults, shows live progress and is the only writer of the run record.

`Controller` is a composition, and the `Cluster` the coordinator and the fault scheduler act
through. Its pieces take the shared `JobState`, a recorder and the few narrow things each needs,
never the controller: the control plane (`plane`), the node agents (`fleet`), the message
inbox (`inbox`), the detectors (`watchdog`: lost nodes and hangs; `barrier`: ranks lingering
after the others finished), the generation lifecycle (`generations`). What is left here is the
run itself: start, the loop that pumps messages and runs the detectors, recovery and faults,
the live view, and the end.
"""
from __future__ import annotations

import signal
import sys
import time
from typing import Any, Callable

from fault_injectors import Topology
from fault_injectors.plan import HostCommand
from ffctl.backends.protocol import NodeBackend
from ffctl.controller.barrier import ExitBarrier
from ffctl.controller.cluster import FatalRun, RecoveryAbandoned
from ffctl.controller.coordinator import RecoveryCoordinator, RecoveryOutcome
from ffctl.controller.decide import Decision
from ffctl.controller.fleet import Fleet
from ffctl.controller.generations import Generations
from ffctl.controller.inbox import Inbox
from ffctl.controller.injector import Injector
from ffctl.controller.plane import ControlPlane
from ffctl.controller.protection import Protection
from ffctl.controller.script import steps_seen, uses_recovery_library
from ffctl.controller.state import JobState, Phase, Report
from ffctl.controller.stragglers import StragglerDetector
from ffctl.controller.watchdog import Watchdog
from ffctl.launch_spec import LIBRARY_MAX_RESTARTS, PLAIN_MAX_RESTARTS, LaunchSpec
from wire import messages
from wire.jobenv import Strategy
from runs import shm
from runs.events import EventKind, RestoreSource, RunStatus
from runs.metrics import compute, run_strategy
from runs.store import RunStore, controller_identity

# Messages handled per batch, and the time a pump spends on batches before it reads heartbeats.
PUMP_BATCH = 64
PUMP_BUDGET_S = 0.05
# Signals passed on to the ranks: those a scheduler sends as a notice (Slurm's --signal).
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


class Controller:
    def __init__(self, spec: LaunchSpec, record: RunStore, nodes: NodeBackend,
                 view: Callable[[dict[str, Any]], None] | None = None,
                 transport_for: Callable[[HostCommand], Any] | None = None) -> None:
        self.spec = spec
        self.rec = record
        self.launcher = nodes
        self.view = view or (lambda state: None)
        self.job = JobState.for_world(spec.world_size, spec.nproc_per_node)
        self.started = time.time()
        self.notice: str | None = None  # the newest line of `notices`
        self.notices: list[str] = []  # said on screen once each: a failed rank, a fallback, a fatal reason
        self.root_cause: dict[str, Any] | None = None  # the failure that stopped the job
        self.recoveries: list[RecoveryOutcome] = []  # what each completed recovery did, in order
        self.plain_script = not uses_recovery_library(spec.script)
        self.steps_unknown = not steps_seen(spec.script, spec.step_regex)  # no step will ever be seen
        # torchrun's default for an unchanged script is no restart; the library keeps ffctl's.
        self.max_restarts = spec.max_restarts if spec.max_restarts is not None else (
            PLAIN_MAX_RESTARTS if self.plain_script else LIBRARY_MAX_RESTARTS)
        self._signals: list[int] = []  # received, to pass on to the ranks (`_forward_signals`)
        self._view_at = 0.0
        self.plane = ControlPlane(spec.address, record.token(), spec.world_size, spec.nnodes, self.record)
        # The run's private shared-memory directory, the same name on every host: drawn here, so
        # nobody can make it first; it reaches the agents only in their own configuration.
        in_memory = spec.recovery in (Strategy.PEER, Strategy.RESTART_MEMORY) and spec.nnodes > 1
        self.fleet = Fleet(spec, self.job, nodes, self.plane, self.wait_for, record.run_id, record.path,
                           shm.new_run_dir(record.run_id), Protection(self.job, self.record, in_memory))
        self.injector = Injector(self, self.job, transport_for or nodes.transport_for,
                                 scheduled=[s for s in spec.injects], chaos=spec.chaos, hang_min_s=spec.hang_min_s)
        self.stragglers = StragglerDetector(spec.world_size, spec.straggler_policy)
        self.watchdog = Watchdog(self.job, self.plane, self.record, spec.heartbeat_timeout, spec.hang_min_s,
                                 self.plain_script, spec.last_step)
        self.barrier = ExitBarrier(self.job, spec.exit_barrier_timeout, self.record, self.announce,
                                   self.fleet.send, self.wait_for, self.fleet.host,
                                   spec.silence_timeout if spec.script else None)
        self.inbox = Inbox(self.job, self.record, self.plane, self.fleet, self.watchdog, self.barrier, self.injector,
                           self.stragglers, self.announce,
                           checkpoints=None if nodes.run_dir is not None else record.path / "checkpoints",
                           plain_script=self.plain_script, straggler_policy=spec.straggler_policy)
        self.generations = Generations(spec, self.job, nodes, self.plane, self.fleet.send, self.wait_for,
                                       self.record, record.run_id, record.path, self.plain_script, self.max_restarts)
        # An unchanged script gets torchrun's restart: every worker stopped and the group started
        # again (it cannot take part in an in-place recovery), restoring nothing itself, and no
        # crash-loop guard: torchrun restarts a failing group until --max-restarts is spent.
        strategy = spec.recovery
        if self.plain_script and strategy == Strategy.PEER:
            strategy = Strategy.RESTART_MEMORY
        self.coordinator = RecoveryCoordinator(self, self.job, strategy, self.max_restarts,
                                               crash_loop_guard=not self.plain_script,
                                               script_restores_itself=self.plain_script,
                                               start_over_before_checkpoint=spec.ckpt_every > 0,
                                               verify_restore=spec.verify_restore and not self.plain_script)
        self.job.progress.every_rank_reports = not self.plain_script
        self.job.progress.verify = spec.verify_restore and not self.plain_script

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
            "steps": self.spec.last_step, "loss": self.job.progress.last_loss,
            "steps_per_s": (1.0 / med) if med else None,
            "fault": self.injector.describe_current(),
            "strategy": run_strategy(self.spec.recovery, self.plain_script),
            "notice": self.notice, "notices": tuple(self.notices), "recoveries": len(self.recoveries),
        })

    def announce(self, line: str) -> None:
        """Say `line` on screen once (the live view prints each notice as it comes)."""
        self.notices.append(line)
        self.notice = line
        self.show(force=True)

    def training_path(self) -> str:
        """Which path the run took, for the record: "built-in", "ddp", "fsdp" or "library" (a
        script on the recovery library, by what its ranks said) or "script" (an unchanged script)."""
        if not self.spec.script:
            return "built-in"
        api = self.inbox.training_api
        if api is None:
            return "script"
        return api if api in ("ddp", "fsdp") else "library"

    # -- the Cluster the coordinator and the fault scheduler act through ----------------------
    def has_gpu(self) -> bool:
        return self.launcher.has_gpu()

    def spare_nodes(self) -> int:
        return self.launcher.spare_nodes()

    @property
    def port(self) -> int:
        return self.plane.port

    def topology(self) -> Topology:
        return self.fleet.topology()

    def send(self, node: int, msg: messages.Message) -> None:
        self.fleet.send(node, msg)

    def abort_generation(self, gen: int) -> None:
        self.plane.abort(gen)

    def attribute_faults(self, ranks: set[int], nodes: set[int]) -> list[str]:
        return self.injector.attribute(ranks, nodes)

    def faults_on(self, nodes: set[int]) -> list[str]:
        return self.injector.attribute(set(), nodes, strict=True)

    def wire_ring(self) -> None:
        self.fleet.wire_ring()

    def start_agent(self, node: int) -> None:
        self.fleet.start(node)

    def wait_agents(self, nodes: list[int]) -> None:
        self.fleet.wait(nodes)

    def spawn_ahead(self, gen: int, ranks: list[int]) -> None:
        self.generations.spawn(gen, ranks)

    def open_generation(self, gen: int, decision: Decision | None, respawn: list[int],
                        ahead: frozenset[int] = frozenset()) -> None:
        self.generations.open(gen, decision, respawn, ahead)

    def await_generation(self, gen: int, respawn: list[int], restore_step: int, source: RestoreSource) -> None:
        self.generations.await_running(gen, respawn, restore_step, source)

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

    # -- the control plane's pump -------------------------------------------------------------
    def pump(self) -> None:
        assert self.plane.inbox is not None
        try:
            # Messages in batches, for at most PUMP_BUDGET_S: a burst of thousands (every rank's
            # abort and join at once) must not keep the heartbeats unread for a second, which
            # would count nodes that beat all along as lost.
            deadline = time.monotonic() + PUMP_BUDGET_S
            while True:
                batch = self.plane.inbox.poll(max_items=PUMP_BATCH)
                for msg in batch:
                    self.inbox.handle(msg)
                if len(batch) < PUMP_BATCH or time.monotonic() > deadline:
                    break
            self.watchdog.check_nodes()
            self.plane.guard()
            self.plane.ok()
        except RuntimeError as exc:  # torch's store errors (DistError is one)
            self.plane.failed(exc)
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

    # -- the run ------------------------------------------------------------------------------
    def _start(self) -> None:
        self.plane.start()
        # Who and where the controller is, so a report can tell a live run from one whose
        # controller was killed; and what the backend leaves if it is (a sandbox's namespaces).
        self.rec.update_run_info(controller={"address": self.spec.address, "port": self.plane.port,
                                             **controller_identity()}, **self.launcher.describe())
        spec = self.spec
        self.record(EventKind.RUN_STARTED, world_size=spec.world_size, strategy=spec.recovery,
                    nnodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
                    steps=spec.steps, seed=spec.seed, model=spec.model,
                    script=list(spec.script), spares=spec.spares, ckpt_every=spec.ckpt_every,
                    max_restarts=self.max_restarts, plain_script=self.plain_script,
                    role=spec.role, torchrun=dict(spec.torchrun), verify_restore=spec.verify_restore,
                    snapshot_copies=spec.snapshot_copies)
        if spec.verify_restore and self.plain_script:
            self.announce("--verify-restore: the script does not use the recovery library; it restores itself "
                          "after a restart, and nothing is replayed or checked")
        for n in range(spec.nnodes):
            self.start_agent(n)
        self.wait_agents(list(range(spec.nnodes)))
        first = self.generations.resumed()
        self.open_generation(0, first, sorted(self.job.members))
        self.job.enter(Phase.RUNNING)
        try:
            self.await_generation(0, sorted(self.job.members), first.restore_step if first else 0,
                                  first.restore_source if first else RestoreSource.NONE)
        except RecoveryAbandoned:
            pass  # a rank failed while starting: the loop recovers it
        self.job.last_progress = time.monotonic()

    def run(self) -> RunStatus:
        status, reason = RunStatus.FAILED, ""
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        # A scheduler's preemption notice (sbatch --signal=B:USR2@90) goes on to the ranks.
        forwarded = {s: signal.signal(s, lambda signum, _: self._signals.append(signum)) for s in FORWARDED_SIGNALS}
        try:
            self._start()
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
                self.inbox.straggler(finding)
            self._teardown()
            self.injector.record_missed(self.steps_unknown, self.injector.since_training(self.plain_script))
            cause: dict[str, Any] = {"root_cause": self.root_cause} if status is RunStatus.FAILED and self.root_cause else {}
            self.record(EventKind.RUN_FINISHED, status=status.value, steps_completed=self.job.progress.committed_step,
                        reason=reason, path=self.training_path(), api=self.inbox.training_api, **cause)
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
            if self.inbox.restore_check.diverged is not None:  # a --verify-restore replay differed
                raise FatalRun(*self.inbox.restore_check.diverged)
            self.watchdog.check_hang()
            # t= counts from the first step; a step trigger waits for every rank
            self.injector.tick(self.injector.since_training(self.plain_script))
            if self.job.pending is not None:
                self.job.enter(Phase.RECOVERING)
                self.recoveries.append(self.coordinator.recover())
                self.job.enter(Phase.RUNNING)
            for n, due in list(self.job.deferred_restarts.items()):
                if time.monotonic() >= due:
                    del self.job.deferred_restarts[n]
                    self.start_agent(n)
            if world <= self.job.reported(Report.DONE, self.job.gen):
                return RunStatus.COMPLETED
            self.barrier.check(world)
            self.show()
            time.sleep(0.005)

    def _teardown(self) -> None:
        try:
            self.injector.revert_all()
        except Exception:
            pass
        self.fleet.stop()
        self.plane.close()


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt

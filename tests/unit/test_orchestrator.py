"""The orchestrator in-process: the recovery coordinator and the fault scheduler driven through a
fake cluster that plays the agents and ranks (abort acknowledgements, inventories, exits, node
restarts, generations that start or fail) and records what was sent, recorded and said.

No process, no store, no socket: each case runs in milliseconds and asserts on the messages sent,
the events recorded and the outcome returned (or the reason the job stopped)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import pytest

from fault_injectors import parse_spec
from fault_injectors.plan import NodePlace, RankPlace, Topology
from fault_injectors.transport import CommandResult
from ffctl.controller.cluster import FatalRun, RecoveryAbandoned
from ffctl.controller.coordinator import (
    ABORT_ACK_TIMEOUT, ABORT_SEEN_TIMEOUT, RecoveryCoordinator, RecoveryOutcome,
)
from ffctl.controller.decide import Decision
from ffctl.controller.failures import Cause, Failure, RankFailure
from ffctl.controller.injector import Injector
from ffctl.controller.progress import StepReport
from ffctl.controller.state import JobState, NodeState, Phase, Report
from wire import messages
from wire.jobenv import Strategy
from runs.events import EventKind, RestoreSource

NNODES, PER_NODE = 2, 2  # ranks 0, 1 on node 0; ranks 2, 3 on node 1


class FakeProc:
    pid = 1

    def poll(self) -> int | None:
        return None

    def running_here(self) -> bool:
        return False

    def stop(self, timeout: float) -> None:
        pass


class FakeCluster:
    """Plays the agents and ranks. `hooks[what]` run when the coordinator waits for `what`
    (`abort`, `inventory`, `teardown`, ...) and `on_await[gen]` while generation `gen` starts:
    that is where a test makes something else fail."""

    def __init__(self, job: JobState) -> None:
        self.job = job
        self.gpu = False
        self.spare_hosts = 0  # spare nodes the backend holds
        self.sent: list[tuple[int, messages.Message]] = []
        self.events: list[tuple[EventKind, dict[str, Any]]] = []
        self.notices: list[str] = []
        self.aborted: list[int] = []
        self.started_agents: list[int] = []
        self.waited_agents: list[int] = []
        self.opened: list[tuple[int, Decision | None, list[int]]] = []
        self.opened_ahead: list[frozenset[int]] = []  # each opened generation's ranks started ahead
        self.spawned_ahead: list[tuple[int, list[int]]] = []
        self.hooks: dict[str, list[Callable[[], None]]] = {}
        self.on_await: dict[int, Callable[[], None]] = {}
        self.blame: list[list[str]] = []  # fault ids for each failure, in order
        self.stuck: set[int] = set()  # ranks that never acknowledge an abort
        self.spawns_kept: set[int] = set()  # held spawns an agent keeps starting whatever it is told
        # Ranks deep in a step: their watcher says abort_seen at once, their training thread
        # acknowledges only during the coordinator's second wait.
        self.busy: set[int] = set()
        self.busy_acks = True
        self.waits: list[tuple[str, float]] = []
        self._abort_waits = 0
        # node -> what its agent holds: (own ranks' steps, neighbour's ranks' steps)
        self.held: dict[int, tuple[dict[int, set[int]], dict[int, set[int]]]] = {}

    # -- Cluster --------------------------------------------------------------------------
    def record(self, kind: EventKind, /, t: float | None = None, **data: Any) -> None:
        self.events.append((kind, data))

    def has_gpu(self) -> bool:
        return self.gpu

    def spare_nodes(self) -> int:
        return self.spare_hosts

    def announce(self, line: str) -> None:
        self.notices.append(line)

    def send(self, node: int, msg: messages.Message) -> None:
        self.sent.append((node, msg))
        if isinstance(msg, messages.Kill):
            for r in msg.ranks:  # the agent stops them and reports the (expected) exits
                self.job.pids[r] = None
                if r in self.job.spawning and self.job.spawning[r][1] == node and r not in self.spawns_kept:
                    del self.job.spawning[r]  # a held spawn, dropped (`Spawned.dropped`)
        elif isinstance(msg, messages.InventoryRequest):
            local, replica = self.held.get(node, ({}, {}))
            self.job.inventories[(node, msg.req)] = messages.Inventory(
                node=node, req=msg.req, local={str(r): sorted(s) for r, s in local.items()},
                replica={str(r): sorted(s) for r, s in replica.items()})

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str, abandon_on_failure: bool = True) -> bool:
        self.waits.append((what, timeout))
        if what == "abort":
            self._abort_waits += 1
            if self._abort_waits == 2 and self.busy_acks:
                self.job.reports.add(Report.ABORTED, self.job.gen, (r for r in self.busy if self.job.pids.get(r)))
        for hook in self.hooks.pop(what, []):
            hook()
        if abandon_on_failure and self.job.pending is not None:
            raise RecoveryAbandoned(what)
        return cond()

    def abort_generation(self, gen: int) -> None:
        self.aborted.append(gen)
        self.job.reports.add(Report.ABORTED, gen,
                             (r for r, pid in self.job.pids.items() if pid and r not in self.stuck | self.busy))
        self.job.reports.add(Report.ABORT_SEEN, gen, (r for r, pid in self.job.pids.items() if pid and r not in self.stuck))
        self._abort_waits = 0

    def wire_ring(self) -> None:
        pass

    def start_agent(self, node: int) -> None:
        self.started_agents.append(node)
        self.job.nodes[node] = NodeState(node, FakeProc())

    def wait_agents(self, nodes: list[int]) -> None:
        self.waited_agents.extend(nodes)
        for n in nodes:
            self.job.nodes[n].up, self.job.nodes[n].peer = True, (f"10.0.0.{n}", 29400)
            self.held[n] = ({}, {})  # a restarted node holds nothing from before

    def spawn_ahead(self, gen: int, ranks: list[int]) -> None:
        self.spawned_ahead.append((gen, list(ranks)))
        for r in ranks:  # the agent starts each at once and says so (`Spawned`)
            self.job.pids[r] = 1000 * (gen + 1) + r

    def open_generation(self, gen: int, decision: Decision | None, respawn: list[int],
                        ahead: frozenset[int] = frozenset()) -> None:
        self.opened.append((gen, decision, respawn))
        self.opened_ahead.append(ahead)
        self.job.gen = gen
        self.job.progress.open(gen, decision.restore_step if decision else 0)
        for r in respawn:
            if r not in ahead:
                self.job.pids[r] = 1000 * (gen + 1) + r

    def await_generation(self, gen: int, respawn: list[int], restore_step: int, source: RestoreSource) -> None:
        hook = self.on_await.pop(gen, None)
        if hook is not None:
            hook()
        if self.job.pending is not None:
            raise RecoveryAbandoned("rendezvous")

    def attribute_faults(self, ranks: set[int], nodes: set[int]) -> list[str]:
        return self.blame.pop(0) if self.blame else []

    def faults_on(self, nodes: set[int]) -> list[str]:
        return []

    # -- FaultCluster ---------------------------------------------------------------------
    def topology(self) -> Topology:
        nodes = tuple(NodePlace(n, "localhost", "127.0.0.1", st.pid) for n, st in sorted(self.job.nodes.items()))
        ranks = tuple(RankPlace(r, self.job.members[r], pid) for r, pid in sorted(self.job.pids.items()) if pid)
        return Topology("run1", nodes, ranks, record_dir="/nonexistent")

    # -- what happened --------------------------------------------------------------------
    def recorded(self, kind: EventKind) -> list[dict[str, Any]]:
        return [data for k, data in self.events if k is kind]

    def kills(self) -> list[tuple[int, list[int]]]:
        return [(n, list(m.ranks)) for n, m in self.sent if isinstance(m, messages.Kill)]


def _node_1_lost_with_every_copy(disk_step: int | None = None) -> tuple[JobState, FakeCluster]:
    """Node 1 lost, and node 0 holding no replica of its ranks: the failure pending."""
    job = _job()
    job.disk_step = disk_step
    cluster = _cluster(job)
    cluster.held[0] = (cluster.held[0][0], {})  # node 0 lost its replicas of node 1's ranks
    job.nodes[1].declare_lost()
    job.fail(Failure(Cause.NODE_LOST, nodes={1}))
    return job, cluster


def test_both_copies_lost_before_the_first_disk_checkpoint_starts_over_from_step_0() -> None:
    # A job that keeps disk checkpoints has step 0 as its newest state until the first one is
    # complete: it starts over from there, loudly, rather than stopping.
    job, cluster = _node_1_lost_with_every_copy()
    coordinator = RecoveryCoordinator(cluster, job, Strategy.PEER, 3, start_over_before_checkpoint=True)
    outcome = coordinator.recover()
    assert outcome.restore_source is RestoreSource.NONE and outcome.restore_step == 0
    assert outcome.ranks == (0, 1, 2, 3)  # the survivors' newer state goes too: one step for all
    assert ("no copy of the state of rank(s) [2, 3] survives and no disk checkpoint is complete yet: every rank "
            "starts over from step 0 (8 steps lost)") in cluster.notices
    assert not cluster.recorded(EventKind.RECOVERY_FAILED)


def _job(steps: int = 8, spares: int = 0) -> JobState:
    """Two nodes of two ranks, every rank at `steps`; each agent holds its ranks' two newest steps
    and replicas of its ring neighbour's."""
    job = JobState.for_world(NNODES * PER_NODE, PER_NODE)
    for n in range(NNODES):
        job.nodes[n] = NodeState(n, FakeProc(), pid=100 + n, peer=(f"10.0.0.{n}", 29400), up=True,
                                 spares_total=spares)
    for r in job.members:
        job.pids[r] = 500 + r
    for step in range(1, steps + 1):
        for r in job.members:
            job.progress.report(StepReport(0, step, r, 1.0 / step, 0.1))
    job.enter(Phase.RUNNING)
    return job


def _cluster(job: JobState, newest: int = 8) -> FakeCluster:
    cluster = FakeCluster(job)
    held = {newest - 1, newest}
    for n in range(NNODES):
        mine = {r: set(held) for r, m in job.members.items() if m == n}
        theirs = {r: set(held) for r, m in job.members.items() if m == (n - 1) % NNODES}
        cluster.held[n] = (mine, theirs)
    return cluster


def _rank_exit(job: JobState, rank: int, step: int = 9, error: str = "", code: int = -9, t: float = 1.0) -> Failure:
    job.pids[rank] = None
    rf = RankFailure(rank, job.members[rank], "h", t, step=step, pid=500 + rank, exitcode=code, error=error)
    return Failure(Cause.PROCESS_EXIT, {rank}, t=t, detail=f"exit code {code}", rank_failures={rank: rf})


def _coordinator(cluster: FakeCluster, strategy: str = Strategy.PEER, max_restarts: int = 3) -> RecoveryCoordinator:
    return RecoveryCoordinator(cluster, cluster.job, strategy, max_restarts)


def test_a_killed_rank_is_restored_from_its_own_node_in_one_step() -> None:
    job = _job()
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))
    cluster.blame = [["f1"]]
    outcome = _coordinator(cluster).recover()
    assert outcome == RecoveryOutcome(gen=1, restore_step=8, restore_source=RestoreSource.LOCAL_MEMORY, ranks=(1,),
                                      fault_ids=("f1",), attempts=1, restarts=0)
    assert cluster.aborted == [0] and job.pending is None
    assert [n for n, m in cluster.sent if isinstance(m, messages.InventoryRequest)] == [0, 1]
    (detected,) = cluster.recorded(EventKind.FAILURE_DETECTED)
    assert detected["cause"] == "process-exit" and detected["ranks"] == [1] and detected["fault_ids"] == ["f1"]
    (decided,) = cluster.recorded(EventKind.RECOVERY_DECIDED)
    assert decided["restore_source"] == "local-memory" and decided["restore_step"] == 8 and decided["ranks"] == [1]
    assert decided["strategy"] == "peer"
    assert cluster.notices == ["rank 1 (node 0) failed after step 8: SIGKILL (fault f1)"]
    assert cluster.opened[0][0] == 1 and cluster.opened[0][2] == [1]


def test_a_copy_refused_on_restore_is_laid_to_the_faults_of_the_recovery_under_way() -> None:
    # Rank 1's own copy is corrupt: it refuses it, and the same recovery restores the replica.
    # Another open fault on rank 1 (a slow rank just reverted) must not take the refusal: the
    # report lists refused copies under the fault whose recovery refused them.
    job = _job()
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))
    cluster.blame = [["f1"], ["f0-slow"]]

    def refuse() -> None:
        job.bad_sources.add((1, 8, RestoreSource.LOCAL_MEMORY, ""))
        job.fail(Failure(Cause.RESTORE_FAILED, {1}, t=2.0, detail="rank 1's local-memory copy of step 8: bad"))
    cluster.on_await[1] = refuse
    outcome = _coordinator(cluster).recover()
    assert outcome.fault_ids == ("f1",) and outcome.attempts == 2 and outcome.restarts == 0
    assert cluster.blame == [["f0-slow"]]  # never asked: nothing else is blamed, or marked detected
    first, refusal = cluster.recorded(EventKind.FAILURE_DETECTED)
    assert refusal["cause"] == "restore-failed" and refusal["fault_ids"] == [] and refusal["explained_by"] == ["f1"]
    decided = cluster.recorded(EventKind.RECOVERY_DECIDED)
    assert [d["restore_source"] for d in decided] == ["local-memory", "peer-memory"]
    assert decided[1]["failure_ids"] == [first["failure_id"], refusal["failure_id"]]


def test_a_second_rank_failing_while_survivors_acknowledge_joins_the_same_recovery() -> None:
    job = _job()
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))
    cluster.stuck = {2}  # rank 2 is dying: it never acknowledges the abort
    cluster.hooks["abort"] = [lambda: job.fail(_rank_exit(job, 2, t=2.0))]
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (1, 2) and outcome.attempts == 1 and outcome.gen == 1
    # Rank 1 from its own node, rank 2 too (node 1 survived): one decision for both.
    assert outcome.restore_source is RestoreSource.LOCAL_MEMORY
    assert len(cluster.recorded(EventKind.FAILURE_DETECTED)) == 1
    assert cluster.recorded(EventKind.RECOVERY_DECIDED)[0]["ranks"] == [1, 2]


def test_a_failure_during_the_recovery_abandons_it_and_starts_over_with_both() -> None:
    job = _job()
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))
    cluster.blame = [["f1"], ["f2"]]
    # While generation 1 starts, rank 3 dies: generation 1 is abandoned before it runs.
    cluster.on_await[1] = lambda: job.fail(_rank_exit(job, 3, t=2.0))
    outcome = _coordinator(cluster).recover()
    assert outcome.attempts == 2 and outcome.gen == 2 and outcome.fault_ids == ("f1", "f2")
    assert cluster.aborted == [0, 1]  # the abandoned generation is aborted too
    detected = cluster.recorded(EventKind.FAILURE_DETECTED)
    assert [d["ranks"] for d in detected] == [[1], [3]] and [d["gen"] for d in detected] == [0, 1]
    decided = cluster.recorded(EventKind.RECOVERY_DECIDED)
    assert [d["gen"] for d in decided] == [1, 2]
    assert [o[0] for o in cluster.opened] == [1, 2] and cluster.opened[1][2] == [3]
    assert job.gen == 2 and job.pending is None and all(job.pids.values())


def test_a_busy_survivor_is_waited_for_and_a_silent_one_is_replaced_at_once() -> None:
    job = _job()
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))
    cluster.busy = {0}  # in a long step: its watcher answered, its training thread later
    cluster.stuck = {3}  # SIGSTOPped: not even its watcher answers
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (1, 3) and outcome.gen == 1
    assert cluster.kills() == [(1, [3])]  # the silent one only; the busy one stays
    # First every survivor's watcher, briefly; then the training threads of those that answered.
    assert cluster.waits[:2] == [("abort", ABORT_SEEN_TIMEOUT), ("abort", ABORT_ACK_TIMEOUT - ABORT_SEEN_TIMEOUT)]


def test_a_busy_survivor_that_never_leaves_its_step_is_replaced_after_the_ack_timeout() -> None:
    job = _job()
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))
    cluster.busy, cluster.busy_acks = {0}, False  # alive, but its training thread is wedged
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (0, 1)
    assert cluster.kills() == [(0, [0])]


def test_the_same_injected_fault_on_the_same_rank_twice_is_recovered_twice() -> None:
    job = _job()
    cluster = _cluster(job)
    coordinator = _coordinator(cluster, max_restarts=0)
    cluster.blame = [["f1"], ["f2"]]
    for attempt in (1, 2):
        job.fail(_rank_exit(job, 1, step=9))
        outcome = coordinator.recover()
        assert outcome.gen == attempt and outcome.ranks == (1,) and outcome.restarts == 0
    assert not cluster.recorded(EventKind.RECOVERY_FAILED)


def test_the_same_rank_failing_twice_the_same_way_after_a_restore_is_a_crash_loop() -> None:
    job = _job()
    cluster = _cluster(job)
    coordinator = _coordinator(cluster, max_restarts=10)
    job.fail(_rank_exit(job, 1, step=9, error="RuntimeError: boom", code=1))
    assert coordinator.recover().restarts == 1
    job.fail(_rank_exit(job, 1, step=9, error="RuntimeError: boom", code=1, t=5.0))
    with pytest.raises(FatalRun) as stopped:
        coordinator.recover()
    reason = stopped.value.reason
    assert reason.startswith("crash loop: rank 1 failed again at step 9") and reason.endswith(": the job stops")
    assert stopped.value.root_cause is not None and stopped.value.root_cause["rank"] == 1
    (failed,) = cluster.recorded(EventKind.RECOVERY_FAILED)
    assert failed["reason"] == reason and failed["restarts"] == 1 and failed["max_restarts"] == 10
    assert cluster.notices[-1] == reason
    assert len(cluster.opened) == 1  # no generation opened for the second failure


def test_the_restart_budget_stops_the_job_once_spent() -> None:
    job = _job()
    cluster = _cluster(job)
    coordinator = _coordinator(cluster, max_restarts=1)
    job.fail(_rank_exit(job, 1, error="RuntimeError: a", code=1))
    assert coordinator.recover().restarts == 1
    job.fail(_rank_exit(job, 2, error="RuntimeError: b", code=1, t=3.0))
    with pytest.raises(FatalRun, match=r"^restart budget spent: 1 of --max-restarts 1 used: the job stops$"):
        coordinator.recover()
    assert cluster.recorded(EventKind.RECOVERY_FAILED)[0]["root_cause"]["rank"] == 2


def test_recovery_none_stops_at_the_first_failure() -> None:
    job = _job()
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 2))
    with pytest.raises(FatalRun, match="^process-exit and --recovery none: the job stops$"):
        _coordinator(cluster, strategy=Strategy.NONE).recover()
    assert cluster.aborted == [0] and not cluster.opened


def test_both_copies_lost_falls_back_to_the_disk_checkpoint() -> None:
    job, cluster = _node_1_lost_with_every_copy(disk_step=5)
    outcome = _coordinator(cluster).recover()
    assert outcome.restore_source is RestoreSource.DISK and outcome.restore_step == 5
    assert outcome.ranks == (0, 1, 2, 3)  # survivors hold no memory copy of step 5: all restart
    assert (0, [0, 1]) in [(n, sorted(rs)) for n, rs in cluster.kills()]
    assert cluster.started_agents == [1]  # no spare anywhere: the node's agent comes back
    assert "every memory copy of rank(s) [2, 3] is gone: falling back to the disk checkpoint of step 5" \
        in cluster.notices
    (decided,) = cluster.recorded(EventKind.RECOVERY_DECIDED)
    assert decided["restore_source"] == "disk" and decided["lost_both_copies"] == [2, 3]


def test_both_copies_lost_and_no_disk_checkpoint_stops_the_job_with_the_reason() -> None:
    job, cluster = _node_1_lost_with_every_copy()
    with pytest.raises(FatalRun) as stopped:
        _coordinator(cluster).recover()
    reason = "no copy of the state of rank(s) [2, 3] survives and there is no complete disk checkpoint: the job stops"
    assert stopped.value.reason == reason and cluster.notices[-1] == reason
    assert stopped.value.root_cause is not None and stopped.value.root_cause["cause"] == "node-lost"
    (failed,) = cluster.recorded(EventKind.RECOVERY_FAILED)
    assert failed["reason"] == reason and failed["root_cause"]["nodes"] == [1]
    assert not cluster.opened


def test_a_node_lost_while_survivors_acknowledge_moves_its_ranks_to_spares() -> None:
    job = _job(spares=2)
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))

    def node_1_dies() -> None:
        job.nodes[1].declare_lost()
        job.fail(Failure(Cause.NODE_LOST, nodes={1}, t=2.0))

    cluster.hooks["abort"] = [node_1_dies]
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (1, 2, 3) and outcome.attempts == 1
    # Ranks 2 and 3 come from node 0's replicas of node 1: peer memory.
    assert outcome.restore_source is RestoreSource.PEER_MEMORY and outcome.restore_step == 8
    assert job.members[2] == job.members[3] == 0  # on node 0's warm spares
    assert cluster.started_agents == [] and 1 in job.deferred_restarts  # node 1 comes back later
    (decided,) = cluster.recorded(EventKind.RECOVERY_DECIDED)
    assert decided["placement"] == {"1": 0, "2": 0, "3": 0}
    assert job.pending is None


class StoppedAgent(FakeProc):
    """An agent that stopped beating but still runs (SIGSTOPped): it ends only when stopped."""

    def __init__(self, log: list[str]) -> None:
        self.code: int | None = None
        self.log = log

    def poll(self) -> int | None:
        return self.code

    def stop(self, timeout: float) -> None:
        self.log.append("stopped")
        self.code = -9


def test_a_node_lost_by_heartbeat_has_its_agent_stopped_before_the_next_generation_opens() -> None:
    # Its ranks outlive a stopped agent: left running they would join generation 1 beside their
    # replacements.
    job = _job(spares=2)
    cluster = _cluster(job)
    log: list[str] = []
    job.nodes[1].proc = StoppedAgent(log)
    job.nodes[1].declare_lost()
    job.fail(Failure(Cause.NODE_LOST, nodes={1}))
    cluster.hooks["teardown"] = [lambda: log.append("teardown")]
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (2, 3) and outcome.restore_source is RestoreSource.PEER_MEMORY
    assert log == ["stopped", "teardown"] and job.nodes[1].proc.poll() is not None


def test_no_common_step_without_a_lost_rank_names_no_empty_list() -> None:
    job = _job()
    cluster = _cluster(job)
    cluster.held[1] = ({2: {3}, 3: {3}}, cluster.held[1][1])  # node 1's ranks' slots: an older step
    cluster.held[0] = (cluster.held[0][0], {})
    job.fail(Failure(Cause.HANG))
    with pytest.raises(FatalRun) as stopped:
        _coordinator(cluster).recover()
    assert "[]" not in stopped.value.reason and "survives" not in stopped.value.reason
    assert stopped.value.reason == ("the ranks' memory copies hold no step in common and there is no complete "
                                    "disk checkpoint: the job stops")


@pytest.mark.parametrize("gpu", [False, True])
def test_a_lost_node_without_spares_goes_to_a_warm_template_on_a_cpu_host(gpu: bool) -> None:
    job = _job(spares=0)
    cluster = _cluster(job)
    cluster.gpu = gpu
    job.nodes[0].template = True  # node 0's worker template is warm
    job.nodes[1].declare_lost()
    job.fail(Failure(Cause.NODE_LOST, nodes={1}, t=2.0))
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (2, 3) and outcome.restore_source is RestoreSource.PEER_MEMORY
    if gpu:
        # A GPU host has no device to spare: the ranks wait for their node's restarted agent.
        assert job.members[2] == job.members[3] == 1 and cluster.started_agents == [1]
    else:
        # Forked on node 0 in milliseconds; node 1 comes back later, off the recovery's path.
        assert job.members[2] == job.members[3] == 0
        assert cluster.started_agents == [] and 1 in job.deferred_restarts


@pytest.mark.parametrize("spares", [0, 2])
def test_a_lost_node_comes_back_on_a_spare_node_while_the_backend_holds_one(spares: int) -> None:
    # A scheduler's spare node takes the lost node's ranks, even where a survivor's template is
    # warm or holds warm spare processes: the survivors keep their own load.
    job = _job(spares=spares)
    cluster = _cluster(job)
    cluster.spare_hosts = 1
    job.nodes[0].template = True
    job.nodes[1].declare_lost()
    job.fail(Failure(Cause.NODE_LOST, nodes={1}, t=2.0))
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (2, 3) and outcome.restore_source is RestoreSource.PEER_MEMORY
    assert job.members[2] == job.members[3] == 1 and cluster.started_agents == [1]
    (decided,) = cluster.recorded(EventKind.RECOVERY_DECIDED)
    assert decided["placement"] == {"2": 1, "3": 1}


class FakeTransport:
    def __init__(self, ran: list[tuple[str, ...]]) -> None:
        self.host = "localhost"
        self.ran = ran

    def run(self, argv: Any, *, timeout: float, input: str | None = None) -> CommandResult:
        self.ran.append(tuple(argv))
        return CommandResult(tuple(argv), 0, "", "")

    def spawn_detached(self, argv: Any, *, timeout: float) -> None:
        self.ran.append(tuple(argv))


def _report(job: JobState, gen: int, step: int, ranks: list[int]) -> None:
    for r in ranks:
        job.progress.report(StepReport(gen, step, r, 0.5, 0.1))


def test_a_fault_scheduled_during_replay_fires_when_every_rank_reaches_its_step() -> None:
    job = _job(steps=6)
    cluster = _cluster(job)
    ran: list[tuple[str, ...]] = []
    injector = Injector(cluster, job, lambda cmd: FakeTransport(ran), scheduled=[parse_spec("kill-rank:rank=1,step=7")])
    _report(job, 0, 7, [0])  # only rank 0 has step 7
    injector.tick(1.0)
    assert not cluster.recorded(EventKind.FAULT_INJECTED)
    # A failure: generation 1 restores step 5 and replays 6, 7, ...
    job.gen = 1
    job.progress.open(1, 5)
    injector.tick(2.0)
    _report(job, 1, 6, [0, 1, 2, 3])
    _report(job, 1, 7, [0, 1, 2])
    injector.tick(3.0)
    assert not cluster.recorded(EventKind.FAULT_INJECTED) and not ran
    _report(job, 1, 7, [3])
    injector.tick(4.0)
    (injected,) = cluster.recorded(EventKind.FAULT_INJECTED)
    assert injected["fault_id"] == "f1" and injected["ranks"] == [1] and injected["gen"] == 1
    assert injected["at_step"] == 7 and injected["breaks_job"] is True  # only a recovery ends it
    assert any(str(job.pids[1]) in argv for argv in ran)  # rank 1's process got the signal
    injector.tick(5.0)
    assert len(cluster.recorded(EventKind.FAULT_INJECTED)) == 1  # fired once


def test_a_scheduled_fault_waits_while_a_failure_is_pending() -> None:
    job = _job(steps=7)
    cluster = _cluster(job)
    ran: list[tuple[str, ...]] = []
    injector = Injector(cluster, job, lambda cmd: FakeTransport(ran), scheduled=[parse_spec("kill-rank:rank=2,step=7")])
    job.fail(_rank_exit(job, 1))
    injector.tick(1.0)
    assert not ran and not cluster.recorded(EventKind.FAULT_INJECTED)


def _injected(cluster: FakeCluster) -> list[tuple[list[int], int]]:
    """(ranks, committed step when injected) of each fault injected."""
    return [(e["ranks"], e["at_step"]) for e in cluster.recorded(EventKind.FAULT_INJECTED)]


def test_a_kill_at_a_phase_is_armed_seconds_of_steps_ahead_but_never_before_an_earlier_fault() -> None:
    job = _job(steps=8)  # steps of 0.1 s: armed 30 steps (3 s) ahead, not just 6
    cluster = _cluster(job)
    ran: list[tuple[str, ...]] = []
    injector = Injector(cluster, job, lambda cmd: FakeTransport(ran), scheduled=[
        parse_spec("kill-rank:rank=1,step=37,phase=backward"), parse_spec("kill-rank:rank=2,step=9")])
    injector.tick(1.0)
    assert not ran  # the kill at step 9 is not due; the one armed ahead waits behind it
    _report(job, 0, 9, [0, 1, 2, 3])
    injector.tick(2.0)
    assert _injected(cluster) == [([2], 9)]
    injector.attribute({2}, set())  # rank 2's kill is seen
    injector.tick(3.0)
    assert _injected(cluster) == [([2], 9), ([1], 9)]  # 28 steps ahead of its step


def test_a_kill_armed_in_its_rank_is_neither_survived_nor_blamed_elsewhere_until_it_lands() -> None:
    job = _job(steps=8)
    cluster = _cluster(job)
    injector = Injector(cluster, job, lambda cmd: FakeTransport([]), scheduled=[
        parse_spec("kill-rank:rank=1,step=30,phase=optimizer"), parse_spec("kill-rank:rank=3,step=31")],
        hang_min_s=0.0)
    injector.tick(1.0)
    (armed,) = injector.faults
    # The job goes on for longer than any detector needs: an applied fault would count as
    # survived by now, and the next one would fire; this one has not taken effect yet.
    armed.applied_t = armed.injected_t - 60.0
    injector._progress_t = armed.injected_t
    assert not injector._settled()
    assert injector.attribute({0}, set()) == []  # rank 0's failure is not rank 1's armed kill
    injector._seen_step = 37  # well past its step, still armed: its phase is not in these steps
    assert injector._settled()  # later faults do not wait for it
    # Armed late (the job already past its step, faults held back before it): it lands in the
    # next step, and later faults wait for it until well past that one.
    armed.armed_step = 37
    assert not injector._settled()
    injector._seen_step = 44
    assert injector._settled()
    injector.landed(1)
    assert not armed.armed and armed.applied_t is not None and armed.applied_t >= armed.injected_t
    assert injector.attribute({1}, set()) == [armed.fault_id]  # rank 1 dies where it landed


def test_phase_transitions_follow_the_table() -> None:
    job = JobState.for_world(2, 1)
    assert job.phase is Phase.STARTING
    job.enter(Phase.RUNNING)
    job.enter(Phase.RECOVERING)
    job.enter(Phase.RUNNING)
    with pytest.raises(ValueError, match="starting"):
        JobState.for_world(2, 1).enter(Phase.RECOVERING)
    job.enter(Phase.COMPLETED)
    with pytest.raises(ValueError):
        job.enter(Phase.RUNNING)
    assert str(Phase.RECOVERING) == "recovering" and f"{Cause.HANG}" == "hang"


def test_enums_keep_the_recorded_strings() -> None:
    assert Strategy.ALL == ("peer", "restart-memory", "restart-disk", "none")
    assert {"peer": 1}[Strategy.PEER] == 1 and Strategy("restart-disk") is Strategy.RESTART_DISK
    assert [s.value for s in RestoreSource] == ["local-memory", "peer-memory", "replica", "replica-group", "disk", "none", "script"]
    merged = Failure(Cause.PROCESS_EXIT, {1})
    merged.merge(Failure(Cause.NODE_LOST, nodes={1}))
    assert merged.cause == "process-exit+node-lost" and type(merged.cause) is str
    assert merged.causes == (Cause.PROCESS_EXIT, Cause.NODE_LOST)


def _away(job: JobState) -> None:
    """Ranks 2 and 3 (launched on node 1) run on node 0, as an earlier node fault left them."""
    job.members[2] = job.members[3] = 0


@pytest.mark.parametrize("node_1", ["starting", "lost"])
def test_ranks_started_again_after_a_node_fault_go_home_and_their_copies_leave_one_node(node_1: str) -> None:
    # Every rank on node 0, and node 1's agent not up: node 0 lost, every copy with it. The ranks
    # wait for a restarted agent either way; those of node 1 wait for their own node's, so that
    # the next node fault does not find all four in one place again. Node 1's agent is waited
    # for while it is still starting, and started again only once it is lost.
    job = _job(spares=1)
    _away(job)
    job.disk_step = 5
    cluster = _cluster(job)
    cluster.held[1] = ({}, {})
    job.nodes[1].up = False
    if node_1 == "lost":
        job.nodes[1].declare_lost()
    job.nodes[0].declare_lost()
    job.fail(Failure(Cause.NODE_LOST, nodes={0}))
    outcome = _coordinator(cluster).recover()
    assert outcome.restore_source is RestoreSource.DISK and outcome.ranks == (0, 1, 2, 3)
    (decided,) = cluster.recorded(EventKind.RECOVERY_DECIDED)
    assert decided["placement"] == {"0": 0, "1": 0, "2": 1, "3": 1}
    assert sorted(cluster.started_agents) == ([0] if node_1 == "starting" else [0, 1])
    assert sorted(cluster.waited_agents) == [0, 1]


def test_a_node_whose_agent_is_starting_is_not_started_again_by_a_recovery() -> None:
    # Node 1 came back after a node fault (its ranks on node 0's spares) and its agent is still
    # starting when rank 0 is killed. Started again, the agent on its way would be replaced: in a
    # chaos soak 16-18 times per seed, each a start paid again on a busy host.
    job = _job(spares=2)
    _away(job)
    cluster = _cluster(job)
    job.nodes[1] = NodeState(1, FakeProc(), incarnation=1)  # started, not up yet
    job.fail(_rank_exit(job, 0))
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (0,) and cluster.started_agents == [] and cluster.waited_agents == []
    assert job.nodes[1].starting and job.nodes[1].incarnation == 1 and 1 not in job.deferred_restarts


def test_a_rank_killed_away_from_home_goes_home_with_the_replica_held_there() -> None:
    job = _job(spares=1)
    _away(job)
    cluster = _cluster(job)  # node 0 holds all four ranks' slots, node 1 their replicas
    job.nodes[1].template = True
    job.fail(_rank_exit(job, 2))
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (2,) and outcome.restore_step == 8
    assert outcome.restore_source is RestoreSource.PEER_MEMORY  # from node 1, where it now runs
    assert job.members[2] == 1 and job.members[3] == 0  # rank 3 moves when it is started again
    (_, decision, _), = cluster.opened
    assert decision is not None and decision.sources[2].kind == "peer-memory"


@pytest.mark.parametrize("why", ["home down", "home cold", "no replica at home"])
def test_a_rank_killed_away_from_home_stays_where_it_can_start_at_once(why: str) -> None:
    job = _job(spares=0)
    _away(job)
    cluster = _cluster(job)
    job.nodes[0].template = True
    job.nodes[1].template = why != "home cold"
    if why == "no replica at home":
        cluster.held[1] = ({}, {})
    if why == "home down":
        job.nodes[1].declare_lost()
        job.nodes[1].pid = 0
    job.fail(_rank_exit(job, 2))
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (2,) and job.members[2] == 0


def _spawn_held_on_node_1() -> tuple[JobState, FakeCluster]:
    """Generation 1 opened with ranks 2 and 3 sent to node 1, whose agent (just restarted) holds
    them while its template warms up; then node 0 is lost."""
    job = _job()
    cluster = _cluster(job)
    job.gen = 1
    for r in (2, 3):
        job.pids[r] = None
        job.spawning[r] = (1, 1)
    job.nodes[0].declare_lost()
    job.fail(Failure(Cause.NODE_LOST, nodes={0}))
    return job, cluster


def test_a_spawn_held_by_an_agent_is_called_off_before_the_next_generation_opens() -> None:
    # Left alone, the agent would start ranks 2 and 3 into generation 1 once its template is
    # warm: after generation 2 opened, beside their replacements (a job that could not stop
    # them: "did not stop within 15s").
    job, cluster = _spawn_held_on_node_1()
    outcome = _coordinator(cluster).recover()
    assert (1, [2, 3]) in cluster.kills()
    assert not job.spawning and outcome.gen == 2 and set(outcome.ranks) == {0, 1, 2, 3}


def test_the_next_generation_waits_for_a_spawn_the_agent_has_not_called_off() -> None:
    job, cluster = _spawn_held_on_node_1()
    cluster.spawns_kept = {3}
    with pytest.raises(FatalRun, match=r"rank\(s\) \[3\] did not stop within 15s"):
        _coordinator(cluster).recover()
    assert not cluster.opened


def _warm_job() -> tuple[JobState, FakeCluster]:
    """`_job`, each node's worker template warm: a replacement there starts in milliseconds."""
    job = _job()
    for st in job.nodes.values():
        st.template = True
    return job, _cluster(job)


def test_a_killed_rank_is_started_again_while_the_survivors_leave_their_step() -> None:
    # Its node lives and it goes nowhere else: it starts before the survivors have answered,
    # waits for generation 1's plan, and is not started a second time when that opens.
    job, cluster = _warm_job()
    job.fail(_rank_exit(job, 1))
    seen_while_survivors_answer: list[list[tuple[int, list[int]]]] = []
    cluster.hooks["abort"] = [lambda: seen_while_survivors_answer.append(list(cluster.spawned_ahead))]
    outcome = _coordinator(cluster).recover()
    assert seen_while_survivors_answer == [[(1, [1])]]
    assert outcome.ranks == (1,) and outcome.restore_source is RestoreSource.LOCAL_MEMORY
    assert cluster.opened_ahead == [frozenset({1})] and cluster.opened[0][2] == [1]
    assert job.pids[1] == 2001 and not cluster.kills() and not job.ahead


def test_no_replacement_starts_ahead_without_a_warm_start() -> None:
    job = _job()  # no template, no spare: a cold start the decision might not keep
    cluster = _cluster(job)
    job.fail(_rank_exit(job, 1))
    _coordinator(cluster).recover()
    assert cluster.spawned_ahead == [] and cluster.opened_ahead == [frozenset()]


def _lose_node(job: JobState, node: int, t: float = 1.0) -> None:
    job.nodes[node].declare_lost()
    job.fail(Failure(Cause.NODE_LOST, nodes={node}, t=t))


def test_a_lost_nodes_ranks_are_placed_and_started_ahead_where_the_decision_puts_them() -> None:
    job, cluster = _warm_job()
    _lose_node(job, 1)
    placed_while_survivors_answer: list[dict[int, int]] = []
    cluster.hooks["abort"] = [lambda: placed_while_survivors_answer.append(dict(job.members))]
    outcome = _coordinator(cluster).recover()
    assert placed_while_survivors_answer == [{0: 0, 1: 0, 2: 0, 3: 0}]
    assert cluster.spawned_ahead == [(1, [2, 3])] and cluster.opened_ahead == [frozenset({2, 3})]
    assert outcome.ranks == (2, 3) and outcome.restore_source is RestoreSource.PEER_MEMORY
    (decided,) = cluster.recorded(EventKind.RECOVERY_DECIDED)
    assert decided["placement"] == {"2": 0, "3": 0} and job.home == {0: 0, 1: 0, 2: 1, 3: 1}


@pytest.mark.parametrize("why", ["gpu", "spare-node"])
def test_a_lost_nodes_ranks_wait_for_the_decision_where_it_may_not_place_them_on_a_survivor(why: str) -> None:
    # A GPU host has no device free for a second rank without a spare; a backend's spare node
    # takes the lost node's ranks once its agent is up there.
    job, cluster = _warm_job()
    cluster.gpu, cluster.spare_hosts = why == "gpu", int(why == "spare-node")
    _lose_node(job, 1)
    _coordinator(cluster).recover()
    assert cluster.spawned_ahead == [] and cluster.opened_ahead == [frozenset()]
    assert job.members[2] == job.members[3] == 1 and cluster.started_agents == [1]


def test_a_replacement_started_ahead_on_a_node_lost_meanwhile_is_placed_again() -> None:
    job, cluster = _warm_job()
    job.fail(_rank_exit(job, 1))
    cluster.hooks["abort"] = [lambda: _lose_node(job, 0, t=2.0)]
    outcome = _coordinator(cluster).recover()
    assert cluster.spawned_ahead == [(1, [1])]
    # Both of node 0's ranks go to node 1's warm template, rank 1 with them.
    assert set(outcome.ranks) == {0, 1} and cluster.opened_ahead == [frozenset()]
    assert job.members[0] == job.members[1] == 1


def test_a_replacement_started_ahead_that_dies_before_the_decision_is_started_again() -> None:
    job, cluster = _warm_job()
    job.fail(_rank_exit(job, 1))

    def dies() -> None:
        assert job.pids[1] == 2001
        job.pids[1] = None
        job.fail(Failure(Cause.PROCESS_EXIT, {1}, t=2.0, detail="exit code 1"))
    cluster.hooks["abort"] = [dies]
    outcome = _coordinator(cluster).recover()
    assert outcome.ranks == (1,) and outcome.attempts == 1
    assert cluster.opened_ahead == [frozenset()] and cluster.opened[0][2] == [1] and job.pids[1] == 2001


def test_replacements_started_ahead_by_an_abandoned_attempt_are_kept_by_the_next() -> None:
    # Rank 3 dies while the inventories are asked for: the attempt is abandoned before
    # generation 1 opens. Rank 1's replacement, waiting for generation 1's plan, is no survivor
    # of generation 0 (left among them it would never answer the abort and be killed): the next
    # attempt counts it lost, keeps it, and starts rank 3's replacement ahead too.
    job, cluster = _warm_job()
    job.fail(_rank_exit(job, 1))
    cluster.blame = [["f1"], ["f2"]]
    cluster.hooks["inventory"] = [lambda: job.fail(_rank_exit(job, 3, t=2.0))]
    outcome = _coordinator(cluster).recover()
    assert outcome.attempts == 2 and outcome.gen == 1 and outcome.ranks == (1, 3)
    assert cluster.spawned_ahead == [(1, [1]), (1, [3])]
    assert cluster.opened_ahead == [frozenset({1, 3})] and not cluster.kills()
    assert job.pids[1] == 2001 and job.pids[3] == 2003


def test_a_time_trigger_counts_from_the_first_committed_step_not_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A loaded host's start-up takes seconds: t=2 must land 2 s into training, not before step 1.
    job = _job(steps=0)
    cluster = _cluster(job)
    ran: list[tuple[str, ...]] = []
    injector = Injector(cluster, job, lambda cmd: FakeTransport(ran), scheduled=[parse_spec("kill-rank:rank=1,t=2")])
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    for _ in range(5):  # ten seconds of start-up: no step yet, so no time has passed for t=
        now[0] += 2.0
        injector.tick(injector.since_training(from_ranks_start=False))
    assert injector.since_training(from_ranks_start=False) == -1.0 and not cluster.recorded(EventKind.FAULT_INJECTED)
    _report(job, 0, 1, [0, 1, 2, 3])  # the first step
    injector.tick(injector.since_training(from_ranks_start=False))
    now[0] += 1.5
    injector.tick(injector.since_training(from_ranks_start=False))
    assert not cluster.recorded(EventKind.FAULT_INJECTED)
    now[0] += 0.6
    injector.tick(injector.since_training(from_ranks_start=False))
    (injected,) = cluster.recorded(EventKind.FAULT_INJECTED)
    assert injected["fault_id"] == "f1"
    # A job that reports no steps counts from its ranks' start (its phase `running`) instead.
    other = _job(steps=0)
    plain = Injector(_cluster(other), other, lambda cmd: FakeTransport(ran))
    assert plain.since_training(from_ranks_start=True) == 0.0


def test_faults_that_never_took_effect_are_recorded_missed_with_their_reason() -> None:
    job = _job(steps=5)
    cluster = _cluster(job)
    injector = Injector(cluster, job, lambda cmd: FakeTransport([]),
                        scheduled=[parse_spec("kill-rank:rank=1,step=9"), parse_spec("kill-rank:rank=2,t=30")])
    assert injector.record_missed(steps_unknown=False, elapsed=12.0) == ["f1", "f2"]
    first, second = cluster.recorded(EventKind.FAULT_MISSED)
    assert first["reason"] == "the job ended at step 5, before step 9" and first["kind"] == "kill-rank"
    assert second["reason"] == "the job ended at t=12.0, before t=30"
    cluster2 = _cluster(job)
    plain = Injector(cluster2, job, lambda cmd: FakeTransport([]), scheduled=[parse_spec("kill-rank:rank=1,step=3")])
    plain.record_missed(steps_unknown=True, elapsed=-1.0)
    (missed,) = cluster2.recorded(EventKind.FAULT_MISSED)
    assert "reports no steps" in missed["reason"]


def test_one_fault_is_reverted_by_its_id_and_the_rest_are_refused_with_why() -> None:
    job = _job(steps=7)
    cluster = _cluster(job)
    ran: list[tuple[str, ...]] = []
    injector = Injector(cluster, job, lambda cmd: FakeTransport(ran),
                        scheduled=[parse_spec("kill-rank:rank=2,step=50")])
    hang, _ = injector.inject(parse_spec("hang-rank:rank=1,duration=600"))
    kill, _ = injector.inject(parse_spec("kill-rank:rank=3"))
    assert hang is not None and kill is not None
    assert injector.revert_by_id(hang.fault_id, dry_run=True) is None and not cluster.recorded(EventKind.FAULT_REVERTED)
    assert injector.revert_by_id(hang.fault_id) is None
    (reverted,) = cluster.recorded(EventKind.FAULT_REVERTED)
    assert reverted["fault_id"] == hang.fault_id and hang.reverted
    assert any("CONT" in " ".join(argv) for argv in ran)  # the rank was sent SIGCONT: ended, not only noted
    assert injector.revert_by_id(hang.fault_id) == f"{hang.fault_id} (hang-rank) is reverted already"
    assert injector.revert_by_id(kill.fault_id) == f"{kill.fault_id} (kill-rank) has nothing to revert"
    assert injector.revert_by_id("f1") == "f1 has not been injected yet"  # the scheduled kill at step 50
    assert injector.revert_by_id("f99") == "this run has no fault f99"
    assert len(cluster.recorded(EventKind.FAULT_REVERTED)) == 1


def test_the_run_directorys_key_is_never_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-step fault's command names the rank's mailbox in the run's shared-memory directory,
    # whose key keeps others from making that name first: events.jsonl is world-readable.
    job = _job(steps=7)
    cluster = _cluster(job)
    key = "0123456789abcdef" * 2
    real = cluster.topology
    monkeypatch.setattr(cluster, "topology", lambda: dataclasses.replace(real(), fault_dir=f"/dev/shm/ffctl-run1-{key}"))
    injector = Injector(cluster, job, lambda cmd: FakeTransport([]))
    injector.inject(parse_spec("crash-rank:rank=1"))
    (injected,) = cluster.recorded(EventKind.FAULT_INJECTED)
    shown = " ".join(injected["commands"])
    assert "/dev/shm/ffctl-run1-KEY/" in shown and key not in shown

"""What keeps the controller's work per pump and per recovery from growing with the cluster: the
heartbeat keys read a share per pump, evenly, each once per period; the ring wired anew only
where a neighbour changed; the survivors' answers waited for as long as they keep coming; the
decision's replicas gathered once. Each piece is built with only what these use."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ffctl.controller import fleet as fleet_mod
from ffctl.controller import watchdog as watchdog_mod
from ffctl.controller.cluster import FatalRun, RecoveryAbandoned
from ffctl.controller.decide import Inventory, decide
from ffctl.controller.failures import Cause, Failure
from ffctl.controller.fleet import Fleet
from ffctl.controller.protection import Protection
from ffctl.controller.state import JobState, NodeState, Phase
from ffctl.controller.progress import StepReport
from ffctl.controller.watchdog import Watchdog
from wire import messages
from wire.jobenv import Strategy
from wire.generation_plan import LocalSlot, PeerReplica
from runs.events import EventKind, RestoreSource


class _Agent:
    def poll(self) -> None:
        return None  # running

    def running_here(self) -> bool:
        return False  # on a host of its own: its silence is all the controller has


def _job(nodes: int) -> JobState:
    job = JobState.for_world(nodes, 1)
    for n in range(nodes):
        job.nodes[n] = NodeState(n, _Agent(), up=True, peer=("127.0.0.1", 20000 + n))  # type: ignore[arg-type]
    return job


def _watchdog(nodes: int) -> tuple[Watchdog, list[int]]:
    dog = Watchdog(_job(nodes), None, lambda *a, **k: None, 1.0, 5.0, False)  # type: ignore[arg-type]
    reads: list[int] = []
    dog.read_heartbeat = lambda st: reads.append(st.node)  # type: ignore[method-assign]
    return dog, reads


def _fleet(nodes: int) -> tuple[Fleet, list[tuple[int, messages.Message]]]:
    spec = SimpleNamespace(recovery=Strategy.PEER, snapshot_copies=1)
    job = _job(nodes)
    fleet = Fleet(spec, job, None, None, None, "r", Path("runs/r"), "",  # type: ignore[arg-type]
                  Protection(job, lambda *a, **k: None, True))
    sent: list[tuple[int, messages.Message]] = []
    fleet.send = lambda node, msg: sent.append((node, msg))  # type: ignore[method-assign]
    return fleet, sent


def test_heartbeat_keys_are_read_a_share_per_pump_each_once_per_period() -> None:
    nodes = 1024
    dog, reads = _watchdog(nodes)
    period = max(watchdog_mod.HEARTBEAT_READ_S, watchdog_mod.HEARTBEAT_READ_PER_NODE_S * nodes)
    dog.read_heartbeats(100.0)  # the first pump reads every key once
    assert sorted(reads) == list(range(nodes))
    reads.clear()
    pump = 0.005
    per_pump = []
    t = 100.0
    for _ in range(round(period / pump)):  # one period of pumps 5 ms apart
        t += pump
        before = len(reads)
        dog.read_heartbeats(t)
        per_pump.append(len(reads) - before)
    # Every key once in the period (give or take the rounding of the last pump), none twice...
    assert nodes - 2 <= len(reads) <= nodes and len(set(reads)) == len(reads)
    # ... spread evenly: no pump reads more than its share, where every 0.05 s all of them were due.
    assert max(per_pump) <= nodes * pump / period + 1


def test_a_small_cluster_keeps_its_read_period() -> None:
    dog, reads = _watchdog(8)
    dog.read_heartbeats(50.0)
    reads.clear()
    t = 50.0
    for _ in range(100):  # 0.5 s of pumps
        t += 0.005
        dog.read_heartbeats(t)
    # Each of 8 keys every HEARTBEAT_READ_S: 10 reads each in 0.5 s.
    assert abs(len(reads) - 8 * 0.5 / watchdog_mod.HEARTBEAT_READ_S) <= 1
    assert set(reads) == set(range(8))


def test_the_ring_is_wired_anew_only_where_a_neighbour_changed() -> None:
    fleet, sent = _fleet(64)
    fleet.wire_ring()
    assert sorted(n for n, _ in sent) == list(range(64))  # everyone, the first time
    sent.clear()
    fleet.wire_ring()
    assert sent == []  # nothing changed
    fleet.job.nodes[10].up = False  # node 10 lost: only node 9's neighbour changes
    fleet.wire_ring()
    assert [(n, m.holders) for n, m in sent] == [(9, (("127.0.0.1", 20011),))]  # type: ignore[attr-defined]
    sent.clear()
    fleet.job.nodes[10].up, fleet.job.nodes[10].incarnation = True, 1  # it comes back, a new agent
    fleet.wire_ring()
    assert sorted(n for n, _ in sent) == [9, 10]


def test_with_two_copies_each_node_streams_to_the_next_two_and_a_loss_rewires_two() -> None:
    fleet, sent = _fleet(8)
    fleet.spec.snapshot_copies = 2
    fleet.wire_ring()
    by_node = {n: m for n, m in sent}
    assert by_node[3].holders == (("127.0.0.1", 20004), ("127.0.0.1", 20005))  # type: ignore[attr-defined]
    assert by_node[7].holders == (("127.0.0.1", 20000), ("127.0.0.1", 20001))  # type: ignore[attr-defined]
    sent.clear()
    fleet.job.nodes[5].up = False  # it held copies of nodes 3 and 4: only their holders change
    fleet.wire_ring()
    assert {n: [p for _, p in m.holders] for n, m in sent} == {  # type: ignore[attr-defined]
        3: [20004, 20006], 4: [20006, 20007]}


def test_the_decision_at_a_thousand_nodes_takes_the_lost_node_from_its_ring_neighbour() -> None:
    nodes, lost, step = 1024, 512, 7
    members = {r: r for r in range(nodes)}
    invs = {n: Inventory(n, "127.0.0.1", 20000 + n, {n: frozenset({step - 1, step})},
                         {(n - 1) % nodes: frozenset({step - 1, step})}) for n in range(nodes) if n != lost}
    d = decide(Strategy.PEER, members, {lost}, {lost}, invs, list(range(nodes)), None, gen=1)
    assert d is not None and d.restore_step == step and d.restore_source is RestoreSource.PEER_MEMORY
    assert d.sources[lost] == PeerReplica(address="127.0.0.1", port=20000 + lost + 1, where=d.sources[lost].where)
    assert all(d.sources[r] == LocalSlot(node=r) for r in range(nodes) if r != lost)


def _answers(batches: list[set[int]]) -> tuple[Any, list[float]]:
    """A cluster whose survivors' answers arrive a batch per wait, as from a long queue."""
    got: set[int] = set()
    waits: list[float] = []

    def wait_for(cond: Any, timeout: float, what: str, abandon_on_failure: bool = True) -> bool:
        waits.append(timeout)
        if batches:
            got.update(batches.pop(0))
        return bool(cond())

    return SimpleNamespace(wait_for=wait_for, got=got), waits


def test_answers_are_waited_for_while_they_keep_coming_and_a_silent_rank_is_given_up() -> None:
    from ffctl.controller.coordinator import await_answers

    cluster, waits = _answers([set(range(0, 300)), set(range(300, 700)), set(range(700, 1023)), set()])
    ranks = set(range(1024))  # rank 1023 never answers (stopped)
    await_answers(cluster, ranks, lambda: set(cluster.got), 1.5)
    # Three windows brought answers, the fourth none: then the silent one is given up.
    assert len(waits) == 4 and cluster.got == set(range(1023))
    cluster2, waits2 = _answers([set(range(8))])
    await_answers(cluster2, set(range(8)), lambda: set(cluster2.got), 1.5)
    assert len(waits2) == 1  # all answered in the first window: no more waiting


def test_an_agent_started_again_has_the_start_up_limit_until_its_first_beat() -> None:
    # A node back after a kill starts its agent on a host busy with the recovery: taken for lost
    # a second after it said it was up, it failed the recovery over a node that was fine.
    dog, _ = _watchdog(2)
    job = dog.job
    job.gen = 3
    st = job.nodes[1]
    st.incarnation, st.hb_first = 1, False  # what the inbox sets when the agent says it is up
    assert dog.heartbeat_limit(st) == watchdog_mod.STARTUP_HEARTBEAT_S
    lost: list[Any] = []
    job.fail = lost.append  # type: ignore[method-assign]
    st.hb_seen = time.monotonic() - 2.0  # silent for twice the 1 s limit, not yet beaten
    dog.check_nodes()
    assert st.up and not lost
    dog.heartbeat(messages.Heartbeat(node=1, incarnation=1, beat=1))
    assert st.hb_first and dog.heartbeat_limit(st) == 1.0
    st.hb_seen = time.monotonic() - 2.0  # beaten once, then silent past the limit: lost
    dog.check_nodes()
    assert not st.up and [f.nodes for f in lost] == [{1}]


def test_an_agent_started_again_keeps_the_start_up_limit_while_its_template_warms_up() -> None:
    # Three jobs' nodes coming back at once on one host: a new agent beat once, then its beats
    # were held back for over a second while its template imported torch, and the recovery
    # waiting for it stopped the job.
    dog, _ = _watchdog(2)
    job = dog.job
    job.gen = 3
    st = job.nodes[1]
    st.incarnation, st.hb_first, st.up_at = 1, False, time.monotonic()
    dog.heartbeat(messages.Heartbeat(node=1, incarnation=1, beat=1))
    assert st.hb_first and not st.template
    assert dog.heartbeat_limit(st) == watchdog_mod.STARTUP_HEARTBEAT_S
    lost: list[Any] = []
    job.fail = lost.append  # type: ignore[method-assign]
    st.hb_seen = time.monotonic() - 2.0
    dog.check_nodes()
    assert st.up and not lost
    st.template = True  # warm: the usual limit
    assert dog.heartbeat_limit(st) == 1.0
    st.template, st.up_at = False, time.monotonic() - watchdog_mod.RESTART_WARMUP_S - 1  # or past the warm-up
    assert dog.heartbeat_limit(st) == 1.0
    st.up_at, st.incarnation = time.monotonic(), 0  # the job's own first agents: the job-start rule only
    assert dog.heartbeat_limit(st) == 1.0


def test_once_the_last_step_is_committed_a_silent_agent_gets_the_start_up_limit() -> None:
    # Four jobs ending at once on a 2-core host held an agent's beats back for 1.15 s right after
    # the last step, and a recovery began for a job with nothing left to train.
    dog, _ = _watchdog(2)
    dog.last_step = 800
    job = dog.job
    st = job.nodes[1]
    dog.heartbeat(messages.Heartbeat(node=1, incarnation=0, beat=1))
    lost: list[Any] = []
    job.fail = lost.append  # type: ignore[method-assign]
    job.progress.report(StepReport(0, 799, 0, 2.5, 0.1))
    assert dog.heartbeat_limit(st) == 1.0  # still training: a second's silence loses the node
    job.progress.report(StepReport(0, 800, 0, 2.4, 0.1))
    assert dog.heartbeat_limit(st) == watchdog_mod.STARTUP_HEARTBEAT_S
    st.hb_seen = time.monotonic() - 2.0
    dog.check_nodes()
    assert st.up and not lost
    st.hb_seen = time.monotonic() - watchdog_mod.STARTUP_HEARTBEAT_S - 1  # a host frozen for good
    dog.check_nodes()
    assert not st.up and [f.nodes for f in lost] == [{1}]
    dog.heartbeat(messages.Heartbeat(node=0, incarnation=0, beat=1))
    assert dog.heartbeat_limit(job.nodes[0]) == watchdog_mod.STARTUP_HEARTBEAT_S
    dog.last_step = None  # a script's loop: its last step is not known, so never assumed
    assert dog.heartbeat_limit(job.nodes[0]) == 1.0


class _Here(_Agent):
    """An agent process of the controller's own host and network: `running` says whether it
    runs (False: SIGSTOPped)."""

    def __init__(self) -> None:
        self.running = True

    def running_here(self) -> bool:
        return self.running


def test_a_silent_agent_running_on_this_host_is_the_hosts_load_not_a_lost_node() -> None:
    # A chaos soak's four jobs on 2 cores held a local agent's beats back for over a second
    # right after a recovery, and a node that was fine was taken for lost.
    events: list[tuple[Any, dict[str, Any]]] = []
    dog, _ = _watchdog(2)
    dog.record = lambda kind, **f: events.append((kind, f))  # type: ignore[assignment]
    job = dog.job
    job.gen = 3
    st = job.nodes[1]
    st.proc = here = _Here()  # type: ignore[assignment]
    dog.heartbeat(messages.Heartbeat(node=1, incarnation=0, beat=1))
    assert dog.heartbeat_limit(st) == 1.0
    lost: list[Any] = []
    job.fail = lost.append  # type: ignore[method-assign]
    st.hb_seen = time.monotonic() - 2.0  # twice the limit, its process running: late, not lost
    dog.check_nodes()
    assert st.up and not lost and st.hb_late and events == []
    dog.heartbeat(messages.Heartbeat(node=1, incarnation=0, beat=2))  # the beats come back
    ((kind, fields),) = events
    assert kind is EventKind.HEARTBEAT_LATE and fields["node"] == 1 and 2.0 <= fields["silent_s"] < 5.0
    assert not st.hb_late
    here.running = False  # SIGSTOPped: the usual limit
    st.hb_seen = time.monotonic() - 2.0
    dog.check_nodes()
    assert not st.up and [f.nodes for f in lost] == [{1}]
    # Running, but silent past RUNNING_HERE_HEARTBEAT_S: wedged (its beats stop after its own
    # LOOP_STUCK_S), lost.
    st0 = job.nodes[0]
    st0.proc = _Here()  # type: ignore[assignment]
    dog.heartbeat(messages.Heartbeat(node=0, incarnation=0, beat=1))
    st0.hb_seen = time.monotonic() - watchdog_mod.RUNNING_HERE_HEARTBEAT_S - 1
    dog.check_nodes()
    assert not st0.up and [f.nodes for f in lost] == [{1}, {0}]


@pytest.mark.parametrize("phase", [Phase.RECOVERING, Phase.STARTING])
def test_an_agent_lost_again_while_the_agents_start_is_not_waited_for(phase: Phase) -> None:
    # Node 1's new agent said it was up, then its beats stopped while node 0's agent was still
    # starting: the recovery starts over (node 1 again among the nodes to start), rather than
    # waiting out the 60 s for an agent that will never be up and stopping the job.
    fleet, _ = _fleet(2)
    job = fleet.job
    job.phase = phase
    job.nodes[0].up = False
    job.nodes[1].declare_lost()  # taken for lost by the watchdog ...
    waited: list[float] = []

    def wait_for(cond: Any, timeout: float, what: str, abandon_on_failure: bool = True) -> bool:
        job.fail(Failure(Cause.NODE_LOST, nodes={1}))  # ... while the wait runs
        waited.append(timeout)
        return bool(cond())

    fleet.wait_for = wait_for
    if phase is Phase.RECOVERING:
        with pytest.raises(RecoveryAbandoned, match="agents starting"):
            fleet.wait([0, 1])
    else:
        with pytest.raises(FatalRun, match=r"node\(s\) \[1\] lost while the agents started \(see runs/r/logs\)"):
            fleet.wait([0, 1])
    # (then a moment for the lost agent's own word on why it gave up: it has none here)
    assert waited == [fleet_mod.AGENT_START_TIMEOUT, 1.0]


class _Exited:
    def poll(self) -> int:
        return -9


def test_an_agent_that_dies_or_never_comes_up_while_it_starts_loses_its_node() -> None:
    # A node started again after a recovery, its ranks elsewhere, is waited for by nobody: its
    # agent killed while it started left the node without one, holding no replicas, for good.
    events: list[tuple[Any, dict[str, Any]]] = []
    dog = Watchdog(_job(3), None, lambda kind, **f: events.append((kind, f)), 1.0, 5.0, False)  # type: ignore[arg-type]
    dog.read_heartbeat = lambda st: None  # type: ignore[method-assign]
    job = dog.job
    lost: list[Any] = []
    job.fail = lost.append  # type: ignore[method-assign]
    job.nodes[1] = NodeState(1, _Agent(), incarnation=1)  # type: ignore[arg-type]  # starting, in time
    job.nodes[2] = NodeState(2, _Exited(), incarnation=1, failed="node busy")  # type: ignore[arg-type]
    dog.check_nodes()
    assert job.nodes[1].starting and not job.nodes[2].starting and job.nodes[2].lost
    assert [(k.value, f["node"], f["reason"], f["starting"], f["agent_error"]) for k, f in events] == [
        ("node_lost", 2, "agent-exit", True, "node busy")]
    job.nodes[1].started_at -= watchdog_mod.AGENT_START_TIMEOUT + 1  # never says it is up
    dog.check_nodes()
    assert [f.nodes for f in lost] == [{2}, {1}] and events[-1][1]["reason"] == "start-timeout"
    dog.check_nodes()  # a lost node is lost once
    assert len(lost) == 2


@pytest.mark.parametrize("phase", [Phase.RECOVERING, Phase.STARTING])
def test_an_agent_that_gives_up_starting_is_stopped_in_its_own_words(phase: Phase) -> None:
    # Two runs given one run id: node 1's agent finds the node held, says so and exits, and its
    # exit may be seen before its word, while node 0's agent is still starting. The job stops
    # naming the cause, not "lost while the agents started".
    fleet, _ = _fleet(2)
    job = fleet.job
    job.phase = phase
    job.nodes[0].up = job.nodes[1].up = False
    waits: list[float] = []

    def wait_for(cond: Any, timeout: float, what: str, abandon_on_failure: bool = True) -> bool:
        waits.append(timeout)
        if len(waits) == 1:
            job.nodes[1].declare_lost()  # the watchdog saw the exit ...
            job.fail(Failure(Cause.NODE_LOST, nodes={1}))
        else:
            job.nodes[1].failed = "run id 'ci' is in use on this host"  # ... then its word came
        return bool(cond())

    fleet.wait_for = wait_for
    with pytest.raises(FatalRun, match="^node 1: run id 'ci' is in use on this host$"):
        fleet.wait([0, 1])
    assert waits == [fleet_mod.AGENT_START_TIMEOUT, 1.0]


def test_a_node_no_rank_waits_for_is_started_again_later_and_later_not_recovered() -> None:
    # A link down: the node's ranks moved to node 0, and every start of node 1's agent ends at
    # once. As failures, four empty recoveries in half a second spent the restart budget and
    # stopped a job that was training.
    events: list[tuple[Any, dict[str, Any]]] = []
    dog = Watchdog(_job(2), None, lambda kind, **f: events.append((kind, f)), 1.0, 5.0, False)  # type: ignore[arg-type]
    dog.read_heartbeat = lambda st: None  # type: ignore[method-assign]
    job = dog.job
    job.phase = Phase.RUNNING
    job.members[1] = 0
    lost: list[Any] = []
    job.fail = lost.append  # type: ignore[method-assign]
    delays = []
    for incarnation in (1, 2, 3):
        job.nodes[1] = NodeState(1, _Exited(), incarnation=incarnation)  # type: ignore[arg-type]
        dog.check_nodes()
        delays.append(round(job.deferred_restarts[1] - time.monotonic()))
    assert lost == [] and delays == [1, 2, 4]
    assert [f["restart_in_s"] for _, f in events] == [1.0, 2.0, 4.0]
    assert job.start_failures[1] == 3
    job.start_failures[1] = 10
    job.nodes[1] = NodeState(1, _Exited(), incarnation=4)  # type: ignore[arg-type]
    dog.check_nodes()
    assert events[-1][1]["restart_in_s"] == watchdog_mod.START_RETRY_MAX_S
    # A rank placed on it again (going home) waits for it: then a failure, as before.
    job.members[1] = 1
    job.nodes[1] = NodeState(1, _Exited(), incarnation=5)  # type: ignore[arg-type]
    dog.check_nodes()
    assert [f.nodes for f in lost] == [{1}]

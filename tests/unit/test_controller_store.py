"""The controller's side of a hostile control store, over a real TCPStore: heartbeats (sealed,
newer only, of the node's current agent), the keys it owns (written again when changed or
deleted) and a store call that fails (recorded, a fresh connection, never an exception out of
`pump`). The controller is built bare, with only what these paths use."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from ffctl.controller.controller import Controller
from ffctl.controller.inbox import Inbox
from ffctl.controller.plane import ControlPlane
from ffctl.controller.state import JobState, NodeState, Phase
from ffctl.controller.watchdog import Watchdog
from wire import control, messages
from wire.generation_plan import GenerationPlan
from runs.events import EventKind
from tests.helpers.store import loopback_store

TOKEN = "e" * 64


class _Record:
    def __init__(self) -> None:
        self.events: list[tuple[EventKind, dict[str, Any]]] = []

    def append(self, kind: EventKind, /, t: float | None = None, **data: Any) -> None:
        self.events.append((kind, data))

    def rejected(self) -> list[dict[str, Any]]:
        return [data for kind, data in self.events if kind is EventKind.MESSAGE_REJECTED]


class _Agent:
    def poll(self) -> None:
        return None  # running

    def running_here(self) -> bool:
        return False  # on a host of its own: its silence is all the controller has


def _controller() -> tuple[Controller, _Record]:
    rec = _Record()
    plane = ControlPlane("127.0.0.1", TOKEN, 2, 2, rec.append)
    plane.store = plane.server = loopback_store()
    plane.inbox = control.Receiver(plane.store, control.CTL_QUEUE, opener=control.Opener(TOKEN),
                                   on_reject=plane.rejected)
    job = JobState.for_world(2, 1)
    ctl = Controller.__new__(Controller)
    ctl.job, ctl.plane, ctl._signals = job, plane, []
    ctl.watchdog = Watchdog(job, plane, rec.append, heartbeat_timeout=1.0, hang_min_s=5.0, plain_script=False)
    # The inbox as it is, its pieces that these paths never reach left out.
    ctl.inbox = Inbox(job, rec.append, plane, None, ctl.watchdog, None, None, None,  # type: ignore[arg-type]
                      lambda line: None, checkpoints=None, plain_script=False, straggler_policy=None)
    ctl.injector = SimpleNamespace(revert_due=lambda: None)  # type: ignore[assignment]
    return ctl, rec


def _beat(sealer: control.Sealer, node: int, beat: int, incarnation: int = 0) -> bytes:
    key = control.heartbeat_key(node)
    msg = messages.Heartbeat(node=node, incarnation=incarnation, beat=beat)
    return sealer.seal(key, msg.to_dict()).encode()


def test_only_a_newer_sealed_beat_of_the_current_agent_is_a_sign_of_life() -> None:
    ctl, rec = _controller()
    st = ctl.job.nodes[1] = NodeState(1, _Agent(), up=True)  # type: ignore[arg-type]
    agent = control.Sealer(TOKEN, "agent/1")
    first, second = _beat(agent, 1, 1), _beat(agent, 1, 2)
    key = control.heartbeat_key(1)

    def read(value: bytes | str) -> float:
        assert ctl.plane.store is not None
        ctl.plane.store.set(key, value)
        st.hb_seen = 0.0
        ctl.watchdog.read_heartbeat(st)
        return st.hb_seen

    assert read(first) > 0
    assert read(first) == 0.0  # the same value again is no news
    assert read(second) > 0
    assert read(first) == 0.0  # an older beat written back: a replay
    assert read("garbage") == 0.0
    assert read(_beat(control.Sealer(TOKEN, "agent/1"), 1, 1, incarnation=3)) == 0.0  # not its agent
    st.incarnation = 4
    assert read(_beat(control.Sealer(TOKEN, "agent/1"), 1, 5, incarnation=3)) == 0.0  # its previous agent's:
    st.incarnation = 0  # left in the key, no news, and nothing to report
    assert read(_beat(control.Sealer("x" * 64, "agent/1"), 1, 9)) == 0.0  # not sealed with the token
    reasons = [r["reason"] for r in rec.rejected()]
    assert len(reasons) == 4 and "replayed" in reasons[0] and "too short" in reasons[1], reasons
    assert "incarnation 3" in reasons[2] and "bad MAC" in reasons[3], reasons
    assert all(r["queue"] == key for r in rec.rejected())


def test_keys_the_controller_owns_are_written_again_when_changed_or_deleted() -> None:
    ctl, rec = _controller()
    plane = ctl.plane
    assert plane.store is not None
    plane.publish(1, GenerationPlan.fresh(1, 2, "peer"))
    plane.store.set(control.GEN_KEY, "0")
    ctl.pump()
    plane.store.delete_key(control.gen_plan_key(1))
    plane.guard_at = 0.0
    ctl.pump()
    assert control.read(plane.store, control.GEN_KEY) == plane.guarded[control.GEN_KEY]
    assert control.read(plane.store, control.gen_plan_key(1)) == plane.guarded[control.gen_plan_key(1)]
    assert [(r["queue"], r["reason"].split()[1]) for r in rec.rejected()] == [
        (control.GEN_KEY, "overwritten"), (control.gen_plan_key(1), "deleted")]


def test_a_failing_store_call_is_recorded_and_the_connection_opened_again() -> None:
    ctl, rec = _controller()
    plane = ctl.plane

    class Broken:
        def poll(self, max_items: int = 1000) -> list[Any]:
            raise dist.DistNetworkError("Failed to recv, got 0 bytes")

    good, plane.inbox = plane.inbox, Broken()  # type: ignore[assignment]
    before = plane.store
    t0 = time.monotonic()
    ctl.pump()  # no exception
    assert time.monotonic() - t0 < 5.0
    assert plane.store is not before  # a fresh connection to the same server
    assert "control store error: DistNetworkError" in rec.rejected()[0]["reason"]
    assert good is not None and plane.store is not None
    plane.inbox = good
    good.store = plane.store
    control.send_dict(plane.store, control.CTL_QUEUE, {"type": "junk"})  # the new connection works
    ctl.pump()
    assert plane.failing_since is None


def test_a_spawn_is_settled_by_the_agent_s_answer_for_its_own_generation_only() -> None:
    ctl, _ = _controller()
    job = ctl.job
    job.spawning = {0: (3, 0), 1: (3, 1)}
    # A late answer of an older generation's spawn settles nothing of this one.
    ctl.inbox.dispatch(messages.Spawned(node=1, gen=2, pids={}, dropped=[1]))
    assert job.spawning == {0: (3, 0), 1: (3, 1)} and not job.stopped(1)
    ctl.inbox.dispatch(messages.Spawned(node=0, gen=3, pids={"0": 700}))
    ctl.inbox.dispatch(messages.Spawned(node=1, gen=3, pids={}, dropped=[1]))
    assert job.spawning == {} and job.pids[0] == 700 and not job.stopped(0) and job.stopped(1)


def test_an_agent_replaced_while_it_started_is_not_taken_for_the_nodes_agent() -> None:
    # A recovery started node 1 again (incarnation 1) while its previous agent was still starting;
    # that one then says it is up. Taken for the node's agent, its pid would be what a kill-node
    # kills, while the node's real agent runs on and the fault is never seen.
    ctl, rec = _controller()
    st = ctl.job.nodes[1] = NodeState(1, _Agent(), incarnation=1)  # type: ignore[arg-type]
    ctl.inbox.fleet = SimpleNamespace(  # type: ignore[assignment]
        launcher=SimpleNamespace(clock_offset=lambda node: None), clock_offsets={},
        agent_time=lambda node, t: t, wire_ring=lambda: None)
    ctl.job.phase = Phase.RUNNING

    def up(incarnation: int, pid: int) -> None:
        ctl.inbox.dispatch(messages.AgentUp(node=1, incarnation=incarnation, pid=pid, host="h", time=time.time(),
                                            peer_address="127.0.0.1", peer_port=1))

    up(0, 4242)
    assert (st.up, st.pid) == (False, 0)
    stale = [data for kind, data in rec.events if kind is EventKind.AGENT_STALE]
    assert [(d["node"], d["incarnation"], d["current"], d["kind"], d["report"]["pid"]) for d in stale] == [
        (1, 0, 1, "agent_up", 4242)]
    ctl.job.start_failures[1] = 2  # its earlier starts ended before it was up
    up(1, 4343)
    assert (st.up, st.pid) == (True, 4343) and 1 not in ctl.job.start_failures  # the next waits 1 s again
    assert [data["pid"] for kind, data in rec.events if kind is EventKind.AGENT_STARTED] == [4343]


def test_no_report_of_a_replaced_agent_is_acted_on_and_each_is_recorded() -> None:
    # The stale agent's other reports went on landing on the node's state: its `spares` (no
    # template, no spares) made placement see a warm node as cold until the real agent's next.
    ctl, rec = _controller()
    st = ctl.job.nodes[1] = NodeState(1, _Agent(), incarnation=2)  # type: ignore[arg-type]
    st.spares, st.template = 1, True
    ctl.job.pids[3] = 900
    ctl.inbox.dispatch(messages.Spares(node=1, incarnation=1, count=0, total=0, template=False))
    ctl.inbox.dispatch(messages.Spawned(node=1, incarnation=1, gen=0, pids={"3": 555}))
    ctl.inbox.dispatch(messages.AgentFailed(node=1, incarnation=1, reason="node busy"))
    assert (st.spares, st.template, st.failed, ctl.job.pids[3]) == (1, True, "", 900)
    stale = [data for kind, data in rec.events if kind is EventKind.AGENT_STALE]
    assert [(d["kind"], d["incarnation"], d["current"]) for d in stale] == [
        ("spares", 1, 2), ("spawned", 1, 2), ("agent_failed", 1, 2)]
    assert stale[2]["report"]["reason"] == "node busy"  # the record keeps what it said
    # No agent of ours names an incarnation the controller has not started: refused.
    ctl.inbox.dispatch(messages.Spares(node=1, incarnation=3, count=0))
    assert st.spares == 1 and "agent incarnation 3 of node 1, which runs 2" in rec.rejected()[-1]["reason"]
    # The current agent's reports, and a rank's refusal (which names no incarnation), are acted on.
    ctl.inbox.dispatch(messages.Spares(node=1, incarnation=2, count=0, template=False))
    assert (st.spares, st.template) == (0, False)
    ctl.inbox.dispatch(messages.Refusal(node=1, rank=3, where="plan", reason="bad MAC"))
    assert rec.rejected()[-1]["reason"] == "bad MAC"


def test_every_report_an_agent_sends_names_its_incarnation() -> None:
    # The controller can drop a replaced agent's reports only where they say whose they are.
    for spec in messages.REPORTS.values():
        if "node" in spec.names and "rank" not in spec.names:  # what an agent sends of its own
            assert "incarnation" in spec.names, spec.cls.__name__
    sent = messages.from_agent(messages.Spares, 4, 7, count=1)
    assert (sent.node, sent.incarnation) == (4, 7)
    step = messages.from_agent(messages.Step, 4, 7, rank=0, gen=0, step=1, dt=0.1)  # the rank's: none
    assert not hasattr(step, "incarnation")


def test_a_step_error_before_its_ranks_spawn_report_is_the_root_cause() -> None:
    # On a loaded host rank 1 of a new generation failed in its first step before its agent's
    # spawn report came: its error was dropped, and its exit, filed after rank 0's (brought down
    # by it, in the allreduce), lost the root cause to rank 0.
    from ffctl.controller.failures import root_cause

    ctl, _ = _controller()
    job = ctl.job
    job.gen = 2
    ctl.inbox.fleet = SimpleNamespace(host=lambda node: f"h{node}")  # type: ignore[assignment]
    ctl.inbox.barrier = SimpleNamespace(exited=lambda *a: None)  # type: ignore[assignment]
    ctl.inbox.dispatch(messages.StepError(rank=1, node=1, gen=2, step=3, error="RuntimeError: boom"))
    assert job.pending is not None and set(job.pending.rank_failures) == {1}
    ctl.inbox.dispatch(messages.StepError(rank=1, node=0, gen=2, step=3, error="not where it runs"))
    ctl.inbox.dispatch(messages.StepError(rank=0, node=0, gen=1, step=3, error="an older generation's"))
    assert set(job.pending.rank_failures) == {1}
    for node, rank, pid in ((0, 0, 100), (1, 1, 101)):
        ctl.inbox.dispatch(messages.Spawned(node=node, incarnation=0, gen=2, pids={str(rank): pid}))
    for rank, pid in ((0, 100), (1, 101)):  # rank 0's exit is filed first
        ctl.inbox.dispatch(messages.RankExited(node=rank, incarnation=0, rank=rank, gen=2, pid=pid, exitcode=1,
                                               log_tail=["RecoveryError: allreduce failed"] if rank == 0 else None))
    cause = root_cause(job.pending)
    assert cause["rank"] == 1 and cause["error"] == "RuntimeError: boom" and cause["exitcode"] == 1, cause
    assert cause["pid"] == 101

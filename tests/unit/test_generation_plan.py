"""A generation's plan, typed from the controller's decision to a rank's restore: every kind of
source round-trips through its wire form, the one decoder refuses anything else with one line
naming what is wrong (an unknown kind of source, a field missing or of the wrong type, a plan
that contradicts itself), and a rank that reads such a plan, sealed and all, uses none of it:
it reports it, and the controller records a `message_rejected` event."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from wire import control
from recovery.job import Job
from wire.jobenv import Strategy
from wire.messages import DecodeError
from wire.generation_plan import Disk, Fresh, GenerationPlan, LocalSlot, PeerReplica, Where, decode_plan, decode_source
from runs.events import RestoreSource
from tests.unit.test_controller_store import TOKEN, _controller

PEER = {"type": "peer-memory", "address": "10.0.0.2", "port": 41000, "where": "replica"}


def _plan(**change: Any) -> dict[str, Any]:
    """A valid plan of generation 3 on the wire (world of 2, restore step 8), changed."""
    return {"type": "plan", "gen": 3, "world_size": 2, "strategy": "peer", "restore_step": 8,
            "sources": {"0": {"type": "local-memory", "node": 0}, "1": PEER}, **change}


def test_every_kind_of_source_round_trips() -> None:
    for source in (Fresh(), LocalSlot(node=1), PeerReplica(address="h", port=1, where=Where.LOCAL), Disk()):
        wire = json.loads(json.dumps(source.to_dict()))
        assert decode_source(wire) == source and wire["type"] == source.kind.value
        assert isinstance(source.kind, RestoreSource)


def test_a_plan_round_trips_typed() -> None:
    plan = decode_plan(json.loads(json.dumps(_plan())))
    assert plan == GenerationPlan(gen=3, world_size=2, strategy=Strategy.PEER, restore_step=8,
                                  sources={0: LocalSlot(node=0), 1: PeerReplica(address="10.0.0.2", port=41000,
                                                                                where=Where.REPLICA)})
    assert plan.strategy is Strategy.PEER and plan.sources[1].where is Where.REPLICA  # type: ignore[union-attr]
    assert plan.to_dict() == _plan() and decode_plan(plan.to_dict()) == plan
    assert plan.source(1).kind is RestoreSource.PEER_MEMORY
    fresh = GenerationPlan.fresh(0, 4, "restart-disk")
    assert decode_plan(fresh.to_dict()) == fresh and isinstance(fresh.source(3), Fresh)


@pytest.mark.parametrize("raw,why", [
    (_plan(sources={"0": {"type": "local-memory", "node": 0}, "1": {**PEER, "type": "peer-memroy"}}),
     "plan: sources: rank 1: unknown source kind 'peer-memroy'"),
    (_plan(sources={"0": {"type": "replica"}, "1": PEER}), "rank 0: unknown source kind 'replica'"),
    (_plan(sources={"0": {"node": 0}, "1": PEER}), "rank 0: unknown source kind None"),
    (_plan(sources={"0": {"type": "local-memory", "node": 0}, "1": {k: v for k, v in PEER.items() if k != "address"}}),
     "rank 1: peer-memory: missing field 'address'"),
    (_plan(sources={"0": {"type": "local-memory", "node": 0}, "1": {**PEER, "port": "41000"}}),
     "rank 1: peer-memory: bad port='41000'"),
    (_plan(sources={"0": {"type": "local-memory", "node": 0}, "1": {**PEER, "where": "elsewhere"}}),
     "rank 1: peer-memory: bad where='elsewhere'"),
    (_plan(sources={"0": {"type": "local-memory", "node": "0"}, "1": PEER}), "rank 0: local-memory: bad node='0'"),
    (_plan(sources={"0": {"type": "disk", "path": "/etc"}, "1": PEER}), "rank 0: disk: unexpected field 'path'"),
    (_plan(sources={"0": "disk", "1": PEER}), "rank 0: not a source: 'disk'"),
    (_plan(sources={"x": {"type": "disk"}}), "plan: sources: bad rank 'x'"),
    (_plan(sources=[PEER, PEER]), "plan: bad sources="),
    (_plan(sources={"0": {"type": "disk"}, "2": {"type": "disk"}}), "source for rank 2, outside a world of 2"),
    (_plan(sources={"0": {"type": "disk"}}), "restore step 8 but rank 1 has no copy of it"),
    (_plan(sources={"0": {"type": "disk"}, "1": {"type": "none"}}), "restore step 8 but rank 1 has no copy of it"),
    (_plan(world_size="2"), "plan: bad world_size='2'"),
    (_plan(world_size=0), "plan: bad world_size=0"),
    (_plan(strategy="hope"), "plan: bad strategy='hope'"),
    (_plan(restore_step=-1), "plan: bad restore_step=-1"),
    (_plan(restore_step=True), "plan: bad restore_step=True"),
    ({k: v for k, v in _plan().items() if k != "gen"}, "plan: missing field 'gen'"),
    (_plan(note="hi"), "plan: unexpected field 'note'"),
    (_plan(type="gen"), "a 'gen' where a plan belongs"),
    ([], "not a plan: []"),
])
def test_the_decoder_refuses_a_malformed_plan_with_one_line(raw: Any, why: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_plan(raw)
    assert why in info.value.reason and "\n" not in info.value.reason, info.value.reason


def test_a_plan_of_step_0_with_copies_restores_them() -> None:
    # The initial state is a step: a plan of step 0 that names copies is a restore (survivors
    # that trained past it go back to it), one that names none a fresh start.
    plan = GenerationPlan(gen=2, world_size=2, strategy=Strategy.PEER, restore_step=0,
                          sources={0: LocalSlot(node=0), 1: PeerReplica(address="h", port=1, where=Where.REPLICA)})
    assert plan.restores and plan.source(0) == LocalSlot(node=0) and decode_plan(plan.to_dict()) == plan
    fresh = GenerationPlan.fresh(2, 2, "peer")
    assert not fresh.restores and isinstance(fresh.source(0), Fresh)
    with pytest.raises(DecodeError, match="restore step 0 but rank 1 has no copy of it"):
        decode_plan(_plan(restore_step=0, sources={"0": {"type": "local-memory", "node": 0}}))


def test_a_plan_the_controller_makes_is_one_a_rank_accepts() -> None:
    # The checks of the whole plan run when it is made, too: the controller cannot publish one
    # that every rank would refuse.
    with pytest.raises(DecodeError):
        GenerationPlan(gen=1, world_size=2, strategy=Strategy.PEER, restore_step=5, sources={0: Disk()})
    with pytest.raises(ValueError):
        control.publish_plan(dist.HashStore(), 2, GenerationPlan.fresh(1, 2, "peer"))


def _rank(store: control.Store, rank: int = 1) -> Job:
    """A rank's `Job` with only what refusing a plan uses: its store, sealer and identity."""
    job = Job.__new__(Job)
    job.env = SimpleNamespace(rank=rank, node=0)  # type: ignore[assignment]
    job.store = store
    job._sealer = control.Sealer(TOKEN, f"rank/{rank}")
    job._opener = control.Opener(TOKEN)
    job._send_lock = threading.Lock()
    job._plans = control.Reader(job._opener, job._rejected)
    return job


@pytest.mark.parametrize("sources,why", [
    ({"0": {"type": "local-memory", "node": 0}, "1": {**PEER, "type": "peer-memroy"}},
     "unknown source kind 'peer-memroy'"),
    ({"0": {"type": "local-memory", "node": 0}, "1": {k: v for k, v in PEER.items() if k != "address"}},
     "missing field 'address'"),
])
def test_a_rank_refuses_a_malformed_sealed_plan_and_the_controller_records_it(sources: dict[str, Any],
                                                                               why: str) -> None:
    ctl, rec = _controller()
    store = ctl.plane.store
    assert store is not None
    key = control.gen_plan_key(3)
    # Sealed with the job's token: authentic, but not a plan a rank can follow.
    bad = control.Sealer(TOKEN, "controller").seal(key, _plan(sources=sources))
    store.set(key, bad)
    job = _rank(store)
    with pytest.raises(TimeoutError):
        control.newest_plan(job.store, 3, 0.3, job._opener, job._rejected, reader=job._plans)
    ctl.pump()
    rejected = rec.rejected()
    assert len(rejected) == 1, rejected  # reported once, however often the rank looked
    assert rejected[0]["queue"] == key and rejected[0]["reported_by_rank"] == 1
    assert "malformed plan" in rejected[0]["reason"] and why in rejected[0]["reason"], rejected[0]
    # The genuine plan, written over it, is the one the rank then follows.
    good = GenerationPlan(gen=3, world_size=2, strategy=Strategy.PEER, restore_step=8,
                          sources={0: LocalSlot(node=0), 1: PeerReplica(address="10.0.0.2", port=41000,
                                                                        where=Where.REPLICA)})
    control.publish_plan(store, 3, good, control.Sealer(TOKEN, "controller"))
    assert control.newest_plan(job.store, 3, 1.0, job._opener, job._rejected, reader=job._plans) == (3, good)

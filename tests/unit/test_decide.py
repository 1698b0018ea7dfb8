"""The recovery decision (restore step and per-rank sources) as a pure function: the next
generation's typed plan."""
from __future__ import annotations

from ffctl.controller.decide import Inventory, decide, ring_holder
from wire.jobenv import Strategy
from wire.generation_plan import Disk, Fresh, GenerationPlan, LocalSlot, PeerReplica, Where, decode_plan
from runs.events import RestoreSource

MEMBERS = {0: 0, 1: 0, 2: 1, 3: 1}
NODES = [0, 1]


def inv(node: int, local: dict[int, set[int]], replica: dict[int, set[int]]) -> Inventory:
    return Inventory(node, f"10.0.0.{node + 1}", 4000 + node,
                     {r: frozenset(s) for r, s in local.items()}, {r: frozenset(s) for r, s in replica.items()})


def test_ring_holder() -> None:
    assert ring_holder(0, [0, 1, 2]) == 1
    assert ring_holder(2, [0, 1, 2]) == 0
    assert ring_holder(0, [0]) is None


def test_process_fault_takes_the_newest_common_step_from_local_slots() -> None:
    invs = {0: inv(0, {0: {24, 25}, 1: {23, 24}}, {2: {24, 25}, 3: {24, 25}}),
            1: inv(1, {2: {24, 25}, 3: {24, 25}}, {0: {24, 25}, 1: {23, 24}})}
    d = decide("peer", MEMBERS, {1}, set(), invs, NODES, None, gen=1)
    assert d is not None and d.restore_step == 24
    assert d.restore_source == "local-memory"
    assert d.sources[1] == LocalSlot(node=0)
    # The decision is the next generation's plan, typed end to end, and what is published of it
    # decodes back to the same plan.
    assert isinstance(d.plan, GenerationPlan) and d.plan.gen == 1 and d.plan.world_size == 4
    assert d.plan.strategy is Strategy.PEER and d.plan.restore_step == 24
    assert decode_plan(d.plan.to_dict()) == d.plan


def test_node_fault_takes_lost_ranks_from_the_ring_neighbour() -> None:
    invs = {0: inv(0, {0: {39, 40}, 1: {39, 40}}, {2: {39, 40}, 3: {38, 39}})}
    d = decide("peer", MEMBERS, {2, 3}, {1}, invs, NODES, None, gen=1)
    assert d is not None and d.restore_step == 39 and d.restore_source == "peer-memory"
    assert d.sources[2] == PeerReplica(address="10.0.0.1", port=4000, where=Where.REPLICA)
    assert d.sources[0].kind is RestoreSource.LOCAL_MEMORY and isinstance(d.sources[0], LocalSlot)
    assert decode_plan(d.plan.to_dict()) == d.plan


def test_both_copies_gone_falls_back_to_disk_or_nothing() -> None:
    invs = {0: inv(0, {0: {39, 40}, 1: {39, 40}}, {})}  # node 0 never received node 1's replicas
    d = decide("peer", MEMBERS, {2, 3}, {1}, invs, NODES, 30, gen=1)
    assert d is not None and d.restore_source == "disk" and d.restore_step == 30
    assert d.lost_both_copies == (2, 3)
    assert all(s == Disk() for s in d.sources.values())
    assert decide("peer", MEMBERS, {2, 3}, {1}, invs, NODES, None, gen=1) is None


def test_excluded_copy_is_never_offered() -> None:
    invs = {0: inv(0, {0: {24, 25}, 1: {24, 25}}, {2: {24, 25}, 3: {24, 25}}),
            1: inv(1, {2: {24, 25}, 3: {24, 25}}, {0: {24, 25}, 1: {24, 25}})}
    d = decide("peer", MEMBERS, {1}, set(), invs, NODES, None,
               frozenset({(1, 25, "local-memory", ""), (1, 24, "local-memory", "")}), gen=1)
    assert d is not None and isinstance(d.sources[1], PeerReplica) and d.restore_step == 25


def test_a_corrupt_replica_rules_out_that_holder_only() -> None:
    """--snapshot-copies 2 on three nodes: node 2's rank restores from one holder's replica; once
    that copy is found corrupt, the same step comes from the other holder, and only with both
    ruled out does the decision go back a step (or to disk)."""
    members = {0: 0, 1: 1, 2: 2}
    invs = {0: inv(0, {0: {24, 25}}, {2: {24, 25}, 1: {24, 25}}), 1: inv(1, {1: {24, 25}}, {2: {24, 25}, 0: {24, 25}})}
    first = decide("peer", members, {2}, {2}, invs, [0, 1, 2], 20, gen=1)
    assert first is not None and first.restore_step == 25 and isinstance(first.sources[2], PeerReplica)
    used = f"{first.sources[2].address}:{first.sources[2].port}"
    again = decide("peer", members, {2}, {2}, invs, [0, 1, 2], 20, frozenset({(2, 25, "peer-memory", used)}), gen=2)
    assert again is not None and again.restore_step == 25 and again.restore_source == "peer-memory"
    other = again.sources[2]
    assert isinstance(other, PeerReplica) and f"{other.address}:{other.port}" != used
    both = frozenset({(2, 25, "peer-memory", "10.0.0.1:4000"), (2, 25, "peer-memory", "10.0.0.2:4001")})
    back = decide("peer", members, {2}, {2}, invs, [0, 1, 2], 20, both, gen=3)
    assert back is not None and back.restore_step == 24 and back.restore_source == "peer-memory"


def test_restart_disk_without_checkpoint_starts_over() -> None:
    d = decide("restart-disk", MEMBERS, {0, 1, 2, 3}, set(), {}, NODES, None, gen=1)
    assert d is not None and d.restore_step == 0 and d.restore_source == "none"
    assert all(isinstance(s, Fresh) for s in d.sources.values()) and d.plan.strategy is Strategy.RESTART_DISK
    d = decide("restart-disk", MEMBERS, {0, 1, 2, 3}, set(), {}, NODES, 50, gen=1)
    assert d is not None and d.restore_step == 50 and d.restore_source == "disk"


def test_a_rank_away_from_home_takes_the_replica_its_home_holds() -> None:
    # Rank 2 (launched on node 1) runs on node 0 after an earlier node fault and is killed: node
    # 0 holds its slot, node 1 (node 0's ring neighbour) a replica of the same steps. With
    # `homes` the replica wins, so that the rank can be started on node 1 again.
    members = {0: 0, 1: 0, 2: 0, 3: 1}
    invs = {0: inv(0, {0: {7, 8}, 1: {7, 8}, 2: {7, 8}}, {3: {7, 8}}),
            1: inv(1, {3: {7, 8}}, {0: {7, 8}, 1: {7, 8}, 2: {7, 8}})}
    d = decide(Strategy.PEER, members, {2}, set(), invs, NODES, None, gen=1, homes={2: 1})
    assert d is not None and d.restore_step == 8
    assert d.sources[2] == PeerReplica(address="10.0.0.2", port=4001, where=Where.REPLICA)
    assert d.sources[0] == LocalSlot(node=0)  # a survivor keeps its own slot
    # Without it, or when the home holds no copy of that step, the slot where the rank ran.
    assert decide(Strategy.PEER, members, {2}, set(), invs, NODES, None, gen=1).sources[2] == LocalSlot(node=0)
    bare = {0: invs[0], 1: inv(1, {3: {7, 8}}, {0: {7, 8}, 1: {7, 8}})}
    assert decide(Strategy.PEER, members, {2}, set(), bare, NODES, None, gen=1, homes={2: 1}).sources[2] \
        == LocalSlot(node=0)

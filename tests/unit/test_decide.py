"""The recovery decision (restore step and per-rank sources) as a pure function."""
from __future__ import annotations

from ffctl.controller.decide import Inventory, decide, ring_holder

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
    d = decide("peer", MEMBERS, {1}, set(), invs, NODES, None)
    assert d is not None and d.restore_step == 24
    assert d.restore_source == "local-memory"
    assert d.sources[1] == {"kind": "local-memory", "node": 0}


def test_node_fault_takes_lost_ranks_from_the_ring_neighbour() -> None:
    invs = {0: inv(0, {0: {39, 40}, 1: {39, 40}}, {2: {39, 40}, 3: {38, 39}})}
    d = decide("peer", MEMBERS, {2, 3}, {1}, invs, NODES, None)
    assert d is not None and d.restore_step == 39 and d.restore_source == "peer-memory"
    assert d.sources[2]["address"] == "10.0.0.1" and d.sources[2]["where"] == "replica"
    assert d.sources[0]["kind"] == "local-memory"


def test_both_copies_gone_falls_back_to_disk_or_nothing() -> None:
    invs = {0: inv(0, {0: {39, 40}, 1: {39, 40}}, {})}  # node 0 never received node 1's replicas
    d = decide("peer", MEMBERS, {2, 3}, {1}, invs, NODES, 30)
    assert d is not None and d.restore_source == "disk" and d.restore_step == 30
    assert d.lost_both_copies == (2, 3)
    assert all(s == {"kind": "disk"} for s in d.sources.values())
    assert decide("peer", MEMBERS, {2, 3}, {1}, invs, NODES, None) is None


def test_excluded_copy_is_never_offered() -> None:
    invs = {0: inv(0, {0: {24, 25}, 1: {24, 25}}, {2: {24, 25}, 3: {24, 25}}),
            1: inv(1, {2: {24, 25}, 3: {24, 25}}, {0: {24, 25}, 1: {24, 25}})}
    d = decide("peer", MEMBERS, {1}, set(), invs, NODES, None,
               frozenset({(1, 25, "local-memory"), (1, 24, "local-memory")}))
    assert d is not None and d.sources[1]["kind"] == "peer-memory" and d.restore_step == 25


def test_restart_disk_without_checkpoint_starts_over() -> None:
    d = decide("restart-disk", MEMBERS, {0, 1, 2, 3}, set(), {}, NODES, None)
    assert d is not None and d.restore_step == 0 and d.restore_source == "none"
    d = decide("restart-disk", MEMBERS, {0, 1, 2, 3}, set(), {}, NODES, 50)
    assert d is not None and d.restore_step == 50 and d.restore_source == "disk"

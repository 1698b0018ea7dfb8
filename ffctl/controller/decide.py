"""The recovery decision, as a pure function: which step to restore and where each rank's state
comes from (DESIGN.md step 3).

The restore step s is the newest step that every rank of the next generation can get: a survivor
from its own node's slots, a lost rank from its node's slots when the node survived (process
fault) or from the ring neighbour's replicas (node fault). Survivors only hold their two newest
slots, so s is never more than one step behind them. When no step is held everywhere, the newest
complete disk checkpoint is used; when there is none either, there is no decision (never
silently wrong state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recovery.jobenv import Strategy
from runs.events import RestoreSource


@dataclass(frozen=True)
class Inventory:
    """Valid snapshot steps an agent holds: its own ranks' slots and its neighbour's replicas."""

    node: int
    address: str
    port: int
    local: dict[int, frozenset[int]]
    replica: dict[int, frozenset[int]]


@dataclass(frozen=True)
class Decision:
    restore_step: int
    restore_source: RestoreSource  # local-memory | peer-memory | disk | none (fresh start)
    sources: dict[int, dict[str, Any]]
    lost_both_copies: tuple[int, ...] = ()  # ranks whose memory copies were all gone


def ring_holder(node: int, nodes: list[int]) -> int | None:
    """The node holding replicas of `node`'s slots: the next node on the ring."""
    ring = sorted(nodes)
    if len(ring) < 2:
        return None
    return ring[(ring.index(node) + 1) % len(ring)]


def _disk(world: list[int], disk_step: int | None, lost_both: tuple[int, ...]) -> Decision | None:
    if disk_step is None:
        return None
    return Decision(disk_step, RestoreSource.DISK, {r: {"kind": "disk"} for r in world}, lost_both)


def decide(
    strategy: str,
    members: dict[int, int],
    lost_ranks: set[int],
    lost_nodes: set[int],
    inventories: dict[int, Inventory],
    all_nodes: list[int],
    disk_step: int | None,
    exclude: frozenset[tuple[int, int, str]] = frozenset(),
) -> Decision | None:
    """`exclude` holds (rank, step, source kind) copies a rank found corrupt: never offered again."""
    world = sorted(members)
    if strategy == Strategy.RESTART_DISK:
        if disk_step is None:
            return Decision(0, RestoreSource.NONE, {r: {"kind": "none"} for r in world})
        return _disk(world, disk_step, ())
    options: dict[int, dict[int, dict[str, Any]]] = {}
    for rank in world:
        node = members[rank]
        here: dict[int, dict[str, Any]] = {}
        # A replica held by any live node (normally the ring neighbour; after several faults a
        # rank's newest copy may sit elsewhere). A local slot wins over a replica of the same step.
        for holder, inv in sorted(inventories.items()):
            if holder in lost_nodes:
                continue
            for step in inv.replica.get(rank, frozenset()):
                if (rank, step, "peer-memory") not in exclude:
                    here[step] = {"kind": "peer-memory", "address": inv.address, "port": inv.port, "where": "replica"}
        if node not in lost_nodes and node in inventories:
            for step in inventories[node].local.get(rank, frozenset()):
                if (rank, step, "local-memory") not in exclude:
                    here[step] = {"kind": "local-memory", "node": node}
        options[rank] = here
    common = set.intersection(*(set(o) for o in options.values())) if options else set()
    lost_both = tuple(sorted(r for r in lost_ranks if not options.get(r)))
    if not common:
        return _disk(world, disk_step, lost_both)
    step = max(common)
    sources = {r: options[r][step] for r in world}
    lost_kinds = {sources[r]["kind"] for r in lost_ranks} or {"local-memory"}
    label = RestoreSource.PEER_MEMORY if RestoreSource.PEER_MEMORY in lost_kinds else RestoreSource.LOCAL_MEMORY
    return Decision(step, label, sources)

"""The recovery decision, as a pure function: which step to restore and where each rank's state
comes from (DESIGN.md, One-step restoration, step 4).

The restore step s is the newest step that every rank of the next generation can get: a survivor
from its own node's slots, a lost rank from its node's slots when the node survived (process
fault) or from the ring neighbour's replicas (node fault). Survivors only hold their two newest
slots, so s is never more than one step behind them. When no step is held everywhere, the newest
complete disk checkpoint is used; when there is none either, there is no decision (never
silently wrong state).

With `replay` (`--verify-restore`, three slots a rank), the plan restores the oldest step held
everywhere instead of the newest, s, when they differ: the steps after it up to s (one or two)
are trained again, and each rank's loss of each is checked against the one it reported before
the fault (`verify_until` is s). Two steps back when they are held: a rank killed between
writing its snapshot of s and reporting s has no loss of s to compare, but has one of s - 1.
State that a restore cannot bring back (a prefetched batch the script never registered) then
shows as a different loss, before training goes on.

The decision is the next generation's typed plan (`wire.generation_plan.GenerationPlan`), published to
the ranks as it is, plus what only the controller needs to know about it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from wire.jobenv import Strategy
from wire.generation_plan import FRESH, Disk, GenerationPlan, LocalSlot, PeerReplica, Source, Where
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
    """The next generation's plan, where the lost ranks' state comes from (the run record's
    `restore_source`: local-memory | peer-memory | disk | none, a fresh start | script, an
    unchanged script restoring itself), and the ranks whose memory copies were all gone."""

    plan: GenerationPlan
    restore_source: RestoreSource
    lost_both_copies: tuple[int, ...] = ()
    # The newest step held everywhere, when the plan restores an older one to train the steps up
    # to it again and compare their losses (`replay`); 0: nothing to check.
    verify_until: int = 0

    @property
    def restore_step(self) -> int:
        return self.plan.restore_step

    @property
    def sources(self) -> Mapping[int, Source]:
        return self.plan.sources

    @classmethod
    def fresh(cls, gen: int, world_size: int, strategy: str, label: RestoreSource = RestoreSource.NONE) -> Decision:
        """Every rank of generation `gen` starts from step 0."""
        return cls(GenerationPlan.fresh(gen, world_size, strategy), label)


def ring_holder(node: int, nodes: list[int]) -> int | None:
    """The node holding replicas of `node`'s slots: the next node on the ring."""
    holders = ring_holders(node, nodes, 1)
    return holders[0] if holders else None


def ring_holders(node: int, nodes: list[int], copies: int) -> list[int]:
    """The nodes holding replicas of `node`'s slots (`--snapshot-copies`): the next `copies`
    nodes on the ring, fewer when fewer other nodes are up."""
    ring = sorted(nodes)
    at = ring.index(node)
    return [ring[(at + i) % len(ring)] for i in range(1, min(copies, len(ring) - 1) + 1)]


def _plan(gen: int, strategy: str, world: list[int], step: int, sources: Mapping[int, Source]) -> GenerationPlan:
    return GenerationPlan(gen=gen, world_size=len(world), strategy=Strategy(strategy), restore_step=step,
                          sources=dict(sources))


def _disk(gen: int, strategy: str, world: list[int], disk_step: int | None,
          lost_both: tuple[int, ...]) -> Decision | None:
    if disk_step is None:
        return None
    return Decision(_plan(gen, strategy, world, disk_step, {r: Disk() for r in world}), RestoreSource.DISK, lost_both)


def _replicas(rank: int, holders: Iterable[Inventory],
              exclude: frozenset[tuple[int, int, str, str]]) -> dict[int, Source]:
    """Step -> the replica of `rank` these holders offer (a later holder's wins), less the
    copies found corrupt."""
    out: dict[int, Source] = {}
    for inv in holders:
        for step in inv.replica[rank]:
            copy = PeerReplica(address=inv.address, port=inv.port, where=Where.REPLICA)
            if (rank, step, RestoreSource.PEER_MEMORY, copy.holder) not in exclude:
                out[step] = copy
    return out


def decide(
    strategy: str,
    members: dict[int, int],
    lost_ranks: set[int],
    lost_nodes: set[int],
    inventories: dict[int, Inventory],
    all_nodes: list[int],
    disk_step: int | None,
    exclude: frozenset[tuple[int, int, str, str]] = frozenset(),
    *,
    gen: int,
    replay: bool = False,
    homes: Mapping[int, int] | None = None,
) -> Decision | None:
    """Generation `gen`'s plan. `exclude` holds (rank, step, source kind, holder) copies a rank
    found corrupt (holder: a replica's "address:port", "" for a local slot): never offered
    again. `replay`: restore the oldest common step, to verify. `homes`: lost ranks that run
    away from the node they were launched on, and that node: there a replica of a step wins over
    the slot in the rank's current node's memory, so that the rank can go home with it
    (`coordinator.place`)."""
    world = sorted(members)
    if strategy == Strategy.RESTART_DISK:
        if disk_step is None:
            return Decision(_plan(gen, strategy, world, 0, {r: FRESH for r in world}), RestoreSource.NONE)
        return _disk(gen, strategy, world, disk_step, ())
    # Who holds replicas of each rank, gathered once: looking through every inventory for every
    # rank would cost nodes x ranks, a million lookups at a thousand nodes.
    held_by: dict[int, list[Inventory]] = {}
    for holder, inv in sorted(inventories.items()):
        if holder not in lost_nodes:
            for rank in inv.replica:
                held_by.setdefault(rank, []).append(inv)
    options: dict[int, dict[int, Source]] = {}
    for rank in world:
        node = members[rank]
        # A replica held by any live node (normally the ring neighbour; after several faults a
        # rank's newest copy may sit elsewhere). A local slot wins over a replica of the same step.
        here = _replicas(rank, held_by.get(rank, ()), exclude)
        if node not in lost_nodes and node in inventories:
            for step in inventories[node].local.get(rank, frozenset()):
                if (rank, step, RestoreSource.LOCAL_MEMORY, "") not in exclude:
                    here[step] = LocalSlot(node=node)
        home = (homes or {}).get(rank)
        if rank in lost_ranks and home is not None:
            here.update(_replicas(rank, [inv for inv in held_by.get(rank, ()) if inv.node == home], exclude))
        options[rank] = here
    common = set.intersection(*(set(o) for o in options.values())) if options else set()
    lost_both = tuple(sorted(r for r in lost_ranks if not options.get(r)))
    if not common:
        return _disk(gen, strategy, world, disk_step, lost_both)
    step = newest = max(common)
    if replay:
        step = min(common)
    sources = {r: options[r][step] for r in world}
    peer = any(isinstance(sources[r], PeerReplica) for r in lost_ranks)
    label = RestoreSource.PEER_MEMORY if peer else RestoreSource.LOCAL_MEMORY
    return Decision(_plan(gen, strategy, world, step, sources), label, verify_until=newest if step < newest else 0)

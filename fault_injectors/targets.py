"""Resolve a fault's target (rank, node, host or a seeded mode) against a topology, and check it
against a job's shape before the job exists."""
from __future__ import annotations

import math
import random

from fault_injectors.plan import Topology
from wire.fault_spec import FaultSpec, FaultSpecError, TargetMode


def resolve(spec: FaultSpec, topo: Topology) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ranks, nodes) the fault hits. Rank-level kinds pick ranks; node and network kinds nodes."""
    target = spec.target
    all_ranks = sorted(r.rank for r in topo.ranks)
    all_nodes = sorted(n.node for n in topo.nodes)
    by_rank = spec.kind.targets_rank
    if target.mode is TargetMode.RANK:
        rank = target.number
        if rank not in all_ranks:
            raise FaultSpecError(f"rank {rank} does not exist (world size {len(all_ranks)})")
        node = topo.rank(rank).node
        return ((rank,), (node,)) if by_rank else ((), (node,))
    if target.mode is TargetMode.NODE:
        node = target.number
        if node not in all_nodes:
            raise FaultSpecError(f"node {node} does not exist (nodes {all_nodes})")
        return (tuple(r.rank for r in topo.ranks_of(node)) if by_rank else (), (node,))
    if target.mode is TargetMode.HOST:
        nodes = tuple(n.node for n in topo.nodes if n.host == target.value)
        if not nodes:
            raise FaultSpecError(f"host {target.value!r} is not part of this run")
        ranks = tuple(r.rank for r in topo.ranks if r.node in nodes)
        return (ranks if by_rank else (), nodes)
    # A seeded pick is among the nodes that are up: one whose agent is starting again after an
    # earlier fault has nothing to hit yet (its ranks, if any, are elsewhere).
    up = [n.node for n in topo.nodes if n.agent_pid > 0]
    pool = all_ranks if by_rank else (up or all_nodes)
    rng = random.Random(spec.seed)
    if target.mode is TargetMode.ONE:
        count = 1
    elif target.mode is TargetMode.ALL:
        count = len(pool)
    elif target.mode is TargetMode.FIXED:
        count = target.number
        if count > len(pool):
            raise FaultSpecError(f"fixed:{count} asks for more targets than the {len(pool)} there are")
    else:
        count = max(1, math.floor(len(pool) * target.number / 100))
    chosen = tuple(sorted(rng.sample(pool, count)))
    if by_rank:
        return chosen, tuple(sorted({topo.rank(r).node for r in chosen}))
    return (), chosen


def check_in_job(spec: FaultSpec, world_size: int, nnodes: int) -> None:
    """Refuse a target outside a job of this shape, before any process of it exists (the same
    checks `resolve` makes against the live topology, for what the job's size alone decides)."""
    target = spec.target
    pool = world_size if spec.kind.targets_rank else nnodes
    if target.mode is TargetMode.RANK and target.number >= world_size:
        raise FaultSpecError(f"rank {target.value} does not exist (world size {world_size}: ranks 0-{world_size - 1})")
    if target.mode is TargetMode.NODE and target.number >= nnodes:
        raise FaultSpecError(f"node {target.value} does not exist ({nnodes} node(s): nodes 0-{nnodes - 1})")
    if target.mode is TargetMode.FIXED and target.number > pool:
        what = "ranks" if spec.kind.targets_rank else "nodes"
        raise FaultSpecError(f"fixed:{target.value} asks for more targets than the {pool} {what} there are")
    peer = spec.option("peer")
    if peer is not None and peer.isascii() and peer.isdigit() and int(peer) >= nnodes:
        raise FaultSpecError(f"peer={peer!r} is not a node of this job ({nnodes} node(s))")

"""Putting the state of the restore step back on every rank of a new generation.

Each rank starts from its own copy of step s (its 1/W slice of the replicated state, its whole
sharded and unique state), read from its agent, the ring neighbour or disk. Then:

1. each rank checks its copy and takes the checksum of every slice of its live replicated state
   (`prepare`: this needs no group, so it runs while the new group is being built); then, in one
   exchange (`agree`, the new group's first collective, which doubles as its barrier), every
   rank learns whether every copy is usable (if not, nobody loads anything), every slice's
   checksum in the copy that holds the slice, and so which ranks' live state matches the step.
   A survivor that stopped at step s matches ("kept"), its sharded state included (checked
   against its own copy); a replacement, a rank that got one step further, or a step function
   that changed state before its first collective does not;
2. when some rank matches, each rank that does not receives the slices it lacks (all but its
   own, which its copy holds), each from a rank that matches, point to point and side by side,
   checks them and loads the whole ("received"). Slice q comes from rank q when rank q matches,
   so the transfer is spread over the survivors. Ranks that match load their own live tensors
   inside the snapshot's structure, which puts back its non-tensor values (a learning rate a
   scheduler moved early in the aborted step), and their unique state (RNG, data position, a
   sharded optimizer's part);
3. when none matches (restart strategies: every process is new), all ranks allgather their slices
   and load the whole ("gathered").

Case 2 moves the replicated state once per replacement instead of to every rank, and no rank
sends more than a slice or two of it, so recovery time does not grow with the world size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from recovery import checksum
from recovery.errors import RecoveryError
from recovery.slots import SlotContent
from runs.events import RestoreHow
from recovery.snapshot import (
    Layout, Replicated, StateEntry, assemble, byte_view, own_bytes, own_pieces, read_meta, rebuild, replicated,
    slice_pieces, tensors_from,
)

if TYPE_CHECKING:
    from recovery.group import Generation

KEPT, RECEIVED, GATHERED = RestoreHow.KEPT, RestoreHow.RECEIVED, RestoreHow.GATHERED
TAG = 1 << 20  # point-to-point tag of slice 0 of the state transfer; slice q has TAG + q
TAG_OWN = 1 << 21  # ...and of rank r's shards sent by a live replica: TAG_OWN + r


def _slice_crcs(layout: Layout, tensors: tuple[torch.Tensor, ...], world: int) -> list[int]:
    """crc32 of each of the W slices of the live tensors."""
    out: list[int] = []
    for index in range(world):
        crc = 0
        for _, piece in slice_pieces(layout, tensors, index):
            crc = checksum.crc32(byte_view(piece), crc)
        out.append(crc)
    return out


def _set(entries: list[StateEntry], states: dict[str, Any]) -> None:
    for entry in entries:
        if entry.name not in states:
            raise RecoveryError(f"snapshot has no state {entry.name!r}")
        entry.set(states[entry.name])


class Unusable(Exception):
    """Some rank's copy of the restore step is missing or corrupt; `mine` says whether this
    rank's is one of them. Nobody has loaded anything."""

    def __init__(self, mine: bool) -> None:
        super().__init__("a copy of the restore step is unusable")
        self.mine = mine


@dataclass(frozen=True)
class Prepared:
    """What a rank can work out before the new group exists: whether its copy is usable and the
    checksums of its copy and of its live state. Computed while the group is being built."""

    content: SlotContent | None
    usable: bool
    meta: dict[str, Any] | None
    live: Replicated
    row: list[int]  # this rank's row of the exchange


def _own_crc(layout: Layout, tensors: tuple[torch.Tensor, ...]) -> int:
    crc = 0
    for _, piece in own_pieces(layout, tensors):
        crc = checksum.crc32(byte_view(piece), crc)
    return crc


# The columns of a rank's row in the exchange, before its W slice checksums of its live state.
USABLE, SLICE_CRC, SAME_LAYOUT, OWN_MATCHES, OWN_LIVE_CRC, OWN_COPY_CRC, REPLICA_CLASS, COPY_LOCAL = range(8)
HEAD = 8


def prepare(entries: list[StateEntry], content: SlotContent | None, step: int, world: int,
            local: bool = False) -> Prepared:
    """`local`: the copy was read from this rank's own agent (a survivor's, or a rank replaced
    on its own node), not from the ring neighbour or disk."""
    usable = content is not None and content.step == step and content.verify()
    meta = read_meta(content.meta) if usable and content is not None else None
    live = replicated(entries, world)
    same_layout = meta is not None and live.layout == meta["layout"]
    mine = _slice_crcs(live.layout, live.tensors, world) if same_layout else [0] * world
    slice_crc = own_copy = 0
    own_live = _own_crc(live.layout, live.tensors)
    if usable and content is not None and meta is not None:
        slice_crc = checksum.crc32(memoryview(content.shard)[: meta["layout"].slice_len(meta["rank"])])
        own_copy = checksum.crc32(own_bytes(meta, content.shard))
    # A rank's sharded state is kept when its live shards are its copy's, byte for byte.
    own_matches = int(usable and same_layout and own_live == own_copy)
    row = [int(usable), slice_crc, int(same_layout), own_matches, own_live, own_copy, _replica_class(entries),
           int(local), *mine]
    return Prepared(content, usable, meta, live, row)


def _replica_class(entries: list[StateEntry]) -> int:
    """Which ranks hold the same shards as this one (HSDP: the ranks of its column of the mesh),
    named by the lowest of them; -1 when the shards are this rank's alone (FSDP) or there are none."""
    groups = {e.replicas for e in entries if e.sharded and e.replicas}
    return min(next(iter(groups))) if len(groups) == 1 else -1


def agree(group: Generation, prepared: Prepared) -> list[list[int]]:
    """Every rank's row of `prepare`, in rank order: whether all copies are usable, every
    slice's checksum (from the copy that holds it) and which ranks' live state matches them all.
    Every rank of the group calls it together; once it returns, every rank has joined."""
    return [[int(v) for v in r.tolist()] for r in group.allgather(torch.tensor(prepared.row, dtype=torch.int64))]


def _healers(table: list[list[int]]) -> dict[int, int]:
    """For each rank whose shards must be put back and whose copy came from off its node (a
    replaced node's rank), a rank of its replica class on a surviving node that holds exactly
    those shards (same checksum as the copy) in its memory: its live shards when they are the
    step's, else its own agent's copy of the step (a survivor that finished one step more). It
    sends them. Every rank works out the same map from the same table."""
    members: dict[int, list[int]] = {}  # replica class -> its ranks: a look per class, not per rank
    for q, row in enumerate(table):
        members.setdefault(row[REPLICA_CLASS], []).append(q)
    out: dict[int, int] = {}
    for r, row in enumerate(table):
        if row[OWN_MATCHES] or row[COPY_LOCAL] or row[REPLICA_CLASS] < 0:
            continue
        holders = [q for q in members[row[REPLICA_CLASS]]
                   if q != r and table[q][OWN_COPY_CRC] == row[OWN_COPY_CRC] and (table[q][OWN_MATCHES] or table[q][COPY_LOCAL])]
        if holders:
            out[r] = min(holders, key=lambda q: (not table[q][OWN_MATCHES], q))  # live shards first
    return out


def restore(group: Generation, entries: list[StateEntry], prepared: Prepared, table: list[list[int]],
            keep_live: bool = False) -> RestoreHow:
    """Load the restore step on this rank from its copy, as `prepare` found it (nothing may have
    changed the live state since) and as the group agreed (`table`); every rank of the group
    calls it together. Returns how this rank got its state: "kept", "received", "gathered" (the
    replicated state, see the module's docstring) or "healed" (its shards from a live replica).
    With `keep_live`, a rank that keeps its state loads nothing at all: its unique state and
    non-tensor values stay as they are too (a survivor that goes on with the step it was in, see
    `Job._collective`).

    Sharded state is settled apart from the replicated: a rank whose live shards are its copy's
    keeps them; else, for a rank whose copy came from off its node, a rank of its replica class
    (HSDP) on a surviving node sends the same shards from its memory (the received bytes are
    checked against the copy's checksum); else it loads them from its copy."""
    world, rank = group.world_size, group.rank
    content, usable, meta, live = prepared.content, prepared.usable, prepared.meta, prepared.live
    if not all(r[USABLE] for r in table):
        raise Unusable(mine=not usable)
    assert content is not None and meta is not None
    layout: Layout = meta["layout"]
    want = [r[SLICE_CRC] for r in table]
    keepers = [q for q, r in enumerate(table) if r[SAME_LAYOUT] and r[HEAD:] == want]
    needers = [q for q in range(world) if q not in keepers]
    own, healed = _settle_shards(group, prepared, table)
    live_rep = live.tensors[: len(layout.specs)]

    if not keepers:
        whole = _gather(group, layout, memoryview(content.shard)[: layout.slice_len(rank)])
        _set(entries, assemble(meta, whole, copy=False, own=own if own is not None else b""))
        return RestoreHow.HEALED if healed else GATHERED
    senders = _senders(keepers, world)
    if rank in keepers:
        # Every keeper sends the slices it is assigned to every rank that needs them, so the
        # transfer is spread over the survivors instead of one of them sending the whole state.
        sends: list[tuple[torch.Tensor, int, int]] = []
        for q in [q for q in _filled(layout, world) if senders[q] == rank]:
            part = _slice(layout, live.tensors, q)
            sends += [(part, n, TAG + q) for n in needers if n != q]
        group.exchange(sends, [])
        if own is None:  # its shards are the step's too: nothing of it changes
            if not keep_live:
                _set(entries, rebuild(meta, live.tensors))
            return KEPT
        _set(entries, rebuild(meta, (*live_rep, *tensors_from(layout.own, own, copy=False))))
        return RestoreHow.HEALED if healed else RestoreHow.LOADED
    whole = torch.empty(layout.total, dtype=torch.uint8)
    lo, hi = layout.shard(rank)
    byte_view(whole[lo:hi])[:] = memoryview(content.shard)[: hi - lo]  # this rank's own slice: from its copy
    wanted = [q for q in _filled(layout, world) if q != rank]
    group.exchange([], [(whole[slice(*layout.shard(q))], senders[q], TAG + q) for q in wanted])
    bad = [q for q in wanted if checksum.crc32(byte_view(whole[slice(*layout.shard(q))])) != want[q]]
    if bad:
        raise RecoveryError(f"state for step {content.step}: slices {bad} from ranks "
                            f"{sorted({senders[q] for q in bad})} fail their checksums")
    if own is None:
        own = _own(meta, content.shard)  # live shards that are the step's, as bytes
    _set(entries, assemble(meta, whole, copy=False, own=own))
    return RestoreHow.HEALED if healed else RECEIVED


def _settle_shards(group: Generation, prepared: Prepared, table: list[list[int]]) -> tuple[torch.Tensor | None, bool]:
    """This rank's sharded bytes for the restore step: None when its live shards are the step's;
    else received from a live replica (True: healed) or read from its copy. Ranks that heal
    another send their live shards here, point to point."""
    rank, live, layout = group.rank, prepared.live, prepared.live.layout
    healers = _healers(table)
    sends = []
    if rank in healers.values():
        if table[rank][OWN_MATCHES]:
            mine = _own_buffer(layout, live.tensors)
        else:
            assert prepared.meta is not None and prepared.content is not None
            mine = _own(prepared.meta, prepared.content.shard)
        sends = [(mine, r, TAG_OWN + r) for r, q in sorted(healers.items()) if q == rank]
    got: torch.Tensor | None = None
    recvs = []
    if rank in healers:
        got = torch.empty(layout.own_total, dtype=torch.uint8)
        recvs = [(got, healers[rank], TAG_OWN + rank)]
    if sends or recvs:
        group.exchange(sends, recvs)
    if table[rank][OWN_MATCHES]:
        return None, False
    if got is not None:
        if checksum.crc32(byte_view(got)) != table[rank][OWN_COPY_CRC]:
            raise RecoveryError(f"shards from rank {healers[rank]} fail the checksum of rank {rank}'s copy")
        return got, True
    assert prepared.meta is not None and prepared.content is not None
    return _own(prepared.meta, prepared.content.shard), False


def _own_buffer(layout: Layout, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The live sharded tensors' bytes, in layout order, in one buffer (what a healer sends)."""
    out = torch.empty(layout.own_total, dtype=torch.uint8)
    for off, src in own_pieces(layout, tensors):
        out[off : off + src.numel()] = src
    return out


def _own(meta: dict[str, Any], shard: bytes) -> torch.Tensor:
    """This rank's sharded tensors' bytes from its copy, in a buffer of their own (the loaded
    tensors are views of it)."""
    raw = own_bytes(meta, shard)
    out = torch.empty(len(raw), dtype=torch.uint8)
    if len(raw):
        byte_view(out)[:] = raw
    return out


def _senders(keepers: list[int], world: int) -> dict[int, int]:
    """Which keeper sends slice q of the replicated state: rank q itself when it is a keeper,
    the slices of the other ranks spread over the keepers in turn. Every rank works out the
    same assignment from the same table."""
    out = {q: q for q in keepers}
    orphans = [q for q in range(world) if q not in out]
    out.update({q: keepers[i % len(keepers)] for i, q in enumerate(orphans)})
    return out


def _filled(layout: Layout, world: int) -> list[int]:
    """The slices that hold any bytes (with less state than ranks, the last ones are empty)."""
    return [q for q in range(world) if layout.shard(q)[0] < layout.shard(q)[1]]


def _slice(layout: Layout, tensors: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
    """Slice `index` of the live replicated byte string: a view when it lies in one tensor."""
    pieces = slice_pieces(layout, tensors, index)
    if len(pieces) == 1:
        return pieces[0][1]
    lo, hi = layout.shard(index)
    out = torch.empty(hi - lo, dtype=torch.uint8)
    for off, src in pieces:
        out[off : off + src.numel()] = src
    return out


def _gather(group: Generation, layout: Layout, shard: bytes | memoryview) -> torch.Tensor:
    mine = torch.zeros(layout.chunk, dtype=torch.uint8)
    if len(shard):
        mine[: len(shard)] = torch.frombuffer(bytearray(shard), dtype=torch.uint8)
    rows = torch.empty(group.world_size, layout.chunk, dtype=torch.uint8)
    group.allgather_into(mine, rows)
    return rows.reshape(-1)[: layout.total]

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

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from recovery.errors import RecoveryError
from recovery.slots import SlotContent
from runs.events import RestoreHow
from recovery.snapshot import (
    Layout, Replicated, StateEntry, assemble, byte_view, own_bytes, own_pieces, read_meta, rebuild, replicated,
    slice_pieces,
)

if TYPE_CHECKING:
    from recovery.group import Generation

KEPT, RECEIVED, GATHERED = RestoreHow.KEPT, RestoreHow.RECEIVED, RestoreHow.GATHERED
TAG = 1 << 20  # point-to-point tag of slice 0 of the state transfer; slice q has TAG + q


def _slice_crcs(layout: Layout, tensors: tuple[torch.Tensor, ...], world: int) -> list[int]:
    """crc32 of each of the W slices of the live tensors."""
    out: list[int] = []
    for index in range(world):
        crc = 0
        for _, piece in slice_pieces(layout, tensors, index):
            crc = zlib.crc32(byte_view(piece), crc)
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
        crc = zlib.crc32(byte_view(piece), crc)
    return crc


def prepare(entries: list[StateEntry], content: SlotContent | None, step: int, world: int) -> Prepared:
    usable = content is not None and content.step == step and content.verify()
    meta = read_meta(content.meta) if usable and content is not None else None
    live = replicated(entries, world)
    same_layout = meta is not None and live.layout == meta["layout"]
    mine = _slice_crcs(live.layout, live.tensors, world) if same_layout else [0] * world
    slice_crc = own_matches = 0
    if usable and content is not None and meta is not None:
        slice_crc = zlib.crc32(memoryview(content.shard)[: meta["layout"].slice_len(meta["rank"])])
        # A rank's sharded state exists nowhere else: it is kept when its live shards are the
        # copy's, byte for byte, and loaded from its copy otherwise.
        own_matches = int(same_layout and _own_crc(live.layout, live.tensors) == zlib.crc32(own_bytes(meta, content.shard)))
    return Prepared(content, usable, meta, live, [int(usable), slice_crc, int(same_layout), own_matches, *mine])


def agree(group: Generation, prepared: Prepared) -> list[list[int]]:
    """Every rank's row of `prepare`, in rank order: whether all copies are usable, every
    slice's checksum (from the copy that holds it) and which ranks' live state matches them all.
    Every rank of the group calls it together; once it returns, every rank has joined."""
    return [[int(v) for v in r.tolist()] for r in group.allgather(torch.tensor(prepared.row, dtype=torch.int64))]


def restore(group: Generation, entries: list[StateEntry], prepared: Prepared, table: list[list[int]],
            keep_live: bool = False) -> RestoreHow:
    """Load the restore step on this rank from its copy, as `prepare` found it (nothing may have
    changed the live state since) and as the group agreed (`table`); every rank of the group
    calls it together. Returns how this rank got its replicated state: "kept", "received" or
    "gathered". With `keep_live`, a rank that keeps its state loads nothing at all: its unique
    state and non-tensor values stay as they are too (a survivor that goes on with the step it
    was in, see `Job._collective`)."""
    world, rank = group.world_size, group.rank
    content, usable, meta, live = prepared.content, prepared.usable, prepared.meta, prepared.live
    if not all(r[0] for r in table):
        raise Unusable(mine=not usable)
    assert content is not None and meta is not None
    layout: Layout = meta["layout"]
    want = [r[1] for r in table]
    keepers = [q for q, r in enumerate(table) if r[2] and r[3] and r[4:] == want]
    needers = [q for q in range(world) if q not in keepers]
    matches = rank in keepers

    own = _own(meta, content.shard)
    if not keepers:
        whole = _gather(group, layout, memoryview(content.shard)[: layout.slice_len(rank)])
        _set(entries, assemble(meta, whole, copy=False, own=own))
        return GATHERED
    senders = _senders(keepers, world)
    if matches:
        # Every keeper sends the slices it is assigned to every rank that needs them, so the
        # transfer is spread over the survivors instead of one of them sending the whole state.
        sends: list[tuple[torch.Tensor, int, int]] = []
        for q in [q for q in _filled(layout, world) if senders[q] == rank]:
            part = _slice(layout, live.tensors, q)
            sends += [(part, n, TAG + q) for n in needers if n != q]
        group.exchange(sends, [])
        if not keep_live:
            _set(entries, rebuild(meta, live.tensors))
        return KEPT
    whole = torch.empty(layout.total, dtype=torch.uint8)
    lo, hi = layout.shard(rank)
    byte_view(whole[lo:hi])[:] = memoryview(content.shard)[: hi - lo]  # this rank's own slice: from its copy
    wanted = [q for q in _filled(layout, world) if q != rank]
    group.exchange([], [(whole[slice(*layout.shard(q))], senders[q], TAG + q) for q in wanted])
    bad = [q for q in wanted if zlib.crc32(byte_view(whole[slice(*layout.shard(q))])) != want[q]]
    if bad:
        raise RecoveryError(f"state for step {content.step}: slices {bad} from ranks "
                            f"{sorted({senders[q] for q in bad})} fail their checksums")
    _set(entries, assemble(meta, whole, copy=False, own=own))
    return RECEIVED


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

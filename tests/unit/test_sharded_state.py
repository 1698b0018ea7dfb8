"""Sharded state in a snapshot and at a restore, without processes.

A sharded entry's tensors are kept whole by their rank, as bytes after its replicated slice: a
capture laid out into a slot and read back gives the same tensors, bit for bit, and the restore's
checksum of a rank's own part finds a live state that moved. Which rank heals whose shards is
worked out from the exchange's table alone (`_healers`): only a rank whose copy came from off its
node, only from a rank of its replica class holding the same shards, live ones first.
"""
from __future__ import annotations

import zlib

import torch

from recovery.restore import (
    COPY_LOCAL, OWN_COPY_CRC, OWN_MATCHES, REPLICA_CLASS, _healers, _own_crc, _replica_class,
)
from recovery.snapshot import StateEntry, assemble, byte_view, capture, own_bytes, read_meta, replicated


def _entries(shard: torch.Tensor, weights: torch.Tensor, replicas: tuple[int, ...] = ()) -> list[StateEntry]:
    return [StateEntry("rep", lambda: {"w": weights}, lambda s: None, replicated=True),
            StateEntry("shards", lambda: {"s": shard, "lr": 0.5}, lambda s: None, replicated=False, sharded=True,
                       replicas=replicas),
            StateEntry("rng", lambda: {"seed": 7}, lambda s: None, replicated=False)]


def test_a_sharded_entry_round_trips_through_the_slot_bytes_bit_for_bit() -> None:
    shard = torch.randn(37, dtype=torch.float32)
    weights = torch.randn(10, dtype=torch.float64)
    cap = capture(_entries(shard, weights), step=4, rank=1, world_size=2)
    assert cap.shard_len == cap.layout.slice_len(1) + shard.numel() * 4
    raw = bytearray(cap.shard_len)
    for off, src in cap.shard_pieces():
        raw[off : off + src.numel()] = bytes(byte_view(src.contiguous()))
    meta = read_meta(cap.meta)
    # Only rank 1's slice of the replicated bytes is here; the other slice is zeros for the test.
    whole = torch.zeros(cap.layout.total, dtype=torch.uint8)
    lo, hi = cap.layout.shard(1)
    whole[lo:hi] = torch.frombuffer(bytearray(raw[: hi - lo]), dtype=torch.uint8)
    states = assemble(meta, whole, own=own_bytes(meta, bytes(raw)))
    assert torch.equal(states["shards"]["s"], shard) and states["shards"]["lr"] == 0.5
    assert states["rng"] == {"seed": 7}
    assert zlib.crc32(own_bytes(meta, bytes(raw))) == _own_crc(cap.layout, cap.tensors)
    shard.add_(1.0)  # the live shard moves on: its checksum no longer matches the copy's
    assert _own_crc(cap.layout, replicated(_entries(shard, weights), 2).tensors) != zlib.crc32(own_bytes(meta, bytes(raw)))


def test_the_replica_class_is_named_by_its_lowest_rank() -> None:
    t = torch.zeros(1)
    assert _replica_class(_entries(t, t, (3, 1))) == 1
    assert _replica_class(_entries(t, t)) == -1  # FSDP: the shards are the rank's alone


def _row(matches: int, copy_crc: int, klass: int, local: int) -> list[int]:
    row = [1] * 8
    row[OWN_MATCHES], row[OWN_COPY_CRC], row[REPLICA_CLASS], row[COPY_LOCAL] = matches, copy_crc, klass, local
    return row


def test_healers_prefer_live_shards_then_a_survivors_own_copy() -> None:
    # 2 x 2 HSDP: classes {0, 2} (crc 10) and {1, 3} (crc 20); node 1 (ranks 2, 3) was replaced.
    table = [_row(1, 10, 0, 1), _row(0, 20, 1, 1), _row(0, 10, 0, 0), _row(0, 20, 1, 0)]
    # Rank 0's live shards are the step's; rank 1 ran one step more but its own agent holds the step.
    assert _healers(table) == {2: 0, 3: 1}


def test_no_healing_without_a_holder_of_the_same_shards() -> None:
    table = [_row(1, 10, 0, 1), _row(1, 20, 1, 1), _row(0, 11, 0, 0), _row(0, 20, -1, 0)]
    # Rank 2's copy differs from rank 0's shards; rank 3's shards are its own (no class).
    assert _healers(table) == {}


def test_a_rank_with_a_copy_from_its_own_agent_loads_it() -> None:
    table = [_row(1, 10, 0, 1), _row(0, 10, 0, 1)]  # rank 1 replaced on its own node
    assert _healers(table) == {}

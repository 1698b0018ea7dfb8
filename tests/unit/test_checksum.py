"""Snapshot checksums over several threads: the value is zlib's CRC-32 whatever the split."""
from __future__ import annotations

import mmap
import os
import random
import threading
import zlib
from pathlib import Path

import pytest
import torch

from ffctl.agent.peerstore import PeerStore
from recovery import checksum
from recovery.peer import PeerClient
from recovery.slots import SlotContent, SlotWriter, read_slot, slot_path
from recovery.snapshot import StateEntry, byte_view, capture


def test_combine_is_the_crc_of_the_concatenation() -> None:
    rng = random.Random(7)
    for _ in range(200):
        a, b = rng.randbytes(rng.randint(0, 2000)), rng.randbytes(rng.randint(0, 2000))
        start = rng.getrandbits(32)
        assert checksum.combine(zlib.crc32(a, start), zlib.crc32(b), len(b)) == zlib.crc32(a + b, start)
    # Long second parts (the exponent's high bits) and an empty one.
    zeros = bytes(3 << 20)
    assert checksum.combine(zlib.crc32(b"head"), zlib.crc32(zeros), len(zeros)) == zlib.crc32(b"head" + zeros)
    assert checksum.combine(0x1234, 0, 0) == 0x1234


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 8])
def test_parallel_crc_equals_one_pass(threads: int) -> None:
    data = bytearray(os.urandom(1 << 20)) * (checksum.PARALLEL_MIN // (1 << 20) + 7)
    data[12345] ^= 0xFF
    assert checksum.crc32(data, threads=threads) == zlib.crc32(data)
    assert checksum.crc32(memoryview(data)[3:], 99, threads=threads) == zlib.crc32(memoryview(data)[3:], 99)


def test_every_kind_of_buffer_a_snapshot_is_checksummed_in() -> None:
    size = checksum.PARALLEL_MIN + 4099
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8)
    expected = zlib.crc32(bytes(byte_view(tensor)))
    assert checksum.crc32(byte_view(tensor), threads=4) == expected  # a live tensor's bytes
    with mmap.mmap(-1, size + 64) as mm:  # a slot's shared memory
        mm[64:] = bytes(byte_view(tensor))
        view = memoryview(mm)[64:]
        assert checksum.crc32(view, threads=4) == expected
        view.release()
    assert checksum.crc32(bytes(byte_view(tensor)), threads=4) == expected


def test_threads_only_for_large_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    real_start = threading.Thread.start

    def counting_start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    checksum.crc32(bytes(checksum.PARALLEL_MIN - 1), threads=8)
    assert started == []  # a model the size of the tests' takes one pass, no thread
    checksum.crc32(bytes(checksum.PARALLEL_MIN * 2), threads=8)
    # Parts no smaller than PART_MIN: 64 MiB over 8 threads is 4 parts, 3 of them on threads.
    assert started == ["ffctl-crc"] * (checksum.PARALLEL_MIN * 2 // checksum.PART_MIN - 1)
    assert not [t for t in threading.enumerate() if t.name == "ffctl-crc"]  # none outlives the call


def test_default_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(32)))
    monkeypatch.delenv(checksum.THREADS_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert checksum.default_threads() == checksum.MAX_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 ranks share 32 cores
    assert checksum.default_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert checksum.default_threads() == 1
    monkeypatch.setenv(checksum.THREADS_ENV, "3")
    assert checksum.default_threads() == 3
    for garbage in ("0", "-2", "many", ""):
        monkeypatch.setenv(checksum.THREADS_ENV, garbage)
        assert checksum.default_threads() == 1  # ignored: the share again


def test_large_slot_checksummed_on_threads_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's slot over PARALLEL_MIN: the rank writes its checksum on threads, the neighbour's
    agent checks it on threads, and both are the one-pass CRC-32 a reader of any kind computes."""
    monkeypatch.setenv(checksum.THREADS_ENV, "4")
    weights = torch.randn(checksum.PARALLEL_MIN // 4 + 1000)
    entries = [StateEntry("w", lambda: {"w": weights}, lambda _s: None, False, sharded=True)]
    writer = SlotWriter(str(tmp_path), "r", 0, 0)
    writer.begin(capture(entries, 5, 0, 1))
    writer.fence()
    content = read_slot(writer.paths[1])
    writer.close()
    assert content is not None and len(content.shard) > checksum.PARALLEL_MIN
    assert content.crc == zlib.crc32(content.shard, zlib.crc32(content.meta)) and content.verify()
    store = PeerStore("127.0.0.1", "t" * 64, lambda rank, slot: slot_path(str(tmp_path), "r", 0, rank, slot)).start()
    try:
        client = PeerClient(store.address, store.port, "t" * 64)
        client.put(0, content)
        assert client.get(0, 5, "replica") == content
        bad = bytearray(content.shard)
        bad[len(bad) // 2] ^= 1  # a flipped bit in the part a thread checks
        with pytest.raises(Exception, match="refused replica"):
            client.put(0, SlotContent(7, content.meta, bytes(bad), content.crc))
        assert not SlotContent(7, content.meta, bytes(bad), content.crc).verify()
        client.close()
    finally:
        store.stop()

"""Shared-memory snapshot slots: two per rank (`step % 2`; three under `--verify-restore`, `step %
3`), files in the run's private directory in /dev/shm (`runs.shm`), owned by the node agent.

A slot is a file mapped by the rank that writes it and by the agent that streams and serves it.
A crash of the rank loses nothing already committed. Layout: a 4 KiB header, then the pickled
meta, then the rank's shard of the replicated state. The header is written last (after a crc32 of
everything behind it), so a rank killed mid-copy leaves a slot marked `writing`, never a valid
slot with torn content; the other slot still holds the step before. Slots are created with
O_EXCL and reopened with O_NOFOLLOW, and only regular files of ours are used
(`runs.shm.open_file`).
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from recovery import checksum
from recovery.doorbell import Ringer
from runs import shm
from runs.shm import claim_path, slot_path

if TYPE_CHECKING:
    from recovery.snapshot import Capture

MAGIC = b"FFS1"
HEADER = struct.Struct("<4sIqQQIQ")  # magic, state, step, meta_len, shard_len, crc, seq
ACK = struct.Struct("<q")  # replicated step, written by the agent only
ACK_OFFSET = 64
DATA_OFFSET = 4096
MAX_SLOTS = 9  # slot files are named s0..s9 (`runs.shm`)
EMPTY, WRITING, VALID = 0, 1, 2


class NodeBusy(Exception):
    """Another live process holds this node's slot names (a second run with the same id)."""


def claim_node(shm_dir: str, run_id: str, node: int) -> int:
    """Claim a node's slot names for the caller's lifetime: an flock, which the kernel releases
    when the holder dies, however it dies. Two runs given the same run id on one host each have
    their own directory, but would still stand in each other's way (the same namespaces, dead
    man's switches and `--run` scopes), so the second is refused while the first lives. Makes the
    run's private directory if no other agent of this host has (UnsafeShm if something else
    stands there). Returns the descriptor to keep open (not inherited by children)."""
    shm.ensure_private_dir(shm_dir)
    path = claim_path(shm_dir, run_id, node)
    twins = shm.live_twins(shm_dir, run_id, node)
    try:
        if twins:
            raise BlockingIOError
        return shm.hold(path)
    except BlockingIOError:
        held = twins[0] if twins else path
        raise NodeBusy(f"run id {run_id!r} is in use on this host: another ffctl run holds node {node}'s "
                       f"snapshot slots ({shm.redact(str(held))}); give this run another --run-id") from None


def release_node(shm_dir: str, run_id: str, node: int, fd: int) -> None:
    """Give up a claim, removing the lock file first (while still held, so nobody holds a lock
    on a name that is gone)."""
    claim_path(shm_dir, run_id, node).unlink(missing_ok=True)
    os.close(fd)


@dataclass(frozen=True)
class SlotHeader:
    state: int
    step: int
    meta_len: int
    shard_len: int
    crc: int
    seq: int
    replicated_step: int

    @property
    def valid(self) -> bool:
        return self.state == VALID


@dataclass(frozen=True)
class SlotContent:
    step: int
    meta: bytes
    shard: bytes
    crc: int

    def verify(self) -> bool:
        return checksum.crc32(self.shard, zlib.crc32(self.meta)) == self.crc


def parse_header(raw: bytes | mmap.mmap) -> SlotHeader | None:
    if len(raw) < ACK_OFFSET + ACK.size:
        return None
    magic, state, step, meta_len, shard_len, crc, seq = HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        return None
    (rep,) = ACK.unpack_from(raw, ACK_OFFSET)
    return SlotHeader(state, step, meta_len, shard_len, crc, seq, rep)


class HeaderWatch:
    """Watches a slot's header through a read-only mapping: no system call per look, which
    matters to an agent that looks every few milliseconds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = shm.open_file(path)
        try:
            self._mm = mmap.mmap(fd, ACK_OFFSET + ACK.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def read(self) -> SlotHeader | None:
        return parse_header(self._mm)

    def close(self) -> None:
        self._mm.close()


def read_header(path: Path) -> SlotHeader | None:
    try:
        fd = shm.open_file(path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(ACK_OFFSET + ACK.size)
    return parse_header(raw)


def read_slot(path: Path) -> SlotContent | None:
    """A consistent copy of a valid slot, or None (empty, being written, or changed while read)."""
    before = read_header(path)
    if before is None or not before.valid:
        return None
    with os.fdopen(shm.open_file(path), "rb") as fh:
        fh.seek(DATA_OFFSET)
        meta = fh.read(before.meta_len)
        shard = fh.read(before.shard_len)
    after = read_header(path)
    # Seqlock: the writer bumps seq before touching data, so equal seqs mean an untorn read.
    if after is None or after.seq != before.seq or not after.valid:
        return None
    return SlotContent(before.step, meta, shard, before.crc)


def write_ack(path: Path, step: int) -> None:
    with os.fdopen(shm.open_file(path, os.O_RDWR), "r+b") as fh:
        fh.seek(ACK_OFFSET)
        fh.write(ACK.pack(step))


class SlotWriter:
    """Writes one rank's captures into its two slots in a background thread.

    `begin` returns at once; the copy overlaps the next step's forward and backward. `fence`
    waits for it and must be called before the optimizer mutates the captured tensors.
    """

    def __init__(self, shm_dir: str, run_id: str, node: int, rank: int, token: str = "", slots: int = 2) -> None:
        if not 2 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots {slots!r}: 2 to {MAX_SLOTS}")
        # Only ever the run's private directory, which this node's agent made before any rank.
        shm.check_private_dir(shm_dir)
        self.slots = slots
        self.paths = [slot_path(shm_dir, run_id, node, rank, s) for s in range(slots)]
        self._bell = Ringer(run_id, node, token)  # tells the agent to stream now, so it need not poll
        self._maps: list[tuple[int, mmap.mmap] | None] = [None] * slots
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._seq = 0
        self.last_written = -1

    def _map(self, slot: int, size: int) -> mmap.mmap:
        current = self._maps[slot]
        if current is not None and current[0] >= size:
            return current[1]
        if current is not None:
            current[1].close()
        # Created anew (O_EXCL) or, for a replacement of the rank, its predecessor's file reopened:
        # never through a symlink, never a file that is not ours.
        fd, created = shm.open_or_create(self.paths[slot])
        try:
            fresh = created or os.fstat(fd).st_size == 0
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if fresh:
            ACK.pack_into(mm, ACK_OFFSET, -1)  # zero would read as "step 0 is replicated"
        self._maps[slot] = (size, mm)
        return mm

    def _copy(self, cap: Capture, mm: mmap.mmap) -> None:
        self._seq += 1
        HEADER.pack_into(mm, 0, MAGIC, WRITING, cap.step, 0, 0, 0, self._seq)
        mm[DATA_OFFSET : DATA_OFFSET + len(cap.meta)] = cap.meta
        base = DATA_OFFSET + len(cap.meta)
        if cap.shard_len:
            # Here, not at the top: the agent reads these slots without torch (only a rank,
            # which has it, writes them).
            import torch

            dst = torch.frombuffer(mm, dtype=torch.uint8, count=cap.shard_len, offset=base)
            for off, src in cap.shard_pieces():
                dst[off : off + src.numel()].copy_(src)
            del dst  # release the buffer export so the map can be closed later
        crc = checksum.crc32(memoryview(mm)[base : base + cap.shard_len], zlib.crc32(cap.meta))
        HEADER.pack_into(mm, 0, MAGIC, VALID, cap.step, len(cap.meta), cap.shard_len, crc, self._seq)
        self.last_written = cap.step
        self._bell.ring()

    def begin(self, cap: Capture, then: Callable[[], None] | None = None) -> None:
        """Copy `cap` in the background, then call `then` (on the copying thread)."""
        self.fence()
        mm = self._map(cap.step % self.slots, DATA_OFFSET + len(cap.meta) + cap.shard_len)

        def run() -> None:
            try:
                self._copy(cap, mm)
                if then is not None:
                    then()
            except BaseException as exc:  # surfaced by fence()
                self._error = exc

        self._thread = threading.Thread(target=run, name="ffctl-snapshot", daemon=True)
        self._thread.start()

    def fence(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait_ack(self, timeout: float) -> None:
        """Sleep until the agent answers that it acknowledged a slot (or `wake`), at most `timeout`."""
        self._bell.wait(timeout)

    def wake(self) -> None:
        """End a `wait_ack` now (from another thread)."""
        self._bell.wake()

    def replicated_step(self, step: int) -> int:
        # Read from our own mapping: the fence polls this, and a file open per poll costs a
        # rank real CPU on a busy host.
        mapped = self._maps[step % self.slots]
        if mapped is None:
            return -1
        (rep,) = ACK.unpack_from(mapped[1], ACK_OFFSET)
        return int(rep)

    def close(self) -> None:
        self.fence()
        for entry in self._maps:
            if entry is not None:
                entry[1].close()
        self._maps = [None] * self.slots
        self._bell.close()

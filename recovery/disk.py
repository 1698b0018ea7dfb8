"""Disk checkpoints: the same per-rank content as a memory slot, written atomically to a file.

`<ckpt_dir>/step-<k>/rank-<r>.snap` is written to a temp name, fsync'd and renamed; the
controller marks a step complete (`COMPLETE`) once every rank has reported its file, so a restart
never reads a checkpoint some rank did not finish.
"""
from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

from recovery import checksum
from recovery.slots import SlotContent
from recovery.snapshot import Capture, byte_view

_HEAD = struct.Struct("<4sqQQI")  # magic, step, meta_len, shard_len, crc
MAGIC = b"FFD1"


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step-{step:08d}"


def rank_file(ckpt_dir: str | Path, step: int, rank: int) -> Path:
    return step_dir(ckpt_dir, step) / f"rank-{rank}.snap"


def save(ckpt_dir: str | Path, cap: Capture) -> Path:
    shard = bytearray(cap.shard_len)
    view = memoryview(shard)
    for off, src in cap.shard_pieces():
        view[off : off + src.numel()] = byte_view(src)
    crc = checksum.crc32(shard, zlib.crc32(cap.meta))
    path = rank_file(ckpt_dir, cap.step, cap.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(_HEAD.pack(MAGIC, cap.step, len(cap.meta), len(shard), crc))
        fh.write(cap.meta)
        fh.write(shard)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def load(ckpt_dir: str | Path, step: int, rank: int) -> SlotContent | None:
    path = rank_file(ckpt_dir, step, rank)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    magic, fstep, meta_len, shard_len, crc = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC or fstep != step:
        return None
    body = raw[_HEAD.size :]
    return SlotContent(step, body[:meta_len], body[meta_len : meta_len + shard_len], crc)


def mark_complete(ckpt_dir: str | Path, step: int) -> None:
    (step_dir(ckpt_dir, step) / "COMPLETE").touch()


def complete_steps(ckpt_dir: str | Path) -> list[int]:
    """The steps of `ckpt_dir` every rank finished (marked complete), in order."""
    steps = []
    for path in Path(ckpt_dir).glob("step-*/COMPLETE"):
        digits = path.parent.name[len("step-"):]
        if digits.isdigit():
            steps.append(int(digits))
    return sorted(steps)


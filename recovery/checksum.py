"""Checksums of snapshot bytes: zlib's CRC-32, over several threads when the bytes are many.

Every snapshot is checksummed where it is written (the rank, every step), where it is received
(the neighbour's agent, every step) and where it is restored. zlib's CRC-32 runs at about 4 GB/s
on one core: for a rank whose shard of the parameters and optimizer state is gigabytes, that is
seconds a step, longer than the step itself, and the rank's next update waits for its snapshot.
The CRC-32 of a concatenation follows from the CRC-32s of its parts and the second part's length
(`combine`, the algebra zlib's `crc32_combine` uses), so a large buffer is cut into parts that
threads checksum at once (zlib lets go of the GIL while it runs) and the parts are combined.
The value is the one a single pass gives: whoever checks a checksum needs to agree on nothing
but CRC-32, however many threads wrote it.

Small buffers (a model the size of the tests', a CPU host whose cores all train) take the single
pass: threads would only add their start-up to work that takes milliseconds.
"""
from __future__ import annotations

import os
import threading
import zlib
from typing import Any

POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected (as zlib computes it)
PARALLEL_MIN = 32 << 20  # bytes below which one pass is used
PART_MIN = 16 << 20  # no thread gets a part smaller than this
MAX_THREADS = 8
THREADS_ENV = "FFCTL_CHECKSUM_THREADS"


def _times(a: int, b: int) -> int:
    """a(x) * b(x) modulo CRC-32's polynomial, both in zlib's reflected form (x^0 is bit 31)."""
    m, product = 1 << 31, 0
    while m:
        if a & m:
            product ^= b
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
        m >>= 1
    return product


def _squares() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, for k = 0..63."""
    table = [1 << 30]  # x^1
    for _ in range(63):
        table.append(_times(table[-1], table[-1]))
    return tuple(table)


_X_2K = _squares()


def _x_to_8n(n: int) -> int:
    """x^(8n) modulo the polynomial: what appending n zero bytes multiplies a CRC's register by."""
    result, k, n = 1 << 31, 3, n  # x^0; 8n = n * 2^3
    while n:
        if n & 1:
            result = _times(_X_2K[k % 64], result)
        n >>= 1
        k += 1
    return result


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of A + B from CRC-32(A), CRC-32(B) and len(B) in bytes."""
    if len_b <= 0:
        return crc_a
    return _times(_x_to_8n(len_b), crc_a) ^ crc_b


def default_threads() -> int:
    """Threads a checksum may use: `FFCTL_CHECKSUM_THREADS` if set, else this process's share of
    the cores it may run on (the node's ranks share them: `LOCAL_WORLD_SIZE`), at most 8."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw.isdigit() and int(raw) > 0:
        return min(int(raw), 64)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    share = cpus // max(1, int(local)) if local.isdigit() and int(local) > 0 else cpus
    return max(1, min(MAX_THREADS, share))


def crc32(data: Any, value: int = 0, threads: int | None = None) -> int:
    """zlib.crc32(data, value), on up to `threads` threads (`default_threads()` by default) when
    `data` (anything with the buffer protocol) is PARALLEL_MIN bytes or more."""
    view = memoryview(data).cast("B")
    size = len(view)
    if size < PARALLEL_MIN:  # every step of a small model: no environment or affinity read
        return zlib.crc32(view, value)
    want = default_threads() if threads is None else max(1, threads)
    parts = min(want, size // PART_MIN)
    if parts <= 1:
        return zlib.crc32(view, value)
    bounds = [size * i // parts for i in range(parts + 1)]
    results = [0] * parts
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = zlib.crc32(view[bounds[i]:bounds[i + 1]])
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    # Threads of this call only, gone when it returns: a process that forks (an agent forking
    # its worker template) must not carry a pool's idle threads into the fork.
    workers = [threading.Thread(target=run, args=(i,), name="ffctl-crc", daemon=True) for i in range(1, parts)]
    for w in workers:
        w.start()
    first = zlib.crc32(view[:bounds[1]], value)
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    crc = first
    for i in range(1, parts):
        crc = combine(crc, results[i], bounds[i + 1] - bounds[i])
    return crc

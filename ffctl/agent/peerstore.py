"""The agent's snapshot store: the server side of the snapshot channel (`recovery.peer`).

It serves the agent's own ranks' slots from shared memory and holds replicas of its ring
neighbour's slots in memory. A put is two-phase (see `recovery.peer`); the store verifies the
slot's checksum (it travels with the copy) before it keeps a committed copy, so a slot corrupted
in the sender's memory never becomes the replica a replacement restores from; whoever restores
verifies it again.

A put names its own length, so the store caps it before allocating anything: at most
`max_slot_bytes` for one (rank, slot) and `max_total_bytes` over every buffer it holds (by
default half the host's memory). The per-slot cap defaults to the size a slot of this job can
have: twice the largest slot this node's own ranks wrote (the ring neighbour's ranks hold shards
of the same state), at least 256 MiB (before any is written), at most a quarter of the memory; a
put of gigabytes with the token would otherwise make the agent zero them and miss its
heartbeats. A put over either is refused, logged, and its connection closed; nothing of it is
allocated or read.

Whatever the store refuses (a client that fails the token handshake, a malformed frame, a put over
a cap, a copy whose checksum does not match) is logged and handed to `on_refused`, which the agent
turns into a `message_rejected` event in the run record; a few a second at most, the rest counted
and the count handed over with the next one, so a client that hammers the port cannot flood the
record. A refusal closes that one connection and nothing else.
"""
from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from recovery import checksum
from recovery.peer import (
    MAX_REQUEST_PAYLOAD, ChannelError, local_address, recv_exact, recv_header, recv_into, send_frame, server_handshake,
)
from recovery.slots import SlotContent, read_slot
from recovery.throttle import Throttle

log = logging.getLogger(__name__)


@dataclass
class _Replica:
    step: int
    crc: int
    meta_len: int
    length: int
    buf: bytearray

    def content(self) -> SlotContent:
        view = memoryview(self.buf)
        return SlotContent(self.step, bytes(view[: self.meta_len]), bytes(view[self.meta_len : self.length]), self.crc)


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return 1 << 34


class PeerStore:
    """An agent's snapshot server: local slots from shared memory, neighbour replicas in memory."""

    # How many refusals a second reach `on_refused`; beyond that they are counted and the count
    # goes with the next one reported.
    REPORTS_PER_S = 5

    def __init__(self, address: str, token: str, local_slot: Callable[[int, int], Path],
                 max_slot_bytes: int | None = None, max_total_bytes: int | None = None,
                 on_refused: Callable[[str, int], None] | None = None, slots: int = 2) -> None:
        self.token = token
        self.slots = slots  # per rank, used in turn (`step % slots`), as the ranks' SlotWriter
        self.on_refused = on_refused
        self.reports = Throttle(self.REPORTS_PER_S)
        self._memory = _physical_memory()
        # None: derived from this node's own slots (`slot_cap`).
        self.max_slot_bytes: int | None = max_slot_bytes
        self.max_total_bytes = max_total_bytes if max_total_bytes is not None else self._memory // 2
        self._cap, self._cap_at = 0, float("-inf")
        self.refused: list[str] = []  # why puts were refused, newest last (a few kept)
        self.local_slot = local_slot  # (rank, slot index) -> path of this node's slot file
        self.replicas: dict[tuple[int, int], _Replica] = {}  # (rank, slot) -> committed copy
        self.kept_at: dict[int, float] = {}  # rank -> when a copy of its slots was last kept (monotonic)
        self._buffers: dict[tuple[int, int], bytearray] = {}  # reused from step to step
        self._pending: dict[tuple[int, int], _Replica] = {}  # received, not yet committed
        self._receiving: set[tuple[int, int]] = set()  # slots whose buffer a put is filling
        self.lock = threading.Lock()
        store = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(30.0)
                # A Unix socket's client has no address: say which door it came through.
                at = self.client_address
                peer = "{}:{}".format(*at[:2]) if isinstance(at, tuple) else "the local socket"
                try:
                    if not server_handshake(self.request, store.token):
                        store.note_refusal(f"a client at {peer} failed the job-token handshake")
                        return
                    while True:
                        header = recv_header(self.request)
                        if header.get("op") == "put":
                            reply, body = store.receive(header, self.request), b""
                        elif header.get("op") in ("commit", "drop"):
                            reply, body = store.settle(header), b""
                        else:
                            length = int(header.get("len", 0))
                            if not 0 <= length <= MAX_REQUEST_PAYLOAD:
                                raise ValueError(f"a {header.get('op')!r} request with a payload of {length} bytes")
                            payload = recv_exact(self.request, length) if length else b""
                            reply, body = store.serve(header, payload)
                        send_frame(self.request, reply, body)
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    # A frame that does not parse, from a client that knew the token.
                    store.note_refusal(f"a malformed frame from {peer}: {type(exc).__name__}: {exc}"[:300])
                except (ChannelError, OSError):
                    return  # the connection closes; a refused put was noted where it was refused

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((address, 0), Handler, bind_and_activate=True)
        self.server.daemon_threads = True
        self.address, self.port = self.server.server_address[:2]
        # The same service on an abstract Unix socket, for clients on this host and network
        # namespace (`recovery.peer`): a fraction of loopback TCP's kernel time per copy.
        self.local_server: socketserver.ThreadingUnixStreamServer | None
        try:
            self.local_server = socketserver.ThreadingUnixStreamServer(
                local_address(token, self.address, self.port), Handler)  # type: ignore[arg-type]
        except OSError as exc:  # taken: its clients fall back to TCP after a failed handshake
            log.warning("ffctl snapshot channel: no local socket (%s); clients on this host use TCP", exc)
            self.local_server = None
        else:
            self.local_server.daemon_threads = True
        self._threads = [threading.Thread(target=srv.serve_forever, name="ffctl-peer", daemon=True)
                         for srv in (self.server, self.local_server) if srv is not None]

    def start(self) -> PeerStore:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        for srv in (self.server, self.local_server):
            if srv is not None:
                srv.shutdown()
                srv.server_close()

    def receive(self, header: dict[str, Any], sock: socket.socket) -> dict[str, Any]:
        """Read a streamed slot into this (rank, slot)'s buffer, pending until the sender commits."""
        rank, step, length = int(header["rank"]), int(header["step"]), int(header["len"])
        meta_len, crc = int(header["meta_len"]), int(header["crc"])
        key = (rank, step % self.slots)
        if rank < 0 or step < 0 or not 0 <= meta_len <= length:
            self._refuse(f"put of rank {rank} step {step}: bad header (len {length}, meta_len {meta_len})")
        cap = self.slot_cap()
        if length > cap:
            self._refuse(f"put of rank {rank} step {step}: {length} bytes over the cap of {cap} per slot")
        with self.lock:
            buf = self._buffers.get(key)
            if buf is None or len(buf) < length:
                held = sum(len(b) for b in self._buffers.values()) - (len(buf) if buf is not None else 0)
                if held + length > self.max_total_bytes:
                    self._refuse(f"put of rank {rank} step {step}: {length} bytes would hold "
                                 f"{held + length}, over the cap of {self.max_total_bytes}")
            self.replicas.pop(key, None)  # the old copy of this slot is being overwritten
            self._pending.pop(key, None)
            self._receiving.add(key)
            if buf is None or len(buf) < length:
                buf = self._buffers[key] = bytearray(length)
        try:
            recv_into(sock, memoryview(buf)[:length])
        finally:
            with self.lock:
                self._receiving.discard(key)
        with self.lock:
            self._pending[key] = _Replica(step, crc, meta_len, length, buf)
        return {"ok": True}

    SLOT_CAP_FLOOR = 256 << 20  # the per-slot cap before this node's ranks wrote a slot

    def slot_cap(self) -> int:
        """The largest put of one slot taken: `max_slot_bytes` if given, else twice this node's
        largest slot (looked at once a second at most), within [SLOT_CAP_FLOOR, memory / 4]."""
        if self.max_slot_bytes is not None:
            return self.max_slot_bytes
        now = time.monotonic()
        if now - self._cap_at >= 1.0:
            self._cap_at = now
            try:
                folder = self.local_slot(0, 0).parent
                largest = max((p.stat().st_size for p in folder.iterdir() if p.is_file()), default=0)
            except OSError:
                largest = 0
            self._cap = min(self._memory // 4, max(self.SLOT_CAP_FLOOR, 2 * largest))
        return self._cap

    def _refuse(self, why: str) -> None:
        self.note_refusal(why)
        raise ChannelError(why)

    def note_refusal(self, why: str) -> None:
        """Log a refusal and hand it to `on_refused` (a few a second; never raises)."""
        log.warning("ffctl snapshot channel: refused %s", why)
        self.refused.append(why)
        del self.refused[:-16]  # a few kept
        held = self.reports.admit()
        if self.on_refused is None or held is None:
            return
        try:
            self.on_refused(why, held)
        except Exception:  # whoever listens is gone: the log line stays
            pass

    def settle(self, header: dict[str, Any]) -> dict[str, Any]:
        """The second phase of a put: keep the pending copy ("commit") or forget it ("drop")."""
        rank, step = int(header["rank"]), int(header["step"])
        with self.lock:
            pending = self._pending.pop((rank, step % self.slots), None)
        if pending is None or pending.step != step:
            return {"ok": False, "error": f"no pending copy of rank {rank} step {step}"}
        if header["op"] != "commit":
            return {"ok": True}
        # The copy is checked before it is kept: a slot corrupted in the sender's memory (or a
        # sender that lies) must not become the replica a replacement later restores from; the
        # neighbour keeps the other slot's step, which the controller can still choose.
        if checksum.crc32(memoryview(pending.buf)[: pending.length]) != pending.crc:
            why = f"put of rank {rank} step {step}: checksum mismatch, not kept"
            self.note_refusal(why)
            return {"ok": False, "error": why}
        with self.lock:
            # Kept only if no newer put of this slot began meanwhile (it reuses the buffer).
            if (rank, step % self.slots) not in self._pending and (rank, step % self.slots) not in self._receiving:
                self.replicas[(rank, step % self.slots)] = pending
                self.kept_at[rank] = time.monotonic()
        return {"ok": True}

    def find(self, rank: int, step: int, where: str) -> SlotContent | None:
        slot = step % self.slots
        if where == "local":
            content = read_slot(self.local_slot(rank, slot))
        else:
            with self.lock:
                replica = self.replicas.get((rank, slot))
                content = replica.content() if replica is not None else None
        return content if content is not None and content.step == step else None

    def quiet(self, rank: int, for_s: float, within_s: float) -> None:
        """Wait until no copy of `rank`'s slots has been kept for `for_s` seconds, at most
        `within_s` seconds: a stopped rank's last copies have arrived."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with self.lock:
                since = time.monotonic() - self.kept_at.get(rank, float("-inf"))
            if since >= for_s:
                return
            time.sleep(min(for_s - since, max(0.0, deadline - time.monotonic())))

    def corrupt(self, rank: int) -> list[int]:
        """corrupt-snapshot copy=replica: flip every bit of one byte in the middle of each copy
        of `rank`'s slots this store keeps, its checksum left as it was (a bit flip in memory
        after the copy was verified); the steps of the copies hit."""
        hit = []
        with self.lock:
            for (r, _), replica in self.replicas.items():
                if r == rank and replica.length > replica.meta_len:
                    at = replica.meta_len + (replica.length - replica.meta_len) // 2
                    replica.buf[at] ^= 0xFF
                    hit.append(replica.step)
        return sorted(hit)

    def inventory(self) -> dict[str, dict[str, list[int]]]:
        """Valid steps held per rank: {"local": {rank: [steps]}, "replica": {rank: [steps]}}."""
        out: dict[str, dict[str, list[int]]] = {"local": {}, "replica": {}}
        with self.lock:
            for (rank, _), replica in self.replicas.items():
                out["replica"].setdefault(str(rank), []).append(replica.step)
        return out

    def serve(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op = header.get("op")
        if op == "get":
            content = self.find(int(header["rank"]), int(header["step"]), str(header.get("where", "local")))
            if content is None:
                return {"ok": False, "error": "not held"}, b""
            return {"ok": True, "step": content.step, "crc": content.crc, "meta_len": len(content.meta)}, content.meta + content.shard
        return {"ok": False, "error": f"unknown op {op!r}"}, b""

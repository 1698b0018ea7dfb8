"""The snapshot channel's protocol (between agents, and from an agent to a replacement rank),
and its client.

A small TCP protocol: each connection starts with a mutual HMAC-SHA256 challenge keyed by the
job token, so only the job's own agents and ranks can read or plant snapshots. Frames are a
4-byte length, a JSON header and an optional payload. The server side is the agent's snapshot
store (`ffctl.agent.peerstore.PeerStore`); `PeerClient` is what a rank restoring a copy and an
agent streaming its slots to its ring neighbour use.

Streaming a slot happens every step, beside training, so it costs as little CPU as it can: the
sender hands the slot file to the kernel (`sendfile`) and the receiver reads straight into a
buffer it keeps per (rank, slot). A store whose client runs on the same host, in the same
network namespace (every node of a one-machine run, and a rank fetching from its own agent),
is reached over an abstract Unix socket instead of loopback TCP, with the same handshake and
frames: loopback TCP costs the two sides about 7.6 ms of kernel time per 11 MB, a Unix socket
about 2.5 ms, and on one machine those cores are the ones training. The socket's name is a
digest keyed by the job token (nobody else can bind it first), the client talks only to a
process of its own user, and anything that goes wrong on that path (no such name: another host
or namespace) falls back to TCP, which network faults act on.

A put is two-phase. The receiver holds the bytes as pending and says so; the sender then looks
at the slot's seqlock and commits the copy only if the writer did not touch the slot meanwhile,
so a torn copy is never kept.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from recovery.slots import DATA_OFFSET, SlotContent, read_header
from wire import control

_LEN = struct.Struct(">I")
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
# Requests other than a put carry no payload worth more than this; a bigger one is malformed.
MAX_REQUEST_PAYLOAD = 1 << 20


class ChannelError(Exception):
    """The peer could not be reached, refused our token, or broke the protocol."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, 1 << 22))
        if not n:
            raise ChannelError("connection closed mid-frame")
        got += n


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    raw = json.dumps({**header, "len": len(payload)}).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    if payload:
        sock.sendall(payload)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > 1 << 20:
        raise ChannelError("frame header too large")
    try:
        header = json.loads(recv_exact(sock, n))
    except RecursionError:
        # A megabyte of brackets exhausts the decoder's stack: a malformed frame like any other.
        raise ValueError("frame header nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError(f"frame header is a JSON {type(header).__name__}, not an object")
    return header


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    header = recv_header(sock)
    length = int(header.get("len", 0))
    return header, (recv_exact(sock, length) if length else b"")


def local_address(token: str, address: str, port: int) -> bytes:
    """The abstract Unix name a snapshot store listening at (address, port) also listens on
    (per network namespace, so a sandboxed or remote node's store is never reached this way)."""
    return control.abstract_socket_name(token, f"snapshot-channel {address} {port}")


def _connect_local(address: str, port: int, token: str, timeout: float) -> socket.socket | None:
    """An authenticated connection to the store's Unix socket, or None where there is none to
    use: no such name here (another host or namespace), a process of another user holding it,
    or one that fails the handshake (the caller then goes over TCP, as to any remote store)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(local_address(token, address, port))
        _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        if uid != os.getuid():
            raise ChannelError(f"the snapshot channel's local socket is held by uid {uid}")
        client_handshake(sock, token)
        return sock
    except (OSError, ChannelError):
        sock.close()
        return None


def _mac(token: str, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(token.encode(), nonce + role, hashlib.sha256).digest()


def client_handshake(sock: socket.socket, token: str) -> None:
    server_nonce = recv_exact(sock, 32)
    my_nonce = os.urandom(32)
    sock.sendall(_mac(token, server_nonce, b"client") + my_nonce)
    if not hmac.compare_digest(recv_exact(sock, 32), _mac(token, my_nonce, b"server")):
        raise ChannelError("peer failed to prove the job token")


def server_handshake(sock: socket.socket, token: str) -> bool:
    nonce = os.urandom(32)
    sock.sendall(nonce)
    answer = recv_exact(sock, 64)
    if not hmac.compare_digest(answer[:32], _mac(token, nonce, b"client")):
        return False
    sock.sendall(_mac(token, answer[32:], b"server"))
    return True


class PeerClient:
    """One authenticated connection to a `PeerStore`: over its Unix socket where the store runs
    on this host and network namespace, else (or with `local=False`) over TCP. `transport` says
    which."""

    def __init__(self, address: str, port: int, token: str, timeout: float = 10.0, local: bool = True) -> None:
        sock = _connect_local(address, port, token, timeout) if local else None
        self.transport = "unix" if sock is not None else "tcp"
        if sock is None:
            try:
                sock = socket.create_connection((address, port), timeout=timeout)
            except OSError as exc:
                raise ChannelError(f"snapshot peer {address}:{port} unreachable: {exc}") from None
            try:
                client_handshake(sock, token)
            except (OSError, ChannelError) as exc:
                sock.close()
                raise ChannelError(f"snapshot peer {address}:{port}: {exc}") from None
        self.sock = sock

    def _put_header(self, rank: int, step: int, crc: int, meta_len: int, length: int) -> None:
        raw = json.dumps({"op": "put", "rank": rank, "step": step, "crc": crc, "meta_len": meta_len,
                          "len": length}).encode()
        self.sock.sendall(_LEN.pack(len(raw)) + raw)

    def _settle(self, rank: int, step: int, keep: bool) -> bool:
        send_frame(self.sock, {"op": "commit" if keep else "drop", "rank": rank, "step": step})
        reply, _ = recv_frame(self.sock)
        return keep and bool(reply.get("ok"))

    def put(self, rank: int, content: SlotContent) -> None:
        length = len(content.meta) + len(content.shard)
        self._put_header(rank, content.step, content.crc, len(content.meta), length)
        self.sock.sendall(content.meta)
        self.sock.sendall(content.shard)
        reply, _ = recv_frame(self.sock)
        if not reply.get("ok") or not self._settle(rank, content.step, keep=True):
            raise ChannelError(f"peer refused replica of rank {rank} step {content.step}: {reply.get('error')}")

    def put_slot(self, rank: int, path: Path) -> int | None:
        """Stream a valid slot file straight from shared memory. Returns the step the peer now
        holds, or None when the slot was not valid or changed while it was sent."""
        before = read_header(path)
        if before is None or not before.valid:
            return None
        length = before.meta_len + before.shard_len
        self._put_header(rank, before.step, before.crc, before.meta_len, length)
        with open(path, "rb") as fh:
            self.sock.sendfile(fh, offset=DATA_OFFSET, count=length)
        reply, _ = recv_frame(self.sock)
        # The peer has copied every byte by now: an unchanged seqlock means an untorn copy.
        after = read_header(path)
        intact = bool(reply.get("ok")) and after is not None and after.valid and after.seq == before.seq
        return before.step if self._settle(rank, before.step, intact) else None

    def get(self, rank: int, step: int, where: str) -> SlotContent | None:
        send_frame(self.sock, {"op": "get", "rank": rank, "step": step, "where": where})
        reply, payload = recv_frame(self.sock)
        if not reply.get("ok"):
            return None
        meta_len = int(reply["meta_len"])
        return SlotContent(int(reply["step"]), payload[:meta_len], payload[meta_len:], int(reply["crc"]))

    def close(self) -> None:
        self.sock.close()

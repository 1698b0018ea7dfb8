"""The snapshot channel between agents (and from an agent to a replacement rank).

A small TCP protocol: each connection starts with a mutual HMAC-SHA256 challenge keyed by the
job token, so only the job's own agents and ranks can read or plant snapshots. Frames are a
4-byte length, a JSON header and an optional payload. `PeerStore` is the server side an agent
runs: it serves its own ranks' slots from shared memory and holds replicas of its ring
neighbour's slots in memory.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import socketserver
import struct
import threading
from pathlib import Path
from typing import Any, Callable

from recovery.slots import SlotContent, read_slot

_LEN = struct.Struct(">I")


class ChannelError(Exception):
    """The peer could not be reached, refused our token, or broke the protocol."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ChannelError("connection closed mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    raw = json.dumps({**header, "len": len(payload)}).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    if payload:
        sock.sendall(payload)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > 1 << 20:
        raise ChannelError("frame header too large")
    header = json.loads(_recv_exact(sock, n))
    payload = _recv_exact(sock, int(header.get("len", 0))) if header.get("len") else b""
    return header, payload


def _mac(token: str, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(token.encode(), nonce + role, hashlib.sha256).digest()


def _client_handshake(sock: socket.socket, token: str) -> None:
    server_nonce = _recv_exact(sock, 32)
    my_nonce = os.urandom(32)
    sock.sendall(_mac(token, server_nonce, b"client") + my_nonce)
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(token, my_nonce, b"server")):
        raise ChannelError("peer failed to prove the job token")


def _server_handshake(sock: socket.socket, token: str) -> bool:
    nonce = os.urandom(32)
    sock.sendall(nonce)
    answer = _recv_exact(sock, 64)
    if not hmac.compare_digest(answer[:32], _mac(token, nonce, b"client")):
        return False
    sock.sendall(_mac(token, answer[32:], b"server"))
    return True


class PeerStore:
    """An agent's snapshot server: local slots from shared memory, neighbour replicas in memory."""

    def __init__(self, address: str, token: str, local_slot: Callable[[int, int], Path]) -> None:
        self.token = token
        self.local_slot = local_slot  # (rank, slot index) -> path of this node's slot file
        self.replicas: dict[tuple[int, int], SlotContent] = {}  # (rank, slot) -> content
        self.lock = threading.Lock()
        store = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(30.0)
                try:
                    if not _server_handshake(self.request, store.token):
                        return
                    while True:
                        header, payload = recv_frame(self.request)
                        reply, body = store.serve(header, payload)
                        send_frame(self.request, reply, body)
                except (ChannelError, OSError, ValueError):
                    return

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((address, 0), Handler, bind_and_activate=True)
        self.server.daemon_threads = True
        self.address, self.port = self.server.server_address[:2]
        self._thread = threading.Thread(target=self.server.serve_forever, name="ffctl-peer", daemon=True)

    def start(self) -> PeerStore:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def find(self, rank: int, step: int, where: str) -> SlotContent | None:
        slot = step % 2
        if where == "local":
            content = read_slot(self.local_slot(rank, slot))
        else:
            with self.lock:
                content = self.replicas.get((rank, slot))
        return content if content is not None and content.step == step else None

    def inventory(self) -> dict[str, dict[str, list[int]]]:
        """Valid steps held per rank: {"local": {rank: [steps]}, "replica": {rank: [steps]}}."""
        out: dict[str, dict[str, list[int]]] = {"local": {}, "replica": {}}
        with self.lock:
            for (rank, _), content in self.replicas.items():
                out["replica"].setdefault(str(rank), []).append(content.step)
        return out

    def serve(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op = header.get("op")
        if op == "put":
            meta_len = int(header["meta_len"])
            content = SlotContent(int(header["step"]), payload[:meta_len], payload[meta_len:], int(header["crc"]))
            if not content.verify():
                return {"ok": False, "error": "checksum mismatch"}, b""
            with self.lock:
                self.replicas[(int(header["rank"]), content.step % 2)] = content
            return {"ok": True}, b""
        if op == "get":
            content = self.find(int(header["rank"]), int(header["step"]), str(header.get("where", "local")))
            if content is None:
                return {"ok": False, "error": "not held"}, b""
            return {"ok": True, "step": content.step, "crc": content.crc, "meta_len": len(content.meta)}, content.meta + content.shard
        return {"ok": False, "error": f"unknown op {op!r}"}, b""


class PeerClient:
    """One authenticated connection to a `PeerStore`."""

    def __init__(self, address: str, port: int, token: str, timeout: float = 10.0) -> None:
        try:
            self.sock = socket.create_connection((address, port), timeout=timeout)
            _client_handshake(self.sock, token)
        except OSError as exc:
            raise ChannelError(f"snapshot peer {address}:{port} unreachable: {exc}") from None

    def put(self, rank: int, content: SlotContent) -> None:
        header = {"op": "put", "rank": rank, "step": content.step, "crc": content.crc, "meta_len": len(content.meta)}
        send_frame(self.sock, header, content.meta + content.shard)
        reply, _ = recv_frame(self.sock)
        if not reply.get("ok"):
            raise ChannelError(f"peer refused replica of rank {rank} step {content.step}: {reply.get('error')}")

    def get(self, rank: int, step: int, where: str) -> SlotContent | None:
        send_frame(self.sock, {"op": "get", "rank": rank, "step": step, "where": where})
        reply, payload = recv_frame(self.sock)
        if not reply.get("ok"):
            return None
        meta_len = int(reply["meta_len"])
        return SlotContent(int(reply["step"]), payload[:meta_len], payload[meta_len:], int(reply["crc"]))

    def close(self) -> None:
        self.sock.close()

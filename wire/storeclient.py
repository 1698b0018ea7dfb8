"""A client of torch's TCPStore in plain Python: how a process without torch talks to the job's store.

The node agent and `ffctl inject` speak to the controller's store only through the control
plane's calls (`wire.control`: `set`, `compare_set`, `multi_set`, `delete_key`). Importing torch
for them costs each process about two seconds of CPU and a few hundred MB of memory before it
can say a word, and an agent is started again on every node fault: its replacement's start is
part of the fault's recovery time, on a host whose CPUs the training wants. So they speak the
store's wire protocol themselves, the requests they need of it and nothing else.

The protocol is torch's (c10d's `TCPStore`, the same for its libuv and classic servers): a
request is a one-byte query type followed by its arguments, each string or value a 64-bit length
and its bytes, integers in the host's byte order; the client validates the connection with a
magic number, and every key it sends carries the client's key prefix, "/". Only requests that
answer are waited on (`set` and `multi_set` answer nothing). The query numbers have only ever been
appended to, so the ones used here mean the same to every torch this project supports;
`tests/unit/test_storeclient.py` checks each request against the installed torch's own server
and client.

Every call is bounded by the client's timeout. A call that fails (the server gone, a timeout, an
answer that is not one) raises `StoreError` and closes the connection, which the next call opens
again, with one attempt: unlike torch's client, none is left out of step with the server by a
timed-out call, and as with it, a server that is gone fails each call at once. One
connection serves the process's threads one call at a time.
"""
from __future__ import annotations

import secrets
import socket
import struct
import threading
import time
from enum import IntEnum

# Sent first on every connection: torch's server closes one that opens with anything else.
VALIDATION_MAGIC = 0x3C85F7CE
# Torch's client puts this before every key (its `TCPStore` keys live under "/").
KEY_PREFIX = b"/"
# No value of the control plane comes near this; a longer answer is not one.
MAX_VALUE = 64 << 20

_U8 = struct.Struct("=B")
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_I64 = struct.Struct("=q")


class Query(IntEnum):
    """torch's `QueryType` numbers for the requests made here."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    DELETE_KEY = 8
    MULTI_SET = 11
    PING = 13


class StoreError(RuntimeError):
    """A store call that did not complete: the server could not be reached, did not answer in
    time, closed the connection, or answered something that is not an answer. (A RuntimeError,
    as torch's store errors are.)"""


def _blob(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _key(key: str) -> bytes:
    return _blob(KEY_PREFIX + key.encode())


def _value(value: bytes | str) -> bytes:
    return _blob(value.encode() if isinstance(value, str) else bytes(value))


class StoreClient:
    """A connection to a TCPStore server at `host`:`port`; each call takes at most `timeout`
    seconds (opening the connection included), else raises `StoreError`."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    # -- the calls ---------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._call(_U8.pack(Query.SET) + _key(key) + _value(value), None)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """As torch's: writes `desired` when the key holds `expected` (or is missing and
        `expected` is empty) and answers the key's value after; for a missing key with another
        `expected`, answers `expected`."""
        answer = self._call(_U8.pack(Query.COMPARE_SET) + _key(key) + _value(expected) + _value(desired), "blob")
        assert isinstance(answer, bytes)
        return answer

    def multi_set(self, keys: list[str], values: list[bytes] | list[str] | list[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        pairs: list[tuple[str, bytes | str]] = list(zip(keys, values))
        body = b"".join(_key(k) + _value(v) for k, v in pairs)
        self._call(_U8.pack(Query.MULTI_SET) + _I64.pack(len(keys)) + body, None)

    def delete_key(self, key: str) -> bool:
        answer = self._call(_U8.pack(Query.DELETE_KEY) + _key(key), "i64")
        return bool(answer)

    def close(self) -> None:
        with self._lock:
            self._drop()

    # -- the connection ----------------------------------------------------------------------
    def _call(self, request: bytes, answer: str | None) -> bytes | int | None:
        with self._lock:
            deadline = time.monotonic() + self.timeout
            try:
                sock = self._sock or self._open(deadline, retry=False)
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(request)
                if answer is None:
                    return None
                if answer == "i64":
                    return int(_I64.unpack(self._read(sock, _I64.size, deadline))[0])
                (size,) = _U64.unpack(self._read(sock, _U64.size, deadline))
                if size > MAX_VALUE:
                    raise StoreError(f"store at {self.host}:{self.port} answered a value of {size} bytes")
                return self._read(sock, size, deadline)
            except StoreError:
                self._drop()
                raise
            except (OSError, struct.error) as exc:
                self._drop()
                raise StoreError(f"store at {self.host}:{self.port}: {type(exc).__name__}: {exc}") from None

    def _open(self, deadline: float, retry: bool = True) -> socket.socket:
        """Connect, validate, and make sure it is a store that answers. `retry`: while the
        server refuses, try again until `deadline`, as torch's client does when it first
        connects. A call that connects again after a failure tries once: a server that has gone
        away (the controller killed) must not hold every call of a stopping agent for its whole
        timeout, which outlasted the deadline it is stopped by and left its shared memory behind."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(f"store at {self.host}:{self.port}: not reachable within {self.timeout:g}s")
            try:
                sock = socket.create_connection((self.host, self.port), timeout=left)
                break
            except (ConnectionRefusedError, ConnectionResetError, socket.timeout):
                if not retry:
                    raise
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = secrets.randbits(32)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(_U8.pack(Query.VALIDATE) + _U32.pack(VALIDATION_MAGIC) + _U8.pack(Query.PING) + _U32.pack(nonce))
            (echo,) = _U32.unpack(self._read(sock, _U32.size, deadline))
            if echo != nonce:
                raise StoreError(f"{self.host}:{self.port} is not a TCPStore (its ping answer was wrong)")
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock

    @staticmethod
    def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
        parts, got = [], 0
        while got < n:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(min(n - got, 1 << 20))
            if not chunk:
                raise StoreError("the store closed the connection")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


def connect(host: str, port: int, timeout: float = 30.0) -> StoreClient:
    """A connection to the store at `host`:`port`, open and validated (StoreError if it cannot be
    within `timeout`); every later call also takes at most `timeout`."""
    client = StoreClient(host, port, timeout)
    with client._lock:
        try:
            client._open(time.monotonic() + timeout)
        except OSError as exc:
            raise StoreError(f"store at {host}:{port}: {type(exc).__name__}: {exc}") from None
    return client

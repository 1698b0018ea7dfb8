"""The plain-Python store client (`wire.storeclient`) against the installed torch's own TCPStore:
each request it makes means to torch's server what torch's client means by it, the control
plane's queues work across the two clients, a failed call is a `StoreError` within its timeout and
the next call connects again, and the processes that use it do not import torch."""
from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from wire import control, messages, storeclient
from wire.storeclient import StoreClient, StoreError


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    yield store
    del store


@pytest.fixture
def client(server: dist.TCPStore) -> Iterator[StoreClient]:
    c = storeclient.connect("127.0.0.1", server.port, timeout=10.0)
    yield c
    c.close()


def test_set_and_multi_set_are_what_torchs_client_reads(server: dist.TCPStore, client: StoreClient) -> None:
    client.set("a/b", b"\x00\xffbytes")
    client.set("text", "é")
    client.multi_set(["m/1", "m/2"], [b"one", b"two"])
    assert server.get("a/b") == b"\x00\xffbytes"
    assert server.get("text") == "é".encode()
    assert server.get("m/1") == b"one" and server.get("m/2") == b"two"
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        client.multi_set(["x", "y"], [b"1"])


def test_compare_set_answers_as_torchs_does(server: dist.TCPStore, client: StoreClient) -> None:
    server.set("k", "v1")
    assert client.compare_set("k", b"other", b"v2") == b"v1"  # no match: the value, unchanged
    assert client.compare_set("k", b"v1", b"v2") == b"v2"  # a match: written
    assert server.get("k") == b"v2"
    assert client.compare_set("gone", b"expected", b"new") == b"expected"  # missing: what was expected
    assert not server.check(["gone"])
    assert client.compare_set("fresh", b"", b"made") == b"made"  # missing and "" expected: created
    assert server.get("fresh") == b"made"
    for expected in (b"", b"x"):  # torch's client, the same questions: the same answers
        assert server.compare_set("k", expected, "y") == client.compare_set("k", expected, b"y")


def test_delete_key_says_whether_there_was_one(server: dist.TCPStore, client: StoreClient) -> None:
    server.set("d", "1")
    assert client.delete_key("d") is True
    assert not server.check(["d"])
    assert client.delete_key("d") is False


def test_the_control_planes_queue_works_from_either_client_to_the_other(server: dist.TCPStore,
                                                                         client: StoreClient) -> None:
    sealer, token = control.Sealer("t" * 64, "agent/0"), "t" * 64
    inbox = control.Receiver(server, control.CTL_QUEUE, opener=control.Opener(token))
    sent = [messages.AgentUp(node=0, incarnation=0, pid=100 + i, host="h", time=1.0, peer_address="127.0.0.1", peer_port=1)
            for i in range(5)]
    for msg in sent:
        assert control.send(client, control.CTL_QUEUE, msg, sealer) is None
    got: list[object] = []
    deadline = time.monotonic() + 10
    while len(got) < len(sent) and time.monotonic() < deadline:
        got += inbox.poll()
    assert [messages.decode(m).pid for m in got] == [m.pid for m in sent]  # type: ignore[attr-defined]
    # ... and the other way: read back through the plain client what torch's wrote.
    control.store_set(server, "reply", b"sealed")
    assert control.read(client, "reply") == b"sealed"
    assert control.read(client, "no-such-key") is None


def test_threads_sharing_one_client_reserve_distinct_indices(server: dist.TCPStore, client: StoreClient) -> None:
    sealer = control.Sealer("t" * 64, "agent/0")
    errors: list[BaseException] = []

    def send(n: int) -> None:
        try:
            for i in range(40):
                msg = messages.AgentUp(node=n, incarnation=0, pid=i, host="h", time=1.0, peer_address="127.0.0.1", peer_port=1)
                assert control.send(client, control.CTL_QUEUE, msg, sealer) is None
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert control.parse_counter(server.get(f"{control.CTL_QUEUE}/n")) == 240
    assert all(server.check([f"{control.CTL_QUEUE}/{i}"]) for i in range(1, 241))


def test_a_dropped_connection_fails_one_call_and_the_next_connects_again(server: dist.TCPStore,
                                                                          client: StoreClient) -> None:
    client.set("x", b"1")
    assert client._sock is not None
    client._sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(StoreError):
        client.compare_set("x", b"1", b"2")
    assert client._sock is None
    assert client.compare_set("x", b"1", b"2") == b"2"


def _listener(answer: bytes | None, done: threading.Event) -> tuple[socket.socket, threading.Thread]:
    """A server that is not a store: it answers `answer` to whatever comes, or nothing, and
    holds the connection until `done`."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()

    def serve() -> None:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        with conn:
            conn.recv(64)
            if answer is not None:
                conn.sendall(answer)
            done.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return lsock, thread


@pytest.mark.parametrize("answer", [None, b"\x01\x02\x03\x04"], ids=["silent", "wrong-ping"])
def test_a_server_that_is_not_a_store_is_an_error_within_the_timeout(answer: bytes | None) -> None:
    done = threading.Event()
    lsock, thread = _listener(answer, done)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError):
            storeclient.connect("127.0.0.1", lsock.getsockname()[1], timeout=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        done.set()
        lsock.close()
        thread.join(5)


def test_no_server_is_an_error_within_the_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="not reachable within 0.5s"):
            storeclient.connect("127.0.0.1", port, timeout=0.5)
        assert time.monotonic() - t0 < 5


def test_the_agent_and_the_inject_client_do_not_import_torch() -> None:
    code = ("import sys; import ffctl.agent.agent, ffctl.controller.client; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_once_the_server_is_gone_each_call_fails_at_once_not_after_its_timeout() -> None:
    # A store that answers the handshake, then goes away (its controller killed). A stopping
    # agent makes several calls; each held for the 10 s timeout outlasted the deadline the agent
    # is stopped by, and the agent was killed before it removed its shared memory.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    port = lsock.getsockname()[1]

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            hello = b""
            while len(hello) < 10:  # validate (1 + 4 bytes), then ping (1 + 4)
                hello += conn.recv(10 - len(hello))
            conn.sendall(hello[6:10])  # the ping's nonce, echoed

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = storeclient.connect("127.0.0.1", port, timeout=10.0)
    thread.join(10)
    lsock.close()  # nothing listens on the port any more
    t0 = time.monotonic()
    for _ in range(3):
        with pytest.raises(StoreError):
            client.compare_set("k", b"a", b"b")
    assert time.monotonic() - t0 < 3.0

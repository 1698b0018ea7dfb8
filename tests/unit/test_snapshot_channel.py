"""Snapshot format, shared-memory slots and the authenticated snapshot channel."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from recovery.peer import ChannelError, PeerClient, _LEN, local_address
from ffctl.agent.peerstore import PeerStore
from recovery.slots import SlotContent, SlotWriter, read_header, read_slot, slot_path
from recovery.snapshot import StateEntry, assemble, capture, read_meta


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[StateEntry]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    entries = [StateEntry("model", model.state_dict, model.load_state_dict, True),
               StateEntry("optim", opt.state_dict, opt.load_state_dict, True),
               StateEntry("rng", torch.get_rng_state, torch.set_rng_state, False)]
    return model, opt, entries


def test_shards_of_all_ranks_reassemble_bit_exact(tmp_path: Path) -> None:
    model, opt, entries = _state()
    world = 3
    shards, metas = [], []
    for rank in range(world):
        writer = SlotWriter(str(tmp_path), "r", 0, rank)
        writer.begin(capture(entries, 9, rank, world))
        writer.fence()
        content = read_slot(writer.paths[1])
        assert content is not None and content.step == 9 and content.verify()
        shards.append(content.shard)
        metas.append(content.meta)
        writer.close()
    # Each rank holds a third of the replicated state, not all of it.
    total = sum(len(s) for s in shards)
    assert max(len(s) for s in shards) <= -(-total // world)
    states = assemble(read_meta(metas[2]), b"".join(shards))
    for key, value in model.state_dict().items():
        assert torch.equal(states["model"][key], value)
    assert torch.equal(states["rng"], torch.get_rng_state())
    fresh = torch.optim.AdamW(model.parameters(), foreach=False)
    fresh.load_state_dict(states["optim"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_torn_or_corrupt_slot_is_never_valid(tmp_path: Path) -> None:
    _, _, entries = _state()
    writer = SlotWriter(str(tmp_path), "r", 0, 0)
    writer.begin(capture(entries, 4, 0, 1))
    writer.fence()
    path = writer.paths[0]
    assert read_slot(path) is not None
    with open(path, "r+b") as fh:  # a bit flips in the shard
        fh.seek(-1, 2)
        byte = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([byte[0] ^ 1]))
    content = read_slot(path)
    assert content is not None and not content.verify()
    with open(path, "r+b") as fh:  # a writer killed mid-copy leaves state WRITING
        fh.seek(4)
        fh.write((1).to_bytes(4, "little"))
    assert read_slot(path) is None and read_header(path) is not None and not read_header(path).valid
    writer.close()


def _store(tmp_path: Path, token: str = "t" * 64, on_refused: Callable[[str, int], None] | None = None) -> PeerStore:
    return PeerStore("127.0.0.1", token, lambda rank, slot: slot_path(str(tmp_path), "r", 0, rank, slot),
                     on_refused=on_refused).start()


def _content(step: int, meta: bytes, shard: bytes) -> SlotContent:
    import zlib

    return SlotContent(step, meta, shard, zlib.crc32(shard, zlib.crc32(meta)))


def test_channel_round_trip_and_checksum(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        client = PeerClient(store.address, store.port, "t" * 64)
        seven, eight = _content(7, b"meta", b"shard-bytes"), _content(8, b"meta8", b"other-shard")
        client.put(2, seven)
        client.put(2, eight)
        got = client.get(2, 7, "replica")
        assert got == seven and got.verify()
        assert client.get(2, 9, "replica") is None
        # A copy whose bytes do not match the sender's checksum (corrupted in the sender's memory
        # or on the way) is refused, never kept: a replacement must not restore from it. The
        # other slot's step stays, so the controller can still restore that one.
        with pytest.raises(ChannelError, match="refused replica of rank 2 step 9"):
            client.put(2, SlotContent(9, b"meta", b"tampered", seven.crc))
        assert client.get(2, 9, "replica") is None
        assert store.inventory()["replica"] == {"2": [8]}
        assert any("checksum mismatch" in why for why in store.refused)
        assert client.get(2, 8, "replica") == eight
        client.close()
    finally:
        store.stop()


def test_slot_rewritten_while_streamed_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer reuses a slot while its copy is in flight: the sender sees the seqlock move
    once the peer holds the bytes and drops the copy, so no torn replica is ever kept."""
    import recovery.peer as peer

    _, _, entries = _state()
    writer = SlotWriter(str(tmp_path), "r", 0, 1)
    writer.begin(capture(entries, 6, 1, 2))
    writer.fence()
    store = _store(tmp_path)
    real_read_header = peer.read_header
    looks: list[int] = []

    def rewritten_after_first_look(path: Path):  # type: ignore[no-untyped-def]
        looks.append(1)
        if len(looks) == 2:  # the look after the peer has copied the bytes
            writer.begin(capture(entries, 8, 1, 2))
            writer.fence()
        return real_read_header(path)

    monkeypatch.setattr(peer, "read_header", rewritten_after_first_look)
    try:
        client = PeerClient(store.address, store.port, "t" * 64)
        assert client.put_slot(1, writer.paths[0]) is None
        assert store.inventory()["replica"] == {} and client.get(1, 6, "replica") is None
        assert client.put_slot(1, writer.paths[0]) == 8  # the next pass sends the new content
        assert client.get(1, 8, "replica") == read_slot(writer.paths[0])
        client.close()
    finally:
        store.stop()
        writer.close()


@pytest.mark.parametrize("local", [True, False], ids=["unix", "tcp"])
def test_slot_streamed_from_shared_memory(tmp_path: Path, local: bool) -> None:
    """A store on this host and network namespace is reached over its Unix socket; one elsewhere
    (here: `local=False`) over TCP; the same copy arrives either way."""
    _, _, entries = _state()
    writer = SlotWriter(str(tmp_path), "r", 0, 1)
    writer.begin(capture(entries, 6, 1, 2))
    writer.fence()
    store = _store(tmp_path)
    try:
        client = PeerClient(store.address, store.port, "t" * 64, local=local)
        assert client.transport == ("unix" if local else "tcp")
        assert client.sock.family == (socket.AF_UNIX if local else socket.AF_INET)
        assert client.put_slot(1, writer.paths[0]) == 6
        assert client.get(1, 6, "replica") == read_slot(writer.paths[0])
        client.close()
    finally:
        store.stop()
        writer.close()


def _squat(name: bytes, nonce: bool, hold: float) -> tuple[socket.socket, list[bytes], threading.Thread]:
    """A listener on `name` that takes one connection, sends a nonce if told (inviting a
    handshake answer), and keeps what the client sent it within `hold` seconds."""
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(name)
    squatter.listen(4)
    received: list[bytes] = []

    def serve() -> None:
        conn, _ = squatter.accept()
        conn.settimeout(hold)
        got = b""
        try:
            if nonce:
                conn.sendall(b"n" * 32)
            while chunk := conn.recv(1 << 16):
                got += chunk
        except OSError:
            pass
        received.append(got)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return squatter, received, thread


def _free_local_name(store: PeerStore) -> bytes:
    """Close the store's Unix socket (as if its name had been taken), and return the name."""
    assert store.local_server is not None
    name = store.local_server.server_address
    store.local_server.shutdown()
    store.local_server.server_close()
    store.local_server = None
    return name if isinstance(name, bytes) else name.encode()


def test_a_stranger_holding_the_local_name_learns_nothing_and_the_copy_goes_over_tcp(tmp_path: Path) -> None:
    """Whoever holds the store's Unix name (it would need the job token to compute it) cannot
    prove the token: the client falls back to TCP and the copy still arrives."""
    store = _store(tmp_path)
    name = _free_local_name(store)
    assert name == local_address("t" * 64, store.address, store.port)
    squatter, received, thread = _squat(name, nonce=False, hold=0.5)
    try:
        client = PeerClient(store.address, store.port, "t" * 64)
        assert client.transport == "tcp"
        client.put(3, _content(5, b"m", b"shard"))
        assert client.get(3, 5, "replica") == _content(5, b"m", b"shard")
        client.close()
        thread.join(10.0)
        assert received == [b""]  # it sent no nonce, so it was sent nothing
    finally:
        squatter.close()
        store.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hold the name as another user")
def test_a_local_name_held_by_another_user_is_never_spoken_to(tmp_path: Path) -> None:
    """A process of another user holding the name is not even answered (its uid is read from
    the socket before any byte is sent), however genuine its challenge looks."""
    store = _store(tmp_path)
    name = _free_local_name(store)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: holds the name, sends a challenge, reports what came back
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            squatter, received, thread = _squat(name, nonce=True, hold=10.0)
            os.write(write_end, b"r")  # listening
            thread.join(15.0)
            os.write(write_end, str(len(received[0]) if received else -1).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"r"
        client = PeerClient(store.address, store.port, "t" * 64)
        assert client.transport == "tcp"
        client.put(3, _content(5, b"m", b"shard"))
        client.close()
        assert os.read(read_end, 16) == b"0"  # nothing, not even an answer to its challenge
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
        store.stop()


def test_channel_refuses_a_wrong_token(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        with pytest.raises(ChannelError):
            client = PeerClient(store.address, store.port, "x" * 64)
            client.get(0, 1, "local")
        assert store.replicas == {}
    finally:
        store.stop()


def test_transfer_cut_mid_stream_stores_nothing(tmp_path: Path) -> None:
    """A node killed while streaming a slot: the receiver keeps no partial replica."""
    import json
    store = _store(tmp_path)
    try:
        client = PeerClient(store.address, store.port, "t" * 64)
        header = json.dumps({"op": "put", "rank": 1, "step": 3, "crc": 0, "meta_len": 4, "len": 1000}).encode()
        client.sock.sendall(_LEN.pack(len(header)) + header + b"x" * 100)
        client.sock.shutdown(socket.SHUT_RDWR)
        client.close()
        import time
        time.sleep(0.3)
        assert store.replicas == {}
    finally:
        store.stop()


class _Heard:
    """What a store handed to `on_refused`, with a wait for the connection threads to get there."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.unreported: list[int] = []
        self._changed = threading.Condition()

    def __call__(self, why: str, unreported: int) -> None:
        with self._changed:
            self.reasons.append(why)
            self.unreported.append(unreported)
            self._changed.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[str]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.reasons) >= n, timeout), self.reasons
            return list(self.reasons)


def _raw_frame(client: PeerClient, body: bytes) -> None:
    client.sock.sendall(_LEN.pack(len(body)) + body)


def _closed_by_server(client: PeerClient) -> bool:
    client.sock.settimeout(10.0)
    try:
        return client.sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_every_refusal_reaches_on_refused_and_the_store_keeps_serving(tmp_path: Path) -> None:
    heard = _Heard()
    store = _store(tmp_path, on_refused=heard)
    store.reports.per_s = 100  # one by one here; the limit has its own test
    try:
        # A stranger that answers the challenge with garbage.
        stranger = socket.create_connection((store.address, store.port), timeout=10.0)
        assert len(stranger.recv(32)) == 32
        stranger.sendall(b"\x00" * 64)
        assert stranger.recv(1) == b""  # no proof of its own, the connection closed
        stranger.close()
        assert "failed the job-token handshake" in heard.wait_for(1)[0]

        # Clients that knew the token and still sent nonsense: each closes its own connection.
        cases = [json.dumps([1, 2]).encode(),                                     # not an object
                 b"\xff\xfe not json",                                            # not JSON
                 json.dumps({"op": "get", "rank": 0, "step": 1, "len": 1 << 30}).encode(),  # payload
                 json.dumps({"op": "put", "step": 1, "len": 4}).encode()]          # no rank
        for body in cases:
            client = PeerClient(store.address, store.port, "t" * 64)
            _raw_frame(client, body)
            assert _closed_by_server(client)
            client.close()
        reasons = heard.wait_for(1 + len(cases))
        assert all("malformed frame" in why for why in reasons[1:]), reasons
        assert "JSON list" in reasons[1] and "payload of 1073741824 bytes" in reasons[3], reasons

        # A put over the cap is refused before anything is allocated.
        client = PeerClient(store.address, store.port, "t" * 64)
        client.put(0, _content(2, b"m", b"x" * 8))
        store.max_slot_bytes = 4
        with pytest.raises((ChannelError, OSError)):  # the store hangs up mid-put
            client.put(0, _content(3, b"m", b"x" * 8))
        client.close()
        assert "over the cap" in heard.wait_for(len(cases) + 2)[-1]

        # The store still serves a genuine client.
        good = PeerClient(store.address, store.port, "t" * 64)
        assert good.get(0, 2, "replica") == _content(2, b"m", b"x" * 8)
        good.close()
    finally:
        store.stop()


def test_a_flood_of_refusals_is_reported_a_few_a_second_and_counted(tmp_path: Path) -> None:
    heard = _Heard()
    store = _store(tmp_path, on_refused=heard)
    try:
        for i in range(PeerStore.REPORTS_PER_S + 7):
            store.note_refusal(f"probe {i}")
        assert heard.reasons == [f"probe {i}" for i in range(PeerStore.REPORTS_PER_S)]
        assert heard.unreported == [0] * PeerStore.REPORTS_PER_S
        assert len(store.refused) == 12  # all logged
        time.sleep(1.05)  # a new window
        store.note_refusal("after")
        assert heard.reasons[-1] == "after" and heard.unreported[-1] == 7  # the flood, counted
    finally:
        store.stop()


def test_a_listener_that_fails_never_breaks_the_store(tmp_path: Path) -> None:
    def broken(why: str, unreported: int) -> None:
        raise RuntimeError("the controller is gone")

    store = _store(tmp_path, on_refused=broken)
    try:
        with pytest.raises(ChannelError):
            PeerClient(store.address, store.port, "x" * 64).get(0, 1, "local")
        client = PeerClient(store.address, store.port, "t" * 64)
        client.put(1, _content(4, b"m", b"y"))
        assert client.get(1, 4, "replica") == _content(4, b"m", b"y")
        client.close()
    finally:
        store.stop()

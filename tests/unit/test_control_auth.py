"""The sealed control plane: what a receiver accepts and refuses, over a real TCPStore, and the
snapshot channel's cap on what one put may make the receiver allocate."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from wire import control, messages
from wire.generation_plan import GenerationPlan
from tests.helpers.store import loopback_store
from recovery.peer import _LEN, ChannelError, PeerClient
from ffctl.agent.peerstore import PeerStore
from recovery.slots import SlotContent, slot_path

TOKEN = "a" * 64
OTHER = "b" * 64
Q = "ctl/q"
LIMITS = messages.Limits(world_size=4, nnodes=2)

_store = loopback_store


def _step(step: int = 3) -> dict[str, Any]:
    return {"type": "step", "rank": 1, "node": 0, "gen": 0, "step": step, "loss": 2.5, "dt": 0.1}


def _refused(raw: str | bytes, to: str = Q, opener: control.Opener | None = None) -> str:
    with pytest.raises(control.Rejected) as info:
        (opener or control.Opener(TOKEN)).open(raw, to)
    return info.value.reason


def test_a_sealed_message_opens_once() -> None:
    sealer, opener = control.Sealer(TOKEN, "rank/1"), control.Opener(TOKEN)
    raw = sealer.seal(Q, _step())
    assert opener.open(raw, Q) == _step()
    assert "replayed" in _refused(raw, opener=opener)  # the same message again


def test_an_older_sequence_is_refused_a_newer_one_accepted() -> None:
    sealer, opener = control.Sealer(TOKEN, "rank/1"), control.Opener(TOKEN)
    first, second, third = (sealer.seal(Q, _step(s)) for s in (1, 2, 3))
    assert opener.open(second, Q)["step"] == 2
    assert "old sequence" in _refused(first, opener=opener)
    assert opener.open(third, Q)["step"] == 3
    # Another sender's sequence is its own: its first message is fine after ours.
    assert opener.open(control.Sealer(TOKEN, "rank/2").seal(Q, _step(9)), Q)["step"] == 9


def _tamper(raw: str, field: str, value: Any) -> str:
    env = json.loads(raw[64:])
    if field in env:
        env[field] = value
    else:
        env["body"][field] = value
    return raw[:64] + json.dumps(env, separators=(",", ":"))


@pytest.mark.parametrize("field,value", [
    ("kind", "done"), ("sender", "controller/0"), ("seq", 10**6), ("step", 4), ("rank", 0), ("to", "agent/0/0/q"),
])
def test_any_altered_part_breaks_the_mac(field: str, value: Any) -> None:
    raw = control.Sealer(TOKEN, "rank/1").seal(Q, _step())
    assert "bad MAC" in _refused(_tamper(raw, field, value))


def test_a_wrong_token_garbage_and_unsigned_json_are_refused() -> None:
    assert "bad MAC" in _refused(control.Sealer(OTHER, "rank/1").seal(Q, _step()))
    assert "too short" in _refused(b"\xff\x00not json")
    assert "bad MAC" in _refused(json.dumps({**_step(), "padding": "x" * 80}))
    assert "bad MAC" in _refused(b"\x00" * 500)


def test_a_message_sealed_for_another_key_is_refused() -> None:
    raw = control.Sealer(TOKEN, "controller").seal("agent/0/0/q", {"type": "stop"})
    assert "sealed for" in _refused(raw, to="agent/1/0/q")


def test_a_timestamp_outside_the_window_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    sealer = control.Sealer(TOKEN, "rank/1")
    real = time.time
    monkeypatch.setattr(control.time, "time", lambda: real() - 2 * control.TIME_WINDOW_S)
    old = sealer.seal(Q, _step())
    monkeypatch.setattr(control.time, "time", real)
    assert "window" in _refused(old)


@pytest.mark.parametrize("msg,why", [
    ({"type": "launch_missiles"}, "unknown message kind"),
    ({"type": 7}, "unknown message kind"),
    ({**_step(), "rank": 4}, "bad rank"),  # world is 4: ranks 0..3
    ({**_step(), "rank": True}, "bad rank"),
    ({**_step(), "gen": "1"}, "bad gen"),
    ({**_step(), "loss": "low"}, "bad loss"),
    ({k: v for k, v in _step().items() if k != "dt"}, "missing field 'dt'"),
    ({"type": "agent_up", "node": 2, "incarnation": 0, "pid": 1, "host": "h", "time": 1.0, "peer_address": "a", "peer_port": 1}, "bad node"),
    ({"type": "spawned", "node": 0, "gen": 0, "pids": {"x": 1}}, "bad pids"),
    ({"type": "inject_request", "fault": "kill-rank:rank=1", "req": "../../x"}, "bad req"),
])
def test_fields_are_checked_before_use(msg: dict[str, Any], why: str) -> None:
    with pytest.raises(messages.DecodeError, match=why.replace("(", r"\(")):
        messages.decode(msg, LIMITS)


def test_valid_messages_pass_the_field_check() -> None:
    assert messages.decode(_step(), LIMITS) == messages.Step(rank=1, node=0, gen=0, step=3, loss=2.5, dt=0.1)
    spawn = {"type": "spawn", "gen": 1, "ranks": [{"rank": 3, "env": {"RANK": "3"}}]}
    assert messages.decode(spawn, LIMITS, command=True).to_dict() == spawn
    kill = messages.decode({"type": "kill", "ranks": [0, 3], "grace": 3.0}, LIMITS, command=True)
    assert kill == messages.Kill(ranks=[0, 3], grace=3.0)
    with pytest.raises(messages.DecodeError, match="unknown command kind"):
        messages.decode({"type": "step"}, LIMITS, command=True)  # not an agent command


def test_the_receiver_drops_and_reports_what_does_not_open() -> None:
    store = _store()
    rejected: list[tuple[str, int, str, bytes]] = []
    rx = control.Receiver(store, Q, opener=control.Opener(TOKEN),
                          on_reject=lambda q, i, reason, raw: rejected.append((q, i, reason, raw)))
    sealer = control.Sealer(TOKEN, "rank/1")
    control.send(store, Q, messages.decode(_step(1)), sealer)
    # Unsealed, as a forger would write it (long enough to be taken for a sealed value).
    control.send_dict(store, Q, {"type": "done", "rank": 0, "node": 0, "gen": 0, "step": 40, "note": "x" * 64})
    idx = store.add(f"{Q}/n", 1)
    store.set(f"{Q}/{idx}", b"\x80\x81 not json")
    replayed = sealer.seal(Q, _step(2))
    for _ in range(2):
        idx = store.add(f"{Q}/n", 1)
        store.set(f"{Q}/{idx}", replayed)
    control.send(store, Q, messages.decode(_step(3)), sealer)
    got = rx.poll()
    assert [m["step"] for m in got] == [1, 2, 3]
    assert [(q, i) for q, i, _, _ in rejected] == [(Q, 2), (Q, 3), (Q, 5)]
    assert "bad MAC" in rejected[0][2] and "too short" in rejected[1][2] and "replayed" in rejected[2][2]
    assert rejected[1][3] == b"\x80\x81 not json"
    assert not any(store.check([f"{Q}/{i}"]) for i in range(1, 7))  # refused ones are gone too


def test_unsealed_queues_refuse_non_json_instead_of_raising() -> None:
    store = _store()
    rejected: list[str] = []
    rx = control.Receiver(store, "q", on_reject=lambda q, i, reason, raw: rejected.append(reason))
    store.set("q/1", "{broken")
    store.add("q/n", 1)
    control.send_dict(store, "q", {"i": 1})
    assert rx.poll() == [{"i": 1}] and len(rejected) == 1 and rejected[0].startswith("not JSON")


def test_a_forged_plan_is_reported_and_the_genuine_one_found() -> None:
    store = _store()
    opener, sealer = control.Opener(TOKEN), control.Sealer(TOKEN, "controller")
    reported: list[tuple[str, str]] = []
    # An attacker's plan and generation pointer first...
    store.set(control.gen_plan_key(1), json.dumps({"gen": 1, "world_size": 2, "sources": {}}))
    store.set(control.GEN_KEY, "1")
    with pytest.raises(TimeoutError):
        control.newest_plan(store, 1, 0.3, opener, lambda key, i, reason, raw: reported.append((key, reason)))
    # Both refused: the pointer is only a hint, so the plan itself was looked for as well.
    assert {k for k, _ in reported} == {control.GEN_KEY, control.gen_plan_key(1)}
    # ...then the controller's, written over them.
    control.publish_plan(store, 1, GenerationPlan.fresh(1, 2, "peer"), sealer)
    gen, plan = control.newest_plan(store, 1, 5.0, opener)
    assert gen == 1 and plan.world_size == 2
    # A genuine plan copied to another generation's key does not open there.
    store.set(control.gen_plan_key(2), store.get(control.gen_plan_key(1)))
    with pytest.raises(TimeoutError):
        control.wait_plan(store, 2, 0.3, opener)


def test_the_control_key_is_not_the_token() -> None:
    # The snapshot channel's HMAC is keyed by the token itself: the two keys must differ.
    assert control.control_key(TOKEN) != TOKEN.encode()
    assert control.control_key(TOKEN) != control.control_key(OTHER)


# -- the snapshot channel's put cap -------------------------------------------------------------------
def _peer(tmp_path: Path, **caps: int) -> PeerStore:
    return PeerStore("127.0.0.1", TOKEN, lambda rank, slot: slot_path(str(tmp_path), "r", 0, rank, slot), **caps).start()


def _content(step: int, size: int) -> SlotContent:
    import zlib

    shard = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    return SlotContent(step, b"m", shard, zlib.crc32(shard, zlib.crc32(b"m")))


def test_a_put_over_the_slot_cap_is_refused_unallocated(tmp_path: Path) -> None:
    store = _peer(tmp_path, max_slot_bytes=4096, max_total_bytes=1 << 20)
    try:
        client = PeerClient(store.address, store.port, TOKEN)
        client.put(1, _content(2, 4000))  # within the cap: held
        assert store.inventory()["replica"] == {"1": [2]}
        # A sender naming a huge length: refused from the header alone, connection closed.
        header = json.dumps({"op": "put", "rank": 1, "step": 3, "crc": 0, "meta_len": 1, "len": 1 << 40}).encode()
        client.sock.sendall(_LEN.pack(len(header)) + header)
        client.sock.settimeout(5.0)
        assert client.sock.recv(1) == b""  # closed without a reply
        client.close()
        assert store.refused and "over the cap of 4096" in store.refused[-1]
        assert max(len(b) for b in store._buffers.values()) < 8192  # nothing big was allocated
        assert store.inventory()["replica"] == {"1": [2]}  # the held copy is untouched
        with pytest.raises((ChannelError, OSError)):
            PeerClient(store.address, store.port, TOKEN).put(1, _content(5, 5000))
    finally:
        store.stop()


def test_puts_over_the_total_cap_are_refused(tmp_path: Path) -> None:
    store = _peer(tmp_path, max_slot_bytes=4096, max_total_bytes=10_000)
    try:
        client = PeerClient(store.address, store.port, TOKEN)
        client.put(0, _content(2, 4000))
        client.put(0, _content(3, 4000))
        client.put(0, _content(4, 4000))  # reuses slot 0's buffer: no growth
        with pytest.raises((ChannelError, OSError)):
            client.put(1, _content(2, 4000))  # a third buffer would hold 12 kB
        assert "over the cap of 10000" in store.refused[-1]
        assert sorted(store.inventory()["replica"]["0"]) == [3, 4]
    finally:
        store.stop()

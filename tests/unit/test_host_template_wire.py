"""The host template's messages: every kind goes through `encode` and back through `decode`
unchanged, and anything else raises `DecodeError` with one line, never another exception."""
from __future__ import annotations

import json
import random

import pytest

from wire import host_template as wire

MESSAGES: list[wire.Message] = [
    wire.Ready(12), wire.StartAgent(1, {"PATH": "/bin", "X": ""}, "/work", "/runs/r/logs/agent-0.log", '{"node": 0}'),
    wire.AgentStarted(1, 345), wire.AgentStarted(2, 0, "fork failed: [Errno 11]"), wire.StopAgent(345),
    wire.AgentExited(345, -9), wire.AgentExited(346, 0),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips(msg: wire.Message) -> None:
    assert wire.decode(wire.encode(msg).rstrip(b"\n")) == msg


@pytest.mark.parametrize("line, says", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "not a message"),
    (b'{"type": "fork_everything"}', "unknown kind 'fork_everything'"),
    (b'{"pid": 3}', "unknown kind 'None'"),
    (b'{"type": "ready"}', "field 'pid' missing"),
    (b'{"type": "ready", "pid": "3"}', "field 'pid': '3' is not an integer"),
    (b'{"type": "ready", "pid": true}', "field 'pid': 'True' is not an integer"),
    (b'{"type": "ready", "pid": 3, "argv": ["sh"]}', "Ready has no field 'argv'"),
    (b'{"type": "stop_agent", "pid": 3.5}', "is not an integer"),
    (b'{"type": "start_agent", "id": 1, "env": {"A": 1}, "cwd": "", "log": "", "config": ""}',
     "field 'env'"),
    (b'{"type": "start_agent", "id": 1, "env": [], "cwd": "", "log": "", "config": ""}', "field 'env'"),
    (b'{"type": "agent_started", "id": 1, "pid": 2, "error": 5}', "field 'error'"),
])
def test_what_is_not_a_message_is_refused_in_one_line(line: bytes, says: str) -> None:
    with pytest.raises(wire.DecodeError) as err:
        wire.decode(line)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_an_oversized_line_is_refused_before_parsing() -> None:
    with pytest.raises(wire.DecodeError, match="a line of"):
        wire.decode(b'{"type": "ready", "pid": 1, "pad": "' + b"x" * wire.MAX_LINE + b'"}')


def test_garbage_only_ever_raises_decode_error() -> None:
    rng = random.Random(7)
    kinds = [k.value for k in wire.Kind] + ["", "x"]
    values = [None, True, 0, -1, 1.5, "", "s", [], {}, {"a": "b"}, {"a": 1}, 2**70]
    for _ in range(3000):
        raw: dict[str, object] = {"type": rng.choice(kinds)}
        for name in rng.sample(["id", "pid", "env", "cwd", "log", "config", "error", "code", "zz"], rng.randint(0, 6)):
            raw[name] = rng.choice(values)
        line = json.dumps(raw).encode()
        try:
            msg = wire.decode(line)
        except wire.DecodeError:
            continue
        assert wire.decode(wire.encode(msg).rstrip(b"\n")) == msg
    for _ in range(500):
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(0, 60)))
        try:
            wire.decode(junk)
        except wire.DecodeError:
            pass

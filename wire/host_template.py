"""The host template's messages: how the local backend asks it for node agents, and what it says.

The host template (`ffctl.agent.host_template`) is a warm process, torch imported, that forks
the node agents of a launch whose nodes all run on this machine (DESIGN.md, "Processes"). The
local backend (`ffctl.backends.host_template`) talks to it over its stdin and stdout, one JSON
line per message. Each kind is a frozen dataclass; `encode` writes one, `decode` is the one way
back and raises `DecodeError` (one line naming the kind or field) for anything else, so a line
it cannot read is reported by its reader, never fatal to it.

Requests (backend -> template): `StartAgent`, `StopAgent`. Replies (template -> backend):
`Ready` once, after the warm-up; `AgentStarted` for each `StartAgent` (a pid, or the error);
`AgentExited` when a forked agent ends, with its exit status as `subprocess` gives one
(negative: killed by that signal).
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum
from typing import Any, Union


class Kind(str, Enum):
    READY = "ready"
    START_AGENT = "start_agent"
    AGENT_STARTED = "agent_started"
    STOP_AGENT = "stop_agent"
    AGENT_EXITED = "agent_exited"


@dataclass(frozen=True)
class Ready:
    """The warm-up is done; `pid` is the template's own."""

    pid: int


@dataclass(frozen=True)
class StartAgent:
    """Fork a node agent: its environment and working directory (what `python -m ffctl.agent`
    would have been started with), its log file, and its config, the line the agent reads first
    on its stdin. The template holds the write end of that stdin for the agent's lifetime."""

    id: int
    env: dict[str, str]
    cwd: str
    log: str
    config: str


@dataclass(frozen=True)
class AgentStarted:
    """The answer to `StartAgent` `id`: the agent's pid, or 0 and why not."""

    id: int
    pid: int
    error: str = ""


@dataclass(frozen=True)
class StopAgent:
    """Close agent `pid`'s stdin: EOF is every agent's signal to stop its workers and exit."""

    pid: int


@dataclass(frozen=True)
class AgentExited:
    pid: int
    code: int


Message = Union[Ready, StartAgent, AgentStarted, StopAgent, AgentExited]
_KINDS: dict[Kind, type[Any]] = {
    Kind.READY: Ready, Kind.START_AGENT: StartAgent, Kind.AGENT_STARTED: AgentStarted,
    Kind.STOP_AGENT: StopAgent, Kind.AGENT_EXITED: AgentExited,
}
_NAMES = {cls: kind for kind, cls in _KINDS.items()}
_TYPES = {"int": "int", "str": "str", "dict[str, str]": "env"}  # the fields' annotations
_WHAT = {"int": "an integer", "str": "a string", "env": "a map of strings to strings"}
MAX_LINE = 1 << 20  # a StartAgent carries an environment: generous, but bounded


class DecodeError(ValueError):
    """A line that is not one of these messages."""


def encode(msg: Message) -> bytes:
    return (json.dumps({"type": _NAMES[type(msg)].value, **asdict(msg)}) + "\n").encode()


def _check(name: str, value: Any, want: str) -> Any:
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "env": isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()),
    }[want]
    if not ok:
        raise DecodeError(f"field {name!r}: {str(value)[:60]!r} is not {_WHAT[want]}")
    return value


def decode(line: bytes) -> Message:
    """The message on `line`. Raises DecodeError, and only that."""
    if len(line) > MAX_LINE:
        raise DecodeError(f"a line of {len(line)} bytes")
    try:
        raw = json.loads(line)
    except ValueError:
        raise DecodeError(f"not JSON: {line[:60]!r}") from None
    if not isinstance(raw, dict):
        raise DecodeError(f"not a message: {line[:60]!r}")
    try:
        cls = _KINDS[Kind(raw.get("type"))]
    except ValueError:
        raise DecodeError(f"unknown kind {str(raw.get('type'))[:40]!r}") from None
    known = {f.name: f for f in fields(cls)}
    extra = set(raw) - set(known) - {"type"}
    if extra:
        raise DecodeError(f"{cls.__name__} has no field {sorted(extra)[0][:40]!r}")
    values = {}
    for name, f in known.items():
        if name not in raw:
            if f.default is not MISSING:
                continue
            raise DecodeError(f"{cls.__name__}: field {name!r} missing")
        values[name] = _check(name, raw[name], _TYPES[str(f.type)])
    try:
        return cls(**values)
    except TypeError as exc:
        raise DecodeError(f"{cls.__name__}: {exc}") from None

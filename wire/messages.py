"""The typed messages of the control plane: what ranks and agents tell the controller, and the
commands the controller gives agents.

Each kind of message is one frozen dataclass; its fields say the type and range of each value
they carry (a rank within the job, a step not negative, a port in range). On the wire a message
is a JSON object whose `type` is the kind and whose other keys are the fields, exactly as the
dataclass names them; `to_dict` writes that form and `decode` is the one way back: it returns the
message or raises `DecodeError` with one line naming the kind, the field and the bad value, for
anything at all (an unknown kind, a field missing, of the wrong type, out of range, or one the
kind does not have). It never raises anything else, so a value read from the store cannot crash
its reader.

Reports (ranks and agents -> the controller, on `ctl/q`) and commands (the controller -> an
agent, on the agent's queue) are separate sets: `decode(..., command=True)` reads a command, so
a report forged onto an agent's queue (or the reverse) is an unknown kind there.

Checking is driven by per-kind tables built once, when this module is imported: decoding the
per-step `step` report costs a dict lookup, one small check per field and a dataclass call.
"""
from __future__ import annotations

import dataclasses
import math
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, NamedTuple, TypeVar

from runs.events import RestoreHow, RestoreSource, StepPhase
from wire.fault_spec import FAULT_ID, FaultSpec, FaultSpecError, parse_injection

if TYPE_CHECKING:
    from typing import dataclass_transform
else:
    # typing has it from Python 3.11; it only tells a type checker what `_register` does.
    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda f: f

# Without a job to compare with (`limits` not given), ranks and nodes are only bounded by these.
MAX_RANKS = 1 << 20
MAX_NODES = 1 << 16
MAX_STR = 100_000
MAX_LIST = 100_000
MAX_GRACE_S = 86_400.0


class Kind(str, Enum):
    """What a rank or an agent reports to the controller (on `ctl/q`)."""

    STEP = "step"
    STARTED = "started"
    JOINED = "joined"
    RESTORED = "restored"
    DONE = "done"
    ABORTED = "aborted"
    ABORT_SEEN = "abort_seen"
    RESTORE_FAILED = "restore_failed"
    ERROR = "error"
    CKPT = "ckpt"
    AGENT_FAILED = "agent_failed"
    AGENT_UP = "agent_up"
    AGENT_ERROR = "agent_error"
    SPARES = "spares"
    SPAWNED = "spawned"
    RANK_EXITED = "rank_exited"
    REPLICATED = "replicated"
    INVENTORY = "inventory"
    INJECT_REQUEST = "inject_request"
    # `ffctl inject revert FAULT --run ID`: end one fault of the job now (chaosd's recover by id).
    REVERT_REQUEST = "revert_request"
    # A sender that refused something it read (an agent's queue, an abort flag, a plan).
    REJECTED = "rejected"
    TRAINING = "training"
    # An agent's sign of life: written to its own key (`hb/<node>`), and sent on `ctl/q` too
    # while someone else writes over that key.
    HEARTBEAT = "heartbeat"
    # An armed in-step fault fired (a kill-rank with phase=): where, just before the rank dies.
    FAULT_LANDED = "fault_landed"
    # An agent flipped a byte in the replicas it holds of a rank (corrupt-snapshot copy=replica).
    REPLICAS_CORRUPTED = "replicas_corrupted"
    # None of a node's ranks has printed a line for a while (`silent`), or one printed again
    # after that (`output`): what tells the controller a script's job is silent as a whole.
    SILENT = "silent"
    OUTPUT = "output"


class CommandKind(str, Enum):
    """What the controller tells an agent (on the agent's queue)."""

    SPAWN = "spawn"
    KILL = "kill"
    NEIGHBOR = "neighbor"
    INVENTORY = "inventory"
    STOP = "stop"


class ReplyKind(str, Enum):
    """What the controller answers a client (`ffctl inject`) under a key of the request's own."""

    INJECT_REPLY = "inject_reply"


class DecodeError(ValueError):
    """A value is not a valid message; `reason` says which kind, field and value, in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Limits:
    """What a field's value must lie within: the job's world size and node count."""

    def __init__(self, world_size: int, nnodes: int) -> None:
        self.world_size = world_size
        self.nnodes = nnodes


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- value checks: (value, limits or None) -> whether it is valid ---------------------------------
Check = Callable[[Any, "Limits | None"], bool]
# A field's value once checked, made into its type (an enum member, a nested message); may
# refuse with DecodeError where a check alone cannot name what is wrong (a nested message).
Convert = Callable[[Any, "Limits | None"], Any]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any, _: Limits | None) -> bool:
    return _is_int(v) and abs(v) < 1 << 62


def _nat(v: Any, _: Limits | None) -> bool:
    return _is_int(v) and 0 <= v < 1 << 62


def _num(v: Any, _: Limits | None) -> bool:
    # Not necessarily finite: a diverged loss is NaN or inf and is a fact worth reporting.
    return isinstance(v, float) or (_is_int(v) and abs(v) < 1 << 62)


def _finite(v: Any) -> bool:
    # Ints are bounded first: math.isfinite refuses an int too large for a float with an error.
    return (isinstance(v, float) and math.isfinite(v)) or (_is_int(v) and abs(v) < 1 << 62)


def _seconds(v: Any, _: Limits | None) -> bool:
    return _finite(v) and 0 <= v <= 1e12


def _time(v: Any, _: Limits | None) -> bool:  # a wall-clock timestamp
    return _finite(v) and 0 <= v < 1e11


def _grace(v: Any, _: Limits | None) -> bool:
    return _finite(v) and 0 <= v <= MAX_GRACE_S


def _str(v: Any, _: Limits | None) -> bool:
    return isinstance(v, str) and len(v) <= MAX_STR


def _bool(v: Any, _: Limits | None) -> bool:
    return isinstance(v, bool)


def _rank(v: Any, lim: Limits | None) -> bool:
    return _is_int(v) and 0 <= v < (lim.world_size if lim is not None else MAX_RANKS)


def _node(v: Any, lim: Limits | None) -> bool:
    return _is_int(v) and 0 <= v < (lim.nnodes if lim is not None else MAX_NODES)


def _rank_key(k: Any, lim: Limits | None) -> bool:
    # JSON object keys are strings: a rank as a key is its decimal digits (ASCII only, since
    # str.isdigit also admits other scripts' digits, which int() may refuse).
    return isinstance(k, str) and 0 < len(k) <= 10 and k.isascii() and k.isdigit() and _rank(int(k), lim)


def _ranks(v: Any, lim: Limits | None) -> bool:
    return isinstance(v, list) and len(v) <= MAX_LIST and all(_rank(r, lim) for r in v)


def _lines(v: Any, lim: Limits | None) -> bool:  # a log tail or a traceback
    return isinstance(v, list) and len(v) <= 10_000 and all(_str(x, lim) for x in v)


def _pids(v: Any, lim: Limits | None) -> bool:  # {"<rank>": pid}
    return isinstance(v, dict) and all(_rank_key(k, lim) and _nat(p, lim) for k, p in v.items())


def _rank_words(v: Any, lim: Limits | None) -> bool:  # {"<rank>": "spare" | "template" | ...}
    return isinstance(v, dict) and all(_rank_key(k, lim) and _str(x, lim) for k, x in v.items())


def _rank_seconds(v: Any, lim: Limits | None) -> bool:  # {"<rank>": seconds}
    return isinstance(v, dict) and all(_rank_key(k, lim) and _seconds(x, lim) for k, x in v.items())


def _held(v: Any, lim: Limits | None) -> bool:  # {"<rank>": [steps]}
    return isinstance(v, dict) and all(
        _rank_key(k, lim) and isinstance(s, list) and len(s) <= MAX_LIST and all(_int(x, lim) for x in s)
        for k, s in v.items())


def _steps(v: Any, lim: Limits | None) -> bool:  # [step, ...]
    return isinstance(v, list) and len(v) <= MAX_LIST and all(_nat(x, lim) for x in v)


# How a script drives the recovery library (`Training.api`).
APIS = ("step-function", "ddp", "fsdp")


def _api(v: Any, _: Limits | None) -> bool:
    return isinstance(v, str) and v in APIS


def _req(v: Any, _: Limits | None) -> bool:  # an inject request id: it names a store key
    return isinstance(v, str) and 0 < len(v) <= 64 and v.isascii() and v.isalnum()


def _fault_id(v: Any, _: Limits | None) -> bool:  # the controller's ids: f1, f2, ...
    return isinstance(v, str) and FAULT_ID.fullmatch(v) is not None


def _addr(v: Any, _: Limits | None) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 255


def _port(v: Any, _: Limits | None) -> bool:
    return _is_int(v) and 0 < v < 65536


def _holder(v: Any, lim: Limits | None) -> bool:
    """A snapshot channel as "address:port" (an IPv6 address has colons of its own)."""
    if not isinstance(v, str) or ":" not in v:
        return False
    address, _, port = v.rpartition(":")
    return _addr(address, lim) and port.isascii() and port.isdigit() and _port(int(port), lim)


MAX_COPIES = 8  # --snapshot-copies: ring neighbours a node's slots are streamed to


def _endpoints(v: Any, lim: Limits | None) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) <= MAX_COPIES
            and all(isinstance(e, (list, tuple)) and len(e) == 2 and _addr(e[0], lim) and _port(e[1], lim) for e in v))


def _plain(value: Any) -> Any:
    """A field's value as JSON holds it: tuples (of a converted field) as lists, a fault as the
    text its parser reads."""
    if isinstance(value, FaultSpec):
        return value.to_text()
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _as_fault(v: Any, _: Limits | None) -> FaultSpec:
    """A fault to inject now, from its text, by the one parser every fault spec goes through."""
    try:
        return parse_injection(v, scheduled=False)
    except FaultSpecError as exc:
        raise DecodeError(str(exc)) from None


def _as_endpoints(v: Any, _: Limits | None) -> tuple[tuple[str, int], ...]:
    return tuple((str(a), int(p)) for a, p in v)


def _env(v: Any, _: Limits | None) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _rank_specs(v: Any, lim: Limits | None) -> bool:  # spawn: [{"rank": r, "env": {str: str}}]
    return isinstance(v, list) and len(v) <= MAX_LIST and all(
        isinstance(s, dict) and s.keys() == {"rank", "env"} and _rank(s["rank"], lim) and _env(s["env"], lim)
        for s in v)


def _restore_source(v: Any, _: Limits | None) -> bool:
    return isinstance(v, str) and v in RestoreSource._value2member_map_


def _restore_how(v: Any, _: Limits | None) -> bool:
    return isinstance(v, str) and v in RestoreHow._value2member_map_


def _phase(v: Any, _: Limits | None) -> bool:
    return isinstance(v, str) and v in StepPhase._value2member_map_


_WANT: dict[Check, str] = {
    _int: "an integer", _nat: "an integer >= 0", _num: "a number", _seconds: "a finite number of seconds >= 0",
    _time: "a timestamp", _grace: f"seconds from 0 to {MAX_GRACE_S:g}", _str: "a string",
    _bool: "true or false", _rank: "a rank of the job", _node: "a node of the job",
    _ranks: "a list of ranks", _lines: "a list of strings", _pids: "{rank: pid}",
    _rank_words: "{rank: string}", _rank_seconds: "{rank: seconds}", _held: "{rank: [steps]}", _steps: "[steps]",
    _req: "1-64 ASCII letters or digits", _fault_id: "a fault id (f1, f2, ...)", _addr: "a host address", _port: "a port (1-65535)",
    _rank_specs: '[{"rank": rank, "env": {string: string}}]', _api: " or ".join(APIS),
    _restore_source: " or ".join(s.value for s in RestoreSource),
    _restore_how: " or ".join(h.value for h in RestoreHow),
    _phase: " or ".join(p.value for p in StepPhase),
    _holder: "address:port",
    _endpoints: f"a list of at most {MAX_COPIES} [address, port]",
}


def _enum(cls: type[Enum]) -> Convert:
    """The member of `cls` a checked value names: the decoded message holds the enum."""
    return lambda v, _: cls(v)


def _field(check: Check, convert: Convert | None = None) -> Any:
    """A field every message of its kind carries; `convert` makes the checked value its type."""
    return dataclasses.field(metadata={"check": check, "convert": convert})


def _optional(check: Check, convert: Convert | None = None) -> Any:
    """A field that may be absent (or null): None then."""
    return dataclasses.field(default=None, metadata={"check": check, "optional": True, "convert": convert})


class _Spec(NamedTuple):
    cls: type[Message]
    fields: tuple[tuple[str, Check, bool, Convert | None], ...]  # (name, check, optional, convert)
    names: frozenset[str]


# -- messages --------------------------------------------------------------------------------------
class Message:
    """One message of the control plane. Subclasses are frozen dataclasses registered with
    `@_report` or `@_command`, which build their wire tables once."""

    __slots__ = ()
    kind: ClassVar[Enum]  # Kind, CommandKind, or another table's kinds (`wire.generation_plan`)
    _spec: ClassVar[_Spec]

    def to_dict(self) -> dict[str, Any]:
        """The wire form: `{"type": kind, field: value, ...}`, optional fields left out when None."""
        out: dict[str, Any] = {"type": self.kind.value}
        for name, _, optional, _ in self._spec.fields:
            value = getattr(self, name)
            if value is not None or not optional:
                out[name] = _plain(value)
        return out

    @classmethod
    def from_dict(cls: type[M], raw: Mapping[str, Any], limits: Limits | None = None) -> M:
        """`raw` decoded as this kind of message (DecodeError if it is another or is invalid)."""
        if raw.get("type") != cls.kind.value:
            raise DecodeError(f"a {short_repr(raw.get('type'))} message where a {cls.kind.value} belongs")
        return _decode_fields(cls._spec, cls.kind.value, raw, limits)  # type: ignore[return-value]  # made by cls


M = TypeVar("M", bound=Message)
REPORTS: dict[str, _Spec] = {}
COMMANDS: dict[str, _Spec] = {}
REPLIES: dict[str, _Spec] = {}


# The registering decorators make their class a keyword-only frozen dataclass (below), which a
# type checker learns from `dataclass_transform`: it then checks every message's construction.
# `_field` is a field without a default; `_optional`, a plain default of None as far as a checker
# needs to know.
@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(dataclasses.field, _field))
def _register(table: dict[str, _Spec], kind: Enum) -> Callable[[type[M]], type[M]]:
    """Make `cls` a frozen dataclass and the message of `kind` in `table` (one table per
    decoder: reports, commands, and the plan's tables in `wire.generation_plan`)."""
    def wrap(cls: type[M]) -> type[M]:
        cls = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)
        fields = tuple((f.name, f.metadata["check"], bool(f.metadata.get("optional")), f.metadata.get("convert"))
                       for f in dataclasses.fields(cls))  # type: ignore[arg-type]  # one since the line above
        cls.kind = kind
        cls._spec = _Spec(cls, fields, frozenset(name for name, _, _, _ in fields))
        table[kind.value] = cls._spec
        return cls
    return wrap


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(dataclasses.field, _field))
def _report(kind: Kind) -> Callable[[type[M]], type[M]]:
    return _register(REPORTS, kind)


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(dataclasses.field, _field))
def _command(kind: CommandKind) -> Callable[[type[M]], type[M]]:
    return _register(COMMANDS, kind)


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(dataclasses.field, _field))
def _reply(kind: ReplyKind) -> Callable[[type[M]], type[M]]:
    return _register(REPLIES, kind)


# Reports from a rank name the rank, its node and the generation it is in.
@_report(Kind.STEP)
class Step(Message):
    """A rank committed `step` (its snapshot is durable) with this loss, in `dt` seconds, of which
    it spent `wait` blocked in the step's collectives (what it did not spend computing: the
    straggler detector's signal, since every rank of a synchronous job takes the same `dt`). A
    script that reports its steps itself (`recovery.report_step`, `--step-regex`) may say neither
    its loss nor its wait."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    step: int = _field(_nat)
    dt: float = _field(_seconds)
    loss: float | None = _optional(_num)
    wait: float | None = _optional(_seconds)


@_report(Kind.STARTED)
class Started(Message):
    """A rank's process is up and about to join its generation."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    pid: int | None = _optional(_nat)


@_report(Kind.JOINED)
class Joined(Message):
    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)


@_report(Kind.RESTORED)
class Restored(Message):
    """A rank holds the state of `step`, from `source` (the kind of its plan's source); `how`
    it got its replicated state (kept, received, gathered, continued: `recovery.restore`);
    `loss`, the loss its copy recorded for `step` (the record's, should no report of it have
    reached the controller)."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    step: int = _field(_nat)
    how: RestoreHow | None = _optional(_restore_how, _enum(RestoreHow))
    source: RestoreSource | None = _optional(_restore_source, _enum(RestoreSource))
    loss: float | None = _optional(_num)


@_report(Kind.TRAINING)
class Training(Message):
    """How this rank's script trains, said once as `Job.run` starts: `api` "step-function" (a
    step function with the library's collectives) or "ddp" (torch's DDP, `Job.register_ddp`)."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    api: str = _field(_api)


@_report(Kind.DONE)
class Done(Message):
    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    step: int | None = _optional(_nat)


@_report(Kind.ABORTED)
class Aborted(Message):
    """A rank left its generation (told to, or its group failed) with `step` its last commit."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    step: int = _field(_nat)
    reason: str | None = _optional(_str)
    # The matrix products the rank's failed step skipped (`recovery.failed_step`): 0 when it
    # computed them (the failure came inside `backward()`, or on no collective of torch's).
    skipped: int | None = _optional(_nat)


@_report(Kind.ABORT_SEEN)
class AbortSeen(Message):
    """A rank's abort watcher saw its generation's abort: the process runs, though its training
    thread may still be busy in a step (its `aborted` follows once it leaves the generation)."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)


@_report(Kind.RESTORE_FAILED)
class RestoreFailed(Message):
    """The copy of `step` at `source` could not be used (missing, torn, checksum wrong); for a
    replica, `holder` is the snapshot channel ("address:port") it came from, so that the next
    decision offers another holder's copy of the same step rather than none."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    step: int = _field(_nat)
    source: RestoreSource = _field(_restore_source, _enum(RestoreSource))
    reason: str | None = _optional(_str)
    holder: str | None = _optional(_holder)


@_report(Kind.ERROR)
class StepError(Message):
    """A step raised: its error's first line and the traceback's last lines."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    step: int | None = _optional(_int)
    error: str | None = _optional(_str)
    traceback: list[str] | None = _optional(_lines)


@_report(Kind.FAULT_LANDED)
class FaultLanded(Message):
    """The rank is about to kill itself: the in-step fault it was armed with (kill-rank with
    phase=) met its phase in this step."""

    rank: int = _field(_rank)
    node: int = _field(_node)
    gen: int = _field(_nat)
    step: int = _field(_nat)
    phase: str = _field(_phase)


@_report(Kind.REPLICAS_CORRUPTED)
class ReplicasCorrupted(Message):
    """Node `node`'s agent flipped a byte in each copy it holds of `rank`'s slots (of `steps`;
    none held: empty), after the checksum it verified when it kept them."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    rank: int = _field(_rank)
    steps: list[int] = _field(_steps)


@_report(Kind.CKPT)
class Ckpt(Message):
    """A rank wrote its disk checkpoint of `step`, which it committed in generation `gen` with
    `loss` in `dt` seconds.
    (A complete checkpoint commits the step to the record: its `step` report waits for the
    snapshot's copy on the ring neighbour, and a node fault in between would otherwise restore
    from a step whose loss the record never had.)"""

    rank: int = _field(_rank)
    node: int = _field(_node)
    step: int = _field(_nat)
    gen: int | None = _optional(_nat)
    loss: float | None = _optional(_num)
    dt: float | None = _optional(_seconds)


# Reports from an agent name its node and its incarnation (which start of the node's agent it
# is): the controller acts only on the current one's (`Inbox.dispatch`).
@_report(Kind.AGENT_FAILED)
class AgentFailed(Message):
    """The agent could not start (its node is held by another live agent, ...)."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    reason: str = _field(_str)


@_report(Kind.AGENT_UP)
class AgentUp(Message):
    """Incarnation `incarnation` of the node's agent runs: its pid, host, clock (`time`) and the
    address of its snapshot store. (An agent the controller has since replaced may still say it
    is up: the incarnation tells that one apart.)"""

    node: int = _field(_node)
    incarnation: int = _field(_nat)
    pid: int = _field(_nat)
    host: str = _field(_str)
    time: float = _field(_time)
    peer_address: str = _field(_str)
    peer_port: int | None = _optional(_port)


@_report(Kind.AGENT_ERROR)
class AgentError(Message):
    """A command the agent accepted failed while it carried it out."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    error: str = _field(_str)


@_report(Kind.SPARES)
class Spares(Message):
    """Warm spares the agent holds (`count`), of `total` started; whether its template is warm."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    count: int = _field(_nat)
    total: int | None = _optional(_nat)
    template: bool | None = _optional(_bool)


@_report(Kind.SPAWNED)
class Spawned(Message):
    """Ranks started for generation `gen`: their pids, how each started and how long it took.
    `dropped`: ranks of the generation's spawn that a `Kill` reached before they were started
    (held while the template warmed up): never started, and nothing of theirs to wait for."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    gen: int = _field(_nat)
    pids: dict[str, int] = _field(_pids)
    how: dict[str, str] | None = _optional(_rank_words)
    start_s: dict[str, float] | None = _optional(_rank_seconds)
    dropped: list[int] | None = _optional(_ranks)


@_report(Kind.RANK_EXITED)
class RankExited(Message):
    """A rank's process ended; `expected` when it was told to; a failed one's last lines of
    stdout (`log_tail`) and of stderr (`err_tail`)."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    rank: int = _field(_rank)
    gen: int = _field(_nat)
    pid: int = _field(_nat)
    exitcode: int = _field(_int)
    expected: bool | None = _optional(_bool)
    host: str | None = _optional(_str)
    log_tail: list[str] | None = _optional(_lines)
    err_tail: list[str] | None = _optional(_lines)
    # The Python stacks it wrote when it was stopped to be looked at (a lingering or silent
    # rank), and the file beside its log that keeps them.
    stacks: list[str] | None = _optional(_lines)
    stacks_file: str | None = _optional(_str)
    # The message of the error file torch's `@record` wrote (TORCHELASTIC_ERROR_FILE), if any.
    error: str | None = _optional(_str)


@_report(Kind.SILENT)
class Silent(Message):
    """No rank of generation `gen` on the node has written a line to its logs for `silent_s`
    seconds; `ranks`: each one's own silence. Sent once a silence is a few seconds old."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    gen: int = _field(_nat)
    silent_s: float = _field(_seconds)
    ranks: dict[str, float] = _field(_rank_seconds)


@_report(Kind.OUTPUT)
class Output(Message):
    """A rank of generation `gen` on the node wrote to its logs again after a `silent`."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    gen: int = _field(_nat)


@_report(Kind.REPLICATED)
class Replicated(Message):
    """Every slot of `ranks` on the node is held off-node up to `step`."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    step: int = _field(_nat)
    ranks: list[int] = _field(_ranks)


@_report(Kind.INVENTORY)
class Inventory(Message):
    """The answer to inventory request `req`: the steps held per rank, own and replicas."""

    node: int = _field(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it
    req: int = _field(_int)
    local: dict[str, list[int]] = _field(_held)
    replica: dict[str, list[int]] = _field(_held)


@_report(Kind.INJECT_REQUEST)
class InjectRequest(Message):
    """`ffctl inject` asks for a fault; the answer, an `InjectReply`, goes to `inject_reply_key(req)`.
    The fault travels as the text of its spec and is decoded by its parser: a request whose fault
    does not parse is refused like any malformed message (`ffctl inject` parsed it first)."""

    fault: FaultSpec = _field(_str, _as_fault)
    req: str = _field(_req)
    dry_run: bool | None = _optional(_bool)


@_report(Kind.REVERT_REQUEST)
class RevertRequest(Message):
    """`ffctl inject revert` asks to revert fault `fault_id` now; answered like an inject request,
    an `InjectReply` under `inject_reply_key(req)`."""

    fault_id: str = _field(_fault_id)
    req: str = _field(_req)
    dry_run: bool | None = _optional(_bool)


def inject_reply_key(req: str) -> str:
    """The store key the controller answers inject request `req` under (`req` is alphanumeric:
    `InjectRequest` checks it)."""
    return f"inject/reply/{req}"


@_reply(ReplyKind.INJECT_REPLY)
class InjectReply(Message):
    """The controller's answer to inject request `req`: applied as `fault_id` (`ok`), or not and
    why (`error`; `bad_input` when the spec itself is wrong for this job), or with `dry_run`
    the plan's lines (`plan`)."""

    req: str = _field(_req)
    ok: bool = _field(_bool)
    fault_id: str | None = _optional(_str)
    error: str | None = _optional(_str)
    bad_input: bool | None = _optional(_bool)
    plan: list[str] | None = _optional(_lines)


@_report(Kind.REJECTED)
class Refusal(Message):
    """A rank (`rank` set) or an agent refused a value it read at `where` (index in its queue)."""

    where: str = _field(_str)
    reason: str = _field(_str)
    raw: str | None = _optional(_str)
    index: int | None = _optional(_int)
    node: int | None = _optional(_node)
    incarnation: int | None = _optional(_nat)  # of the agent that sent it (a rank names none)
    rank: int | None = _optional(_rank)
    unreported: int | None = _optional(_nat)  # refused since the last report, not sent one by one


@_report(Kind.HEARTBEAT)
class Heartbeat(Message):
    """Agent incarnation `incarnation` of `node` is alive; `beat` counts its heartbeats. Sealed
    like every value, so only a newer one from the same agent process counts as news."""

    node: int = _field(_node)
    incarnation: int = _field(_nat)
    beat: int = _field(_nat)


def from_agent(kind: type[M], node: int, incarnation: int, **fields: Any) -> M:
    """A report of `kind` from incarnation `incarnation` of node `node`'s agent. It names the
    incarnation wherever its kind has one: a recovery may start a node's agent again while the
    previous one still runs, and the controller acts on the current one's reports only. (A
    `step` the agent reads from a script's output is the rank's, and names none.)"""
    if "incarnation" in kind._spec.names:
        fields["incarnation"] = incarnation
    return kind(node=node, **fields)  # type: ignore[call-arg]  # a kind an agent sends


# Commands to an agent.
@_command(CommandKind.SPAWN)
class Spawn(Message):
    """Start these ranks of generation `gen`, each with its environment."""

    gen: int = _field(_nat)
    ranks: list[dict[str, Any]] = _field(_rank_specs)


@_command(CommandKind.KILL)
class Kill(Message):
    """End these ranks (SIGTERM, then SIGKILL after `grace` seconds); their exits are expected.
    `tail`: report the end of each one's log with its exit (what a lingering rank was doing)."""

    ranks: list[int] = _field(_ranks)
    grace: float | None = _optional(_grace)
    tail: bool | None = _optional(_bool)


@_command(CommandKind.NEIGHBOR)
class Neighbor(Message):
    """Replicate to these snapshot stores, in ring order: the ring neighbour's first, then the
    next nodes' with `--snapshot-copies` above 1 (none: replicate nowhere)."""

    holders: tuple[tuple[str, int], ...] = _field(_endpoints, _as_endpoints)


@_command(CommandKind.INVENTORY)
class InventoryRequest(Message):
    """Report what the node holds, as an `inventory` report answering `req`."""

    req: int = _field(_int)


@_command(CommandKind.STOP)
class Stop(Message):
    """Take every worker down and exit."""


def report_type(kind: Kind | str) -> type[Message]:
    """The message class of a report kind (KeyError for a kind that is not one)."""
    return REPORTS[Kind(kind).value].cls


def _decode_fields(spec: _Spec, kind: str, raw: Mapping[Any, Any], limits: Limits | None) -> Message:
    values: dict[str, Any] = {}
    for name, check, optional, convert in spec.fields:
        value = raw.get(name)
        if value is None:
            if optional:
                continue
            if name not in raw:
                raise DecodeError(f"{kind}: missing field {name!r}")
        if not check(value, limits):
            raise DecodeError(f"{kind}: bad {name}={short_repr(value)} (want {_WANT[check]})")
        if convert is not None:
            try:
                value = convert(value, limits)
            except DecodeError as exc:
                raise DecodeError(f"{kind}: {name}: {exc.reason}") from None
        values[name] = value
    if len(raw) > len(values) + 1:
        extra = [k for k in raw if k != "type" and k not in spec.names]
        if extra:
            raise DecodeError(f"{kind}: unexpected field {short_repr(extra[0])}")
    return spec.cls(**values)


def decode(raw: Any, limits: Limits | None = None, *, command: bool = False) -> Message:
    """The message `raw` (a wire dict) holds: a report, or with `command` an agent command.
    `limits` bounds ranks and nodes by the job's shape. Raises DecodeError, and only that."""
    if not isinstance(raw, dict):
        raise DecodeError(f"not a message: {short_repr(raw)}")
    kind = raw.get("type")
    table = COMMANDS if command else REPORTS
    spec = table.get(kind) if isinstance(kind, str) else None
    if spec is None or not isinstance(kind, str):
        what = "command" if command else "message"
        raise DecodeError(f"unknown {what} kind {short_repr(kind)}")
    return _decode_fields(spec, kind, raw, limits)

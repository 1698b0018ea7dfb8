"""The typed control plane: every message kind round-trips through its wire form, `decode` refuses
anything else with one `DecodeError` naming the kind, field and value (and never raises another
error, whatever it is given), and the controller and the agent handle every kind they can
receive: an unknown or unhandled one is recorded (controller) or reported back (agent)."""
from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffctl.agent.commands import CommandHandler
from ffctl.agent.workers import WorkerSupervisor
from ffctl.controller.inbox import Inbox
from ffctl.controller.plane import ControlPlane
from ffctl.controller.state import JobState
from wire import control, messages
from wire.fault_spec import parse_injection
from wire.messages import CommandKind, DecodeError, Kind
from runs.events import EventKind, RestoreHow, RestoreSource, RunStatus
from tests.helpers.store import loopback_store

LIMITS = messages.Limits(world_size=4, nnodes=2)
TOKEN = "c" * 64

# One valid message of every kind, as it travels.
REPORTS: dict[Kind, dict[str, Any]] = {
    Kind.STEP: {"rank": 1, "node": 0, "gen": 2, "step": 7, "loss": 2.5, "dt": 0.125},
    Kind.STARTED: {"rank": 3, "node": 1, "gen": 0, "pid": 4242},
    Kind.JOINED: {"rank": 0, "node": 0, "gen": 1},
    Kind.RESTORED: {"rank": 2, "node": 1, "gen": 1, "step": 5, "how": "received", "source": "replica"},
    Kind.DONE: {"rank": 1, "node": 0, "gen": 3, "step": 40},
    Kind.TRAINING: {"rank": 1, "node": 0, "gen": 0, "api": "ddp"},
    Kind.ABORTED: {"rank": 1, "node": 0, "gen": 3, "step": 12, "reason": "abort flag", "skipped": 47},
    Kind.ABORT_SEEN: {"rank": 1, "node": 0, "gen": 3},
    Kind.RESTORE_FAILED: {"rank": 2, "node": 1, "gen": 1, "step": 5, "source": "peer-memory", "reason": "missing",
                          "holder": "10.0.0.2:41000"},
    Kind.ERROR: {"rank": 0, "node": 0, "gen": 0, "step": 3, "error": "RuntimeError: boom",
                 "traceback": ["Traceback (most recent call last):", "RuntimeError: boom"]},
    Kind.CKPT: {"rank": 3, "node": 1, "step": 10},
    Kind.AGENT_FAILED: {"node": 1, "reason": "node 1 of run r is held by pid 77"},
    Kind.AGENT_UP: {"node": 0, "incarnation": 1, "pid": 100, "host": "h0", "time": 1.7e9, "peer_address": "10.0.0.1",
                    "peer_port": 40000},
    Kind.AGENT_ERROR: {"node": 1, "error": "spawn: OSError: no memory"},
    Kind.SPARES: {"node": 0, "count": 1, "total": 2, "template": True},
    Kind.SPAWNED: {"node": 1, "gen": 2, "pids": {"2": 501, "3": 502}, "how": {"2": "spare", "3": "cold"},
                   "start_s": {"2": 0.01, "3": 1.5}, "dropped": [1]},
    Kind.HEARTBEAT: {"node": 1, "incarnation": 2, "beat": 40},
    Kind.RANK_EXITED: {"node": 1, "rank": 3, "gen": 2, "pid": 502, "exitcode": -9, "expected": False,
                       "host": "h1", "log_tail": ["step 4", "Killed"], "err_tail": ["Traceback"]},
    Kind.FAULT_LANDED: {"rank": 1, "node": 0, "gen": 0, "step": 12, "phase": "collective"},
    Kind.REPLICAS_CORRUPTED: {"node": 0, "rank": 2, "steps": [11, 12]},
    Kind.SILENT: {"node": 1, "incarnation": 0, "gen": 2, "silent_s": 5.2, "ranks": {"2": 5.2, "3": 7.0}},
    Kind.OUTPUT: {"node": 1, "incarnation": 0, "gen": 2},
    Kind.REPLICATED: {"node": 0, "step": 9, "ranks": [0, 1]},
    Kind.INVENTORY: {"node": 0, "req": 3, "local": {"0": [8, 9], "1": [9]}, "replica": {"2": [9]}},
    Kind.INJECT_REQUEST: {"fault": "kill-rank:rank=1", "req": "a1b2c3", "dry_run": True},
    Kind.REVERT_REQUEST: {"fault_id": "f12", "req": "a1b2c3"},
    Kind.REJECTED: {"where": "agent/0/0/q", "reason": "bad MAC", "raw": "b'x'", "index": 4, "node": 0},
}
COMMANDS: dict[CommandKind, dict[str, Any]] = {
    CommandKind.SPAWN: {"gen": 1, "ranks": [{"rank": 3, "env": {"RANK": "3", "FFCTL_GEN": "1"}}]},
    CommandKind.KILL: {"ranks": [0, 3], "grace": 3.0},
    CommandKind.NEIGHBOR: {"holders": [["10.0.0.2", 41000], ["10.0.0.3", 41000]]},
    CommandKind.INVENTORY: {"req": 12},
    CommandKind.STOP: {},
}


def _wire(kind: Kind | CommandKind, fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind.value, **fields}


def test_the_examples_cover_every_kind() -> None:
    assert set(REPORTS) == set(Kind) and set(COMMANDS) == set(CommandKind)
    assert set(messages.REPORTS) == {k.value for k in Kind}
    assert set(messages.COMMANDS) == {k.value for k in CommandKind}


@pytest.mark.parametrize("kind", list(Kind))
def test_every_report_round_trips(kind: Kind) -> None:
    wire = _wire(kind, REPORTS[kind])
    msg = messages.decode(json.loads(json.dumps(wire)), LIMITS)
    assert msg.kind is kind and type(msg) is messages.report_type(kind)
    assert msg.to_dict() == wire  # the wire form is unchanged: same names, same values
    assert type(msg).from_dict(msg.to_dict(), LIMITS) == msg
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, next(iter(REPORTS[kind])), 0)


@pytest.mark.parametrize("kind", list(CommandKind))
def test_every_command_round_trips(kind: CommandKind) -> None:
    wire = _wire(kind, COMMANDS[kind])
    msg = messages.decode(json.loads(json.dumps(wire)), LIMITS, command=True)
    assert msg.kind is kind and msg.to_dict() == wire
    assert messages.decode(msg.to_dict(), command=True) == msg


def test_restore_words_decode_to_their_enums() -> None:
    msg = messages.decode(_wire(Kind.RESTORED, REPORTS[Kind.RESTORED]), LIMITS)
    assert isinstance(msg, messages.Restored)
    assert msg.how is RestoreHow.RECEIVED and msg.source is RestoreSource.REPLICA


def test_optional_fields_may_be_absent_or_null_and_are_left_out_when_none() -> None:
    msg = messages.decode({"type": "done", "rank": 0, "node": 0, "gen": 1, "step": None})
    assert msg == messages.Done(rank=0, node=0, gen=1) and msg.to_dict() == {"type": "done", "rank": 0, "node": 0, "gen": 1}
    assert messages.decode({"type": "neighbor", "holders": []}, command=True) == messages.Neighbor(holders=())


def _step(**change: Any) -> dict[str, Any]:
    return {**_wire(Kind.STEP, REPORTS[Kind.STEP]), **change}


@pytest.mark.parametrize("raw,why", [
    ({"type": "launch_missiles"}, "unknown message kind 'launch_missiles'"),
    ({"type": 7}, "unknown message kind 7"),
    ({"rank": 1}, "unknown message kind None"),
    ({"type": "spawn", "gen": 1, "ranks": []}, "unknown message kind 'spawn'"),  # a command, not a report
    ({k: v for k, v in _step().items() if k != "dt"}, "step: missing field 'dt'"),
    (_step(loss="1.5"), "step: bad loss='1.5'"),
    (_step(gen=None), "step: bad gen=None"),
    (_step(rank="1"), "step: bad rank='1'"),
    (_step(step=1.0), "step: bad step=1.0"),
    (_step(rank=True), "step: bad rank=True"),  # a bool is not an int
    (_step(node=False), "step: bad node=False"),
    (_step(rank=4), "step: bad rank=4 (want a rank of the job)"),  # world of 4: ranks 0..3
    (_step(node=2), "step: bad node=2"),
    (_step(step=-1), "step: bad step=-1"),
    (_step(step=1 << 70), "step: bad step="),
    (_step(dt=math.inf), "step: bad dt=inf"),
    (_step(dt=-0.5), "step: bad dt=-0.5"),
    (_step(dt=10**400), "step: bad dt="),  # an int too large for a float
    (_step(loss=[1.0]), "step: bad loss=[1.0]"),
    (_step(note="hi"), "step: unexpected field 'note'"),
    (_wire(Kind.SPAWNED, {**REPORTS[Kind.SPAWNED], "pids": {"x": 1}}), "spawned: bad pids"),
    (_wire(Kind.SPAWNED, {**REPORTS[Kind.SPAWNED], "pids": {"9": 1}}), "spawned: bad pids"),  # rank 9 of 4
    (_wire(Kind.SPAWNED, {**REPORTS[Kind.SPAWNED], "pids": {"\u0661": 1}}), "spawned: bad pids"),  # Arabic 1
    (_wire(Kind.SPAWNED, {**REPORTS[Kind.SPAWNED], "pids": [1]}), "spawned: bad pids"),
    (_wire(Kind.SPAWNED, {**REPORTS[Kind.SPAWNED], "dropped": [9]}), "spawned: bad dropped"),  # rank 9 of 4
    (_wire(Kind.INVENTORY, {**REPORTS[Kind.INVENTORY], "local": {"0": [1, "2"]}}), "inventory: bad local"),
    (_wire(Kind.INJECT_REQUEST, {"fault": "kill-rank:rank=1", "req": "../../x"}), "inject_request: bad req"),
    (_wire(Kind.INJECT_REQUEST, {"fault": "kill-rank:rank=1", "req": "a", "dry_run": 1}),
     "inject_request: bad dry_run=1"),
    (_wire(Kind.INJECT_REQUEST, {"fault": "kill-rnak:rank=1", "req": "a"}),
     "inject_request: fault: unknown fault kind 'kill-rnak'"),
    (_wire(Kind.INJECT_REQUEST, {"fault": "kill-rank:rank=1,step=5", "req": "a"}),
     "inject_request: fault: step='5': an injection into a running job applies now"),
    (_wire(Kind.INJECT_REQUEST, {"fault": {"kind": "kill-rank"}, "req": "a"}), "inject_request: bad fault="),
    (_wire(Kind.INJECT_REQUEST, {"spec": "kill-rank:rank=1", "req": "a"}), "inject_request: missing field 'fault'"),
    (_wire(Kind.REVERT_REQUEST, {"fault_id": "../f1", "req": "a"}), "revert_request: bad fault_id"),
    (_wire(Kind.REVERT_REQUEST, {"fault_id": "f0", "req": "a"}), "revert_request: bad fault_id"),
    (_wire(Kind.AGENT_UP, {**REPORTS[Kind.AGENT_UP], "peer_port": 70000}), "agent_up: bad peer_port=70000"),
    (_wire(Kind.AGENT_UP, {**REPORTS[Kind.AGENT_UP], "time": math.nan}), "agent_up: bad time=nan"),
    (_wire(Kind.RANK_EXITED, {**REPORTS[Kind.RANK_EXITED], "log_tail": "Killed"}), "rank_exited: bad log_tail"),
    (_wire(Kind.FAULT_LANDED, {**REPORTS[Kind.FAULT_LANDED], "phase": "lunch"}), "fault_landed: bad phase"),
    (_wire(Kind.ABORTED, {**REPORTS[Kind.ABORTED], "skipped": -3}), "aborted: bad skipped=-3"),
    (_wire(Kind.REPLICAS_CORRUPTED, {**REPORTS[Kind.REPLICAS_CORRUPTED], "steps": [-1]}), "replicas_corrupted: bad steps"),
    (_wire(Kind.ERROR, {**REPORTS[Kind.ERROR], "traceback": [1]}), "error: bad traceback=[1]"),
    (_wire(Kind.SILENT, {**REPORTS[Kind.SILENT], "silent_s": -1}), "silent: bad silent_s=-1"),
    (_wire(Kind.SILENT, {**REPORTS[Kind.SILENT], "ranks": {"x": 1.0}}), "silent: bad ranks"),
    (_wire(Kind.RESTORE_FAILED, {**REPORTS[Kind.RESTORE_FAILED], "source": {"kind": "disk"}}),
     "restore_failed: bad source"),
    (_wire(Kind.RESTORE_FAILED, {**REPORTS[Kind.RESTORE_FAILED], "source": "peer-memroy"}),
     "restore_failed: bad source='peer-memroy'"),
    (_wire(Kind.RESTORED, {**REPORTS[Kind.RESTORED], "how": "copied"}), "restored: bad how='copied'"),
    (_wire(Kind.RESTORE_FAILED, {**REPORTS[Kind.RESTORE_FAILED], "holder": "10.0.0.2"}), "restore_failed: bad holder"),
    (_wire(Kind.RESTORE_FAILED, {**REPORTS[Kind.RESTORE_FAILED], "holder": "10.0.0.2:0"}), "restore_failed: bad holder"),
    (_wire(Kind.RESTORE_FAILED, {**REPORTS[Kind.RESTORE_FAILED], "holder": ":41000"}), "restore_failed: bad holder"),
])
def test_decode_refuses_with_one_line_naming_the_field(raw: dict[str, Any], why: str) -> None:
    with pytest.raises(DecodeError) as info:
        messages.decode(raw, LIMITS)
    assert info.value.reason.startswith(why) and "\n" not in info.value.reason


@pytest.mark.parametrize("raw,why", [
    ({"type": "step"}, "unknown command kind 'step'"),  # a report forged onto an agent's queue
    ({"type": "kill", "ranks": [0, 4]}, "kill: bad ranks"),
    ({"type": "kill", "ranks": [0], "grace": 1e9}, "kill: bad grace"),
    ({"type": "kill", "ranks": [0], "grace": -1}, "kill: bad grace"),
    ({"type": "neighbor", "holders": [["", 1]]}, "neighbor: bad holders"),
    ({"type": "neighbor", "holders": [["10.0.0.2", 41000, 1]]}, "neighbor: bad holders"),
    ({"type": "neighbor", "address": "10.0.0.2", "port": 41000}, "neighbor: missing field 'holders'"),
    ({"type": "spawn", "gen": 1, "ranks": [{"rank": 1}]}, "spawn: bad ranks"),
    ({"type": "spawn", "gen": 1, "ranks": [{"rank": 1, "env": {"A": 1}}]}, "spawn: bad ranks"),
    ({"type": "spawn", "gen": 1, "ranks": [{"rank": 1, "env": {}, "argv": ["sh"]}]}, "spawn: bad ranks"),
    ({"type": "inventory", "req": "3"}, "inventory: bad req"),
    ({"type": "stop", "now": True}, "stop: unexpected field 'now'"),
])
def test_decode_refuses_bad_commands(raw: dict[str, Any], why: str) -> None:
    with pytest.raises(DecodeError, match="^" + why.replace("(", r"\(")):
        messages.decode(raw, LIMITS, command=True)


@pytest.mark.parametrize("raw", [None, 7, "step", ["step"], b"{}", 1.5])
def test_decode_refuses_what_is_not_an_object(raw: Any) -> None:
    with pytest.raises(DecodeError, match="not a message"):
        messages.decode(raw)


def test_without_limits_ranks_and_nodes_are_only_bounded() -> None:
    big = _step(rank=1000, node=500)
    assert messages.decode(big).rank == 1000  # type: ignore[attr-defined]
    with pytest.raises(DecodeError):
        messages.decode(big, LIMITS)
    with pytest.raises(DecodeError):
        messages.decode(_step(rank=-1))


def test_from_dict_wants_its_own_kind() -> None:
    with pytest.raises(DecodeError, match="where a done belongs"):
        messages.Done.from_dict(_step())
    assert messages.Step.from_dict(_step(), LIMITS).step == 7


def test_a_diverged_loss_is_still_a_step() -> None:
    # NaN or inf losses are facts the record keeps; they travel as JSON's NaN and Infinity.
    for loss in (math.nan, math.inf):
        msg = messages.decode(json.loads(json.dumps(_step(loss=loss))), LIMITS)
        assert isinstance(msg, messages.Step) and not math.isfinite(msg.loss)


# -- arbitrary input: a message or the one DecodeError, nothing else ------------------------------
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_KINDS = st.sampled_from([k.value for k in Kind] + [k.value for k in CommandKind] + ["", "nope"])


def _decodes_or_refuses(raw: Any, command: bool) -> None:
    try:
        msg = messages.decode(raw, LIMITS, command=command)
    except DecodeError as exc:
        assert exc.reason and "\n" not in exc.reason
        return
    # What decodes is a message that says the same on the wire.
    assert messages.decode(json.loads(json.dumps(msg.to_dict())), LIMITS, command=command) == msg or _has_nan(msg)


def _has_nan(msg: messages.Message) -> bool:
    return any(isinstance(v, float) and math.isnan(v) for v in msg.to_dict().values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.dictionaries(st.text(max_size=10) | _KINDS, _JSON, max_size=8), kind=_KINDS, command=st.booleans())
def test_arbitrary_objects_decode_or_raise_decode_error(raw: dict[str, Any], kind: str, command: bool) -> None:
    _decodes_or_refuses(raw, command)
    _decodes_or_refuses({**raw, "type": kind}, command)


_EXAMPLES = [(_wire(k, f), False) for k, f in REPORTS.items()] + [(_wire(k, f), True) for k, f in COMMANDS.items()]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(example=st.sampled_from(_EXAMPLES), data=st.data())
def test_near_valid_messages_decode_or_raise_decode_error(example: tuple[dict[str, Any], bool], data: Any) -> None:
    # One field changed to anything, dropped, or one added: valid messages' close neighbours.
    wire, command = example
    raw = dict(wire)
    names = sorted(k for k in raw if k != "type")
    action = data.draw(st.sampled_from(["change", "drop", "add"] if names else ["add"]))
    if action == "change":
        raw[data.draw(st.sampled_from(names))] = data.draw(_JSON)
    elif action == "drop":
        del raw[data.draw(st.sampled_from(names))]
    else:
        raw[data.draw(st.text(max_size=8))] = data.draw(_JSON)
    _decodes_or_refuses(raw, command)


# -- over a real store, sealed ---------------------------------------------------------------------
def test_a_sealed_message_arrives_as_the_same_message() -> None:
    store = loopback_store()
    try:
        rx = control.Receiver(store, control.CTL_QUEUE, opener=control.Opener(TOKEN))
        sealer = control.Sealer(TOKEN, "rank/1")
        sent = [messages.decode(_wire(k, f)) for k, f in REPORTS.items()]
        for msg in sent:
            control.send(store, control.CTL_QUEUE, msg, sealer)
        assert [messages.decode(raw, LIMITS) for raw in rx.poll()] == sent
    finally:
        del store


# -- the controller and the agent handle every kind; the rest is recorded or reported -------------
def test_the_controller_has_a_handler_for_every_report() -> None:
    assert set(Inbox.HANDLERS) == set(Kind)
    assert all(callable(h) for h in Inbox.HANDLERS.values())


def test_the_agent_has_a_handler_for_every_command() -> None:
    assert set(CommandHandler.HANDLERS) == set(CommandKind)


def _controller() -> tuple[Inbox, list[tuple[EventKind, dict[str, Any]]]]:
    # Only what `handle` touches on these paths: the record is where the outcome shows.
    recorded: list[tuple[EventKind, dict[str, Any]]] = []

    def record(kind: EventKind, /, **fields: Any) -> None:
        recorded.append((kind, fields))

    inbox = Inbox.__new__(Inbox)
    inbox.record = record
    inbox.job = JobState(members={}, pids={})  # no node started: no report is a replaced agent's
    inbox.plane = ControlPlane("127.0.0.1", "e" * 64, LIMITS.world_size, LIMITS.nnodes, record)
    inbox.plane.limits = LIMITS
    return inbox, recorded


def test_the_controller_records_an_unknown_or_invalid_message() -> None:
    ctl, recorded = _controller()
    ctl.handle({"type": "launch_missiles", "rank": 0})
    ctl.handle(_step(rank=9))
    assert [k for k, _ in recorded] == [EventKind.MESSAGE_REJECTED] * 2
    assert recorded[0][1]["reason"] == "unknown message kind 'launch_missiles'"
    assert recorded[1][1]["reason"].startswith("step: bad rank=9") and '"rank": 9' in recorded[1][1]["raw"]


def test_the_controller_records_a_message_it_has_no_handler_for(monkeypatch: pytest.MonkeyPatch) -> None:
    ctl, recorded = _controller()
    monkeypatch.setattr(Inbox, "HANDLERS", {k: h for k, h in Inbox.HANDLERS.items() if k is not Kind.STEP})
    ctl.handle(_step())
    [(kind, fields)] = recorded
    assert kind is EventKind.MESSAGE_REJECTED and fields["unhandled"] is True
    assert "no handler for 'step'" in fields["reason"] and '"loss": 2.5' in fields["raw"]


def test_the_controller_records_an_agent_error_and_a_refusal() -> None:
    ctl, recorded = _controller()
    ctl.handle(_wire(Kind.AGENT_ERROR, REPORTS[Kind.AGENT_ERROR]))
    ctl.handle(_wire(Kind.REJECTED, {"where": "gen/1/abort/2", "reason": "bad MAC", "rank": 2, "node": 1}))
    assert recorded[0] == (EventKind.MESSAGE_REJECTED, {"t": recorded[0][1]["t"], "queue": "agent", "index": -1,
                                                        "node": 1, "reason": "spawn: OSError: no memory", "raw": ""})
    assert recorded[1][1] | {"t": 0} == {"queue": "gen/1/abort/2", "index": -1, "reason": "bad MAC", "raw": "",
                                         "reported_by_node": 1, "reported_by_rank": 2, "t": 0}


class _Reporter:
    """The agent's reporter as the command handler uses it: what it would send, kept."""

    node = 0

    def __init__(self) -> None:
        self.reported: list[messages.Message] = []

    def report(self, kind: type[messages.Message], **fields: Any) -> None:
        self.reported.append(kind(node=self.node, **fields))  # type: ignore[call-arg]

    def rejected(self, where: str, index: int, reason: str, raw: bytes) -> None:
        self.report(messages.Refusal, where=where, index=index, reason=reason, raw=control.short_repr(raw))


class _Agent:
    """The agent's command handler over a worker supervisor with no template, spares or store."""

    def __init__(self) -> None:
        reporter = _Reporter()
        self.reported = reporter.reported
        self.stopping = threading.Event()
        cfg = type("Cfg", (), {"node": 0})()
        self.workers = WorkerSupervisor(cfg, None, None, None, dict, self.stopping,  # type: ignore[arg-type]
                                        reporter.report)
        self.commands = CommandHandler("agent/0/0/q", messages.Limits(messages.MAX_RANKS, 2), reporter,  # type: ignore[arg-type]
                                       self.workers, None, self.stopping, 5.0)  # type: ignore[arg-type]

    def handle(self, raw: dict[str, Any]) -> None:
        self.commands.handle(raw)


def _agent() -> tuple[_Agent, list[messages.Message]]:
    agent = _Agent()
    return agent, agent.reported


def test_the_agent_reports_a_command_it_refuses_or_fails_and_carries_out_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    agent, reported = _agent()
    agent.handle({"type": "launch_missiles"})
    agent.handle({"type": "kill", "ranks": [-1]})

    def broken(ranks: list[int], grace: float, tail: bool = False) -> None:
        raise OSError("no such process group")

    agent.workers.kill = broken  # type: ignore[method-assign]
    agent.handle({"type": "kill", "ranks": [1], "grace": 0.5})
    agent.handle({"type": "stop"})
    assert [type(m) for m in reported] == [messages.Refusal, messages.Refusal, messages.AgentError]
    assert reported[0].reason == "unknown command kind 'launch_missiles'"  # type: ignore[attr-defined]
    assert reported[1].reason.startswith("kill: bad ranks=[-1]")  # type: ignore[attr-defined]
    assert reported[2].error == "kill: OSError: no such process group"  # type: ignore[attr-defined]
    assert agent.stopping.is_set()
    assert "ffctl agent 0: command failed: kill: OSError" in caplog.text


class _WarmingTemplate:
    """The agent's template as the worker supervisor sees it: on its first warm-up until `ready`
    is set."""

    def __init__(self) -> None:
        self.starts, self.ready, self.dead = 1, False, False

    def alive(self) -> bool:
        return not self.dead

    def is_ready(self) -> bool:
        return self.ready and not self.dead


def _spawn(gen: int, *ranks: int) -> dict[str, Any]:
    return {"type": "spawn", "gen": gen, "ranks": [{"rank": r, "env": {}} for r in ranks]}


def test_the_first_workers_wait_for_the_template_s_first_warm_up_and_a_killed_one_never_starts() -> None:
    agent, reported = _agent()
    template = _WarmingTemplate()
    agent.workers.template = template  # type: ignore[assignment]
    started: list[tuple[int, list[int]]] = []
    agent.workers.spawn = lambda gen, ranks, received=None: started.append((gen, [r["rank"] for r in ranks]))  # type: ignore[method-assign]
    agent.workers.kill = lambda ranks, grace, tail=False: None  # type: ignore[method-assign]
    agent.handle(_spawn(0, 0, 1))
    agent.workers.spawn_held()
    assert started == []  # held while the template imports torch
    agent.handle({"type": "kill", "ranks": [1], "grace": 0.5})
    # The controller waits for every rank it asked for to start or be dropped: it is told.
    assert reported == [messages.Spawned(node=0, gen=0, pids={}, dropped=[1])]
    template.ready = True
    agent.workers.spawn_held()
    assert started == [(0, [0])]  # forked once warm; the killed rank never started
    # A template started again (it died) is not waited for: the replacement starts at once, cold.
    template.starts, template.ready = 2, False
    agent.handle(_spawn(1, 1))
    assert started == [(0, [0]), (1, [1])]


def test_held_workers_start_cold_when_the_template_dies_before_it_is_warm() -> None:
    agent, _ = _agent()
    template = _WarmingTemplate()
    agent.workers.template = template  # type: ignore[assignment]
    started: list[int] = []
    agent.workers.spawn = lambda gen, ranks, received=None: started.append(gen)  # type: ignore[method-assign]
    agent.handle(_spawn(0, 0))
    agent.workers.spawn_held()
    template.dead = True
    agent.workers.spawn_held()
    assert started == [0]


# --- The controller's answer to `ffctl inject` ------------------------------------------------


def test_an_inject_reply_round_trips_and_refuses_a_malformed_one() -> None:
    reply = messages.InjectReply(req="abc123", ok=True, fault_id="f3")
    wire = json.loads(json.dumps(reply.to_dict()))
    assert wire == {"type": "inject_reply", "req": "abc123", "ok": True, "fault_id": "f3"}
    assert messages.InjectReply.from_dict(wire) == reply
    for bad, why in (({**wire, "ok": "yes"}, "ok"), ({k: v for k, v in wire.items() if k != "ok"}, "ok"),
                     ({**wire, "req": "../gen/current"}, "req"), ({**wire, "plan": "not a list"}, "plan"),
                     ({**wire, "type": "step"}, "step"), ({**wire, "extra": 1}, "extra")):
        with pytest.raises(messages.DecodeError, match=why):
            messages.InjectReply.from_dict(bad)
    assert messages.inject_reply_key("abc123") == "inject/reply/abc123"


class _Record:
    """What the inject client reads of a run: its status, its controller endpoint and its token."""

    def __init__(self, port: int, token: str) -> None:
        self.run_id, self._port, self._token = "r1", port, token

    def status(self) -> RunStatus:
        return RunStatus.RUNNING

    def read_json(self, name: str) -> dict[str, Any]:
        return {"controller": {"address": "127.0.0.1", "port": self._port}}

    def token(self) -> str:
        return self._token


def test_the_inject_client_takes_only_a_sealed_well_formed_answer_to_its_own_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    import torch.distributed as dist

    from ffctl.controller import client
    from ffctl.exits import BadInput, InfraError

    token = "t" * 32
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setattr(client.secrets, "token_hex", lambda n: "req1")
    key = messages.inject_reply_key("req1")
    sealer = control.Sealer(token, "controller")

    def answer(*replies: dict[str, Any]) -> threading.Thread:
        def run() -> None:
            for reply in replies:
                time.sleep(0.15)
                server.set(key, sealer.seal(key, reply))
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    # Malformed, then unsealed, then an answer to someone else's request, then the real one.
    thread = answer({"type": "inject_reply", "req": "req1", "fault_id": "f1"},
                    {"type": "inject_reply", "req": "other", "ok": True, "fault_id": "f9"},
                    {"type": "inject_reply", "req": "req1", "ok": True, "fault_id": "f2"})
    server.set(key, b"not sealed")
    got = client.request(_Record(server.port, token), parse_injection("kill-rank:rank=0", scheduled=False), False,
                         timeout=20)
    thread.join()
    assert got == messages.InjectReply(req="req1", ok=True, fault_id="f2")
    assert server.check([key]) is False  # taken away once read

    thread = answer({"type": "inject_reply", "req": "req1", "ok": False, "error": "rank 9 does not exist",
                     "bad_input": True})
    with pytest.raises(BadInput, match="rank 9 does not exist"):
        client.request(_Record(server.port, token), parse_injection("kill-rank:rank=9", scheduled=False), False,
                       timeout=20)
    thread.join()
    thread = answer({"type": "inject_reply", "req": "req1", "ok": "sure"})
    with pytest.raises(InfraError, match="did not answer within 1s .*malformed.*ok"):
        client.request(_Record(server.port, token), parse_injection("kill-rank:rank=0", scheduled=False), False,
                       timeout=1)
    thread.join()

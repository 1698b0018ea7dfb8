"""Property tests: whatever text a user writes, the fault-spec grammar, the chaos grammar and the
scenario loader either give a valid value or refuse it with one line; never another exception.

"Valid" is checked field by field (kind, target, trigger, duration, options within their bounds
and allowed for the kind), so a parser that let a bad value through fails here too.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fault_injectors.schedule import MIN_MTBF_S, ChaosSpec, parse_chaos
from wire.fault_spec import (
    MAX_DURATION_S, MAX_INDEX, MAX_SEED, MAX_STEP, MAX_T_S, REVERTIBLE, FaultKind, FaultSpec, FaultSpecError,
    TargetMode, allowed_keys, parse_injection, parse_spec,
)
from ffctl.launch_spec import LaunchSpec, SpecError
from wire.messages import InjectRequest
from ffctl.launch.scenario import EXPECT_SCHEMA, LAUNCH_SCHEMA, Scenario, ScenarioError, loads

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = [k.value for k in FaultKind]
KEYS = ["rank", "node", "host", "mode", "step", "t", "duration", "seed", "rate", "delay", "loss", "port", "ports",
        "action", "mb", "signal", "peer", "factor", "id", "Rank", ""]
# Values near the edges: other scripts' digits, exponents, nan and inf, signs, huge numbers.
TRICKY = ["0", "1", "3", "-1", "1.5", "2.5s", "100ms", "2m", "1h", "nan", "inf", "-inf", "1e3", "١", "５", "²",
          "9" * 30, "one", "all", "fixed:0", "fixed:2", "percent:50", "percent:0", "1mbit", "8kbit", "10%",
          "150%", "drop", "reject", "segv", "exception", "64", "65536", "host0", "", " ", "a\nb", "1_0", "0x10"]
SCENARIO_PATH = Path("scenario.toml")


def one_line(message: str) -> None:
    assert message.strip(), "empty message"
    assert len(message.splitlines()) == 1, message


def assert_valid_spec(spec: FaultSpec) -> None:
    assert isinstance(spec.kind, FaultKind)
    target = spec.target
    if target.mode in (TargetMode.RANK, TargetMode.NODE):
        assert isinstance(target.value, int) and 0 <= target.value <= MAX_INDEX
    elif target.mode is TargetMode.FIXED:
        assert isinstance(target.value, int) and 1 <= target.value <= MAX_INDEX
    elif target.mode is TargetMode.PERCENT:
        assert isinstance(target.value, int) and 1 <= target.value <= 100
    elif target.mode is TargetMode.HOST:
        assert isinstance(target.value, str) and target.value.isascii() and target.value.strip() == target.value
    else:
        assert target.value is None
    trigger = spec.trigger
    assert trigger.step is None or trigger.t is None
    if trigger.step is not None:
        assert isinstance(trigger.step, int) and 0 <= trigger.step <= MAX_STEP
    if trigger.t is not None:
        assert math.isfinite(trigger.t) and 0 <= trigger.t <= MAX_T_S
    if spec.duration is not None:
        assert spec.kind in REVERTIBLE
        assert math.isfinite(spec.duration) and 0 < spec.duration <= MAX_DURATION_S
    assert 0 <= spec.seed <= MAX_SEED
    keys = [k for k, _ in spec.options]
    assert len(keys) == len(set(keys))
    assert set(keys) <= set(allowed_keys(spec.kind))
    for _, value in spec.options:
        assert value and value.isascii(), spec.options


def assert_ascii_values(text: str) -> None:
    """An accepted spec was written in ASCII digits and names (`\\d` would take "١" and "５")."""
    for part in text.partition(":")[2].split(","):
        assert part.strip().partition("=")[2].isascii(), text


def check_spec_text(text: str) -> None:
    try:
        spec = parse_spec(text)
    except FaultSpecError as exc:
        one_line(str(exc))
    else:
        assert_valid_spec(spec)
        assert_ascii_values(text)
    for scheduled in (True, False):
        try:
            spec = parse_injection(text, scheduled=scheduled)
        except FaultSpecError as exc:
            one_line(str(exc))
        else:
            assert_valid_spec(spec)
            assert (spec.trigger.step is not None or spec.trigger.t is not None) is scheduled
            if spec.kind is FaultKind.NET_BANDWIDTH:
                assert spec.option("rate") is not None


@SETTINGS
@given(st.text(max_size=80))
def test_any_text_is_a_valid_spec_or_one_line(text: str) -> None:
    check_spec_text(text)


fields = st.tuples(st.sampled_from(KEYS), st.one_of(st.sampled_from(TRICKY), st.text(max_size=8)))
# A well-formed value for every key: specs built from these are valid until one is swapped for a
# tricky value, so the parser must judge that one value (and not stop at an earlier error).
GOOD = {
    "rank": ["0", "1", "3"], "node": ["0", "1"], "host": ["host0", "h-1.example"],
    "mode": ["one", "all", "fixed:2", "percent:50"], "step": ["0", "3", "25"], "t": ["0", "2.5", "90s", "100ms"],
    "duration": ["5", "2.5s", "1m"], "seed": ["0", "7"], "rate": ["1mbit", "8kbit"], "delay": ["100ms", "2s"],
    "loss": ["10%", "0.5%"], "port": ["7400"], "ports": ["7000|7001"], "action": ["drop", "reject"],
    "mb": ["64"], "signal": ["segv", "exception"], "peer": ["0", "1"], "factor": ["3", "1.5"], "drain": ["yes", "no"],
    "phase": ["collective", "forward"], "copy": ["local", "replica"], "holder": ["0", "1"],
}


@st.composite
def near_valid_specs(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(list(FaultKind)))
    keys = draw(st.lists(st.sampled_from(allowed_keys(kind)), unique=True, max_size=4))
    pairs = []
    for key in keys:
        tricky = draw(st.integers(0, 3)) == 0
        pairs.append((key, draw(st.sampled_from(TRICKY) if tricky else st.sampled_from(GOOD[key]))))
    if draw(st.integers(0, 7)) == 0:  # now and then a key of another kind, or one given twice
        pairs.insert(draw(st.integers(0, len(pairs))), draw(st.sampled_from(
            [("rate", "1mbit"), ("port", "80"), ("duration", "5"), ("seed", "3")] + pairs[:1])))
    return kind.value + ":" + ",".join(f"{k}={v}" for k, v in pairs)


@SETTINGS
@given(near_valid_specs())
def test_near_valid_specs_are_valid_or_name_the_one_bad_value(text: str) -> None:
    check_spec_text(text)


@SETTINGS
@given(near_valid_specs())
def test_a_spec_s_text_reads_back_as_the_same_spec(text: str) -> None:
    # `ffctl inject` sends a fault as its text (InjectRequest): what the controller decodes must
    # be the spec the user's command line gave, field for field.
    try:
        spec = parse_spec(text)
    except FaultSpecError:
        return
    assert parse_spec(spec.to_text()) == spec, spec.to_text()
    try:
        now = parse_injection(text, scheduled=False)
    except FaultSpecError:
        return
    request = InjectRequest(fault=now, req="r1")
    assert InjectRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request


@SETTINGS
@given(st.sampled_from(KINDS + ["kill-everything", ""]), st.lists(fields, max_size=6), st.booleans())
def test_spec_shaped_text_is_a_valid_spec_or_one_line(kind: str, pairs: list[tuple[str, str]], colon: bool) -> None:
    body = ",".join(f"{k}={v}" for k, v in pairs)
    check_spec_text(kind + (":" if colon or body else "") + body)


@SETTINGS
@given(st.one_of(st.text(max_size=60), st.lists(st.tuples(
    st.sampled_from(["mtbf", "seed", "kinds", "until", "duration", "rate"]),
    st.one_of(st.sampled_from(TRICKY + ["kill-rank|net-delay", "net-bandwidth", "kill-rank|"]), st.text(max_size=6)),
), max_size=5).map(lambda ps: ",".join(f"{k}={v}" for k, v in ps))))
def test_any_chaos_text_is_a_valid_schedule_or_one_line(text: str) -> None:
    try:
        chaos = parse_chaos(text)
    except FaultSpecError as exc:
        one_line(str(exc))
        return
    assert isinstance(chaos, ChaosSpec)
    assert math.isfinite(chaos.mtbf) and MIN_MTBF_S <= chaos.mtbf <= MAX_T_S
    assert 0 <= chaos.seed <= MAX_SEED and chaos.kinds
    assert chaos.until is None or 0 < chaos.until <= MAX_T_S
    assert chaos.duration is None or (0 < chaos.duration <= MAX_DURATION_S and any(k in REVERTIBLE for k in chaos.kinds))


# --- scenario files -----------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """`value` written as TOML (json's string escapes are TOML's basic-string escapes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(toml_value(v) for v in value) + "]"


scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1), st.floats(), st.booleans(),
    st.text(max_size=12), st.sampled_from(["tiny", "peer", "netns", "completed", "peer-memory",
                                           "kill-rank:rank=1,step=3", "kill-node:node=1,t=2",
                                           "mtbf=60,seed=1", "kill-rank:rank=١,step=3"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3))


def check_scenario_text(text: str, tmp: Path) -> Scenario | None:
    try:
        sc = loads(text, SCENARIO_PATH)
    except ScenarioError as exc:
        one_line(str(exc))
        return None
    try:
        spec = sc.spec(tmp, None)
    except ScenarioError as exc:
        one_line(str(exc))
        return sc
    assert isinstance(spec, LaunchSpec)
    spec.validate()  # what spec() returned is valid as it stands
    return sc


@SETTINGS
@given(st.text(max_size=120))
def test_any_text_is_a_scenario_or_one_line(text: str) -> None:
    check_scenario_text(text, Path("runs"))


@SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(LAUNCH_SCHEMA) + ["nodes"]), values, max_size=4),
       st.dictionaries(st.sampled_from(sorted(EXPECT_SCHEMA)), values, max_size=3))
def test_typed_values_give_a_scenario_or_name_the_key_path(launch: dict[str, Any], expect: dict[str, Any]) -> None:
    lines = ["[launch]"] + [f"{k} = {toml_value(v)}" for k, v in launch.items()]
    lines += ["[expect]"] + [f"{k} = {toml_value(v)}" for k, v in expect.items()]
    text = "\n".join(lines) + "\n"
    try:
        sc = loads(text, SCENARIO_PATH)
    except ScenarioError as exc:
        message = str(exc)
        one_line(message)
        if "not valid TOML" in message:  # (a string json escaped as a lone surrogate)
            return
        named = [f"[launch].{k}" for k in launch] + [f"[expect].{k}" for k in expect]
        assert any(path in message for path in named) or "'nodes'" in message, message
        return
    assert "nodes" not in launch
    for key, value in launch.items():
        assert not isinstance(value, bool) or LAUNCH_SCHEMA[key].kind not in ("int", "number")
    for key, value in expect.items():
        assert not isinstance(value, bool) or EXPECT_SCHEMA[key].kind not in ("int", "number")
    try:
        spec = sc.spec(Path("runs"), None)
    except ScenarioError as exc:
        # Only what needs the whole launch: targets inside the job, steps, restart-disk, a script.
        one_line(str(exc))
        assert "[launch]:" in str(exc)
        return
    spec.validate()


def test_a_valid_scenario_loads_as_written() -> None:
    sc = loads('[launch]\nnnodes = 2\nsteps = 9\nheartbeat_timeout = 0.5\ninject = ["kill-rank:rank=1,step=3"]\n'
               '[expect]\nmax_recovery_s = 5\nrestore_source = ["local-memory", "peer-memory"]\n', SCENARIO_PATH)
    spec = sc.spec(Path("runs"), "r1")
    assert spec.nnodes == 2 and spec.steps == 9 and spec.heartbeat_timeout == 0.5
    assert spec.injects[0].target.value == 1 and spec.injects[0].trigger.step == 3


def test_spec_error_is_the_only_refusal_of_launch_spec() -> None:
    """LaunchSpec.validate refuses badly typed fields itself, whoever built the spec."""
    for bad in ({"nnodes": True}, {"steps": "9"}, {"heartbeat_timeout": float("nan")}, {"seed": -1},
                {"model": None}, {"spares": 10**6}):
        try:
            LaunchSpec(**bad).validate()  # type: ignore[arg-type]
        except SpecError as exc:
            one_line(str(exc))
        else:
            raise AssertionError(f"{bad} accepted")

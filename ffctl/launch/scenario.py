"""Scripted chaos checks: a scenario file says what to launch and what to expect of the report.

    [launch]                       # the same names as `ffctl launch` options
    nnodes = 2
    nproc_per_node = 2
    steps = 60
    recovery = "peer"
    spares = 2
    inject = ["kill-rank:rank=1,step=20", "kill-node:node=1,step=40"]

    [expect]                       # every key is checked against `ffctl report --json`
    status = "completed"
    max_recovery_s = 10.0          # for every fault
    max_detection_s = 1.0
    max_lost_steps = 1
    restore_source = ["local-memory", "peer-memory"]   # allowed sources
    max_lost_gpu_hours_total = 0.01
    min_goodput = 0.0
    faults = 2                     # how many faults the record must hold

Parsing and evaluation are pure; `ffctl run` executes the launch and writes a JUnit file.
`load` checks the file against a schema of types (`LAUNCH_SCHEMA`, `EXPECT_SCHEMA`): a bad value is
refused with its key path, e.g. `s.toml: [launch].steps: 'many' is not an integer`.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from fault_injectors import FaultSpecError
from fault_injectors.schedule import parse_chaos
from fault_injectors.spec import MAX_DURATION_S, MAX_SEED, parse_injection
from ffctl.spec import MAX_NODES, MAX_PROCS_PER_NODE, MAX_STEPS, LaunchSpec, SpecError
from ffctl.workload.sizes import MODELS, OPTIMIZERS
from recovery.jobenv import Strategy
from runs.events import RestoreSource, RunStatus

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ScenarioError(ValueError):
    """The scenario file is unusable; the message names the file, the key path and the value."""


@dataclass(frozen=True)
class Field:
    """The type of one key: `int` (never a boolean), `number` (int or float, finite), `choice`
    (one of `choices`), `text`, `specs` (fault specs), `words` (a string or a list of strings),
    `sources` (one or a list of `choices`); numbers within [low, high]."""

    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    positive: bool = False  # more than `low`, not merely at least


LAUNCH_SCHEMA: dict[str, Field] = {
    "nnodes": Field("int", 1, MAX_NODES),
    "nproc_per_node": Field("int", 1, MAX_PROCS_PER_NODE),
    "steps": Field("int", 1, MAX_STEPS),
    "seed": Field("int", 0, MAX_SEED),
    "model": Field("choice", choices=MODELS),
    "optimizer": Field("choice", choices=OPTIMIZERS),
    "recovery": Field("choice", choices=tuple(Strategy.ALL)),
    "ckpt_every": Field("int", 0, MAX_STEPS),
    "spares": Field("int", 0, MAX_PROCS_PER_NODE),
    "inject": Field("specs"),
    "chaos": Field("text"),
    "sandbox": Field("choice", choices=("netns",)),
    # A timeout of zero would call every node lost at once.
    "heartbeat_timeout": Field("number", 0.0, MAX_DURATION_S, positive=True),
    "script": Field("words"),
}
_STATUSES = tuple(s.value for s in RunStatus)
_SOURCES = tuple(s.value for s in RestoreSource)
EXPECT_SCHEMA: dict[str, Field] = {
    "status": Field("choice", choices=_STATUSES),
    "max_recovery_s": Field("number", 0.0, MAX_DURATION_S),
    "max_detection_s": Field("number", 0.0, MAX_DURATION_S),
    "max_lost_steps": Field("int", 0, MAX_STEPS),
    "restore_source": Field("sources", choices=_SOURCES),
    "max_lost_gpu_hours_total": Field("number", 0.0, 1e9),
    "min_goodput": Field("number", 0.0, 1.0),
    "faults": Field("int", 0, 1_000_000),
    "steps_completed": Field("int", 0, MAX_STEPS),
}
LAUNCH_KEYS = set(LAUNCH_SCHEMA)
EXPECT_KEYS = set(EXPECT_SCHEMA)


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Scenario:
    path: Path
    launch: dict[str, Any]
    expect: dict[str, Any]

    def spec(self, runs_dir: Path, run_id: str | None) -> LaunchSpec:
        """The launch the file describes, checked as a whole (targets inside the job, steps)."""
        raw = dict(self.launch)
        try:
            injects = tuple(parse_injection(s, scheduled=True) for s in raw.pop("inject", []))
        except FaultSpecError as exc:  # load() has checked them; a caller may have changed them
            raise ScenarioError(f"{self.path}: [launch].inject: {exc}") from None
        script = raw.pop("script", ())
        script = (script,) if isinstance(script, str) else tuple(script)
        spec = LaunchSpec(**raw, injects=injects, script=script, runs_dir=runs_dir, run_id=run_id)
        try:
            return spec.validate()
        except SpecError as exc:
            raise ScenarioError(f"{self.path}: [launch]: {exc}") from None


def shown(value: Any) -> str:
    """`value` as the file spells it, cut to one short line."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float) and not math.isfinite(value):
        text = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(where: str, field: Field, value: Any) -> None:
    """Raise ScenarioError(`<where>: <value> is not ...`) unless `value` fits `field`."""
    bad = f"{where}: {shown(value)}"
    if field.kind == "int":
        # TOML's true is a boolean, and Python's bool an int: refused here all the same.
        if not isinstance(value, int) or isinstance(value, bool):
            raise ScenarioError(f"{bad} is not an integer")
    elif field.kind == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ScenarioError(f"{bad} is not a number")
        if not math.isfinite(value):
            raise ScenarioError(f"{bad} is not a finite number")
    elif field.kind == "choice":
        if not isinstance(value, str) or value not in field.choices:
            raise ScenarioError(f"{bad} is not one of {', '.join(field.choices)}")
    elif field.kind == "text":
        if not isinstance(value, str):
            raise ScenarioError(f"{bad} is not a string")
    elif field.kind == "words":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(w, str) and w for w in value):
            raise ScenarioError(f"{bad} is not a non-empty string or list of non-empty strings")
    elif field.kind == "sources":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
            raise ScenarioError(f"{bad} is not a string or a list of strings")
        for item in items:
            if item not in field.choices:
                raise ScenarioError(f"{where}: {shown(item)} is not one of {', '.join(field.choices)}")
    elif field.kind == "specs":
        if not isinstance(value, list):
            raise ScenarioError(f"{bad} is not a list of fault specs")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ScenarioError(f"{where}[{i}]: {shown(item)} is not a fault spec string")
            try:
                parse_injection(item, scheduled=True)
            except FaultSpecError as exc:
                raise ScenarioError(f"{where}[{i}]: {exc}") from None
    if field.kind in ("int", "number") and field.low is not None and field.high is not None:
        low_ok = value > field.low if field.positive else value >= field.low
        if not low_ok or value > field.high:
            above = "more than" if field.positive else "at least"
            raise ScenarioError(f"{bad} is out of range ({above} {field.low:g}, at most {field.high:g})")


def load(path: Path) -> Scenario:
    """Read and check a scenario file: every key known, every value of its type and in range."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ScenarioError(f"scenario {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"scenario {str(path)!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    return loads(text, path)


def loads(text: str, path: Path) -> Scenario:
    """`load` of a file's text; `path` only names it in messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"launch", "expect", "name"}
    if unknown:
        raise ScenarioError(f"{path}: unknown section(s) {sorted(unknown)} (use [launch] and [expect])")
    if "name" in data and not isinstance(data["name"], str):
        raise ScenarioError(f"{path}: name: {shown(data['name'])} is not a string")
    launch, expect = data.get("launch", {}), data.get("expect", {})
    for section, table, schema in (("launch", launch, LAUNCH_SCHEMA), ("expect", expect, EXPECT_SCHEMA)):
        if not isinstance(table, dict):
            raise ScenarioError(f"{path}: {section}: {shown(table)} is not a table (write [{section}])")
        bad = set(table) - set(schema)
        if bad:
            raise ScenarioError(f"{path}: unknown key(s) {sorted(bad)} in [{section}]")
        for key, value in table.items():
            _check(f"{path}: [{section}].{key}", schema[key], value)
    if "chaos" in launch:
        try:
            parse_chaos(launch["chaos"])
        except FaultSpecError as exc:
            raise ScenarioError(f"{path}: [launch].chaos: {exc}") from None
    return Scenario(path, launch, expect)


def evaluate(expect: dict[str, Any], report: dict[str, Any]) -> list[Check]:
    checks: list[Check] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append(Check(name, bool(ok), detail))

    faults = report["faults"]
    if "status" in expect:
        check("status", report["status"] == expect["status"], f"status {report['status']!r}, expected {expect['status']!r}")
    if "steps_completed" in expect:
        check("steps_completed", report["steps_completed"] >= expect["steps_completed"],
              f"{report['steps_completed']} steps, expected at least {expect['steps_completed']}")
    if "faults" in expect:
        check("faults", len(faults) == expect["faults"], f"{len(faults)} faults recorded, expected {expect['faults']}")
    for key, field, word in (("max_recovery_s", "recovery_s", "recovery"), ("max_detection_s", "detection_s", "detection"),
                             ("max_lost_steps", "lost_steps", "lost steps")):
        if key not in expect:
            continue
        for f in faults:
            value = f[field]
            ok = value is not None and value <= expect[key]
            shown = "none" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
            check(f"{key}[{f['fault_id']}]", ok, f"{f['kind']} {word} {shown}, limit {expect[key]}")
    if "restore_source" in expect:
        allowed = expect["restore_source"]
        allowed = [allowed] if isinstance(allowed, str) else list(allowed)
        for f in faults:
            if f["restore_source"] is not None:
                check(f"restore_source[{f['fault_id']}]", f["restore_source"] in allowed,
                      f"{f['kind']} restored from {f['restore_source']}, allowed {allowed}")
    if "max_lost_gpu_hours_total" in expect:
        check("max_lost_gpu_hours_total", report["lost_gpu_hours_total"] <= expect["max_lost_gpu_hours_total"],
              f"{report['lost_gpu_hours_total']:.6f} lost GPU-hours, limit {expect['max_lost_gpu_hours_total']}")
    if "min_goodput" in expect:
        g = report["goodput"] or 0.0
        check("min_goodput", g >= expect["min_goodput"], f"goodput {g:.3f}, minimum {expect['min_goodput']}")
    return checks


def junit(name: str, checks: list[Check], seconds: float) -> str:
    failures = sum(not c.passed for c in checks)
    cases = []
    for c in checks:
        body = "" if c.passed else f"<failure message={quoteattr(c.detail)}>{escape(c.detail)}</failure>"
        cases.append(f'  <testcase classname={quoteattr(name)} name={quoteattr(c.name)}>{body}</testcase>')
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name={quoteattr(name)} tests="{len(checks)}" '
            f'failures="{failures}" time="{seconds:.3f}">\n' + "\n".join(cases) + "\n</testsuite>\n")

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
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from fault_injectors import FaultSpecError, parse_spec
from ffctl.launchspec import LaunchSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LAUNCH_KEYS = {"nnodes", "nproc_per_node", "steps", "seed", "model", "optimizer", "recovery", "ckpt_every",
               "spares", "inject", "chaos", "sandbox", "heartbeat_timeout", "script"}
EXPECT_KEYS = {"status", "max_recovery_s", "max_detection_s", "max_lost_steps", "restore_source",
               "max_lost_gpu_hours_total", "min_goodput", "faults", "steps_completed"}


class ScenarioError(ValueError):
    """The scenario file is unusable; the message names the file and the bad key or value."""


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
        raw = dict(self.launch)
        try:
            injects = tuple(parse_spec(s) for s in raw.pop("inject", []))
        except FaultSpecError as exc:
            raise ScenarioError(f"{self.path}: inject: {exc}") from None
        script = tuple(raw.pop("script", ()))
        return LaunchSpec(**raw, injects=injects, script=script, runs_dir=runs_dir, run_id=run_id)


def load(path: Path) -> Scenario:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"launch", "expect", "name"}
    if unknown:
        raise ScenarioError(f"{path}: unknown section(s) {sorted(unknown)} (use [launch] and [expect])")
    launch, expect = data.get("launch", {}), data.get("expect", {})
    for section, keys, allowed in (("launch", launch, LAUNCH_KEYS), ("expect", expect, EXPECT_KEYS)):
        bad = set(keys) - allowed
        if bad:
            raise ScenarioError(f"{path}: unknown key(s) {sorted(bad)} in [{section}]")
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

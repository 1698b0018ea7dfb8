"""Scripted chaos checks: a scenario file says what to launch, what to break and what to expect.

    name = "a rank killed mid-step"  # optional; the file's name otherwise

    [launch]                         # the job: the same names as `ffctl launch` options
    nnodes = 2
    nproc_per_node = 1
    steps = 40
    seed = 0
    spares = 1
    # straggler = "replace:factor=2"            # --straggler (default "wait")
    # script = ["train.py", "--epochs", "1"]   # a script beside this file (default: built-in GPT)
    # [launch.torchrun]                          # torchrun's options, for a script
    # max_restarts = 1

    [faults]                         # the same specs as `--inject`, and/or a seeded schedule
    inject = ["kill-rank:rank=1,step=20"]   # also slow-rank:rank=1,step=10,factor=3,duration=10
    # chaos = "mtbf=3s,seed=4,kinds=kill-rank,until=8"

    [expect]                         # measured against `ffctl report --json`
    completes = true
    faults = 1                       # how many faults the record must hold
    max_detection_s = 2.0            # per fault (the worst one counts)
    max_recovery_s = 10.0
    max_lost_s = 10.0
    max_lost_steps = 1
    max_lost_gpu_hours = 0.01        # the run's total
    min_goodput = 0.2
    restore_source = ["local-memory", "peer-memory"]   # allowed sources
    matches_fault_free = true        # a fault-free twin, same seed: losses equal bit for bit

`[launch].inject` and `[launch].chaos` (the older spelling) are read as `[faults]`;
`max_lost_gpu_hours_total` as `max_lost_gpu_hours`; `status = "completed"` still works.

Everything here is pure. `load` checks the whole file against a schema of types before anything
starts (`LAUNCH_SCHEMA`, `FAULTS_SCHEMA`, `EXPECT_SCHEMA`): a bad value is refused with its key
path, e.g. `s.toml: [launch].steps: 'many' is not an integer`; `Scenario.spec` checks the launch
as a whole and `Scenario.require_expectations` refuses a file without a single expectation (a
check that cannot fail is not a check). `evaluate` turns a report
into one `Check` per expectation (the measured value against its bound), `compare_losses` is the
bit-for-bit comparison with the fault-free twin, and `worst_case` folds the checks of repeated runs
into each expectation's worst. Running the launches is `ffctl.launch.scenario_runs`.
"""
from __future__ import annotations

import math
import os
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fault_injectors import FaultSpecError
from fault_injectors.schedule import parse_chaos
from wire.fault_spec import MAX_DURATION_S, MAX_SEED, parse_injection
from ffctl.hosts.hostfile import read_user_file
from ffctl.launch.torchrun import FLAGS as TORCHRUN_FLAGS
from ffctl.launch.torchrun import VALUE_DEFAULTS as TORCHRUN_VALUES
from ffctl.launch.torchrun import TorchrunArgError, resolve
from ffctl.launch_spec import MAX_BATCH, MAX_NODES, MAX_PROCS_PER_NODE, MAX_STEPS, LaunchSpec, SpecError
from ffctl.workload.sizes import MODELS, OPTIMIZERS, PARALLELISMS
from wire.jobenv import Strategy
from runs.events import RestoreSource, RunStatus

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ScenarioError(ValueError):
    """The scenario file is unusable; the message names the file, the key path and the value."""


@dataclass(frozen=True)
class Field:
    """The type of one key: `int` (never a boolean), `number` (int or float, finite), `bool`,
    `choice` (one of `choices`), `text`, `specs` (fault specs), `words` (a string or a list of
    strings), `sources` (one or a list of `choices`), `table` (torchrun's options); numbers
    within [low, high]."""

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
    "parallel": Field("choice", choices=PARALLELISMS),
    "batch": Field("int", 0, MAX_BATCH),
    "recovery": Field("choice", choices=tuple(Strategy.ALL)),
    "ckpt_every": Field("int", 0, MAX_STEPS),
    "spares": Field("int", 0, MAX_PROCS_PER_NODE),
    "max_restarts": Field("int", 0, MAX_STEPS),
    "inject": Field("specs"),  # the older place of [faults].inject
    "chaos": Field("text"),  # the older place of [faults].chaos
    "sandbox": Field("choice", choices=("netns",)),
    # A timeout of zero would call every node lost (or hung) at once.
    "heartbeat_timeout": Field("number", 0.0, MAX_DURATION_S, positive=True),
    "hang_timeout": Field("number", 0.0, MAX_DURATION_S, positive=True),
    "script": Field("words"),
    "step_regex": Field("text"),
    "straggler": Field("text"),  # --straggler: wait, or replace[:factor=F][,steps=N]
    "verify_restore": Field("bool"),  # --verify-restore
    "snapshot_copies": Field("int", 1, 8),  # --snapshot-copies
    "torchrun": Field("table"),
}
FAULTS_SCHEMA: dict[str, Field] = {
    "inject": Field("specs"),
    "chaos": Field("text"),
}
_STATUSES = tuple(s.value for s in RunStatus)
_SOURCES = tuple(s.value for s in RestoreSource)
EXPECT_SCHEMA: dict[str, Field] = {
    "completes": Field("bool"),
    "status": Field("choice", choices=_STATUSES),
    "steps_completed": Field("int", 0, MAX_STEPS),
    "faults": Field("int", 0, 1_000_000),
    "max_detection_s": Field("number", 0.0, MAX_DURATION_S),
    "max_recovery_s": Field("number", 0.0, MAX_DURATION_S),
    "max_lost_s": Field("number", 0.0, MAX_DURATION_S),
    "max_lost_steps": Field("int", 0, MAX_STEPS),
    "max_lost_gpu_hours": Field("number", 0.0, 1e9),
    "max_lost_gpu_hours_total": Field("number", 0.0, 1e9),  # the older name of max_lost_gpu_hours
    "min_goodput": Field("number", 0.0, 1.0),
    "restore_source": Field("sources", choices=_SOURCES),
    "matches_fault_free": Field("bool"),
}
LAUNCH_KEYS = set(LAUNCH_SCHEMA)
EXPECT_KEYS = set(EXPECT_SCHEMA)
SECTIONS = ("name", "launch", "faults", "expect")
# torchrun's options a scenario may give in [launch.torchrun] (the job's shape has its own keys).
TORCHRUN_KEYS = tuple(k for k in (*TORCHRUN_VALUES, *TORCHRUN_FLAGS)
                      if k not in ("nnodes", "nproc_per_node", "max_restarts"))


@dataclass(frozen=True)
class Check:
    """One expectation's verdict: `measured` (as shown) against `bound`, `value` the measured
    figure as a number where there is one (what `worst_case` compares), `detail` one line that
    says both and names the fault or step it is about; `run_id` the run it was measured on."""

    name: str
    passed: bool
    measured: str
    bound: str
    detail: str
    value: float | None = None
    run_id: str | None = None
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "measured": self.measured, "bound": self.bound,
                "detail": self.detail, "value": self.value, "run_id": self.run_id, "seed": self.seed}


@dataclass(frozen=True)
class Scenario:
    path: Path
    launch: dict[str, Any]  # [launch] with [faults] folded in (inject, chaos)
    expect: dict[str, Any]
    title: str = ""

    @property
    def name(self) -> str:
        return self.title or self.path.stem

    @property
    def wants_twin(self) -> bool:
        return self.expect.get("matches_fault_free") is True

    def require_expectations(self) -> Scenario:
        """Refuse a scenario that checks nothing (its launch may be valid: `spec` says so first)."""
        if not any(k != "matches_fault_free" or v is True for k, v in self.expect.items()):
            raise ScenarioError(f"{self.path}: [expect] holds no expectation: a check that cannot fail is not a "
                                "check (e.g. completes = true, max_recovery_s = 10)")
        if self.wants_twin and not (self.launch.get("inject") or self.launch.get("chaos")):
            raise ScenarioError(f"{self.path}: [expect].matches_fault_free = true without a fault: the run would "
                                "be its own twin (add [faults].inject or chaos)")
        return self

    def spec(self, runs_dir: Path, run_id: str | None, seed: int | None = None) -> LaunchSpec:
        """The launch the file describes, checked as a whole (targets inside the job, steps, the
        script); `seed` replaces the file's (a repeat's run)."""
        raw = dict(self.launch)
        try:
            injects = tuple(parse_injection(s, scheduled=True) for s in raw.pop("inject", []))
        except FaultSpecError as exc:  # load() has checked them; a caller may have changed them
            raise ScenarioError(f"{self.path}: [faults].inject: {exc}") from None
        words = raw.pop("script", ())
        words = [words] if isinstance(words, str) else list(words)
        table = raw.pop("torchrun", {})
        if "hang_timeout" in raw:
            raw["hang_min_s"] = raw.pop("hang_timeout")
        given = {k: None if k not in table else str(table[k]) for k in TORCHRUN_VALUES}
        flags = {k: bool(table.get(k, False)) for k in TORCHRUN_FLAGS}
        if words and not flags["module"]:
            # A script is named relative to the scenario file, so a folder of checks can move.
            here = self.path.parent / words[0]
            if not os.path.isabs(words[0]) and here.is_file():
                words[0] = str(here)
        try:
            # Only the file counts: a CI machine's PET_* variables must not change the check.
            tr = resolve(given, flags, words, {}, cpus=os.cpu_count() or 1)
        except TorchrunArgError as exc:
            raise ScenarioError(f"{self.path}: [launch.torchrun]: {exc}") from None
        default_layout = 2 if not tr.worker_argv else 1  # as `ffctl launch`: torchrun's 1 for a script
        if tr.nnodes is not None and raw.get("nnodes", tr.nnodes) != tr.nnodes:  # --standalone: one node
            raise ScenarioError(f"{self.path}: [launch.torchrun].standalone with [launch].nnodes = {raw['nnodes']}: "
                                "standalone is one node")
        raw.setdefault("nnodes", tr.nnodes if tr.nnodes is not None else default_layout)
        raw.setdefault("nproc_per_node", default_layout)
        if seed is not None:
            raw["seed"] = seed
        spec = LaunchSpec(**raw, injects=injects, script=tr.worker_argv, role=tr.role, torchrun=tr.recorded,
                          runs_dir=runs_dir, run_id=run_id)
        try:
            return spec.validate()
        except SpecError as exc:
            raise ScenarioError(f"{self.path}: [launch]: {exc}") from None


def twin_spec(spec: LaunchSpec, run_id: str | None) -> LaunchSpec:
    """The fault-free twin of a launch: the same job and seed, no fault at all."""
    return replace(spec, injects=(), chaos=None, run_id=run_id)


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
    elif field.kind == "bool":
        if not isinstance(value, bool):
            raise ScenarioError(f"{bad} is not true or false")
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
    elif field.kind == "table":
        if not isinstance(value, dict):
            raise ScenarioError(f"{bad} is not a table (write [launch.torchrun])")
        for key, item in value.items():
            if key not in TORCHRUN_KEYS:
                hint = "a key of [launch] itself" if key in LAUNCH_SCHEMA else f"known: {', '.join(TORCHRUN_KEYS)}"
                raise ScenarioError(f"{where}: unknown key {key!r} ({hint})")
            flag = key in TORCHRUN_FLAGS
            if flag and not isinstance(item, bool):
                raise ScenarioError(f"{where}.{key}: {shown(item)} is not true or false")
            if not flag and (isinstance(item, bool) or not isinstance(item, (str, int))):
                raise ScenarioError(f"{where}.{key}: {shown(item)} is not a string or an integer")
    if field.kind in ("int", "number") and field.low is not None and field.high is not None:
        low_ok = value > field.low if field.positive else value >= field.low
        if not low_ok or value > field.high:
            above = "more than" if field.positive else "at least"
            raise ScenarioError(f"{bad} is out of range ({above} {field.low:g}, at most {field.high:g})")


def load(path: Path) -> Scenario:
    """Read and check a scenario file: every key known, every value of its type and in range."""
    try:
        text = read_user_file(path)
    except FileNotFoundError:
        raise ScenarioError(f"scenario {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"scenario {str(path)!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    return loads(text, path)


def loads(text: str, path: Path) -> Scenario:
    """`load` of a file's text; `path` names it in messages and anchors a relative script."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        # The parser recurses once per nested array or inline table: 20,000 brackets exhaust
        # the stack long before any scenario needs them.
        raise ScenarioError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None
    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise ScenarioError(f"{path}: unknown section(s) {sorted(unknown)} (use name, [launch], [faults] and [expect])")
    if "name" in data and not isinstance(data["name"], str):
        raise ScenarioError(f"{path}: name: {shown(data['name'])} is not a string")
    tables = {s: data.get(s, {}) for s in ("launch", "faults", "expect")}
    for section, schema in (("launch", LAUNCH_SCHEMA), ("faults", FAULTS_SCHEMA), ("expect", EXPECT_SCHEMA)):
        table = tables[section]
        if not isinstance(table, dict):
            raise ScenarioError(f"{path}: {section}: {shown(table)} is not a table (write [{section}])")
        bad = set(table) - set(schema)
        if bad:
            raise ScenarioError(f"{path}: unknown key(s) {sorted(bad)} in [{section}]")
        for key, value in table.items():
            _check(f"{path}: [{section}].{key}", schema[key], value)
    launch, faults, expect = dict(tables["launch"]), tables["faults"], dict(tables["expect"])
    for key in FAULTS_SCHEMA:
        if key in faults and key in launch:
            raise ScenarioError(f"{path}: [faults].{key} and [launch].{key}: give it in [faults] only")
        if key in faults:
            launch[key] = faults[key]
    if "chaos" in launch:
        try:
            parse_chaos(launch["chaos"])
        except FaultSpecError as exc:
            where = "faults" if "chaos" in faults else "launch"  # the section it was written in
            raise ScenarioError(f"{path}: [{where}].chaos: {exc}") from None
    if "max_lost_gpu_hours_total" in expect:
        if "max_lost_gpu_hours" in expect:
            raise ScenarioError(f"{path}: [expect].max_lost_gpu_hours and max_lost_gpu_hours_total: give one")
        expect["max_lost_gpu_hours"] = expect.pop("max_lost_gpu_hours_total")
    return Scenario(path, launch, expect, data.get("name", ""))


# --- expectations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LossDiff:
    """Where two runs' losses part: the first step at which they differ (or one has no loss)."""

    step: int
    loss: float | None  # the run's
    twin_loss: float | None  # the fault-free twin's


def _bits(x: float | None) -> bytes | None:
    return None if x is None else struct.pack("<d", x)


def compare_losses(run: list[list[float]], twin: list[list[float]]) -> LossDiff | None:
    """None when both runs committed the same steps with bit-identical losses, else the first
    step where they differ (a step only one of them committed counts as a difference)."""
    mine = {int(s): loss for s, loss in run}
    theirs = {int(s): loss for s, loss in twin}
    for step in sorted(set(mine) | set(theirs)):
        a, b = mine.get(step), theirs.get(step)
        if step not in mine or step not in theirs or _bits(a) != _bits(b):
            return LossDiff(step, a, b)
    return None


def _num(value: float | int | None, unit: str = "") -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        text = f"{value:.3f}" if abs(value) >= 0.001 or value == 0 else f"{value:.3g}"
    else:
        text = str(value)
    return text + unit


# Per-fault bounds: report field, unit, what a missing value means.
_PER_FAULT = {
    "max_detection_s": ("detection_s", " s", "never detected"),
    "max_recovery_s": ("recovery_s", " s", "never recovered"),
    "max_lost_s": ("lost_s", " s", "no figure"),
    "max_lost_steps": ("lost_steps", "", "no figure"),
}
# Which way is worse for each expectation's numeric value (`worst_case`): up, or down.
WORSE_IS_HIGHER = {"max_detection_s", "max_recovery_s", "max_lost_s", "max_lost_steps", "max_lost_gpu_hours"}
WORSE_IS_LOWER = {"min_goodput", "steps_completed"}


def evaluate(expect: dict[str, Any], report: dict[str, Any], twin: dict[str, Any] | None = None) -> list[Check]:
    """One Check per expectation, in the file's order. `twin` is the fault-free twin's report,
    needed when `matches_fault_free` is true (without it that check fails, saying so)."""
    checks: list[Check] = []
    faults = report.get("faults") or []
    run_id = report.get("run_id")

    def add(name: str, passed: bool, measured: str, bound: str, detail: str, value: float | None = None) -> None:
        checks.append(Check(name, bool(passed), measured, bound, detail, value, run_id))

    for key, want in expect.items():
        if key == "completes":
            status = str(report.get("status"))
            ok = (status == RunStatus.COMPLETED.value) is want
            reason = f" ({report['reason']})" if report.get("reason") and status != "completed" else ""
            add(key, ok, status, "completed" if want else "not completed", f"run {status}{reason}, expected "
                f"{'it to complete' if want else 'it not to complete'}")
        elif key == "status":
            status = str(report.get("status"))
            add(key, status == want, status, want, f"status {status!r}, expected {want!r}")
        elif key == "steps_completed":
            done = int(report.get("steps_completed") or 0)
            add(key, done >= want, str(done), f">= {want}", f"{done} steps completed, expected at least {want}", done)
        elif key == "faults":
            add(key, len(faults) == want, str(len(faults)), f"== {want}",
                f"{len(faults)} fault(s) recorded, expected {want}", len(faults))
        elif key in _PER_FAULT:
            field_name, unit, missing = _PER_FAULT[key]
            if not faults:
                add(key, False, "no fault", f"<= {want}{unit}", f"no fault was recorded to measure {field_name} on")
                continue
            # The worst fault decides: one never recovered (None) is worse than any figure.
            worst = max(faults, key=lambda f: math.inf if f.get(field_name) is None else f[field_name])
            value = worst.get(field_name)
            ok = value is not None and value <= want
            what = missing if value is None else _num(value, unit)
            add(key, ok, what, f"<= {_num(want, unit)}",
                f"{field_name} {what} ({worst['fault_id']} {worst['kind']} {worst.get('target', '')}".rstrip()
                + f"), limit {_num(want, unit)}", None if value is None else float(value))
        elif key == "max_lost_gpu_hours":
            value = float(report.get("lost_gpu_hours_total") or 0.0)
            add(key, value <= want, f"{value:.6f}", f"<= {want:g}",
                f"{value:.6f} lost GPU-hours in all, limit {want:g}", value)
        elif key == "min_goodput":
            g = report.get("goodput")
            add(key, g is not None and g >= want, _num(g), f">= {want:g}",
                f"goodput {_num(g)}, minimum {want:g}", None if g is None else float(g))
        elif key == "restore_source":
            allowed = [want] if isinstance(want, str) else list(want)
            used = [(f["fault_id"], f["restore_source"]) for f in faults if f.get("restore_source") is not None]
            bad = [(fid, src) for fid, src in used if src not in allowed]
            measured = ", ".join(sorted({src for _, src in used})) or "none"
            if not used:
                detail = "no fault was restored from anywhere"
            elif bad:
                detail = f"{bad[0][0]} restored from {bad[0][1]}, allowed {', '.join(allowed)}"
            else:
                detail = f"restored from {measured}, allowed {', '.join(allowed)}"
            add(key, bool(used) and not bad, measured, " | ".join(allowed), detail)
        elif key == "matches_fault_free":
            if not want:
                continue
            if twin is None:
                add(key, False, "no twin", "bit-identical", "the fault-free twin did not run")
                continue
            diff = compare_losses(report.get("loss_by_step") or [], twin.get("loss_by_step") or [])
            if diff is None:
                n = len(report.get("loss_by_step") or [])
                ok = n > 0
                add(key, ok, f"identical over {n} steps" if ok else "no step", "bit-identical",
                    f"loss of every step ({n}) equals the fault-free twin's ({twin.get('run_id')}) bit for bit"
                    if ok else "neither run committed a step")
            else:
                add(key, False, f"differs at step {diff.step}", "bit-identical",
                    f"first differing step {diff.step}: loss {_loss(diff.loss)}, fault-free twin "
                    f"({twin.get('run_id')}) {_loss(diff.twin_loss)}", float(diff.step))
    # Whatever the file expects: a fault it asked for that never took effect means the scenario
    # tested less than it says, and must not pass as if it had.
    missed = [m for m in report.get("missed_faults") or [] if isinstance(m, dict)]
    if missed:
        first = missed[0]
        add("faults_landed", False, f"{len(missed)} missed", "all landed",
            f"{len(missed)} requested fault(s) never took effect; {first.get('fault_id')} "
            f"({first.get('kind')} {first.get('trigger')}): {first.get('reason')}", float(len(missed)))
    return checks


def _loss(x: float | None) -> str:
    return "none (step not committed)" if x is None else repr(x)


def worst_case(runs: list[list[Check]]) -> list[Check]:
    """Each expectation's worst verdict over repeated runs of one scenario: a missed one before
    any met one; among those, the value furthest the wrong way (the highest recovery, the lowest
    goodput); else the first run's. The detail says which run and how many were folded."""
    if not runs:
        return []
    if len(runs) == 1:
        return list(runs[0])
    names: list[str] = []
    by_name: dict[str, list[Check]] = {}
    for checks in runs:
        for c in checks:
            if c.name not in by_name:
                names.append(c.name)
            by_name.setdefault(c.name, []).append(c)
    out = []
    for name in names:
        group = by_name[name]
        pool = [c for c in group if not c.passed] or group

        def badness(c: Check) -> float:
            if c.value is None:
                return math.inf if not c.passed else -math.inf
            return c.value if name in WORSE_IS_HIGHER else -c.value if name in WORSE_IS_LOWER else 0.0

        worst = max(pool, key=badness)  # max keeps the first of equals
        missed = sum(not c.passed for c in group)
        where = f"worst of {len(group)} runs ({missed} missed), run {worst.run_id}" + \
            (f" seed {worst.seed}" if worst.seed is not None else "")
        out.append(replace(worst, passed=missed == 0, detail=f"{worst.detail}; {where}"))
    return out


@dataclass
class Outcome:
    """What `ffctl run` found for one scenario: its runs, its verdicts (worst case over repeats)
    and an error when a launch could not run at all (an infrastructure error)."""

    name: str
    path: str
    checks: list[Check] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # run_id, record, seed, status, twin
    error: str | None = None
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def passed(self) -> bool:
        return self.error is None and not self.interrupted and bool(self.checks) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "passed": self.passed, "error": self.error,
                "interrupted": self.interrupted, "seconds": self.seconds, "runs": list(self.runs),
                "checks": [c.to_dict() for c in self.checks]}

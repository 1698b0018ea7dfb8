"""`ffctl run` as a library: plan every scenario's launches up front, then run them and judge.

`plan_scenarios` loads each file and plans each launch it needs (one per seed of `--repeat`, and
each one's fault-free twin when `matches_fault_free` is asked), so a bad file, a fault that cannot
work on this machine or a sandbox without root is refused before the first job starts.
`run_scenario` executes one scenario's plans in turn through the launch's one execute path and
folds the verdicts of its runs into each expectation's worst case (`scenario.worst_case`).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

from ffctl.exits import BadInput, InfraError
from ffctl.launch.launch_plan import LaunchPlan, execute, plan_launch
from ffctl.launch.scenario import Check, Outcome, Scenario, ScenarioError, evaluate, load, twin_spec, worst_case
from runs.events import RunStatus
from runs.metrics import compute
from runs.store import RunStore, new_run_id

MAX_REPEAT = 1000
SCENARIO_SUFFIX = ".toml"


@dataclass(frozen=True)
class PlannedRun:
    """One launch of a scenario (one seed) and its fault-free twin, when one is wanted."""

    seed: int
    plan: LaunchPlan
    twin: LaunchPlan | None = None


@dataclass(frozen=True)
class PlannedScenario:
    scenario: Scenario
    runs: tuple[PlannedRun, ...] = field(default=())


def scenario_files(paths: list[Path]) -> list[Path]:
    """The files named, a folder standing for its `*.toml` files (sorted, not recursive)."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix == SCENARIO_SUFFIX and q.is_file())
            if not found:
                raise ScenarioError(f"folder {str(p)!r} holds no {SCENARIO_SUFFIX} scenario")
            out += found
        else:
            out.append(p)
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:40] or "scenario"


def plan_scenarios(paths: list[Path], runs_dir: Path, run_id: str | None = None,
                   repeat: int = 1) -> list[PlannedScenario]:
    """Load and plan everything before anything starts. Run ids: `run_id` itself when it names
    the only run, else `<run_id or a new id>-<scenario>-<seed>`; a twin's adds `-twin`.
    Raises ScenarioError or BadInput (exit 2), naming the file and the value."""
    if not 1 <= repeat <= MAX_REPEAT:
        raise BadInput(f"--repeat {repeat}: must be between 1 and {MAX_REPEAT}")
    files = scenario_files(paths)
    scenarios = [load(p) for p in files]
    single = len(scenarios) == 1 and repeat == 1
    prefix = run_id or new_run_id()
    planned: list[PlannedScenario] = []
    seen: set[str] = set()
    for sc in scenarios:
        base = sc.spec(runs_dir, run_id).seed  # checks the launch whole, the --run-id too
        sc.require_expectations()
        runs = []
        for seed in range(base, base + repeat):
            rid = prefix if single else f"{prefix}-{_slug(sc.path.stem)}-{seed}"
            if rid in seen:  # two files of the same name in different folders
                rid = f"{rid}-{len(seen)}"
            seen.add(rid)
            spec = sc.spec(runs_dir, rid, seed)
            twin = plan_launch(twin_spec(spec, f"{rid}-twin")) if sc.wants_twin else None
            runs.append(PlannedRun(seed, plan_launch(spec), twin))
        planned.append(PlannedScenario(sc, tuple(runs)))
    return planned


def _one(plan: LaunchPlan, view: Callable[[], ContextManager[Callable[[dict[str, Any]], None]]]
         ) -> tuple[RunStatus, RunStore, dict[str, Any]]:
    with view() as v:
        status, record = execute(plan, v)
    return status, record, compute(record.run_id, list(record.events())).to_dict()


def run_scenario(ps: PlannedScenario,
                 view: Callable[[], ContextManager[Callable[[dict[str, Any]], None]]],
                 said: Callable[[str], None] = lambda line: None) -> Outcome:
    """Run one scenario's launches (and twins) in turn and judge them. A launch that cannot run
    (a host, a tool, the machine) ends the scenario with `error` set; Ctrl-C with `interrupted`."""
    sc = ps.scenario
    out = Outcome(sc.name, str(sc.path))
    t0 = time.monotonic()
    per_run: list[list[Check]] = []
    try:
        for pr in ps.runs:
            status, record, report = _one(pr.plan, view)
            entry: dict[str, Any] = {"run_id": record.run_id, "record": str(record.path), "seed": pr.seed,
                                     "status": report["status"]}
            out.runs.append(entry)
            said(f"run {record.run_id}: {report['status']}, {report['steps_completed']} steps, "
                 f"{len(report['faults'])} fault(s) (record in {record.path})")
            if status is RunStatus.INTERRUPTED:
                out.interrupted = True
                break
            twin_report = None
            if pr.twin is not None:
                twin_status, twin_record, twin_report = _one(pr.twin, view)
                entry["twin"] = {"run_id": twin_record.run_id, "record": str(twin_record.path),
                                 "status": twin_report["status"]}
                said(f"run {twin_record.run_id} (fault-free twin): {twin_report['status']}, "
                     f"{twin_report['steps_completed']} steps (record in {twin_record.path})")
                if twin_status is RunStatus.INTERRUPTED:
                    out.interrupted = True
                    break
            checks = evaluate(sc.expect, report, twin_report)
            per_run.append([Check(c.name, c.passed, c.measured, c.bound, c.detail, c.value, c.run_id, pr.seed)
                            for c in checks])
    except (InfraError, OSError) as exc:
        out.error = str(exc) or type(exc).__name__
    except BadInput as exc:  # e.g. a run id taken meanwhile: still nothing of this run started
        out.error = str(exc)
    except KeyboardInterrupt:
        out.interrupted = True
    out.checks = worst_case(per_run)
    out.seconds = time.monotonic() - t0
    return out

"""`ffctl run SCENARIO.toml [--junit FILE]`: a scripted chaos check with expectations (exit 1 if missed)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ffctl.errors import EXIT_EXPECTATION, EXIT_INTERRUPTED, EXIT_OK, BadInput
from ffctl.render import make_console


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        scenario: Annotated[Path, typer.Argument(help="Scenario file ([launch] and [expect] tables).")],
        junit: Annotated[Optional[Path], typer.Option("--junit", help="Write a JUnit XML report here.")] = None,
        run_id: Annotated[Optional[str], typer.Option("--run-id")] = None,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR")] = Path("ffctl-runs"),
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the scenario and print the plan only.")] = False,
    ) -> int:
        """Launch the scenario's job, then check its report against the expectations."""
        from ffctl.launch import scenario as lib
        from ffctl.launch.plan import execute, plan_launch
        from ffctl.render.live import LiveView
        from ffctl.render.report import render_checks, render_plan, render_report
        from runs.events import RunStatus
        from runs.metrics import compute

        try:
            sc = lib.load(scenario)
            plan = plan_launch(sc.spec(runs_dir, run_id))
        except lib.ScenarioError as exc:
            raise BadInput(str(exc)) from None
        console = make_console()
        if dry_run:
            render_plan(list(plan.lines), console)
            return EXIT_OK
        t0 = time.monotonic()
        with LiveView(console) as view:
            status, record = execute(plan, view)
        report = compute(record.run_id, record.events()).to_dict()
        render_report(report, console)
        checks = lib.evaluate(sc.expect, report)
        render_checks([(c.name, c.passed, c.detail) for c in checks], console)
        if junit is not None:
            junit.write_text(lib.junit(scenario.stem, checks, time.monotonic() - t0))
        if status is RunStatus.INTERRUPTED:
            return EXIT_INTERRUPTED
        return EXIT_OK if all(c.passed for c in checks) else EXIT_EXPECTATION

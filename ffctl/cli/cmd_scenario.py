"""`ffctl run SCENARIO.toml|FOLDER ... [--junit FILE] [--markdown FILE] [--repeat N] [--dry-run]`:
scripted chaos checks with expectations. Exit 0 when every expectation holds, 1 when one is
missed, 2 on a bad file (nothing started), 3 when a launch could not run, 130 on Ctrl-C."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ffctl.exits import EXIT_EXPECTATION, EXIT_INFRA, EXIT_INTERRUPTED, EXIT_OK, BadInput
from ffctl.render import make_console


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        scenarios: Annotated[list[Path], typer.Argument(help="Scenario files (TOML: the launch, faults and expect tables), or folders of their *.toml files.")],
        junit: Annotated[Optional[Path], typer.Option("--junit", help="Write JUnit XML here: a test suite per scenario, a test case per expectation.")] = None,
        markdown: Annotated[Optional[Path], typer.Option("--markdown", help="Write a Markdown summary here (e.g. $GITHUB_STEP_SUMMARY).")] = None,
        repeat: Annotated[int, typer.Option("--repeat", help="Run each scenario N times, seeds seed..seed+N-1; each expectation's worst case counts.")] = 1,
        run_id: Annotated[Optional[str], typer.Option("--run-id", help="Run id (one run), or the prefix of every run's id.")] = None,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR", help="Where run records are.")] = Path("ffctl-runs"),
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the scenarios and print what would run; start nothing.")] = False,
    ) -> int:
        """Launch each scenario's job with its faults, then check its report against the expectations."""
        from ffctl.launch import scenario as lib
        from ffctl.launch.scenario_runs import plan_scenarios, run_scenario
        from ffctl.render.live import LiveView
        from ffctl.render.report import render_plan
        from ffctl.render.verdicts import junit as junit_xml
        from ffctl.render.verdicts import markdown as markdown_text
        from ffctl.render.verdicts import render_outcome, render_summary

        from ffctl.cli.cmd_report import check_output, write_output

        for flag, out in (("--junit", junit), ("--markdown", markdown)):
            # Checked before any job runs (--dry-run too: it says what a real run would do): a
            # directory, a FIFO that writing would wait on forever, /dev/full or /proc/version
            # would otherwise lose the verdicts of jobs that ran for minutes.
            if out is not None:
                check_output(flag, out)
        try:
            planned = plan_scenarios(scenarios, runs_dir, run_id, repeat)
        except lib.ScenarioError as exc:
            raise BadInput(str(exc)) from None
        console = make_console()
        if dry_run:
            for ps in planned:
                console.print(f"scenario {ps.scenario.name} ({ps.scenario.path}): expects "
                              + ", ".join(f"{k} = {lib.shown(v)}" for k, v in ps.scenario.expect.items()),
                              markup=False, highlight=False, soft_wrap=True)
                for pr in ps.runs:
                    render_plan(list(pr.plan.lines), console)
                    if pr.twin is not None:
                        render_plan([f"fault-free twin: {pr.twin.lines[0]}"], console)
            return EXIT_OK
        say = lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
        outcomes = []
        for ps in planned:
            outcome = run_scenario(ps, lambda: LiveView(console), say)
            outcomes.append(outcome)
            render_outcome(outcome.to_dict(), console)
            if outcome.interrupted:
                break
        dicts = [o.to_dict() for o in outcomes]
        render_summary(dicts, console)
        unwritten = False
        for flag, out, text in (("--junit", junit, junit_xml), ("--markdown", markdown, markdown_text)):
            if out is None:
                continue
            try:
                write_output(out, text(dicts))
            except OSError as exc:  # e.g. removed or made read-only while the jobs ran
                typer.echo(f"ffctl: error: {flag} {str(out)!r}: {exc.strerror or exc}", err=True)
                unwritten = True
        if any(o.interrupted for o in outcomes):
            return EXIT_INTERRUPTED
        if any(o.error for o in outcomes) or unwritten:
            return EXIT_INFRA
        return EXIT_OK if all(o.passed for o in outcomes) else EXIT_EXPECTATION

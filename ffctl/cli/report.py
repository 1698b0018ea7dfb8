"""`ffctl report`: recovery time and lost GPU-hours of every fault of a run, recomputed from its events."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ffctl.render import make_console
from ffctl.errors import BadInput
from ffctl.render.report import render_report
from runs.metrics import compute
from runs.store import RunStoreError, open_run


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        runs: Annotated[list[str], typer.Argument(help="Run ids.")],
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
        html: Annotated[Optional[Path], typer.Option("--html", help="Also write an HTML report to FILE.")] = None,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR")] = Path("ffctl-runs"),
    ) -> None:
        """Show each fault's detection and recovery time, lost steps and lost GPU-hours."""
        reports = []
        for run_id in runs:
            try:
                record = open_run(runs_dir, run_id)
            except RunStoreError as exc:
                raise BadInput(str(exc)) from None
            reports.append(compute(record.run_id, record.events()).to_dict())
        if as_json:
            typer.echo(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
        console = make_console(record=html is not None, quiet=as_json)
        for rep in reports:
            render_report(rep, console)
        if html is not None:
            console.save_html(str(html))

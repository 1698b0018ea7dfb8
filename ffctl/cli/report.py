"""`ffctl report`: recovery time and lost GPU-hours of every fault of a run, recomputed from its events."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ffctl.render import make_console
from ffctl.errors import BadInput
from ffctl.render.report import render_report
from runs.events import RunStatus
from runs.metrics import compute
from runs.store import RunStore, RunStoreError, open_run


def left_behind(record: RunStore) -> dict[str, Any]:
    """What run.json says a killed controller leaves (its sandbox), narrowed to what is still
    on this machine, and the command that removes it."""
    try:
        sandbox = record.read_json("run.json").get("sandbox") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    namespaces = [str(n) for n in sandbox.get("namespaces") or []]
    links = [str(n) for n in sandbox.get("links") or []]
    if not namespaces and not links:
        return {}
    from ffctl.launch.sandbox import SandboxError, list_namespaces

    try:
        present = set(list_namespaces())
        namespaces = [n for n in namespaces if n in present]
    except SandboxError:
        pass  # no `ip` here to look with: say what the record says
    links = [n for n in links if "/" not in n and Path("/sys/class/net", n).exists()]
    if not namespaces and not links:
        return {}
    return {"namespaces": namespaces, "links": links,
            "remove": f"ffctl inject revert --all --run {record.run_id}"}


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        runs: Annotated[list[str], typer.Argument(help="Run ids.")],
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
        html: Annotated[Optional[Path], typer.Option("--html", help="Also write an HTML report to FILE.")] = None,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR")] = Path("ffctl-runs"),
    ) -> None:
        """Show each fault's detection and recovery time, lost steps and lost GPU-hours.

        Exits 1 when a run is incomplete (its controller was lost before it finished the record):
        the figures stop where it died and the sandbox may still be on the machine, which a script
        must not mistake for a run that ended.
        """
        reports = []
        incomplete = False
        for run_id in runs:
            try:
                record = open_run(runs_dir, run_id)
            except RunStoreError as exc:
                raise BadInput(str(exc)) from None
            rep = compute(record.run_id, record.events(), record.controller_alive()).to_dict()
            if rep["status"] == RunStatus.INCOMPLETE.value:
                incomplete = True
                rep["left"] = left_behind(record)
            reports.append(rep)
        if as_json:
            typer.echo(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
        console = make_console(record=html is not None, quiet=as_json)
        for rep in reports:
            render_report(rep, console)
        if html is not None:
            console.save_html(str(html))
        if incomplete:
            raise typer.Exit(1)

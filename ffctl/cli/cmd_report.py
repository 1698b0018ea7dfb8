"""`ffctl report`: recovery time, lost time and lost GPU-hours of every fault of a run, recomputed
from its events; without a run, the runs recorded; with several, the runs side by side."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ffctl.render import html as html_page
from ffctl.render import make_console
from ffctl.exits import BadInput
from ffctl.render.report import (markdown_comparison, markdown_report, markdown_run_list, render_comparison,
                                 render_report, render_run_list)
from runs.events import RunStatus
from runs.metrics import compute
from runs.store import CorruptRecord, RunStore, RunStoreError, list_runs, open_run


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
    from ffctl.backends.netns import SandboxError, list_namespaces

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


def run_report(record: RunStore) -> dict[str, Any]:
    rep = compute(record.run_id, record.events(), record.controller_alive()).to_dict()
    if rep["status"] == RunStatus.INCOMPLETE.value:
        rep["left"] = left_behind(record)
    return rep


def listed_reports(records: list[RunStore]) -> list[dict[str, Any]]:
    """The reports of the runs of a listing; a run whose record cannot be read (garbage in its
    events or run.json) is left out with one warning line on stderr, so that one bad directory
    never hides every other run."""
    listed = []
    for record in records:
        try:
            listed.append(run_report(record))
        except Exception as exc:  # whatever a hostile record trips, the listing goes on
            why = " ".join(str(exc).split()) or type(exc).__name__
            typer.echo(f"ffctl: warning: run {record.run_id!r} skipped: {why[:300]}", err=True)
    return listed


def run_summary(rep: dict[str, Any]) -> dict[str, Any]:
    """A run as `ffctl report --json` without a run id lists it."""
    return {
        "run_id": rep["run_id"], "status": rep["status"], "strategy": rep["strategy"],
        "world_size": rep["world_size"], "steps_completed": rep["steps_completed"],
        "faults": len(rep["faults"]), "lost_s": sum(float(f.get("lost_s") or 0.0) for f in rep["faults"]),
        "lost_gpu_hours_total": rep["lost_gpu_hours_total"], "goodput": rep["goodput"],
    }


def _write(path: Path, page: str, console: Any) -> None:
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"--html {str(path)!r}: {exc.strerror or exc}") from None
    console.print(f"HTML report written to {path}", markup=False, highlight=False, soft_wrap=True)


def check_outputs(html: Path | None, runs_dir: Path) -> None:
    """`--html FILE` (matplotlib installed, a file in an existing directory) and `--runs-dir`
    (a directory when it exists), checked before any record is read: one line, exit 2."""
    if html is not None:
        html_page.require_matplotlib()
        if not html.parent.is_dir() or html.is_dir():
            raise BadInput(f"--html {str(html)!r}: not a file in an existing directory")
    if runs_dir.exists() and not runs_dir.is_dir():
        raise BadInput(f"--runs-dir {str(runs_dir)!r} is not a directory")


def newest_run(runs_dir: Path, named: list[str] | None) -> str:
    """The id `--last` stands for: the newest run recorded in `runs_dir`."""
    if named:
        raise BadInput(f"--last and run id {named[0]!r}: choose one")
    found = list_runs(runs_dir)
    if not found:
        raise BadInput(f"--last: no runs in {str(runs_dir)!r}")
    return found[0].run_id


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        runs: Annotated[Optional[list[str]], typer.Argument(
            help="Run ids; none lists the runs, several are compared side by side.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
        markdown: Annotated[bool, typer.Option(
            "--markdown", help="Print GitHub-flavoured Markdown tables (for CI summaries).")] = False,
        html: Annotated[Optional[Path], typer.Option(
            "--html", metavar="FILE",
            help="Also write one self-contained HTML page: the tables, a timeline and the loss curve "
                 "(needs the html extra: pip install 'ffctl[html]').")] = None,
        last: Annotated[bool, typer.Option("--last", help="The newest run in the runs directory (no id needed).")] = False,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR",
                                               help="Where run records are.")] = Path("ffctl-runs"),
        project_to: Annotated[Optional[str], typer.Option("--project", hidden=True)] = None,
    ) -> None:
        """Show each fault's detection and recovery time, lost time, lost steps and lost GPU-hours.

        Without a run id, lists the runs in the runs directory, newest first; with several,
        compares them in one table. Exits 1 when a named run is incomplete (its controller was
        lost before it finished the record): the figures stop where it died and the sandbox may
        still be on the machine, which a script must not mistake for a run that ended.
        """
        if as_json and markdown:
            raise BadInput("--json and --markdown: choose one")
        if project_to is not None:
            # The projection grew into its own command (fleet presets, Daly's model, several sizes).
            raise BadInput(f"--project {project_to!r}: projection is `ffctl project RUN... --mtbf T@N --gpus N` "
                           "(or --fleet llama3|rsc1|rsc2) now")
        check_outputs(html, runs_dir)
        if last:
            runs = [newest_run(runs_dir, runs)]
        records = []
        for run_id in runs or []:
            try:
                records.append(open_run(runs_dir, run_id))
            except RunStoreError as exc:
                raise BadInput(str(exc)) from None
        console = make_console(quiet=as_json or markdown)
        if not records:
            listed = listed_reports(list_runs(runs_dir))
            if as_json:
                typer.echo(json.dumps([run_summary(r) for r in listed], indent=2))
            elif markdown:
                typer.echo(markdown_run_list(listed), nl=False)
            render_run_list(listed, console, str(runs_dir))
            if html is not None:
                _write(html, html_page.run_list_html(listed, str(runs_dir)), console)
            return
        try:
            reports = [run_report(record) for record in records]
        except CorruptRecord as exc:
            raise BadInput(f"unreadable run record: {exc}") from None
        if as_json:
            typer.echo(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
        elif markdown:
            typer.echo(markdown_report(reports[0]) if len(reports) == 1 else markdown_comparison(reports), nl=False)
        if len(reports) == 1:
            render_report(reports[0], console)
        else:
            render_comparison(reports, console)
        if html is not None:
            page = html_page.report_html(reports, {r.run_id: r.events() for r in records})
            _write(html, page, console)
        if any(r["status"] == RunStatus.INCOMPLETE.value for r in reports):
            raise typer.Exit(1)

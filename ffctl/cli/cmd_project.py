"""`ffctl project`: what the strategies measured in some runs would give a fleet of 1k to 100k GPUs
(MTBF, ETTR in Daly's complete model and the first-order form, lost and spare GPU-hours per day,
Daly's checkpoint interval), for a published fleet's failure rate or one given. The model is
`runs.projection`; docs/projection.md has every formula and its source."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ffctl.cli.cmd_report import check_outputs, run_report, write_output
from ffctl.exits import BadInput
from ffctl.render import html as html_page
from ffctl.render import make_console
from ffctl.render.report import markdown_fleet_projection, render_fleet_projection, render_run_check
from runs.events import EventKind
from ffctl.cli.durations import parse_duration
from runs.projection import (DEFAULT_GPUS, DEFAULT_GPUS_PER_NODE, DEFAULT_SPARES_PER_1000, PRESETS, Fleet,
                             ProjectionSpec, RunMeasure, check_run, measure_run, project)
from runs.store import RunStore, RunStoreError, open_run

_MAX_GPUS = 100_000_000


def parse_gpu_count(text: str, option: str) -> int:
    digits = text.strip().replace("_", "").replace(",", "")
    if not digits.isascii() or not digits.isdigit() or not 0 < int(digits) <= _MAX_GPUS:
        raise BadInput(f"{option} {text!r}: a whole number of GPUs from 1 to {_MAX_GPUS:,}")
    return int(digits)


def parse_gpus(text: str) -> tuple[int, ...]:
    """`1024,16384,100000` -> the GPU counts, in order, each once."""
    counts: list[int] = []
    for part in text.split(","):
        count = parse_gpu_count(part, "--gpus")
        if count not in counts:
            counts.append(count)
    return tuple(counts)


MAX_RATE = 1_440_000.0


def parse_rate(text: str) -> float:
    try:
        rate = float(text.strip())
    except ValueError:
        rate = math.nan
    # At most one failure per node per minute (1,440,000 per 1,000 node-days): beyond that no
    # job starts, and the model's figures would be noise.
    if not 0 < rate <= MAX_RATE:
        raise BadInput(f"--failures-per-1000-node-days {text!r}: a number of failures above 0 and at most "
                       f"{MAX_RATE:,.0f} (e.g. 6.5)")
    return rate


def parse_fleet(preset: str | None, rate: str | None, mtbf: str | None, gpus_per_node: int) -> Fleet:
    """The fleet from exactly one of --fleet, --failures-per-1000-node-days and --mtbf."""
    given = [name for name, value in (("--fleet", preset), ("--failures-per-1000-node-days", rate),
                                      ("--mtbf", mtbf)) if value is not None]
    if len(given) != 1:
        raise BadInput("give one failure rate: --fleet " + "|".join(PRESETS) + ", --failures-per-1000-node-days R "
                       "or --mtbf T" + (f" (got {' and '.join(given)})" if given else ""))
    if preset is not None:
        if preset not in PRESETS:
            raise BadInput(f"--fleet {preset!r}: use one of {', '.join(PRESETS)}")
        return Fleet.preset(preset, gpus_per_node)
    if rate is not None:
        return Fleet("rate", gpus_per_node, failures_per_1000_node_days=parse_rate(rate),
                     population="as given (--failures-per-1000-node-days)")
    assert mtbf is not None
    duration, at, where = mtbf.partition("@")
    return Fleet("mtbf", gpus_per_node, mtbf_s=parse_duration(duration, "--mtbf"),
                 mtbf_gpus=parse_gpu_count(where, f"--mtbf {mtbf!r}: after @,") if at else None,
                 population="as given (--mtbf)")


def _job(record: RunStore) -> str:
    """What the run trained (the built-in model's size, or the script), from run.json: a step time
    is only a reference for the same job."""
    try:
        spec = record.read_json("run.json").get("spec") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(spec, dict):
        return ""
    script = spec.get("script") or []
    return f"script {' '.join(str(s) for s in script)}" if script else f"model {spec.get('model')}"


def load_measures(runs_dir: Path, run_ids: list[str]) -> list[RunMeasure]:
    """Each run's measures; a run that does not exist or whose record holds no run is bad input."""
    out = []
    for run_id in dict.fromkeys(run_ids):  # a run named twice counts once
        try:
            record = open_run(runs_dir, run_id)
        except RunStoreError as exc:
            raise BadInput(str(exc)) from None
        try:
            events = record.events()
            if not any(ev.kind is EventKind.RUN_STARTED for ev in events):
                raise BadInput(f"run {run_id!r}: its record holds no run ({record.events_path} has no readable "
                               "run_started event)")
            out.append(measure_run(run_report(record), events, _job(record)))
        except (RunStoreError, ValueError, TypeError, KeyError) as exc:
            # A record that reads but holds the wrong things (a step that is no number, a fault
            # without an id) is as unusable as one that does not read.
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise BadInput(f"run {run_id!r}: its record is unreadable: {why[:300]}") from None
    return out


def _check(runs_dir: Path, runs: list[str], check: str | None, within: float | None, as_json: bool,
           other_output: bool) -> None:
    """`--check RUN`: RUN's goodput predicted from the RUNs' per-fault costs beside what it measured."""
    if check is None:
        raise BadInput("--within: only with --check RUN")
    if within is not None and not 0 <= within < math.inf:
        raise BadInput(f"--within {within!r}: a number of percentage points, 0 or more")
    if other_output:
        raise BadInput("--check: prints a table or --json only (no --markdown, no --html)")
    measures = load_measures(runs_dir, [r for r in runs if r != check] + [check])
    try:
        doc = check_run(measures[:-1], measures[-1])
    except ValueError as exc:
        raise BadInput(f"--check {check!r}: {exc}") from None
    doc["within_points"] = within
    doc["ok"] = within is None or abs(doc["difference_points"]) <= within
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        render_run_check(doc, make_console())
    if not doc["ok"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    @app.command("project")
    def project_cmd(
        runs: Annotated[list[str], typer.Argument(
            help="Run ids whose measured costs are projected (any strategies; a fault-free run of the same "
                 "job without per-step snapshots gives the snapshot overhead its reference).")],
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR", help="Where run records are.")] = Path("ffctl-runs"),
        fleet: Annotated[Optional[str], typer.Option(
            "--fleet", metavar="|".join(PRESETS),
            help="A published fleet's failure rate (docs/projection.md gives each one's source).")] = None,
        rate: Annotated[Optional[str], typer.Option(
            "--failures-per-1000-node-days", metavar="R", help="Node failures per 1,000 node-days.")] = None,
        mtbf: Annotated[Optional[str], typer.Option(
            "--mtbf", metavar="T[@N]",
            help="The job's MTBF (e.g. 18m): at every GPU count, or with @N at N GPUs, scaled by N / GPUs.")] = None,
        gpus: Annotated[str, typer.Option("--gpus", metavar="N,N,...", help="GPU counts to project to.")]
            = ",".join(str(g) for g in DEFAULT_GPUS),
        gpus_per_node: Annotated[int, typer.Option(
            "--gpus-per-node", min=1, max=1024, help="GPUs a node holds: rates count failures per node.")]
            = DEFAULT_GPUS_PER_NODE,
        spares_per_1000: Annotated[float, typer.Option(
            "--spares-per-1000", metavar="K",
            help="Warm spare GPUs held per 1,000 (0: a failed node waits for its replacement).")]
            = DEFAULT_SPARES_PER_1000,
        replace_time: Annotated[Optional[str], typer.Option(
            "--replace-time", metavar="T", help="With --spares-per-1000 0: the time a failed node takes to be "
                                               "replaced, added to every recovery (e.g. 10m).")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the projection as JSON.")] = False,
        markdown: Annotated[bool, typer.Option("--markdown", help="Print GitHub-flavoured Markdown.")] = False,
        html: Annotated[Optional[Path], typer.Option(
            "--html", metavar="FILE",
            help="Also write a self-contained HTML page with the tables and ETTR against GPU count "
                 "(needs the html extra: pip install 'ffctl[html]').")] = None,
        check: Annotated[Optional[str], typer.Option(
            "--check", metavar="RUN",
            help="Instead of a fleet: predict RUN's goodput (a run with many faults, e.g. --chaos) from the "
                 "RUNs' per-fault costs, and print it beside what RUN measured.")] = None,
        within: Annotated[Optional[float], typer.Option(
            "--within", metavar="POINTS",
            help="With --check: exit 1 unless the prediction is within POINTS percentage points.")] = None,
    ) -> None:
        """Project measured recovery costs to a fleet: MTBF, ETTR, lost and spare GPU-hours per day."""
        if as_json and markdown:
            raise BadInput("--json and --markdown: choose one")
        if check is not None or within is not None:
            _check(runs_dir, runs, check, within, as_json, markdown or html is not None)
            return
        the_fleet = parse_fleet(fleet, rate, mtbf, gpus_per_node)
        if not 0 <= spares_per_1000 < 1000:
            # Spares are GPUs held beside the job's: a thousand per thousand is a second fleet.
            raise BadInput(f"--spares-per-1000 {spares_per_1000!r}: from 0 to below 1,000 spare GPUs per 1,000")
        spec = ProjectionSpec(the_fleet, parse_gpus(gpus), spares_per_1000,
                              parse_duration(replace_time, "--replace-time") if replace_time is not None else 0.0)
        check_outputs(html, runs_dir)
        doc: dict[str, Any] = project(load_measures(runs_dir, runs), spec)
        if not doc["strategies"]:
            raise BadInput(f"runs {', '.join(map(repr, runs))}: no strategy with a recovery to project "
                           "(runs under --recovery none are only a reference)")
        console = make_console(quiet=as_json or markdown)
        if as_json:
            typer.echo(json.dumps(doc, indent=2))
        elif markdown:
            typer.echo(markdown_fleet_projection(doc), nl=False)
        render_fleet_projection(doc, console)
        if html is not None:
            try:
                write_output(html, html_page.projection_html(doc))
            except OSError as exc:
                raise BadInput(f"--html {str(html)!r}: {exc.strerror or exc}") from None
            console.print(f"HTML page written to {html}", markup=False, highlight=False, soft_wrap=True)

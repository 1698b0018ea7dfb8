"""`ffctl inject KIND --run ID ...`: break a running job now; `ffctl inject revert --all`."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from fault_injectors import FaultSpecError
from wire.fault_spec import FAULT_ID, parse_injection, parse_kind, parse_seconds
from ffctl.cli.durations import EXAMPLES
from fault_injectors.targets import check_in_job
from ffctl.render import make_console
from ffctl.exits import EXIT_INFRA, EXIT_OK, BadInput
from ffctl.render.report import render_plan
from runs.store import RunStore, RunStoreError, open_run, validate_run_id


def register(app: typer.Typer) -> None:
    @app.command("inject")
    def inject(
        kind: Annotated[str, typer.Argument(metavar="KIND", help="Fault kind (`ffctl faults` lists them), or `revert`.")],
        fault: Annotated[Optional[str], typer.Argument(
            metavar="FAULT", help="With `revert`: the id of the fault to revert now (f1, f2, ...; needs --run).")] = None,
        run: Annotated[Optional[str], typer.Option("--run", help="Run id of the running job.")] = None,
        rank: Annotated[Optional[int], typer.Option(help="Target rank.")] = None,
        node: Annotated[Optional[int], typer.Option(help="Target node.")] = None,
        host: Annotated[Optional[str], typer.Option(help="Target host.")] = None,
        duration: Annotated[Optional[str], typer.Option(metavar="DURATION", help="How long until the fault is reverted: 5, 5s, 500ms or 2m.")] = None,
        option: Annotated[Optional[list[str]], typer.Option("--option", "-o", help="Kind-specific key=value (rate=1mbit, delay=100ms).")] = None,
        all_: Annotated[bool, typer.Option("--all", help="With `revert`: remove everything ffctl left (with --run: that run's).")] = False,
        hosts: Annotated[Optional[Path], typer.Option("--hosts", help="Hostfile (with `revert --all`).")] = None,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR", help="Where run records are.")] = Path("ffctl-runs"),
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each host's commands, change nothing.")] = False,
    ) -> int:
        """Inject a fault into a running job (the job's controller applies and records it)."""
        console = make_console()
        if kind == "revert" and fault is not None:
            return _revert_one(fault, run, runs_dir, all_, dry_run, console)
        if fault is not None:
            raise BadInput(f"inject {kind}: unexpected argument {fault!r} (a target is --rank, --node or --host)")
        if kind == "revert":
            from ffctl.launch.cleanup import revert_everything

            if not all_:
                raise BadInput("inject revert: name the fault (ffctl inject revert f1 --run ID) or say --all "
                               "(remove everything ffctl left on the hosts)")
            if run is not None:
                _check_run_id(run)
            # With --run, only that run's switches and sandbox: other runs keep theirs.
            lines = revert_everything(hosts, dry_run=dry_run, run_id=run)
            render_plan(lines, console)
            return EXIT_OK
        try:
            parse_kind(kind)
        except FaultSpecError as exc:
            raise BadInput(str(exc)) from None
        if run is None:
            raise BadInput(f"inject {kind}: --run ID is required")
        _check_run_id(run)
        targets = [f"{k}={v}" for k, v in (("rank", rank), ("node", node), ("host", host)) if v is not None]
        if len(targets) > 1:
            raise BadInput(f"inject {kind}: give one of --rank, --node, --host (got {', '.join(targets)})")
        if duration is not None and parse_seconds(duration) is None:
            raise BadInput(f"--duration {duration!r}: not a duration like {EXAMPLES}")
        # The spec's own grammar reads it (5, 5s, 500ms, 2m), as in --inject and scenario files.
        fields = targets + ([f"duration={duration}"] if duration is not None else []) + list(option or [])
        spec_text = kind + (":" + ",".join(fields) if fields else "")
        try:
            # Checked here, not only by the controller: a bad spec needs no running job to refuse.
            spec = parse_injection(spec_text, scheduled=False)
        except FaultSpecError as exc:
            raise BadInput(f"inject {kind}: {exc}") from None
        try:
            record = open_run(runs_dir, run)
        except RunStoreError as exc:
            raise BadInput(str(exc)) from None
        info = _run_info(record)
        shape = _job_shape(info)
        if shape is not None:
            try:
                check_in_job(spec, shape[0] * shape[1], shape[0])
            except FaultSpecError as exc:
                raise BadInput(f"inject {kind} into run {run}: {exc}") from None
        # Here, not at the top: it talks to the job's store, which loads torch, and every other
        # command (`ffctl report`, `--help`) would pay for it.
        from ffctl.controller import client as inject_client

        try:
            reply = inject_client.request(record, spec, dry_run)
        except RunStoreError as exc:  # its events are garbage: no status to go by
            raise BadInput(f"run {run}: unreadable record: {exc}") from None
        if dry_run:
            render_plan(list(reply.plan or []), console)
            return EXIT_OK
        if not reply.ok:
            typer.echo(f"ffctl: error: {reply.error}", err=True)
            return EXIT_INFRA
        console.print(f"injected {kind} as {reply.fault_id} into run {run}", markup=False, highlight=False)
        return EXIT_OK


def _revert_one(fault: str, run: str | None, runs_dir: Path, all_: bool, dry_run: bool, console: Any) -> int:
    """`ffctl inject revert FAULT --run ID`: the run's controller reverts that one fault now."""
    if all_:
        raise BadInput(f"inject revert {fault}: --all reverts everything; name one fault or say --all")
    if not FAULT_ID.fullmatch(fault):
        raise BadInput(f"inject revert {fault!r}: not a fault id (f1, f2, ...: the run's report lists them)")
    if run is None:
        raise BadInput(f"inject revert {fault}: --run ID is required")
    _check_run_id(run)
    try:
        record = open_run(runs_dir, run)
    except RunStoreError as exc:
        raise BadInput(str(exc)) from None
    _run_info(record)
    from ffctl.controller import client as inject_client

    try:
        inject_client.revert(record, fault, dry_run)
    except RunStoreError as exc:
        raise BadInput(f"run {run}: unreadable record: {exc}") from None
    said = "would revert" if dry_run else "reverted"
    console.print(f"{said} {fault} in run {run}", markup=False, highlight=False)
    return EXIT_OK


def _check_run_id(run: str) -> None:
    try:
        validate_run_id(run)
    except RunStoreError as exc:
        raise BadInput(f"--run: {exc}") from None


def _run_info(record: RunStore) -> dict[str, Any]:
    """run.json as far as injecting needs it: a JSON object whose controller endpoint (if any)
    has an address and a port; anything else is one line, exit 2, never a traceback."""
    try:
        info = record.read_json("run.json")
    except (OSError, ValueError) as exc:
        raise BadInput(f"run {record.run_id}: cannot read run.json: {exc}") from None
    if not isinstance(info, dict):
        raise BadInput(f"run {record.run_id}: run.json is not a JSON object")
    ctl = info.get("controller")
    if ctl is not None and not (isinstance(ctl, dict) and isinstance(ctl.get("address"), str)
                                and type(ctl.get("port")) is int and 0 < ctl["port"] < 65536):
        raise BadInput(f"run {record.run_id}: run.json's controller endpoint is not an address and a port")
    return info


def _job_shape(info: Any) -> tuple[int, int] | None:
    """(nodes, ranks per node) of the run as launched, when its record says (the controller
    checks the target against the live job in any case)."""
    spec = info.get("spec") if isinstance(info, dict) else None
    if not isinstance(spec, dict):
        return None
    nnodes, nproc = spec.get("nnodes"), spec.get("nproc_per_node")
    if type(nnodes) is int and type(nproc) is int and nnodes > 0 and nproc > 0:
        return nnodes, nproc
    return None

"""`ffctl launch`: start instrumented training, inject scheduled faults, recover, record."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fault_injectors import FaultSpecError
from fault_injectors.spec import parse_injection
from ffctl.render import make_console
from ffctl.errors import EXIT_EXPECTATION, EXIT_INTERRUPTED, EXIT_OK, BadInput
from ffctl.launch.plan import execute, plan_launch
from ffctl.spec import LaunchSpec
from ffctl.render.live import LiveView
from ffctl.render.report import render_plan, render_report, root_cause_lines
from runs.events import EventKind, RunStatus, finish_reason
from runs.metrics import compute


def register(app: typer.Typer) -> None:
    @app.command(
        "launch",
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )
    def launch(
        script: Annotated[Optional[list[str]], typer.Argument(help="Training script and its arguments (default: built-in GPT).")] = None,
        nnodes: Annotated[int, typer.Option("--nnodes", help="Nodes (local agents without --hosts).")] = 2,
        nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", "--nproc_per_node", help="Ranks per node.")] = 2,
        steps: Annotated[int, typer.Option(help="Training steps of the built-in workload.")] = 60,
        seed: Annotated[int, typer.Option(help="Seed: same seed, same losses.")] = 0,
        model: Annotated[str, typer.Option(help="Built-in GPT size: tiny, small, medium or base.")] = "tiny",
        optimizer: Annotated[str, typer.Option(help="Built-in GPT optimizer: adamw, or sharded (ZeRO-1).")] = "adamw",
        batch: Annotated[int, typer.Option(help="Built-in GPT: sequences per rank per step (0: the size's default).")] = 0,
        recovery: Annotated[str, typer.Option(help="peer | restart-memory | restart-disk | none")] = "peer",
        ckpt_every: Annotated[int, typer.Option("--ckpt-every", help="Disk checkpoint every N steps (0: never).")] = 0,
        spares: Annotated[int, typer.Option(help="Warm spare workers per node.")] = 0,
        max_restarts: Annotated[int, typer.Option("--max-restarts", "--max_restarts", help="Recoveries allowed from failures ffctl did not inject (a crash in the script, a failed recovery) before the job stops, as torchrun counts restarts; recoveries from injected faults never count. The same rank failing at the same step with the same error after a restore stops the job at once.")] = 3,
        inject: Annotated[Optional[list[str]], typer.Option("--inject", help="Scheduled fault KIND:key=value,...")] = None,
        chaos: Annotated[Optional[str], typer.Option("--chaos", help="Seeded random faults: mtbf=SECONDS,seed=N[,kinds=K1|K2][,until=S][,duration=S].")] = None,
        sandbox: Annotated[Optional[str], typer.Option("--sandbox", help="netns: each local node in its own network namespace (root), so network faults are real.")] = None,
        run_id: Annotated[Optional[str], typer.Option("--run-id", help="Run id (default: time-based).")] = None,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR", help="Where run records go.")] = Path("ffctl-runs"),
        heartbeat_timeout: Annotated[float, typer.Option("--heartbeat-timeout", help="Node loss after this many seconds without heartbeat.")] = 1.0,
        hang_timeout: Annotated[float, typer.Option("--hang-timeout", help="A hang after this many seconds without step progress (or 10x the median step time, if longer).")] = 5.0,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would run and start nothing.")] = False,
        hosts: Annotated[Optional[Path], typer.Option("--hosts", help="Hostfile: one node per host, agents started over SSH.")] = None,
        accept_new_host_keys: Annotated[bool, typer.Option("--accept-new-host-keys", help="Trust and save host keys not yet in known_hosts.")] = False,
        master_addr: Annotated[Optional[str], typer.Option("--master-addr", "--master_addr", help="This machine's address the hosts reach the controller on (default: found over SSH).")] = None,
        remote_python: Annotated[str, typer.Option("--remote-python", help="Python (with torch and ffctl) on the hosts.")] = "python3",
        remote_runs_dir: Annotated[str, typer.Option("--remote-runs-dir", help="Per-run files (logs, checkpoints) on the hosts.")] = "/tmp/ffctl-runs",
        keep_freed_memory: Annotated[bool, typer.Option("--keep-freed-memory/--release-freed-memory", help="Ranks keep freed memory instead of faulting it in again every step (glibc settings; left alone where the host sets an allocator).")] = True,
    ) -> int:
        """Train on local nodes (the built-in GPT, or SCRIPT), inject faults, recover, and record it."""
        try:
            faults = tuple(parse_injection(s, scheduled=True) for s in inject or [])
        except FaultSpecError as exc:
            raise BadInput(f"--inject: {exc}") from None
        spec = LaunchSpec(
            nnodes=nnodes, nproc_per_node=nproc_per_node, steps=steps, seed=seed, model=model, optimizer=optimizer, batch=batch,
            recovery=recovery, ckpt_every=ckpt_every, spares=spares, max_restarts=max_restarts, injects=faults, run_id=run_id,
            runs_dir=runs_dir, script=tuple(script or ()), heartbeat_timeout=heartbeat_timeout, hang_min_s=hang_timeout,
            hostfile=hosts, accept_new_host_keys=accept_new_host_keys, master_addr=master_addr,
            remote_python=remote_python, remote_runs_dir=remote_runs_dir,
            chaos=chaos, sandbox=sandbox, keep_freed_memory=keep_freed_memory,
        )
        plan = plan_launch(spec)
        console = make_console()
        if dry_run:
            render_plan(list(plan.lines), console)
            return EXIT_OK
        with LiveView(console) as view:
            status, record = execute(plan, view)
        render_report(compute(record.run_id, record.events()).to_dict(), console)
        console.print(f"run {record.run_id}: {status.value} (record in {record.path})", markup=False, highlight=False)
        if status is RunStatus.FAILED:
            events = list(record.events())
            reason = finish_reason(events)
            cause = next((e.get("root_cause") for e in reversed(events) if e.kind is EventKind.RUN_FINISHED), None)
            if isinstance(cause, dict):
                for line in root_cause_lines(cause, f"ffctl launch FAILED (run {record.run_id}): {reason}"):
                    typer.echo(line, err=True)
            if reason:
                typer.echo(f"ffctl launch: {reason}", err=True)
        if status is RunStatus.COMPLETED:
            return EXIT_OK
        return EXIT_INTERRUPTED if status is RunStatus.INTERRUPTED else EXIT_EXPECTATION

"""`ffctl launch`: start instrumented training, inject scheduled faults, recover, record."""
from __future__ import annotations

import difflib
import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from fault_injectors import FaultSpecError
from wire.fault_spec import parse_injection
from ffctl.render import make_console
from ffctl.backends import REQUEUED, backend_name
from ffctl.cli.durations import parse_duration
from ffctl.exits import EXIT_EXPECTATION, EXIT_FAULT_MISSED, EXIT_INTERRUPTED, EXIT_NO_REQUEUE, EXIT_OK, BadInput
from ffctl.launch.echo import RankEcho, parse_ranks_filter
from ffctl.launch.torchrun import TorchrunArgError, resolve
from ffctl.launch_spec import LaunchSpec
from ffctl.render.live import LiveView
from ffctl.render.report import render_plan, render_report, root_cause_lines
from runs.events import Event, EventKind, RunStatus, finish_reason
from runs.metrics import compute

if TYPE_CHECKING:
    from ffctl.launch.launch_plan import LaunchPlan


def _gpus() -> int:
    """This machine's GPUs, for torchrun's `--nproc-per-node gpu|auto` (torch only when asked)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _echo(plan: LaunchPlan, console: Any) -> AbstractContextManager[object]:
    """A user script's output on the console as it comes, `[rank N]: line`, its stderr's lines on
    stderr (torchrun's `--local-ranks-filter` picks the local ranks shown). The built-in workload's is in its logs
    only, and so is that of ranks on hosts over SSH, whose logs stay there."""
    spec = plan.spec
    if not spec.script or spec.hostfile is not None:
        return nullcontext()
    err_console = make_console(stderr=True)
    torchrun = dict(spec.torchrun)
    # torchrun's -t/--tee prefixes each teed line `[<role><local rank>]:`; ffctl echoes every
    # line, so with a tee asked for its lines carry that prefix, and `[rank N]:` otherwise.
    teed = torchrun.get("tee", "0").strip() not in ("", "0")
    write = lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    write_err = lambda line: err_console.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    return RankEcho(spec.runs_dir / plan.run_id / "logs", write, spec.nproc_per_node,
                    parse_ranks_filter(torchrun.get("local_ranks_filter", "")), write_err,
                    role=spec.role if teed else None)


def _say_missed(events: Iterable[Event]) -> int:
    """Say each requested fault that never took effect, with why; how many."""
    missed = [e for e in events if e.kind is EventKind.FAULT_MISSED]
    for e in missed:
        typer.echo(f"ffctl launch: fault {e.get('fault_id')} ({e.get('kind')} {e.get('target')} {e.get('trigger')}) "
                   f"missed: {e.get('reason')}", err=True)
    return len(missed)


def _no_such_option(word: str, ctx: typer.Context) -> str:
    """What click says of an unknown option in every other command: the name and the options
    it most resembles."""
    name = word.split("=", 1)[0]
    known = [o for p in ctx.command.params for o in (*p.opts, *getattr(p, "secondary_opts", ())) if o.startswith("-")]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"No such option: {name}" + (f" (Possible options: {', '.join(close)})" if close else "")


def register(app: typer.Typer) -> None:
    @app.command(
        "launch",
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )
    def launch(
        ctx: typer.Context,
        script: Annotated[Optional[list[str]], typer.Argument(help="Training script and its arguments, as torchrun takes them (a `--` before them works too; default: the built-in GPT).")] = None,
        nnodes: Annotated[Optional[str], typer.Option("--nnodes", show_default=False, help="Nodes (local agents without --hosts): N, or torchrun's MIN:MAX (MIN start, as one torchrun on one host runs; ask for more local nodes with a fixed N). Default: 2 for the built-in GPT, torchrun's 1 for a script (PET_NNODES).")] = None,
        nproc_per_node: Annotated[Optional[str], typer.Option("--nproc-per-node", "--nproc_per_node", show_default=False, help="Ranks per node: a number, cpu, gpu or auto, as torchrun takes it. Default: 2 for the built-in GPT, torchrun's 1 for a script (PET_NPROC_PER_NODE).")] = None,
        steps: Annotated[int, typer.Option(help="Training steps of the built-in workload.")] = 60,
        seed: Annotated[int, typer.Option(help="Seed: same seed, same losses.")] = 0,
        model: Annotated[str, typer.Option(help="Built-in GPT size: tiny, small, medium or base.")] = "tiny",
        optimizer: Annotated[str, typer.Option(help="Built-in GPT optimizer: adamw, or sharded (ZeRO-1).")] = "adamw",
        parallel: Annotated[str, typer.Option(help="Built-in GPT parallelism: ddp, fsdp (torch's fully_shard over every rank) or hsdp (replicated across nodes, sharded within one).")] = "ddp",
        batch: Annotated[int, typer.Option(help="Built-in GPT: sequences per rank per step (0: the size's default).")] = 0,
        recovery: Annotated[str, typer.Option(help="peer | restart-memory | restart-disk | none")] = "peer",
        ckpt_every: Annotated[int, typer.Option("--ckpt-every", help="Disk checkpoint every N steps (0: never).")] = 0,
        spares: Annotated[int, typer.Option(help="Warm spare workers per node.")] = 0,
        max_restarts: Annotated[Optional[str], typer.Option("--max-restarts", "--max_restarts", show_default=False, help="Recoveries allowed from failures ffctl did not inject (a crash in the script, a failed recovery) before the job stops, as torchrun counts restarts; recoveries from injected faults never count. Default: torchrun's 0 for an unchanged script (every worker is stopped and the group restarted, as torchrun does); 3 for the built-in GPT and scripts on the recovery library, where the same rank failing at the same step with the same error after a restore also stops the job at once (PET_MAX_RESTARTS).")] = None,
        inject: Annotated[Optional[list[str]], typer.Option("--inject", help="Scheduled fault KIND:key=value,...")] = None,
        chaos: Annotated[Optional[str], typer.Option("--chaos", help="Seeded random faults: mtbf=SECONDS,seed=N[,kinds=K1|K2][,until=S][,duration=S].")] = None,
        sandbox: Annotated[Optional[str], typer.Option("--sandbox", help="netns: each local node in its own network namespace (root), so network faults are real.")] = None,
        backend: Annotated[Optional[str], typer.Option("--backend", help="How nodes run: local (processes here), netns (as --sandbox netns) or slurm (inside an sbatch/salloc allocation: one job step per node's agent, the allocation's extra nodes as spare nodes).")] = None,
        run_id: Annotated[Optional[str], typer.Option("--run-id", help="Run id (default: time-based).")] = None,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR", help="Where run records go.")] = Path("ffctl-runs"),
        heartbeat_timeout: Annotated[str, typer.Option("--heartbeat-timeout", metavar="DURATION", help="Node loss after this many seconds without heartbeat.")] = "1",
        hang_timeout: Annotated[str, typer.Option("--hang-timeout", metavar="DURATION", help="A hang after this many seconds without step progress (or 10x the median step time, if longer).")] = "5",
        straggler: Annotated[str, typer.Option("--straggler", help="What to do about a straggler (a rank the others wait for, named from its step times): wait (record it and bill its lost time) or replace[:factor=F][,steps=N] (also treat a rank slower than F x the median busy time for N steps in a row as failed and replace it with a spare; default F=2, N=3).")] = "wait",
        snapshot_copies: Annotated[int, typer.Option("--snapshot-copies", help="How many other nodes hold each node's snapshots in memory: the next K on the ring (default 1, the neighbour). K nodes lost together still leave a copy; each step waits until all K hold it.")] = 1,
        verify_restore: Annotated[bool, typer.Option("--verify-restore", help="Check every recovery from memory by replay: restore one snapshot further back and train the steps between again; each rank's loss must equal, bit for bit, the one it reported before the fault, or the job stops naming the rank and step (state the script never registered, such as a prefetched batch). Costs one step per recovery.")] = False,
        exit_barrier_timeout: Annotated[str, typer.Option("--exit-barrier-timeout", metavar="DURATION", help="Once some ranks of the job have finished (exit 0), how many seconds the others may keep running before they are stopped and the run fails naming them, with their last output line (torchrun's agent waits 300 s at its exit barrier).")] = "300",
        silence_timeout: Annotated[str, typer.Option("--silence-timeout", metavar="DURATION", help="A script's job in which no rank prints a line or commits a step for this many seconds (and none has exited) is hung: said on screen after 10 s of silence, and at this limit every rank's Python stacks are kept and the run fails naming each rank and its last line.")] = "1800",
        allow_missed: Annotated[bool, typer.Option("--allow-missed", help="Run even if a requested fault's trigger can never fire (a step= for a script that reports no steps, a step past --steps), and exit 0 when a requested fault never took effect; such a fault is recorded as missed (fault_missed) with the reason. Without it such a run is refused before it starts (exit 2), or exits 5.")] = False,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would run and start nothing.")] = False,
        hosts: Annotated[Optional[Path], typer.Option("--hosts", help="Hostfile: one node per host, agents started over SSH.")] = None,
        accept_new_host_keys: Annotated[bool, typer.Option("--accept-new-host-keys", help="Trust and save host keys not yet in known_hosts.")] = False,
        master_addr: Annotated[Optional[str], typer.Option("--master-addr", "--master_addr", help="The job's store (ffctl's controller) address the hosts reach, torchrun's MASTER_ADDR (default: 127.0.0.1 locally, found over SSH with --hosts; PET_MASTER_ADDR).")] = None,
        remote_python: Annotated[str, typer.Option("--remote-python", help="Python (with torch and ffctl) on the hosts.")] = "python3",
        remote_runs_dir: Annotated[str, typer.Option("--remote-runs-dir", help="Per-run files (logs, checkpoints) on the hosts.")] = "/tmp/ffctl-runs",
        step_regex: Annotated[Optional[str], typer.Option("--step-regex", help="A script's steps read off its output: a regular expression with a group (?P<step>\\d+) (or the step as its first group) and optionally (?P<loss>...), matched against each line a rank prints, e.g. 'step (?P<step>\\d+) loss (?P<loss>\\S+)'. For scripts that do not call recovery.report_step; with either, faults can be injected at a step.")] = None,
        keep_freed_memory: Annotated[bool, typer.Option("--keep-freed-memory/--release-freed-memory", help="Ranks keep freed memory instead of faulting it in again every step (glibc settings; left alone where the host sets an allocator).")] = True,
        standalone: Annotated[bool, typer.Option("--standalone", rich_help_panel="torchrun options", help="torchrun's single-node job (PET_STANDALONE): one node; ffctl's controller runs the store on a free port.")] = False,
        rdzv_backend: Annotated[Optional[str], typer.Option("--rdzv-backend", "--rdzv_backend", rich_help_panel="torchrun options", help="Accepted and recorded: ffctl's controller runs the job's TCPStore (torchrun's c10d store) whatever the backend.")] = None,
        rdzv_endpoint: Annotated[Optional[str], typer.Option("--rdzv-endpoint", "--rdzv_endpoint", rich_help_panel="torchrun options", help="Accepted (HOST[:PORT] checked) and recorded: workers get the controller's store as MASTER_ADDR:MASTER_PORT.")] = None,
        rdzv_id: Annotated[Optional[str], typer.Option("--rdzv-id", "--rdzv_id", rich_help_panel="torchrun options", help="Accepted and recorded; TORCHELASTIC_RUN_ID is ffctl's run id (--run-id).")] = None,
        rdzv_conf: Annotated[Optional[str], typer.Option("--rdzv-conf", "--rdzv_conf", rich_help_panel="torchrun options", help="Accepted and recorded (timeouts are ffctl's own).")] = None,
        node_rank: Annotated[Optional[str], typer.Option("--node-rank", "--node_rank", rich_help_panel="torchrun options", help="Accepted and recorded: one ffctl launch starts every node and numbers them (GROUP_RANK).")] = None,
        master_port: Annotated[Optional[str], typer.Option("--master-port", "--master_port", rich_help_panel="torchrun options", help="Accepted and recorded: MASTER_PORT is the port of the controller's store, picked free.")] = None,
        local_addr: Annotated[Optional[str], typer.Option("--local-addr", "--local_addr", rich_help_panel="torchrun options", help="Accepted and recorded: nodes' addresses come from the backend (local, sandbox, --hosts).")] = None,
        monitor_interval: Annotated[Optional[str], typer.Option("--monitor-interval", "--monitor_interval", rich_help_panel="torchrun options", help="Accepted and recorded: ffctl's agents see a worker's exit within 100 ms.")] = None,
        start_method: Annotated[Optional[str], typer.Option("--start-method", "--start_method", rich_help_panel="torchrun options", help="spawn, fork or forkserver: accepted and recorded; workers start as ffctl's agents start them (a fork of a warm template, a spare or a fresh interpreter), each as a fresh `python SCRIPT` would run.")] = None,
        role: Annotated[Optional[str], typer.Option("--role", rich_help_panel="torchrun options", help="The workers' ROLE_NAME (default: default).")] = None,
        module: Annotated[bool, typer.Option("-m", "--module", rich_help_panel="torchrun options", help="SCRIPT is a Python module, run as `python -m` would.")] = False,
        no_python: Annotated[bool, typer.Option("--no-python", "--no_python", rich_help_panel="torchrun options", help="SCRIPT is a program, run as is (not with Python).")] = False,
        run_path: Annotated[bool, typer.Option("--run-path", "--run_path", rich_help_panel="torchrun options", help="Accepted and recorded: a script is always run as `runpy.run_path` runs it.")] = False,
        log_dir: Annotated[Optional[str], typer.Option("--log-dir", "--log_dir", rich_help_panel="torchrun options", help="Accepted and recorded: each rank's output and error file are in the run record, logs/<node>/.")] = None,
        redirects: Annotated[Optional[str], typer.Option("-r", "--redirects", rich_help_panel="torchrun options", help="0-3 or LOCAL_RANK:0-3,...: accepted and recorded; a script's ranks' output always goes to their log in the record and to the console, prefixed [rank N]:.")] = None,
        tee: Annotated[Optional[str], typer.Option("-t", "--tee", rich_help_panel="torchrun options", help="0-3 or LOCAL_RANK:0-3,...: accepted and recorded; a script's ranks' output always goes to their log in the record and to the console, prefixed [rank N]:.")] = None,
        event_log_handler: Annotated[Optional[str], typer.Option("--event-log-handler", "--event_log_handler", rich_help_panel="torchrun options", help="Accepted and recorded: the run's events go to ffctl's record (events.jsonl), whatever handler torch's elastic events would use.")] = None,
        logs_specs: Annotated[Optional[str], typer.Option("--logs-specs", "--logs_specs", rich_help_panel="torchrun options", help="Accepted and recorded: ranks' logs are laid out by ffctl (logs/<node>/<rank>.log and the error files beside them in the run record).")] = None,
        signals_to_handle: Annotated[Optional[str], typer.Option("--signals-to-handle", "--signals_to_handle", rich_help_panel="torchrun options", help="Signal names (checked) accepted and recorded: ffctl stops the job on SIGINT and SIGTERM (the workers get SIGTERM, then SIGKILL after --shutdown-timeout).")] = None,
        shutdown_timeout: Annotated[Optional[str], typer.Option("--shutdown-timeout", "--shutdown_timeout", rich_help_panel="torchrun options", help="Seconds a worker being stopped gets between SIGTERM and SIGKILL (ffctl's default: 5; torchrun's: 30).")] = None,
        numa_binding: Annotated[Optional[str], typer.Option("--numa-binding", "--numa_binding", rich_help_panel="torchrun options", help="Refused: ffctl does not bind workers to NUMA nodes.")] = None,
        duplicate_stdout_filters: Annotated[Optional[str], typer.Option("--duplicate-stdout-filters", "--duplicate_stdout_filters", rich_help_panel="torchrun options", help="Refused: every line a rank prints is in its log in the run record.")] = None,
        duplicate_stderr_filters: Annotated[Optional[str], typer.Option("--duplicate-stderr-filters", "--duplicate_stderr_filters", rich_help_panel="torchrun options", help="Refused: every line a rank prints is in its log in the run record.")] = None,
        virtual_local_rank: Annotated[bool, typer.Option("--virtual-local-rank", "--virtual_local_rank", rich_help_panel="torchrun options", help="Every worker gets LOCAL_RANK=0 and, on a GPU host, only its own device (CUDA_VISIBLE_DEVICES).")] = False,
        local_ranks_filter: Annotated[Optional[str], typer.Option("--local-ranks-filter", "--local_ranks_filter", rich_help_panel="torchrun options", help="LOCAL_RANK,...: the local ranks whose output the console shows, each line prefixed [rank N]: (default: every rank's).")] = None,
    ) -> int:
        """Train on local nodes (the built-in GPT, or SCRIPT), inject faults, recover, and record it."""
        if script and script[0].startswith("-"):
            # Unknown options are left for the script (its own come after it); one before the
            # script is a mistyped option of ours, as torchrun's argparse would say.
            raise BadInput(_no_such_option(script[0], ctx))
        try:
            faults = tuple(parse_injection(s, scheduled=True) for s in inject or [])
        except FaultSpecError as exc:
            raise BadInput(f"--inject: {exc}") from None
        given = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "max_restarts": max_restarts,
                 "rdzv_backend": rdzv_backend, "rdzv_endpoint": rdzv_endpoint, "rdzv_id": rdzv_id,
                 "rdzv_conf": rdzv_conf, "node_rank": node_rank, "master_addr": master_addr,
                 "master_port": master_port, "local_addr": local_addr, "monitor_interval": monitor_interval,
                 "start_method": start_method, "role": role, "log_dir": log_dir, "redirects": redirects,
                 "tee": tee, "local_ranks_filter": local_ranks_filter, "event_log_handler": event_log_handler,
                 "logs_specs": logs_specs, "signals_to_handle": signals_to_handle, "shutdown_timeout": shutdown_timeout,
                 "numa_binding": numa_binding, "duplicate_stdout_filters": duplicate_stdout_filters,
                 "duplicate_stderr_filters": duplicate_stderr_filters}
        flags = {"standalone": standalone, "module": module, "no_python": no_python, "run_path": run_path,
                 "virtual_local_rank": virtual_local_rank}
        try:
            tr = resolve(given, flags, script or (), os.environ, cpus=os.cpu_count() or 1,
                         gpus=_gpus() if (nproc_per_node or os.environ.get("PET_NPROC_PER_NODE", "")).strip()
                         in ("gpu", "auto") else 0)
        except TorchrunArgError as exc:
            raise BadInput(str(exc)) from None
        # Without a script the built-in GPT runs on its own 2x2 default; a script gets torchrun's.
        default_layout = 2 if not tr.worker_argv else 1
        spec = LaunchSpec(
            nnodes=default_layout if tr.nnodes is None else tr.nnodes,
            nproc_per_node=default_layout if tr.nproc_per_node is None else tr.nproc_per_node, steps=steps, seed=seed, model=model, optimizer=optimizer, parallel=parallel, batch=batch,
            recovery=recovery, ckpt_every=ckpt_every, spares=spares, max_restarts=tr.max_restarts, injects=faults, run_id=run_id,
            runs_dir=runs_dir, script=tr.worker_argv, heartbeat_timeout=parse_duration(heartbeat_timeout, "--heartbeat-timeout"),
            hang_min_s=parse_duration(hang_timeout, "--hang-timeout"),
            exit_barrier_timeout=parse_duration(exit_barrier_timeout, "--exit-barrier-timeout"),
            silence_timeout=parse_duration(silence_timeout, "--silence-timeout"), allow_missed=allow_missed,
            hostfile=hosts, accept_new_host_keys=accept_new_host_keys, master_addr=tr.master_addr,
            remote_python=remote_python, remote_runs_dir=remote_runs_dir,
            chaos=chaos, sandbox=sandbox or ("netns" if backend == "netns" else None),
            backend=backend if backend != "netns" else None, keep_freed_memory=keep_freed_memory, role=tr.role, torchrun=tr.recorded,
            step_regex=step_regex, straggler=straggler, verify_restore=verify_restore,
            snapshot_copies=snapshot_copies,
        )
        # Here, not at the top: the launch loads torch (the controller hosts the job's store),
        # and every other command (`ffctl report`, `--help`) would pay for it.
        from ffctl.launch.launch_plan import execute, plan_launch

        plan = plan_launch(spec)
        console = make_console()
        if dry_run:
            render_plan(list(plan.lines), console)
            return EXIT_OK
        for warning in plan.warnings:  # said before the job starts, where CI logs keep it
            typer.echo(f"ffctl launch: warning: {warning}", err=True)
        if plan.chaos_seed_drawn is not None:
            typer.echo(f"ffctl launch: --chaos drew seed={plan.chaos_seed_drawn} (give it to repeat this schedule)",
                       err=True)
        with LiveView(console) as view, _echo(plan, console):
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
            # Steps are known for the built-in GPT, the recovery library and --step-regex; a plain
            # script's silence says nothing of its progress.
            plain = next((e.get("plain_script") for e in events if e.kind is EventKind.RUN_STARTED), True)
            known = not plain or bool(spec.step_regex)
            if backend_name(spec) in REQUEUED and known and not any(e.kind is EventKind.STEP for e in events):
                # Not one step trained: a requeue would start where this did and fail the same way.
                typer.echo(f"ffctl launch: no step was trained: exit {EXIT_NO_REQUEUE}, do not requeue", err=True)
                return EXIT_NO_REQUEUE
        missed = _say_missed(record.events())
        if status is RunStatus.COMPLETED:
            if missed and not spec.allow_missed:
                typer.echo(f"ffctl launch: {missed} requested fault(s) never took effect: exit {EXIT_FAULT_MISSED} "
                           f"(--allow-missed accepts that)", err=True)
                return EXIT_FAULT_MISSED
            return EXIT_OK
        return EXIT_INTERRUPTED if status is RunStatus.INTERRUPTED else EXIT_EXPECTATION

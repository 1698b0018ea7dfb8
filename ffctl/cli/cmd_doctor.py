"""`ffctl doctor [--hosts FILE]`: can these hosts run ffctl jobs, and which faults can they take?

Without ``--hosts`` it checks this machine; with it, every host of the hostfile over SSH (all at
once); with ``--backend slurm``, every node of the Slurm allocation it runs in (each check a job
step on its node). It draws one table row per host and one line per problem, and exits 0 when every host can
run a job, 3 when one cannot (unreachable, refused, no python/torch/ffctl) and 2 for a bad
hostfile. Problems that only rule out some faults (no root, no netem) are shown but do not
change the exit code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ffctl.hosts.doctor import HostReport, check_hosts, check_local
from ffctl.exits import EXIT_INFRA, EXIT_OK, BadInput
from ffctl.hosts.hostfile import HostfileError, parse_hostfile
from ffctl.render import make_console
from ffctl.render.host_checks import render_doctor


def diagnose(hosts: Path | None, *, accept_new_host_keys: bool = False, python: str = "python3",
             timeout: float = 15.0, connect_timeout: float = 10.0, backend: str | None = None) -> list[HostReport]:
    """The reports `ffctl doctor` draws: this machine's, each host's (in hostfile order), or
    each node's of the Slurm allocation it runs in (`backend="slurm"`, checks run as job steps)."""
    if backend not in (None, "local", "slurm"):
        raise BadInput(f"--backend {backend!r}: doctor checks local or slurm")
    if backend == "slurm":
        if hosts is not None:
            raise BadInput("--backend slurm checks the allocation's nodes: give it without --hosts")
        import sys

        from ffctl.backends.slurm_steps import doctor_transports

        # The agents run with this interpreter on every node (a shared filesystem's).
        return check_hosts(doctor_transports(), timeout=timeout, python=sys.executable)
    if hosts is None:
        return [check_local(timeout=timeout)]
    from ffctl.hosts.ssh.remote import SSHError, SSHTransport

    try:
        entries = parse_hostfile(hosts)
    except HostfileError as exc:
        raise BadInput(str(exc)) from None
    transports = []
    try:
        for entry in entries:
            try:
                transports.append(SSHTransport(entry, accept_new_host_keys=accept_new_host_keys,
                                               connect_timeout=connect_timeout))
            except SSHError as exc:  # an unreadable ssh config is the user's to fix
                raise BadInput(str(exc)) from None
        return check_hosts(transports, timeout=timeout, python=python)
    finally:
        for transport in transports:
            transport.close()


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor(
        hosts: Annotated[Optional[Path], typer.Option("--hosts", help="Hostfile (default: check this machine).")] = None,
        accept_new_host_keys: Annotated[bool, typer.Option("--accept-new-host-keys", help="Trust and save host keys not yet in known_hosts.")] = False,
        remote_python: Annotated[str, typer.Option("--remote-python", help="Python the agents would run with on the hosts.")] = "python3",
        timeout: Annotated[float, typer.Option("--timeout", help="Seconds each check may take on a host.")] = 15.0,
        backend: Annotated[Optional[str], typer.Option("--backend", help="slurm: check every node of the Slurm allocation this runs in (each check a job step).")] = None,
        script: Annotated[Optional[Path], typer.Option("--script", help="Also check the timeouts that decide how soon a failure of this training script is noticed (its process-group timeout, TORCH_NCCL_* settings, ffctl's heartbeat and hang limits) for inversions and detection over a minute.")] = None,
        hang_timeout: Annotated[float, typer.Option("--hang-timeout", help="With --script: the launch's --hang-timeout.")] = 5.0,
        heartbeat_timeout: Annotated[float, typer.Option("--heartbeat-timeout", help="With --script: the launch's --heartbeat-timeout.")] = 1.0,
    ) -> int:
        """Check that hosts can run ffctl jobs (python, torch, ffctl) and which faults they can take."""
        found = timeouts_of(script, hang_timeout, heartbeat_timeout) if script is not None else None
        reports = diagnose(hosts, accept_new_host_keys=accept_new_host_keys, python=remote_python,
                           timeout=timeout, backend=backend)
        console = make_console()
        render_doctor(reports, console)
        if found is not None:
            for line in found or ["none inverted, and every failure is noticed within a minute"]:
                console.print(f"timeouts: {line}", markup=False, highlight=False)
        return EXIT_OK if all(r.can_run_job for r in reports) else EXIT_INFRA


def timeouts_of(script: Path, hang_s: float, heartbeat_s: float) -> list[str]:
    """What `ffctl launch SCRIPT` would say of its timeouts (ffctl.launch.timeouts)."""
    from ffctl.controller.script import uses_recovery_library
    from ffctl.launch.launch_plan import timeout_findings
    from ffctl.launch_spec import LaunchSpec, SpecError

    spec = LaunchSpec(nnodes=1, nproc_per_node=1, script=(str(script),), hang_min_s=hang_s,
                      heartbeat_timeout=heartbeat_s)
    try:
        spec.validate()
    except SpecError as exc:
        raise BadInput(str(exc)) from None
    return timeout_findings(spec, plain=not uses_recovery_library(spec.script))

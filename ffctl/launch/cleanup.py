"""`ffctl inject revert --all`: remove every rule, qdisc, downed link, dead man's switch and sandbox
namespace ffctl left, on this machine and on the hosts of a hostfile, whatever the records say;
on a host with the Slurm client, resume the Slurm nodes a kill-node drain=yes left drained.

Everything is found by owner tag (see `fault_injectors.revert`), so this works after a crash,
a SIGKILLed controller or a cut SSH connection. Per host it runs `revert_all`; on this machine
it also sweeps inside every sandbox namespace, then removes the namespaces, veths and bridges.
With `--run ID` it keeps to one run: that run's switches are fired and its sandbox is swept and
removed, and other runs (a sandbox another launch is using) are left alone.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from fault_injectors.node import resume_argv
from fault_injectors.plan import HostCommand
from fault_injectors.revert import RevertError, Sweep, removed_lines, revert_all_plan, run_steps, sweep_of
from fault_injectors.transport import LocalTransport, Transport, TransportError
from ffctl.exits import BadInput, InfraError

if TYPE_CHECKING:
    from ffctl.hosts.hostfile import HostEntry

LOCAL = "localhost"


def _sandbox_prefix(run_id: str | None) -> str:
    from ffctl.backends.netns import NS_PREFIX, short_id

    return NS_PREFIX if run_id is None else f"{NS_PREFIX}{short_id(run_id)}-"


def _hosts(hostfile: Path | None) -> list[HostEntry]:
    if hostfile is None:
        return []
    from ffctl.hosts.hostfile import HostfileError, parse_hostfile

    try:
        return list(parse_hostfile(hostfile))
    except HostfileError as exc:
        raise BadInput(str(exc)) from None


@dataclass(frozen=True)
class Place:
    """One place to clean: this machine, one of its sandbox namespaces, or a host over SSH."""

    name: str  # as the user reads it: localhost, a namespace, a host
    host: str
    netns: str | None
    entry: HostEntry | None  # the hostfile's entry of a remote host
    commands: tuple[HostCommand, ...]  # what runs there


@dataclass(frozen=True)
class RevertPlan:
    """Everything `revert --all` will do, worked out before any of it is done (as `launch`)."""

    run_id: str | None
    places: tuple[Place, ...]
    sandbox_prefix: str
    namespaces: tuple[str, ...]
    drained: tuple[str, ...] = ()  # Slurm nodes drained by ffctl (their reason says so)

    @property
    def removes_sandbox(self) -> bool:
        # Scoped to a run, only a sandbox that exists is that run's to remove.
        return bool(self.namespaces) or self.run_id is None

    def describe(self) -> list[str]:
        lines = [str(c) for place in self.places for c in place.commands]
        lines += [f"[{LOCAL}] {shlex.join(resume_argv(n))}" for n in self.drained]
        if self.namespaces:
            lines.append(f"[{LOCAL}] remove namespaces {', '.join(self.namespaces)} and the links tagged "
                         f"ffctl-sandbox:{self.sandbox_prefix}")
        return lines


def _commands(host: str, netns: str | None, run_id: str | None) -> tuple[HostCommand, ...]:
    """Scoped to one run, fire that run's switches (each reverts its own fault), remove its shared
    memory if it is dead and leave other runs' rules alone; otherwise remove everything ffctl's
    owner tags mark."""
    plan = revert_all_plan(host, netns, run_id)
    if run_id is not None and netns is None:
        plan = [c for c in plan if sweep_of(c) in (Sweep.DEADMEN, Sweep.SHM)]
    return tuple(plan)


def plan_revert(hostfile: Path | None, run_id: str | None = None) -> RevertPlan:
    """Find what to clean (this machine, its sandbox namespaces, the hostfile's hosts) and how."""
    from ffctl.backends.netns import list_namespaces
    from runs.store import RunStoreError, validate_run_id

    if run_id is not None:
        # The id becomes owner tags, pkill patterns and namespace prefixes: only a valid one.
        try:
            validate_run_id(run_id)
        except RunStoreError as exc:
            raise BadInput(f"--run: {exc}") from None
    prefix = _sandbox_prefix(run_id)
    namespaces = tuple(list_namespaces(prefix))
    places = [Place(LOCAL, LOCAL, None, None, _commands(LOCAL, None, run_id))]
    # Rules and qdiscs inside a namespace go with it too; swept first so that a namespace some
    # process still pins is clean all the same.
    places += [Place(ns, LOCAL, ns, None, tuple(c for c in revert_all_plan(LOCAL, ns, run_id) if c.netns))
               for ns in namespaces]
    places += [Place(e.name, e.name, None, e, _commands(e.name, None, run_id)) for e in _hosts(hostfile)]
    from ffctl.backends.slurm_cluster import drained_here

    return RevertPlan(run_id, tuple(places), prefix, namespaces, drained_here(run_id))


def _run_place(place: Place, transport_for: Callable[[HostCommand], Transport]) -> list[str]:
    """Every command runs even when one fails; then RevertError names the first failure. Returns
    what the steps say they removed."""
    where = place.host + (f" (netns {place.netns})" if place.netns else "")
    results = run_steps(place.commands, transport_for, where)
    return [line for cmd, result in zip(place.commands, results) for line in removed_lines(cmd, result)]


def _outcome(name: str, removed: list[str]) -> str:
    """One line per place: what was removed there, or `clean`."""
    return f"{name}: " + ("; ".join(removed) if removed else "clean")


def execute_revert(plan: RevertPlan) -> list[str]:
    """Carry out `plan`, every place even when one fails; one line per place cleaned. Raises
    InfraError naming the first place that could not be cleaned."""
    from ffctl.backends.netns import SandboxError, cleanup_stale

    lines: list[str] = []
    failures: list[str] = []
    for place in plan.places:
        if place.entry is None:
            try:
                removed = _run_place(place, lambda cmd: LocalTransport(LOCAL, cmd.netns))
                if place.netns is None:
                    lines.append(_outcome(place.name, removed))
            except (RevertError, TransportError) as exc:
                failures.append(str(exc))
            continue
        from ffctl.hosts.ssh.remote import SSHTransport

        ssh = SSHTransport(place.entry)
        try:
            lines.append(_outcome(place.name, _run_place(place, lambda cmd: ssh)))
        except (RevertError, TransportError) as exc:
            failures.append(str(exc))
        finally:
            ssh.close()
    if plan.drained:
        resumed = []
        for node in plan.drained:
            out = LocalTransport(LOCAL, None).run(resume_argv(node), timeout=60.0)
            if out.ok:
                resumed.append(node)
            else:
                failures.append(f"on {LOCAL}: cannot resume Slurm node {node}: {out.describe()}")
        if resumed:
            lines.append(f"{LOCAL}: resumed Slurm node(s) {', '.join(resumed)} (drained by ffctl)")
    if plan.removes_sandbox:
        try:
            removed = cleanup_stale(plan.sandbox_prefix)
            lines.append(f"{LOCAL}: sandbox " + (f"removed {', '.join(removed)}" if removed else "nothing to remove"))
        except SandboxError as exc:
            if plan.namespaces:
                failures.append(f"on {LOCAL}: {exc}")
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise InfraError(failures[0] + more)
    return lines


def revert_everything(hostfile: Path | None, dry_run: bool, run_id: str | None = None) -> list[str]:
    """Plan, then (unless `dry_run`, which returns the plan's lines) remove what ffctl left."""
    plan = plan_revert(hostfile, run_id)
    return plan.describe() if dry_run else execute_revert(plan)

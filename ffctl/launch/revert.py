"""`ffctl inject revert --all`: remove every rule, qdisc, downed link, dead man's switch and sandbox
namespace ffctl left, on this machine and on the hosts of a hostfile, whatever the records say.

Everything is found by owner tag (see `fault_injectors.revert`), so this works after a crash,
a SIGKILLed controller or a cut SSH connection. Per host it runs `revert_all`; on this machine
it also sweeps inside every sandbox namespace, then removes the namespaces, veths and bridges.
With `--run ID` it keeps to one run: that run's switches are fired and its sandbox is swept and
removed, and other runs (a sandbox another launch is using) are left alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from fault_injectors.plan import HostCommand
from fault_injectors.revert import FIRE_DEADMEN, RevertError, revert_all, revert_all_plan
from fault_injectors.transport import LocalTransport, Transport, TransportError
from ffctl.errors import BadInput, InfraError

if TYPE_CHECKING:
    from ffctl.hosts.hostfile import HostEntry

LOCAL = "localhost"


def _local(cmd: HostCommand) -> Transport:
    return LocalTransport(LOCAL, cmd.netns)


def _sandbox_prefix(run_id: str | None) -> str:
    from ffctl.launch.sandbox import NS_PREFIX, short_id

    return NS_PREFIX if run_id is None else f"{NS_PREFIX}{short_id(run_id)}-"


def _hosts(hostfile: Path | None) -> list[HostEntry]:
    if hostfile is None:
        return []
    from ffctl.hosts.hostfile import HostfileError, parse_hostfile

    try:
        return list(parse_hostfile(hostfile))
    except HostfileError as exc:
        raise BadInput(str(exc)) from None


def _sweep(where: str, transport_for: Callable[[HostCommand], Transport], host: str, netns: str | None,
           run_id: str | None, scoped: bool) -> None:
    if scoped:
        # One run: fire its switches (each reverts its own fault); leave other runs' rules alone.
        fire = [c for c in revert_all_plan(host, netns, run_id) if c.argv[2] == FIRE_DEADMEN]
        for cmd in fire:
            result = transport_for(cmd).run(cmd.argv, timeout=60.0)
            if not result.ok:
                raise RevertError(f"on {where}: firing dead man's switches failed: {result.describe()}")
        return
    revert_all(host, transport_for, netns=netns, run_id=run_id)


def revert_everything(hostfile: Path | None, dry_run: bool, run_id: str | None = None) -> list[str]:
    """Remove what ffctl left; returns one line per place swept. Raises InfraError naming the
    first place that could not be cleaned (after trying every place)."""
    from ffctl.launch.sandbox import SandboxError, cleanup_stale, list_namespaces
    from runs.store import RunStoreError, validate_run_id

    if run_id is not None:
        # The id becomes owner tags, pkill patterns and namespace prefixes: only a valid one.
        try:
            validate_run_id(run_id)
        except RunStoreError as exc:
            raise BadInput(f"--run: {exc}") from None
    prefix = _sandbox_prefix(run_id)
    namespaces = list_namespaces(prefix)
    hosts = _hosts(hostfile)
    scoped = run_id is not None
    if dry_run:
        lines = [str(c) for c in revert_all_plan(LOCAL, None, run_id)
                 if not scoped or c.argv[2] == FIRE_DEADMEN]
        for ns in namespaces:
            lines += [str(c) for c in revert_all_plan(LOCAL, ns, run_id) if c.netns]
        if namespaces:
            lines.append(f"[{LOCAL}] remove namespaces {', '.join(namespaces)} and the links tagged "
                         f"ffctl-sandbox:{prefix}")
        for entry in hosts:
            lines += [str(c) for c in revert_all_plan(entry.name, None, run_id) if not scoped or c.argv[2] == FIRE_DEADMEN]
        return lines
    lines: list[str] = []
    failures: list[str] = []
    try:
        _sweep(LOCAL, _local, LOCAL, None, run_id, scoped)
        lines.append(f"{LOCAL}: clean")
    except RevertError as exc:
        failures.append(str(exc))
    for ns in namespaces:
        try:
            # Rules and qdiscs inside go with the namespace too; swept first so that a namespace
            # some process still pins is clean all the same.
            revert_all(LOCAL, _local, netns=ns, run_id=run_id)
        except RevertError as exc:
            failures.append(str(exc))
    if namespaces or not scoped:
        try:
            removed = cleanup_stale(prefix)
            lines.append(f"{LOCAL}: sandbox " + (f"removed {', '.join(removed)}" if removed else "nothing to remove"))
        except SandboxError as exc:
            if namespaces:
                failures.append(f"on {LOCAL}: {exc}")
    for entry in hosts:
        from ffctl.hosts.ssh.transport import SSHTransport

        name = entry.name
        transport = SSHTransport(entry)
        try:
            _sweep(name, lambda cmd, t=transport: t, name, None, run_id, scoped)
            lines.append(f"{name}: clean")
        except (RevertError, TransportError) as exc:
            failures.append(str(exc))
        finally:
            transport.close()
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise InfraError(failures[0] + more)
    return lines

"""Node backends: how a job's nodes run, one module per backend, behind one protocol.

`protocol` holds the protocol every backend implements (`NodeBackend`, what the controller calls;
`LaunchBackend`, what the launch drives) and is all the controller imports from here. `local`
(agents as subprocesses on this machine), `netns` (the same, one network namespace per node),
`ssh` (one agent per hostfile host) and `slurm` (one agent step per node of an allocation) are
the backends; `process` is the stop sequence every local child process gets. `BACKENDS` is the
launch's map of backend names to their factories, the only place a backend is picked by name;
each factory imports its module when called, so naming a backend loads only its own
dependencies (paramiko only for `ssh`). May import `ffctl.agent` (the agent's config) and
`ffctl.hosts`; never the controller, the launch, the CLI or rendering.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ffctl.backends.protocol import LaunchBackend
    from ffctl.launch_spec import LaunchSpec

LOCAL = "local"
NETNS = "netns"
SSH = "ssh"
SLURM = "slurm"


def _local(spec: LaunchSpec, run_id: str) -> LaunchBackend:
    from ffctl.backends.local import LocalNodes

    return LocalNodes.for_launch(spec, run_id)


def _netns(spec: LaunchSpec, run_id: str) -> LaunchBackend:
    from ffctl.backends.netns import SandboxNodes

    return SandboxNodes.for_launch(spec, run_id)


def _ssh(spec: LaunchSpec, run_id: str) -> LaunchBackend:
    from ffctl.backends.ssh import SSHNodes

    return SSHNodes.for_launch(spec, run_id)


def _slurm(spec: LaunchSpec, run_id: str) -> LaunchBackend:
    from ffctl.backends.slurm import SlurmNodes

    return SlurmNodes.for_launch(spec, run_id)


# Each way of running nodes, by name. A factory builds and connects nothing (the dry run asks
# the backend it makes what it would run); a new backend is one module and one line here.
BACKENDS: dict[str, Callable[[LaunchSpec, str], LaunchBackend]] = {
    LOCAL: _local, NETNS: _netns, SSH: _ssh, SLURM: _slurm,
}


# Backends whose jobs a scheduler may requeue after a failure: for them a run that trained no
# step exits 4 ("do not requeue", `ffctl.exits.EXIT_NO_REQUEUE`).
REQUEUED = frozenset({SLURM})


def backend_name(spec: LaunchSpec) -> str:
    """The backend a launch spec asks for: `--hosts` is SSH, `--backend slurm` Slurm, else the
    sandbox's (`--sandbox netns`) or local processes."""
    if spec.hostfile is not None:
        return SSH
    if spec.backend == SLURM:
        return SLURM
    return spec.sandbox or LOCAL

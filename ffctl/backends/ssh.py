"""The SSH node backend (`--hosts FILE`): the hostfile's hosts as nodes, one agent per host.

`SSHNodes` implements `ffctl.backends.protocol.LaunchBackend`: `prepare` checks every host
(`ffctl.hosts.ssh.preflight`) before anything starts anywhere, `release` brings the logs home.
Each agent is started with `SSHTransport.start` (`ffctl.hosts.ssh.remote`, the only paramiko
user), its `AgentConfig` (job token included) going in the environment sent over the channel,
never on a command line. The agent lives in its own process group on the host; when the channel
closes (the run ends, the controller is interrupted or killed, the connection drops) the remote
wrapper sends that group SIGTERM and later SIGKILL, so the agent and every rank and spare it
started go with it.

Remote files live in a per-run directory on each host (default ``/tmp/ffctl-runs/<run_id>``),
made 0700 and only inside a runs root that is a directory of the SSH user's no other user can
write (``MAKE_RUN_DIR``): the agent's logs (``logs/<node>/``) and, for ``--recovery
restart-disk``, the disk checkpoints of the ranks on that host. Logs are copied back into the
run record's ``logs/<node>/`` when the run ends, then the remote directory is removed. Because
checkpoints stay on the host that wrote them, restart-disk across hosts needs that directory on a
shared filesystem (give ``--remote-runs-dir`` a path every host mounts) or the failed node's ranks
back on the same host.
"""
from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Sequence

from fault_injectors.plan import HostCommand
from fault_injectors.revert import SHM_SWEEP
from fault_injectors.transport import CommandResult, LocalTransport, Transport, TransportError
from ffctl.agent.config import CONFIG_ENV, TERM_GRACE_S, AgentConfig, agent_argv
from ffctl.backends.protocol import AgentLaunch
from ffctl.exits import BadInput, InfraError
from ffctl.hosts.hostfile import HostEntry
from ffctl.hosts.ssh.preflight import PROBE_TIMEOUT_S, HostSetup, check_master_addr, controller_address, hosts_spec, preflight
from ffctl.hosts.ssh.remote import RemoteProcess, SSHTransport
from ffctl.launch_spec import LaunchSpec
from runs.shm import SHM_ROOT
from runs.store import RunStore

DEFAULT_REMOTE_RUNS_DIR = "/tmp/ffctl-runs"
# The wrapper's SIGKILL comes this long after its SIGTERM: the agent's own shutdown (SIGTERM to
# its workers, TERM_GRACE_S, SIGKILL) must fit inside it so it can also remove its slots.
REMOTE_GRACE_S = TERM_GRACE_S + 5.0


# $1 the remote runs root, $2 the run's directory in it, $3 the node's log directory in that. The
# root may hold other runs (`/tmp/ffctl-runs`) but must be a directory of ours that no other user
# can write: in one they could write to, they could put a symlink or a directory of their own
# where the run's directory goes and read or redirect its logs and checkpoints. Everything made
# here is 0700 (umask).
MAKE_RUN_DIR = r"""umask 077
mkdir -p -- "$1" || exit 1
[ -d "$1" ] && [ ! -L "$1" ] || { echo "$1 is not a directory (a symlink?)"; exit 1; }
[ -O "$1" ] || { echo "$1 belongs to another user: give --remote-runs-dir a directory of your own"; exit 1; }
case $(stat -c %A -- "$1") in
  ?????w????|????????w?) echo "$1 is writable by other users: chmod go-w it, or give --remote-runs-dir"; exit 1 ;;
esac
mkdir -p -- "$3" && [ -d "$2" ] && [ ! -L "$2" ] && [ -O "$2" ] && chmod 700 -- "$2" ||
  { echo "cannot make $2 a private directory"; exit 1; }
"""


# --------------------------------------------------------------------------------------------
# the launcher


class _Guarded:
    """A transport whose failures are values: the injector treats a failed command as a failed
    fault, never as a controller crash, even when the host's connection is gone."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.host = inner.host

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        try:
            return self.inner.run(argv, timeout=timeout, input=input)
        except TransportError as exc:
            return CommandResult(tuple(argv), 255, "", str(exc))

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        try:
            self.inner.spawn_detached(argv, timeout=timeout)
        except TransportError as exc:
            raise OSError(str(exc)) from None


class SSHNodeProcess:
    """The controller's handle on a remote agent; its output goes to ``agent-<node>.log`` here."""

    def __init__(self, proc: RemoteProcess, log: IO[str]) -> None:
        self.proc = proc
        self.pid = proc.remote_pid or 0
        self._log = log
        self._pump = threading.Thread(target=self._copy_output, name=f"ffctl-agent-log-{proc.host}", daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        while not self.proc.output_closed:
            line = self.proc.read_line(0.5)
            if line is not None:
                try:
                    self._log.write(line.text + "\n")
                    self._log.flush()
                except (OSError, ValueError):
                    pass

    def poll(self) -> int | None:
        return self.proc.poll()

    def running_here(self) -> bool:
        return False  # on another host, across a link: its silence is all we have

    def stop(self, timeout: float) -> None:
        # Closing our end of the channel makes the host's wrapper SIGTERM the agent's process
        # group (agent, ranks, spares), then SIGKILL it REMOTE_GRACE_S later.
        if self.proc.terminate(max(timeout, REMOTE_GRACE_S + 2.0)) is None:
            self.proc.close()
        self._pump.join(timeout=2.0)
        self._log.close()


class SSHNodes:
    """One node per hostfile host: the node backend over SSH (see the module docstring)."""

    def __init__(self, hosts: Sequence[tuple[SSHTransport, HostSetup]], run_id: str, log_dir: Path | None,
                 remote_runs_dir: str = DEFAULT_REMOTE_RUNS_DIR, python: str | None = None) -> None:
        if not remote_runs_dir.startswith("/"):
            raise BadInput(f"--remote-runs-dir {remote_runs_dir!r}: must be an absolute path")
        self.log_dir = log_dir
        # Where this run's files live on every host; ranks write disk checkpoints under it.
        self.remote_runs_root = remote_runs_dir.rstrip("/") or "/"
        self.run_dir = f"{remote_runs_dir.rstrip('/') or ''}/{run_id}"
        # The interpreter each agent runs as the user named it (`--remote-python`), found on the
        # remote PATH as the preflight found it; None: the path the preflight resolved.
        self.python = python
        self._use(hosts)
        self._prepared: set[int] = set()
        self._spec: LaunchSpec | None = None
        self._entries: list[HostEntry] = []

    def _use(self, hosts: Sequence[tuple[SSHTransport, HostSetup]]) -> None:
        self.transports = [t for t, _ in hosts]
        self.setups = [s for _, s in hosts]
        self._by_name = {t.host: t for t in self.transports}

    @classmethod
    def for_launch(cls, spec: LaunchSpec, run_id: str) -> SSHNodes:
        """The backend of `ffctl launch --hosts`: the hostfile read and `--master-addr` checked
        (bad input, before connecting anywhere); the hosts are checked in `prepare`."""
        spec, entries = hosts_spec(spec)
        if spec.master_addr:
            check_master_addr(spec.master_addr)
        nodes = cls([], run_id, None, spec.remote_runs_dir, python=spec.remote_python)
        nodes._spec, nodes._entries = spec, entries
        return nodes

    # -- the launch's lifecycle -----------------------------------------------------------------
    def prepare(self) -> str:
        """Check every host (nothing is started anywhere before all pass) and return the
        address of this machine the controller's store listens on."""
        assert self._spec is not None, "prepare() needs SSHNodes.for_launch"
        spec = self._spec
        self._use(preflight(self._entries, accept_new_host_keys=spec.accept_new_host_keys,
                            python=spec.remote_python))
        try:
            return controller_address(self.setups, spec.master_addr)
        except BaseException:
            self.close()
            raise

    def attach(self, record: RunStore) -> None:
        self.log_dir = record.path / "logs"

    def release(self, record: RunStore | None) -> None:
        """Logs home, the hosts' run directories gone, connections closed, however it ended."""
        if record is None:
            self.close()
            return
        problems = self.finish(record.path)
        if problems:
            record.update_run_info(log_copy_problems=problems)

    def agent_launch(self, node: int) -> AgentLaunch:
        python = self.python or self.setups[node].python
        return AgentLaunch(node, tuple(agent_argv(python)), f"over SSH on {self.host(node)}")

    def scheduled_hosts(self) -> list[str] | None:
        return None  # the hostfile's hosts: the record stays here, their logs are copied home

    def plan_notes(self, spec: LaunchSpec) -> list[str]:
        return []

    def admit(self, requeue_bound: int) -> None:
        """No scheduler requeues hosts reached over SSH."""

    # -- NodeBackend ----------------------------------------------------------------------------
    def host(self, node: int) -> str:
        # Before `prepare` (the dry run), the hostfile's names: the same ones.
        return self.setups[node].entry.name if self.setups else self._entries[node].name

    def address(self, node: int) -> str:
        return self.setups[node].address

    def interface(self, node: int) -> str | None:
        return self.setups[node].interface

    def netns(self, node: int) -> str | None:
        return None

    def has_gpu(self) -> bool:
        # The hosts' devices are not probed before a run: GPU faults run emulated there.
        return False

    def spare_nodes(self) -> int:
        return 0  # a lost node comes back on its own host (the hostfile names no spare hosts)

    def sweep(self, run_id: str, nodes: Sequence[int]) -> None:
        """Each host's wrapper ends its agent's process group when the channel closes, and the
        agent removes the run's shared memory on the way out; an agent killed with its node
        cannot, so the run's shared memory no live process holds is removed on every host."""
        for transport in self.transports:
            try:
                transport.run(["sh", "-c", SHM_SWEEP, "sh", SHM_ROOT, run_id], timeout=PROBE_TIMEOUT_S)
            except TransportError:
                continue  # a host gone: `ffctl inject revert --all --hosts` sweeps it later

    def clock_offset(self, node: int) -> float | None:
        """The host's clock minus ours, measured before the run (None: not measurable)."""
        return self.setups[node].clock_offset_s

    def remote_log_dir(self, node: int) -> str:
        return f"{self.run_dir}/logs/{node}"

    def start(self, cfg: AgentConfig) -> SSHNodeProcess:
        node = cfg.node
        transport, setup = self.transports[node], self.setups[node]
        argv = list(cfg.worker_argv)
        if argv and argv[0] != "-m" and not os.path.isabs(argv[0]):
            # A user script must be at the same path on every host (shared or deployed).
            argv[0] = os.path.join(cfg.cwd or os.getcwd(), argv[0])
        remote = replace(cfg, log_dir=self.remote_log_dir(node), cwd=self.run_dir, python=setup.python,
                         worker_argv=tuple(argv))
        if self.log_dir is None:
            raise RuntimeError("SSHNodes.start before attach(): no log directory")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"agent-{node}.log", "a", encoding="utf-8")
        try:
            if node not in self._prepared:
                made = transport.run(["sh", "-c", MAKE_RUN_DIR, "sh", self.remote_runs_root, self.run_dir,
                                      self.remote_log_dir(node)], timeout=PROBE_TIMEOUT_S)
                if not made.ok:
                    raise InfraError(f"{setup.entry.name}: cannot create {self.remote_log_dir(node)}: "
                                     f"{made.describe()}")
                self._prepared.add(node)
            proc = transport.start(self.agent_launch(node).argv, {CONFIG_ENV: remote.to_json()},
                                   cwd=self.run_dir, grace_s=REMOTE_GRACE_S, timeout=PROBE_TIMEOUT_S)
        except TransportError as exc:
            # E.g. the host went away and does not come back for a restart: one line, exit 3.
            log.close()
            raise InfraError(f"{' '.join(str(exc).split())} (starting the agent of node {node})") from None
        except BaseException:
            log.close()
            raise
        return SSHNodeProcess(proc, log)

    # -- faults ---------------------------------------------------------------------------------
    def transport_for(self, cmd: HostCommand) -> Transport:
        """The injector's way to a host: that host's SSH connection (its commands' host is the
        hostfile name); anything else is this machine."""
        inner = self._by_name.get(cmd.host)
        if inner is None:
            return LocalTransport(cmd.host, cmd.netns)
        return _Guarded(inner)

    # -- the end of the run ---------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"host_details": [{**s.describe(), "remote_run_dir": self.run_dir} for s in self.setups]}

    def collect_logs(self, dest: Path) -> list[str]:
        """Copy every host's ``logs/<node>/`` into ``dest/<node>/``; problems, one line each."""
        problems: list[str] = []
        for node, transport in enumerate(self.transports):
            remote = self.remote_log_dir(node)
            try:
                listing = transport.run(["sh", "-c", 'cd -- "$1" 2>/dev/null && ls -1A', "sh", remote],
                                        timeout=PROBE_TIMEOUT_S)
                names = [n for n in listing.stdout.splitlines() if n and "/" not in n]
                local = dest / str(node)
                local.mkdir(parents=True, exist_ok=True)
                for name in names:
                    transport.get_file(f"{remote}/{name}", local / name)
            except TransportError as exc:
                problems.append(" ".join(str(exc).split()))
        return problems

    def remove_remote(self) -> None:
        """Delete this run's directory on every host (after `collect_logs`)."""
        for transport in self.transports:
            try:
                transport.run(["rm", "-rf", "--", self.run_dir], timeout=PROBE_TIMEOUT_S)
            except TransportError:
                pass

    def close(self) -> None:
        for transport in self.transports:
            transport.close()

    def finish(self, record_path: Path) -> list[str]:
        """After the controller: logs home, remote files gone, connections closed."""
        problems: list[str] = []
        try:
            same = os.path.realpath(self.run_dir) == os.path.realpath(record_path)
            if not same:  # a run dir on a shared filesystem is the record already
                problems = self.collect_logs(record_path / "logs")
                self.remove_remote()
        finally:
            self.close()
        return problems

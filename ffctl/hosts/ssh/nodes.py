"""Multi-host runs over SSH: the hostfile's hosts as nodes, one agent per host.

`hosts_spec` turns a hostfile into the node count and ranks per node of a `LaunchSpec`.
`preflight` asks every host, in parallel and before anything is started anywhere, whether it can
take an agent: SSH works (reachable, known host key, accepted key), the remote python imports
ffctl and torch, which address and interface the host is reached on (its agent and ranks listen
there; gloo is pinned to that interface) and how far its clock is from ours (NTP-style, the
midpoint of the round trip). The first host that fails gives one line naming it and the exit
code says whose problem it is (2: the hostfile, a host key or a refused login key; 3: a host
that cannot be reached or cannot run ffctl).

`SSHNodes` is the node backend of such a run (`ffctl.controller.backend.NodeBackend`, and the
launch's lifecycle: `prepare` checks the hosts, `release` brings the logs home). Each agent is started with
`SSHTransport.start`, its `AgentConfig` (job token included) going in the environment sent over
the channel, never on a command line. The agent lives in its own process group on the host;
when the channel closes (the run ends, the controller is interrupted or killed, the connection
drops) the remote wrapper sends that group SIGTERM and later SIGKILL, so the agent and every
rank and spare it started go with it.

Remote files live in a per-run directory on each host (default ``/tmp/ffctl-runs/<run_id>``),
made 0700 and only inside a runs root that is a directory of the SSH user's no other user can
write (``MAKE_RUN_DIR``): the agent's logs (``logs/<node>/``) and, for ``--recovery
restart-disk``, the disk checkpoints of the ranks on that host. Logs are copied back into the run record's ``logs/<node>/`` when the
run ends, then the remote directory is removed. Because checkpoints stay on the host that wrote
them, restart-disk across hosts needs that directory on a shared filesystem (give
``--remote-runs-dir`` a path every host mounts) or the failed node's ranks back on the same host.
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from fault_injectors.plan import HostCommand
from fault_injectors.revert import SHM_SWEEP
from fault_injectors.transport import CommandResult, LocalTransport, Transport, TransportError
from ffctl import __version__
from ffctl.agent.config import CONFIG_ENV, TERM_GRACE_S, AgentConfig, agent_argv
from ffctl.hosts.doctor import clock_offset
from ffctl.errors import BadInput, InfraError
from ffctl.hosts.hostfile import HostEntry, HostfileError, parse_hostfile
from ffctl.spec import LaunchSpec
from ffctl.hosts.ssh.transport import (
    AuthFailed,
    HostKeyChanged,
    HostKeyUnknown,
    RemoteCommandMissing,
    RemoteProcess,
    SSHError,
    SSHTransport,
    require_command,
)
from runs.shm import SHM_ROOT
from runs.store import RunStore

DEFAULT_REMOTE_RUNS_DIR = "/tmp/ffctl-runs"
PROBE_TIMEOUT_S = 30.0
# The wrapper's SIGKILL comes this long after its SIGTERM: the agent's own shutdown (SIGTERM to
# its workers, TERM_GRACE_S, SIGKILL) must fit inside it so it can also remove its slots.
REMOTE_GRACE_S = TERM_GRACE_S + 5.0

# Prints the interpreter's path and ffctl's version (a JSON line); fails (with the ImportError as its last
# line) when ffctl or torch cannot be imported by that python.
_IMPORT_PROBE = "import json, sys, ffctl, torch; print(json.dumps([sys.executable, ffctl.__version__]))"

# Where the host was reached (SSH_CONNECTION: client ip, client port, server ip, server port)
# and its addresses. `ip` often lives in sbin, missing from a non-root user's PATH.
_NET_PROBE = r"""printf 'conn=%s\n' "$SSH_CONNECTION"
for ip in ip /usr/sbin/ip /sbin/ip; do
  if command -v "$ip" >/dev/null 2>&1; then exec "$ip" -o addr show; fi
done
echo 'ip: command not found' >&2
exit 127
"""


# --------------------------------------------------------------------------------------------
# the hostfile as nodes


def hosts_spec(spec: LaunchSpec) -> tuple[LaunchSpec, list[HostEntry]]:
    """The spec with one node per host and the hosts' `slots=` as ranks per node.

    Hosts without ``slots=`` take ``--nproc-per-node``. Every host must end up with the same
    count (the rank layout is node-major and equal-sized); anything else is bad input.
    """
    assert spec.hostfile is not None
    if spec.sandbox:
        raise BadInput(f"--sandbox {spec.sandbox} and --hosts {spec.hostfile}: the sandbox is for nodes on this "
                       "machine; give one or the other")
    try:
        entries = parse_hostfile(spec.hostfile)
    except HostfileError as exc:
        raise BadInput(str(exc)) from None
    counts = {e.name if e.port is None else f"{e.name}:{e.port}": e.slots or spec.nproc_per_node for e in entries}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name} {count}" for name, count in counts.items())
        raise BadInput(
            f"{spec.hostfile}: hosts have unequal slots ({listed}); every host must run the same "
            "number of ranks"
        )
    nproc = next(iter(counts.values()))
    return replace(spec, nnodes=len(entries), nproc_per_node=nproc), entries


# --------------------------------------------------------------------------------------------
# checking the hosts before anything starts


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


@dataclass(frozen=True)
class HostSetup:
    """What the launch learned about one host before starting its agent."""

    node: int
    entry: HostEntry
    python: str  # the remote interpreter's full path
    ffctl_version: str
    address: str  # the host's address SSH reached; its agent and ranks listen there
    interface: str  # the interface that address is on (GLOO_SOCKET_IFNAME)
    seen_controller: str  # this machine's address as the host sees it
    clock_offset_s: float | None  # host clock minus controller clock
    clock_rtt_s: float | None  # round trip of that measurement (its error is at most half)

    def describe(self) -> dict[str, Any]:
        return {
            "node": self.node, "host": self.entry.name, "ssh": self.entry.target, "address": self.address,
            "interface": self.interface, "python": self.python, "ffctl": self.ffctl_version,
            "clock_offset_s": self.clock_offset_s, "clock_rtt_s": self.clock_rtt_s,
        }


def _bad_input(exc: SSHError) -> bool:
    # The user can fix these in their own files (known_hosts, keys, ssh config); an unreachable
    # host or one without ffctl is the infrastructure's problem.
    return isinstance(exc, (HostKeyUnknown, HostKeyChanged, AuthFailed))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _plain_address(text: str) -> str:
    addr = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def parse_net_probe(host: str, output: str) -> tuple[str, str, str]:
    """(host address, its interface, controller address as seen there) from `_NET_PROBE`."""
    conn = ""
    addresses: dict[str, str] = {}
    for line in output.splitlines():
        if line.startswith("conn="):
            conn = line[5:].strip()
            continue
        words = line.split()
        # `2: eth0    inet 10.0.0.2/24 brd ... scope global eth0\ ...`
        if len(words) >= 4 and words[2] in ("inet", "inet6"):
            try:
                addresses[_plain_address(words[3].split("/", 1)[0])] = words[1].split("@", 1)[0].rstrip(":")
            except ValueError:
                continue
    parts = conn.split()
    if len(parts) != 4:
        raise InfraError(f"{host}: cannot tell which address SSH reached (no SSH_CONNECTION in the session)")
    try:
        client, server = _plain_address(parts[0]), _plain_address(parts[2])
    except ValueError:
        raise InfraError(f"{host}: cannot read SSH_CONNECTION {conn!r}") from None
    interface = addresses.get(server)
    if interface is None:
        raise InfraError(
            f"{host}: the address SSH reached ({server}) is on none of its interfaces (NAT or a port "
            "forward?); its ranks need an address the other hosts can reach"
        )
    return server, interface, client


def _check_host(node: int, transport: SSHTransport, python: str, timeout: float) -> HostSetup:
    host = transport.host
    transport.connect()  # unreachable, host key and login errors surface here
    try:
        probe = require_command(transport, [python, "-c", _IMPORT_PROBE], timeout=timeout, what=python)
    except RemoteCommandMissing:
        raise InfraError(
            f"{host}: {python} is not installed there (ffctl needs python with torch and ffctl on every host)"
        ) from None
    if not probe.ok:
        why = _last_line(probe.stderr) or probe.describe()
        raise InfraError(f"{host}: ffctl cannot run there: `{python}` fails to import torch and ffctl ({why})")
    try:
        exe, version = (str(v) for v in json.loads(probe.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        answer = probe.stdout.strip()[-200:]
        raise InfraError(f"{host}: `{python}` gave no answer to the ffctl probe: {answer!r}") from None
    if version != __version__:
        # Agents and the controller speak one protocol: mixed versions would fail mid-run.
        raise InfraError(f"{host}: ffctl {version} is installed there, {__version__} here; install the same "
                         "version on every host")
    net = transport.run(["sh", "-c", _NET_PROBE], timeout=timeout)
    if net.returncode == 127:
        raise InfraError(f"{host}: `ip` (iproute2) is not installed there; it is needed to find the host's interface")
    if not net.ok:
        raise InfraError(f"{host}: cannot list its addresses: {net.describe()}")
    address, interface, seen = parse_net_probe(host, net.stdout)
    offset, rtt = clock_offset(transport, python=exe or python, timeout=timeout)
    return HostSetup(node, transport.entry, exe or python, version, address, interface, seen, offset, rtt)


def preflight(
    entries: Sequence[HostEntry],
    *,
    accept_new_host_keys: bool = False,
    python: str = "python3",
    connect_timeout: float = 10.0,
    timeout: float = PROBE_TIMEOUT_S,
    make_transport: Callable[[HostEntry], SSHTransport] | None = None,
) -> list[tuple[SSHTransport, HostSetup]]:
    """Check every host at once; return its open transport and setup, in hostfile order.

    On any failure every connection is closed and BadInput or InfraError is raised with one
    line naming the first failing host (in hostfile order); nothing was started anywhere.
    """
    make = make_transport or (
        lambda e: SSHTransport(e, accept_new_host_keys=accept_new_host_keys, connect_timeout=connect_timeout)
    )
    transports: list[SSHTransport] = []
    try:
        for entry in entries:
            try:
                transports.append(make(entry))
            except SSHError as exc:  # e.g. an unreadable ssh config
                raise BadInput(str(exc)) from None

        def check(item: tuple[int, SSHTransport]) -> HostSetup | Exception:
            try:
                return _check_host(item[0], item[1], python, timeout)
            except SSHError as exc:
                return BadInput(str(exc)) if _bad_input(exc) else InfraError(str(exc))
            except (BadInput, InfraError) as exc:
                return exc
            except TransportError as exc:
                return InfraError(" ".join(str(exc).split()))

        with ThreadPoolExecutor(max_workers=min(32, len(transports))) as pool:
            results = list(pool.map(check, enumerate(transports)))
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            first = failures[0]
            if len(failures) > 1:
                first = type(first)(f"{first} (and {len(failures) - 1} more host(s) failed their checks)")
            raise first
        setups = [r for r in results if isinstance(r, HostSetup)]
    except BaseException:
        for t in transports:
            t.close()
        raise
    return list(zip(transports, setups))


def _bindable(address: str) -> bool:
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def _route_source(destination: str) -> str | None:
    """This machine's source address on the route to `destination` (`ip route get`)."""
    try:
        out = subprocess.run(["ip", "route", "get", destination], capture_output=True, text=True,
                             timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = out.split()
    return words[words.index("src") + 1] if "src" in words[:-1] else None


def check_master_addr(master_addr: str) -> str:
    """``--master-addr`` as a plain address of this machine (not a wildcard), else BadInput."""
    try:
        addr = _plain_address(master_addr)
    except ValueError:
        raise BadInput(f"--master-addr {master_addr}: not an IP address") from None
    if ipaddress.ip_address(addr).is_unspecified or not _bindable(addr):
        raise BadInput(f"--master-addr {master_addr}: not an address of this machine")
    return addr


def controller_address(setups: Sequence[HostSetup], master_addr: str | None = None) -> str:
    """The address the controller's store listens on: one of this machine's, reachable by every
    host, never a wildcard. ``master_addr`` (``--master-addr``) wins; otherwise the address the
    first host saw our SSH connection come from, or the source of our route to it."""
    loopback = [s for s in setups if ipaddress.ip_address(s.address).is_loopback]
    if loopback and len(loopback) < len(setups):
        raise BadInput(
            f"{loopback[0].entry.name}: reached over loopback ({loopback[0].address}), where the other hosts "
            "cannot reach its ranks; name it in the hostfile by an address they can reach"
        )
    if master_addr:
        return check_master_addr(master_addr)
    # A host reached over loopback saw 127.0.0.1; the others cannot use that.
    remote = [s for s in setups if not ipaddress.ip_address(s.address).is_loopback] or list(setups)
    first = remote[0]
    for candidate in (first.seen_controller, _route_source(first.address)):
        if candidate and not ipaddress.ip_address(candidate).is_unspecified and _bindable(candidate):
            return candidate
    raise InfraError(
        f"{first.entry.name}: cannot tell which address of this machine it reaches "
        f"(it sees {first.seen_controller}); give --master-addr"
    )


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
                 remote_runs_dir: str = DEFAULT_REMOTE_RUNS_DIR) -> None:
        if not remote_runs_dir.startswith("/"):
            raise BadInput(f"--remote-runs-dir {remote_runs_dir!r}: must be an absolute path")
        self.log_dir = log_dir
        # Where this run's files live on every host; ranks write disk checkpoints under it.
        self.remote_runs_root = remote_runs_dir.rstrip("/") or "/"
        self.run_dir = f"{remote_runs_dir.rstrip('/') or ''}/{run_id}"
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
        nodes = cls([], run_id, None, spec.remote_runs_dir)
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

    # -- NodeBackend ----------------------------------------------------------------------------
    def host(self, node: int) -> str:
        return self.setups[node].entry.name

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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.log_dir is None:
            raise RuntimeError("SSHNodes.start before attach(): no log directory")
        log = open(self.log_dir / f"agent-{node}.log", "a", encoding="utf-8")
        try:
            if node not in self._prepared:
                made = transport.run(["sh", "-c", MAKE_RUN_DIR, "sh", self.remote_runs_root, self.run_dir,
                                      self.remote_log_dir(node)], timeout=PROBE_TIMEOUT_S)
                if not made.ok:
                    raise InfraError(f"{setup.entry.name}: cannot create {self.remote_log_dir(node)}: "
                                     f"{made.describe()}")
                self._prepared.add(node)
            proc = transport.start(agent_argv(setup.python), {CONFIG_ENV: remote.to_json()},
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

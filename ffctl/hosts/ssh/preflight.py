"""Checking the hostfile's hosts before a run over SSH starts anything anywhere.

`hosts_spec` turns a hostfile into the node count and ranks per node of a `LaunchSpec`.
`preflight` asks every host, in parallel and before anything is started anywhere, whether it can
take an agent: SSH works (reachable, known host key, accepted key), the remote python imports
ffctl and torch, which address and interface the host is reached on (its agent and ranks listen
there; gloo is pinned to that interface) and how far its clock is from ours (NTP-style, the
midpoint of the round trip). The first host that fails gives one line naming it and the exit
code says whose problem it is (2: the hostfile, a host key or a refused login key; 3: a host
that cannot be reached or cannot run ffctl). `controller_address` picks the address of this
machine the hosts reach the controller's store on. The SSH node backend that uses all this is
`ffctl.backends.ssh`.
"""
from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from fault_injectors.transport import TransportError
from ffctl import __version__
from ffctl.exits import BadInput, InfraError
from ffctl.hosts.doctor import clock_offset
from ffctl.hosts.hostfile import HostEntry, HostfileError, parse_hostfile
from ffctl.hosts.ssh.remote import (
    AuthFailed,
    HostKeyChanged,
    HostKeyUnknown,
    RemoteCommandMissing,
    SSHError,
    SSHTransport,
    require_command,
)
from ffctl.launch_spec import LaunchSpec

PROBE_TIMEOUT_S = 30.0

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

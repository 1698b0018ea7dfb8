"""Real sshd servers in throwaway network namespaces, for testing SSH code on one machine.

`sshd_cluster(n)` (a context manager) builds, as root:

- a bridge in the root namespace with an address in a private 10.x.y.0/24 that nothing else
  uses, and one network namespace per host (``ffssh-<id>-<i>``) joined to it by a veth pair;
- per host an ed25519 host key, an sshd_config and ``/usr/sbin/sshd -D`` listening on that
  namespace's address only;
- a generated user key, authorized on every host, and a known_hosts and an ssh_config
  (aliases ``node0``, ``node1``, ...) in a temp directory.

Everything is torn down on exit, including after a failure half-way through setup: every
process in the namespaces is killed, the namespaces, veths and bridge are deleted and the temp
directory (keys included) is removed. Tests only ever touch those 10.x.y addresses. A cluster
whose pytest was SIGKILLed cannot tear itself down; its temp directory names its owner, and the
next cluster built on the machine sweeps it (`sweep_abandoned`).

Test modules get a cluster from `checked_sshd_cluster(n)`, which skips when this cannot work
(`skip_reason()`: not root, no sshd, no ``ip``) and fails if anything outlived the teardown.
`no_ssh_agent` (an autouse fixture, imported by the modules that want it) and
`empty_known_hosts()` are the SSH client-side setup those modules share.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest

SSHD = "/usr/sbin/sshd"
NS_PREFIX = "ffssh-"
FIRST_HOST = 10  # host i gets 10.x.y.(10 + i); .1 is the bridge, .250 is never assigned
UNUSED_HOST = 250


def skip_reason() -> str | None:
    """Why sshd namespaces cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and run sshd"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is missing (install openssh-server)"
    if shutil.which("ip") is None:
        return "the `ip` command is missing (install iproute2)"
    return None


@dataclass(frozen=True)
class SSHHost:
    alias: str
    netns: str
    address: str
    port: int
    host_key: Path
    host_public_key: str  # "ssh-ed25519 AAAA..."
    log: Path


@dataclass(frozen=True)
class SSHCluster:
    hosts: tuple[SSHHost, ...]
    workdir: Path
    ssh_config: Path
    known_hosts: Path
    user_key: Path
    bridge: str
    prefix: str  # "10.x.y"
    uid: str  # the random id in every name this cluster created

    @property
    def unused_address(self) -> str:
        """An address inside the test subnet that no namespace holds (no one answers there)."""
        return f"{self.prefix}.{UNUSED_HOST}"

    def netns_run(self, host: SSHHost, argv: Sequence[str], timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
        """Run argv inside a host's namespace, from the test process (not over SSH)."""
        return subprocess.run(
            ["ip", "netns", "exec", host.netns, *argv],
            capture_output=True, text=True, timeout=timeout, check=False,
        )

    def netns_pids(self, host: SSHHost) -> list[int]:
        """Every process living in a host's namespace (sshd and whatever it started)."""
        return _netns_pids(host.netns)


def generate_ed25519(private_path: Path, comment: str = "ffctl-test") -> str:
    """Write an OpenSSH ed25519 private key (0600) and .pub; return the public key line."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()
    # sshd refuses group- or world-readable host keys, whatever StrictModes says.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private)
    Path(f"{private_path}.pub").write_text(f"{public} {comment}\n")
    return public


def _sh(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")


def _quiet(*argv: str) -> None:
    subprocess.run(argv, capture_output=True, timeout=30, check=False)


def _netns_pids(netns: str) -> list[int]:
    proc = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=10, check=False
    )
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _free_subnet() -> str:
    """A 10.x.y prefix whose /24 overlaps no address or route of this machine."""
    used: list[ipaddress.IPv4Network] = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
        for word in out.split():
            try:
                net = ipaddress.ip_network(word, strict=False)
            except ValueError:
                continue
            if isinstance(net, ipaddress.IPv4Network) and net.prefixlen > 0:
                used.append(net)
    rng = random.SystemRandom()
    for _ in range(200):
        prefix = f"10.{rng.randint(100, 250)}.{rng.randint(0, 255)}"
        candidate = ipaddress.ip_network(f"{prefix}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 subnet found for the test namespaces")


def _kill_netns_processes(netns: str) -> None:
    # sshd -D only stops its listener on SIGTERM; sessions and anything they started (detached
    # processes included) are other pids in the namespace, so kill them all.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _netns_pids(netns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and _netns_pids(netns):
            time.sleep(0.05)


OWNER_FILE = "owner"  # in a cluster's temp dir: "<pid> <start time>" of the process that built it


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks (/proc/PID/stat field 22): with the pid, it names
    one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _teardown(uid: str) -> None:
    for netns in _namespaces(f"{NS_PREFIX}{uid}-"):
        _kill_netns_processes(netns)
        _quiet("ip", "netns", "del", netns)
    for name in _links():
        if name == f"ffsb{uid}" or name.startswith(f"ffs{uid}h"):  # the bridge, the host-side veths
            _quiet("ip", "link", "del", name)


def _namespaces(prefix: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in ns.splitlines() if line.startswith(prefix)]


def _links() -> list[str]:
    """The names of this namespace's network links (a veth's `@peer` suffix dropped)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    return [parts[1].strip().split("@")[0] for parts in (line.split(":") for line in out.splitlines())
            if len(parts) > 1]


def sweep_abandoned() -> list[str]:
    """Tear down the clusters whose builder is gone (a pytest killed with SIGKILL); their ids."""
    swept = []
    for workdir in Path(tempfile.gettempdir()).glob(f"{NS_PREFIX}*-*"):
        try:
            pid, started = (workdir / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue  # not one of ours, or one still being set up
        if _start_time(int(pid)) == started:
            continue  # its builder lives: it tears its cluster down itself
        uid = workdir.name[len(NS_PREFIX):].split("-", 1)[0]
        _teardown(uid)
        shutil.rmtree(workdir, ignore_errors=True)
        swept.append(uid)
    return swept


def _wait_listening(address: str, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text(errors="replace").strip() if log.exists() else ""
            raise RuntimeError(f"sshd on {address} exited {proc.returncode}: {text[-500:]}")
        with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"sshd on {address}:{port} did not start listening within 10s")


def write_sshd_config(
    path: Path,
    *,
    address: str,
    port: int,
    host_key: Path,
    authorized_keys: Path,
    pid_file: Path,
    setenv: Mapping[str, str] | None = None,
) -> None:
    lines = [
        f"ListenAddress {address}",
        f"Port {port}",
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        f"PidFile {pid_file}",
        "StrictModes no",
        "UseDNS no",
        "PrintMotd no",
        "Subsystem sftp internal-sftp",
        "LogLevel VERBOSE",
        # notice a vanished client within seconds, so its sessions are torn down
        "ClientAliveInterval 2",
        "ClientAliveCountMax 2",
    ]
    if setenv:
        # only the first SetEnv line counts, so all variables go on one line
        lines.append("SetEnv " + " ".join(f'"{k}={v}"' for k, v in setenv.items()))
    path.write_text("\n".join(lines) + "\n")


@contextlib.contextmanager
def sshd_cluster(
    n: int = 2, *, setenv: Mapping[str, str] | None = None, user: str = "root",
    host_setenv: Mapping[int, Mapping[str, str]] | None = None,
) -> Iterator[SSHCluster]:
    """Start ``n`` sshd hosts in fresh namespaces; tear everything down on exit.

    ``setenv`` goes into every sshd_config as SetEnv, e.g. a PATH whose python3 is a chosen
    interpreter. ``host_setenv`` adds (or overrides) variables for single hosts by index, e.g.
    a PATH whose python3 lacks ffctl on one host only.
    """
    reason = skip_reason()
    if reason:
        raise RuntimeError(reason)
    sweep_abandoned()
    uid = secrets.token_hex(3)
    bridge = f"ffsb{uid}"
    with contextlib.ExitStack() as undo:
        workdir = Path(tempfile.mkdtemp(prefix=f"ffssh-{uid}-"))
        undo.callback(shutil.rmtree, workdir, True)
        (workdir / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir

        prefix = _free_subnet()
        _sh("ip", "link", "add", bridge, "type", "bridge")
        undo.callback(_quiet, "ip", "link", "del", bridge)
        _sh("ip", "addr", "add", f"{prefix}.1/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")

        user_key = workdir / "id_ed25519"
        user_public = generate_ed25519(user_key, "ffctl-test-user")
        authorized_keys = workdir / "authorized_keys"
        authorized_keys.write_text(user_public + "\n")

        hosts: list[SSHHost] = []
        for i in range(n):
            netns = f"{NS_PREFIX}{uid}-{i}"
            veth_host, veth_ns = f"ffs{uid}h{i}", f"ffs{uid}n{i}"
            address = f"{prefix}.{FIRST_HOST + i}"
            _sh("ip", "netns", "add", netns)
            undo.callback(_quiet, "ip", "netns", "del", netns)
            _sh("ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
            undo.callback(_quiet, "ip", "link", "del", veth_host)
            _sh("ip", "link", "set", veth_host, "master", bridge)
            _sh("ip", "link", "set", veth_host, "up")
            _sh("ip", "link", "set", veth_ns, "netns", netns)
            _sh("ip", "-n", netns, "link", "set", "lo", "up")
            _sh("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", veth_ns)
            _sh("ip", "-n", netns, "link", "set", veth_ns, "up")

            hostdir = workdir / f"node{i}"
            hostdir.mkdir()
            host_key = hostdir / "ssh_host_ed25519_key"
            host_public = generate_ed25519(host_key, f"node{i}")
            config = hostdir / "sshd_config"
            log = hostdir / "sshd.log"
            write_sshd_config(
                config, address=address, port=22, host_key=host_key,
                authorized_keys=authorized_keys, pid_file=hostdir / "sshd.pid",
                setenv={**(setenv or {}), **(host_setenv or {}).get(i, {})},
            )
            # Registered before starting, so a half-started sshd is killed too.
            undo.callback(_kill_netns_processes, netns)
            proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, SSHD, "-D", "-f", str(config), "-E", str(log)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            undo.callback(_reap, proc)
            _wait_listening(address, 22, proc, log)
            hosts.append(SSHHost(f"node{i}", netns, address, 22, host_key, host_public, log))

        known_hosts = workdir / "known_hosts"
        known_hosts.write_text("".join(f"{h.address} {h.host_public_key}\n" for h in hosts))
        ssh_config = workdir / "ssh_config"
        ssh_config.write_text(
            "".join(
                f"Host {h.alias}\n"
                f"    HostName {h.address}\n"
                f"    Port {h.port}\n"
                f"    User {user}\n"
                f"    IdentityFile {user_key}\n"
                f"    IdentitiesOnly yes\n"
                f"    UserKnownHostsFile {known_hosts}\n"
                for h in hosts
            )
        )
        yield SSHCluster(
            hosts=tuple(hosts), workdir=workdir, ssh_config=ssh_config, known_hosts=known_hosts,
            user_key=user_key, bridge=bridge, prefix=prefix, uid=uid,
        )


@contextlib.contextmanager
def checked_sshd_cluster(
    n: int = 2, *, setenv: Mapping[str, str] | None = None,
    host_setenv: Mapping[int, Mapping[str, str]] | None = None,
) -> Iterator[SSHCluster]:
    """`sshd_cluster` for a test module's fixture, so each module need not repeat the guards:
    skip where sshd namespaces cannot be built here, and once the cluster is torn down, fail if
    it left anything behind (namespaces, links, processes, its temp dir)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with sshd_cluster(n, setenv=setenv, host_setenv=host_setenv) as cluster:
        uid = cluster.uid
        yield cluster
    assert leftovers(uid) == [], "the sshd helper left things behind"


@pytest.fixture(autouse=True)
def no_ssh_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide any SSH agent from a test, so only the keys the tests generate may be offered, never
    a developer's. Autouse in every test module that imports it."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


def empty_known_hosts(directory: Path) -> Path:
    """An empty ``known_hosts`` in `directory`, so that every host key is unknown to a client
    that uses it (the cluster's own known_hosts knows them all)."""
    known = directory / "known_hosts"
    known.write_text("")
    return known


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def leftovers(uid: str) -> list[str]:
    """What a cluster with this id left behind: namespaces, links, processes, its temp dir."""
    found: list[str] = []
    found += _namespaces(f"{NS_PREFIX}{uid}")
    found += [f"link {name}" for name in _links() if uid in name]
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=False).stdout
    found += [f"process {line.strip()}" for line in ps.splitlines() if f"ffssh-{uid}" in line]
    found += [str(p) for p in Path(tempfile.gettempdir()).glob(f"ffssh-{uid}-*")]
    return found

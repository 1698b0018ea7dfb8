"""The netns node backend (`--sandbox netns`): one network namespace per node on this machine,
so network faults are real.

Layout for a run (short id = a digest of the run id):

    root namespace: bridge `ffbr<short>` holding the controller's address 10.x.y.1/24
      veth `ffh<short>n<i>` (on the bridge)  <->  `ffv<short>n<i>` in namespace `ffctl-<short>-n<i>`,
                                                  address 10.x.y.(i+2)/24, lo up

The /24 is derived from the run id and skipped if any address or route of this machine overlaps
it. The bridge and host-side veths carry the alias `ffctl-sandbox:ffctl-<short>-`, so
`cleanup_stale` finds what a crashed run left without any state file. Creating needs root.

The caller stops every process inside the namespaces before `destroy()`: a namespace with a live
process in it outlives `ip netns del`. `SandboxNodes` is the node backend of `--sandbox netns`:
the local backend (`ffctl.backends.local`) with the namespaces built in `prepare` and removed in
`release`.
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from fault_injectors.plan import NodePlace
from ffctl.exits import InfraError
from ffctl.backends.local import LocalNodes
from ffctl.launch_spec import LaunchSpec
from runs.store import RunStore

NS_PREFIX = "ffctl-"
LINK_ALIAS_PREFIX = "ffctl-sandbox:"
MAX_NODES = 250
_TIMEOUT = 30.0


class SandboxError(RuntimeError):
    """The sandbox cannot be built or removed; the message is one line."""


@dataclass(frozen=True)
class SandboxNode:
    index: int
    netns: str
    address: str
    interface: str  # inside the namespace
    host_interface: str  # root-namespace end of the veth, enslaved to the bridge


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT, check=False)
    except FileNotFoundError:
        raise SandboxError(f"the {argv[0]!r} command is missing (iproute2 is needed for --sandbox netns)") from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"`{' '.join(argv)}` did not finish within {_TIMEOUT:g}s") from None
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        raise SandboxError(f"`{' '.join(argv)}` failed: {err[-1] if err else f'exit {proc.returncode}'}")
    return proc


def require_root() -> None:
    if os.geteuid() != 0:
        raise SandboxError("--sandbox netns needs root (network namespaces, veths and a bridge); run as root")
    if shutil.which("ip") is None:
        raise SandboxError("--sandbox netns needs the 'ip' command (iproute2), which is not installed")


def short_id(run_id: str) -> str:
    return hashlib.sha1(run_id.encode()).hexdigest()[:6]


def list_namespaces(prefix: str = NS_PREFIX) -> list[str]:
    """Network namespaces whose name starts with `prefix`."""
    out = _run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def _tagged_links(prefix: str) -> list[str]:
    """Root-namespace links whose alias marks them as a sandbox's (bridge, host-side veths)."""
    out = []
    for path in Path("/sys/class/net").iterdir():
        try:
            alias = (path / "ifalias").read_text().strip()
        except OSError:
            continue
        if alias.startswith(LINK_ALIAS_PREFIX + prefix):
            out.append(path.name)
    return sorted(out)


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    nets: list[ipaddress.IPv4Network] = []
    for line in _run("ip", "-4", "-o", "addr", "show", check=False).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            nets.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
    for line in _run("ip", "-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        for word in line.split()[:2]:
            if word == "default":
                break
            try:
                nets.append(ipaddress.IPv4Network(word, strict=False))
                break
            except ValueError:
                continue  # a route type such as `local` or `broadcast` comes first
    return nets


def pick_subnet(run_id: str) -> ipaddress.IPv4Network:
    """A free 10.x.y.0/24 derived from the run id (the same id tries the same candidates)."""
    used = _networks_in_use()
    for attempt in range(256):
        digest = hashlib.sha1(f"{run_id}\0{attempt}".encode()).digest()
        # 10.64.0.0-10.191.255.0: clear of the 10.0/16 and 10.96/12-style ranges tools default to
        # is not guaranteed, which is why every candidate is checked against this machine.
        net = ipaddress.IPv4Network(f"10.{64 + digest[0] % 128}.{digest[1]}.0/24")
        if not any(net.overlaps(other) for other in used):
            return net
    raise SandboxError("no free 10.x.y.0/24 for the sandbox: every candidate overlaps an address or route here")


class NetnsSandbox:
    """One namespace per node joined by a bridge; use as a context manager or create()/destroy()."""

    def __init__(self, run_id: str, nnodes: int) -> None:
        if not 1 <= nnodes <= MAX_NODES:
            raise SandboxError(f"--sandbox netns supports 1 to {MAX_NODES} nodes, not {nnodes}")
        self.run_id = run_id
        self.nnodes = nnodes
        self.short = short_id(run_id)
        self.prefix = f"{NS_PREFIX}{self.short}-"  # every namespace of this sandbox starts with it
        self.bridge = f"ffbr{self.short}"
        self.alias = LINK_ALIAS_PREFIX + self.prefix
        self._subnet: ipaddress.IPv4Network | None = None
        self._forward_rule = False

    # --- what the controller needs ---

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            raise SandboxError("the sandbox has not been created")
        return self._subnet

    @property
    def controller_address(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def nodes(self) -> tuple[SandboxNode, ...]:
        base = self.subnet.network_address
        return tuple(
            SandboxNode(i, f"{self.prefix}n{i}", str(base + 2 + i), f"ffv{self.short}n{i}", f"ffh{self.short}n{i}")
            for i in range(self.nnodes)
        )

    def addresses(self) -> dict[int, str]:
        return {n.index: n.address for n in self.nodes}

    def namespaces(self) -> dict[int, str]:
        return {n.index: n.netns for n in self.nodes}

    def interfaces(self) -> dict[int, str]:
        return {n.index: n.interface for n in self.nodes}

    def node_place(self, index: int, agent_pid: int, host: str = "localhost") -> NodePlace:
        node = self.nodes[index]
        return NodePlace(index, host, node.address, agent_pid, netns=node.netns, interface=node.interface)

    def describe(self) -> dict[str, object]:
        """What this sandbox puts on the machine, by name, for the run record: a controller that
        is killed leaves exactly this until `ffctl inject revert --all --run RUN` removes it."""
        names = self.node_names()
        return {"kind": "netns", "namespaces": [n.netns for n in names],
                "links": [self.bridge, *(n.host_interface for n in names)]}

    def preview(self) -> NetnsSandbox:
        """Pick the subnet `create` would use, creating nothing (for `--dry-run` and checks)."""
        if self._subnet is None:
            self._subnet = pick_subnet(self.run_id)
        return self

    # --- lifecycle ---

    def create(self) -> NetnsSandbox:
        require_root()
        if _link_exists(self.bridge) or list_namespaces(self.prefix):
            raise SandboxError(f"a sandbox for run {self.run_id!r} already exists ({self.bridge}); "
                               "remove it with `ffctl inject revert --all`")
        self._subnet = pick_subnet(self.run_id)
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def _create(self) -> None:
        bits = str(self.subnet.prefixlen)
        # The alias goes on first, so a half-built sandbox is already findable by cleanup_stale.
        _run("ip", "link", "add", "name", self.bridge, "type", "bridge")
        _run("ip", "link", "set", "dev", self.bridge, "alias", self.alias)
        _no_ipv6(self.bridge)
        _run("ip", "addr", "add", f"{self.controller_address}/{bits}", "dev", self.bridge)
        _run("ip", "link", "set", "dev", self.bridge, "up")
        for node in self.nodes:
            _run("ip", "netns", "add", node.netns)
            _run("ip", "link", "add", "name", node.host_interface, "type", "veth", "peer", "name", node.interface)
            _run("ip", "link", "set", "dev", node.host_interface, "alias", self.alias)
            _no_ipv6(node.host_interface)
            _run("ip", "link", "set", "dev", node.host_interface, "master", self.bridge)
            _run("ip", "link", "set", "dev", node.host_interface, "up")
            _run("ip", "link", "set", "dev", node.interface, "netns", node.netns)
            # IPv6 off inside: the run is IPv4, and a v6 path would slip past v4 fault rules.
            _run("ip", "netns", "exec", node.netns, "sh", "-c",
                 "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6", check=False)
            _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/{bits}", "dev", node.interface)
            _run("ip", "-n", node.netns, "link", "set", "dev", node.interface, "up")
            _run("ip", "-n", node.netns, "link", "set", "dev", "lo", "up")
        self._forward_rule = _allow_bridged(self.bridge, self.alias)

    def destroy(self) -> None:
        """Remove namespaces, veths and the bridge. Idempotent; raises only if something stays."""
        _remove(self.prefix, bridges=[self.bridge], veths=[n.host_interface for n in self.node_names()])
        if self._forward_rule:
            _drop_forward_rule(self.bridge, self.alias)  # the bridge (and its alias) may be gone
            self._forward_rule = False

    def node_names(self) -> tuple[SandboxNode, ...]:
        """Each node's namespace and interfaces (addresses too once the subnet is picked)."""
        if self._subnet is None:
            # Never created here (or create failed early): names do not depend on the subnet.
            return tuple(SandboxNode(i, f"{self.prefix}n{i}", "", f"ffv{self.short}n{i}",
                                     f"ffh{self.short}n{i}") for i in range(self.nnodes))
        return self.nodes

    def __enter__(self) -> NetnsSandbox:
        return self.create()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.destroy()


def _no_ipv6(dev: str) -> None:
    try:
        Path("/proc/sys/net/ipv6/conf", dev, "disable_ipv6").write_text("1\n")
    except OSError:
        pass  # no IPv6 on this kernel: nothing to turn off


def _allow_bridged(bridge: str, tag: str) -> bool:
    """Let bridged sandbox traffic through a FORWARD policy of DROP (br_netfilter hosts)."""
    try:
        if Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() != "1":
            return False
    except OSError:
        return False
    if shutil.which("iptables") is None:
        return False
    policy = _run("iptables", "-w", "-S", "FORWARD", check=False).stdout.splitlines()
    if not policy or policy[0].strip() == "-P FORWARD ACCEPT":
        return False
    _run("iptables", "-w", "-I", "FORWARD", "1", "-i", bridge, "-o", bridge,
         "-m", "comment", "--comment", tag, "-j", "ACCEPT")
    return True


def _drop_forward_rule(bridge: str, tag: str) -> None:
    if shutil.which("iptables") is None:
        return
    rule = ("-i", bridge, "-o", bridge, "-m", "comment", "--comment", tag, "-j", "ACCEPT")
    while _run("iptables", "-w", "-D", "FORWARD", *rule, check=False).returncode == 0:
        pass


def _remove(prefix: str, bridges: list[str], veths: list[str]) -> None:
    """Delete the namespaces starting with `prefix`, then the given links and FORWARD rules."""
    tags = {br: _alias(br) for br in bridges}
    for ns in list_namespaces(prefix):
        _run("ip", "netns", "del", ns, check=False)
    # A veth normally goes with its namespace; one left half-made (or pinned) is removed here.
    for dev in veths + bridges:
        if _link_exists(dev):
            _run("ip", "link", "del", "dev", dev, check=False)
    for br, tag in tags.items():
        if tag.startswith(LINK_ALIAS_PREFIX):
            _drop_forward_rule(br, tag)
    left = list_namespaces(prefix) + [d for d in veths + bridges if _link_exists(d)]
    if left:
        raise SandboxError(f"could not remove {', '.join(left)} (a process may still run inside)")


def _alias(dev: str) -> str:
    try:
        return Path("/sys/class/net", dev, "ifalias").read_text().strip()
    except OSError:
        return ""


def cleanup_stale(prefix: str = NS_PREFIX) -> list[str]:
    """Remove every sandbox namespace, veth and bridge whose name or tag starts with `prefix`.

    What `ffctl inject revert --all` calls; returns the names it removed.
    """
    require_root()
    removed = list_namespaces(prefix)
    links = _tagged_links(prefix)
    bridges = [d for d in links if Path("/sys/class/net", d, "bridge").exists()]
    _remove(prefix, bridges=bridges, veths=[d for d in links if d not in bridges])
    return sorted(set(removed + links))


def kill_inside(namespaces: list[str]) -> None:
    """SIGKILL whatever still runs inside the namespaces (a namespace with a process in it
    outlives `ip netns del`). The agents have stopped their ranks by now; this is the backstop."""
    for ns in namespaces:
        try:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10,
                                 check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for word in out.split():
            try:
                os.kill(int(word), signal.SIGKILL)
            except (ValueError, ProcessLookupError, PermissionError):
                pass


class SandboxNodes(LocalNodes):
    """Local agents, each in its own network namespace of a `NetnsSandbox` built for the run."""

    def __init__(self, run_id: str, nnodes: int) -> None:
        super().__init__()
        self.sandbox = NetnsSandbox(run_id, nnodes)
        # The names do not depend on the subnet: what each agent is started in is known (and the
        # dry run shows it) before the namespaces exist.
        names = self.sandbox.node_names()
        self._netns = {n.index: n.netns for n in names}
        self._ifaces = {n.index: n.interface for n in names}

    @classmethod
    def for_launch(cls, spec: LaunchSpec, run_id: str) -> SandboxNodes:
        return cls(run_id, spec.nnodes)

    def prepare(self) -> str:
        """Build the namespaces; the store listens on the bridge only (the namespaces reach it
        there, nothing else does)."""
        try:
            sb = self.sandbox.create()
        except SandboxError as exc:
            raise InfraError(f"--sandbox netns: {exc}") from None
        self._addresses, self._netns, self._ifaces = sb.addresses(), sb.namespaces(), sb.interfaces()
        self.controller_address = sb.controller_address
        return self.controller_address

    def describe(self) -> dict[str, Any]:
        # What a killed controller leaves, until `ffctl inject revert --all --run RUN`.
        return {"sandbox": self.sandbox.describe()}

    def release(self, record: RunStore | None) -> None:
        kill_inside(list_namespaces(self.sandbox.prefix))
        self.sandbox.destroy()


__all__ = [
    "NetnsSandbox", "SandboxNodes", "kill_inside", "SandboxError", "SandboxNode", "cleanup_stale", "list_namespaces", "pick_subnet",
    "require_root", "short_id",
]

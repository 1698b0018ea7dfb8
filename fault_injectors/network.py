"""Network faults: net-partition, net-port-block, net-bandwidth, net-delay, net-loss, link-down.

All act on the target node (inside its network namespace when it has one):

- net-partition / net-port-block: iptables rules in a chain of their own, `FFCTL-<fault>-<hash>`,
  jumped to from INPUT and OUTPUT. Every rule and jump carries the comment
  `ffctl:<run_id>:<fault_id>`, so they are found again by owner tag. Rules on the node itself cut
  both directions, so no FORWARD rule is needed.
- net-bandwidth / net-delay / net-loss: a root `htb` qdisc with ffctl's reserved handle `ffc1:`
  on the node's interface; the fault's qdisc (tbf or netem, handle `ffc2:`) hangs under its
  default class, and u32 filters steer exempt traffic to a class without it.
- link-down: `ip link set dev IF down`; the link's alias is set to `ffctl-down:<run>:<fault>:<old
  alias>` first, so the revert (and `revert --all`) knows which links ffctl took down.

The controller's address and the SSH port are exempt from every fault that can tell traffic apart
(ACCEPT rules, or the exempt class, in place before any DROP or shaping takes effect); link-down
cannot, and its plan says so. Reverts are small scripts that succeed when there is nothing left to
remove, so reverting twice, or reverting what was never applied, succeeds.

`preflight(plan, transport_for)` runs read-only probes on the target hosts and raises
`FaultUnsupported` (one line) for a fault a host cannot do, before anything is applied.
"""
from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from fault_injectors.deadman import duration_of, fault_id, guard, owner_tag, safe_id
from fault_injectors.plan import FaultPlan, HostCommand, NodePlace, Topology
from wire.fault_spec import FaultFamily, FaultKind, FaultSpec, FaultSpecError
from fault_injectors.transport import CommandResult, Transport

CHAIN_PREFIX = "FFCTL-"
QDISC_HANDLE = "ffc1:"  # reserved root handle: whatever has it is ffctl's
LEAF_HANDLE = "ffc2:"
EXEMPT_CLASS = "ffc1:1"
SHAPED_CLASS = "ffc1:2"
LINK_TAG_PREFIX = "ffctl-down"
_CLASS_RATE = "100gbit"  # htb classes must have a rate; this one never limits

IPTABLES_KINDS = frozenset({FaultKind.NET_PARTITION, FaultKind.NET_PORT_BLOCK})
TC_KINDS = frozenset({FaultKind.NET_BANDWIDTH, FaultKind.NET_DELAY, FaultKind.NET_LOSS})

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
TransportFor = Callable[[HostCommand], Transport]


class FaultUnsupported(FaultSpecError):
    """The target host cannot do this fault (missing tool, kernel feature, interface...)."""


# --- revert scripts: positional parameters only, and "nothing to remove" is success ---

# $1 iptables|ip6tables, $2 chain, $3 owner tag
IPTABLES_REVERT = r"""ipt=$1 chain=$2 tag=$3
"$ipt" -w -n -L "$chain" >/dev/null 2>&1 || exit 0
for base in INPUT OUTPUT FORWARD; do
  while "$ipt" -w -D "$base" -m comment --comment "$tag" -j "$chain" >/dev/null 2>&1; do :; done
done
"$ipt" -w -F "$chain" >/dev/null 2>&1
"$ipt" -w -X "$chain" 2>/dev/null || ! "$ipt" -w -n -L "$chain" >/dev/null 2>&1
"""

# $1 interface. Only a root qdisc with the reserved handle is removed.
TC_REVERT = r"""ours() { tc qdisc show dev "$1" 2>/dev/null | grep -q '^qdisc [^ ]* ffc1: root'; }
ours "$1" || exit 0
tc qdisc del dev "$1" root handle ffc1: 2>/dev/null || ! ours "$1"
"""

# $1 interface, $2 tag `ffctl-down:<run>:<fault>`. Keeps the old alias after the tag.
LINK_DOWN_APPLY = r"""old=$(cat "/sys/class/net/$1/ifalias" 2>/dev/null) || old=
ip link set dev "$1" alias "$2:$old" && ip link set dev "$1" down
"""

# Brings the link up only if this fault's tag is on it, then gives the old alias back.
LINK_DOWN_REVERT = r"""a=$(cat "/sys/class/net/$1/ifalias" 2>/dev/null) || exit 0
case $a in
  "$2:"*) ip link set dev "$1" up && ip link set dev "$1" alias "${a#"$2:"}" ;;
esac
"""

_MISSING_TOOL = r"""for b; do command -v "$b" >/dev/null 2>&1 || { printf '%s\n' "$b"; exit 3; }; done"""

# $@: the leaf qdisc (e.g. `netem delay 100ms`). Builds the fault's qdisc tree on the loopback
# of a throwaway namespace (gone when unshare exits), so nothing on the host changes. Where no
# namespace can be made it says `@untried` and looks only for netem in the kernel.
_QDISC_PROBE = r"""if unshare -n true >/dev/null 2>&1; then
  unshare -n sh -c '
    tc qdisc add dev lo root handle ffc1: htb default 2 || { echo @htb; exit 4; }
    tc class add dev lo parent ffc1: classid ffc1:2 htb rate 1gbit || { echo @htb; exit 4; }
    tc filter add dev lo parent ffc1: protocol ip prio 1 u32 match ip dst 127.0.0.1/32 flowid ffc1:2 || { echo @u32; exit 4; }
    tc qdisc add dev lo parent ffc1:2 handle ffc2: "$@" || { echo "@$1"; exit 4; }' sh "$@" 2>&1
  exit
fi
echo @untried
[ "$1" = netem ] || exit 0
[ -d /sys/module/sch_netem ] && exit 0
cfg=$( { zcat /proc/config.gz || cat "/boot/config-$(uname -r)"; } 2>/dev/null)
[ -n "$cfg" ] || exit 0
printf '%s\n' "$cfg" | grep -Eq '^CONFIG_NET_SCH_NETEM=(y|m)' && exit 0
echo 'Specified qdisc kind is unknown.'; echo @netem; exit 4
"""


# --- validation ---

_IFNAME_BAD = re.compile(r"[/:\s]")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.I)
_TIME = re.compile(r"^\d+(?:\.\d+)?(?:us|ms|s)$")
_PERCENT = re.compile(r"^(\d+(?:\.\d+)?)%$")
_PORT = re.compile(r"^\d{1,5}$")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
          "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}


def _ip(text: str, what: str) -> Address:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise FaultSpecError(f"{what} {text!r} is not an IP address; network faults need IP addresses") from None


def _ifname(place: NodePlace, kind: FaultKind) -> str:
    name = place.interface
    if not name:
        raise FaultUnsupported(
            f"{kind.value} needs the network interface of node {place.node}, which the topology does not name"
        )
    # The kernel's own rule (dev_valid_name); anything else it accepts is passed as one word.
    if len(name) > 15 or name in (".", "..") or _IFNAME_BAD.search(name):
        raise FaultSpecError(f"interface {name!r} of node {place.node} is not a valid interface name")
    return name


def rate_bits(text: str) -> float:
    match = _RATE.match(text)
    if not match:
        raise FaultSpecError(f"rate={text!r} is not a rate like 1mbit, 500kbit or 10mbps")
    bits = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if bits < 8000:
        raise FaultSpecError(f"rate={text!r} is below 8kbit, too slow to shape with tbf")
    return bits


def ports_of(spec: FaultSpec, topo: Topology) -> tuple[int, ...]:
    text = spec.option("ports") or spec.option("port")
    if text is None:
        if not topo.store_port:
            raise FaultSpecError("net-port-block needs port= (the store port of this run is not known)")
        text = str(topo.store_port)
    ports: list[int] = []
    for word in filter(None, re.split(r"[|+;\s]", text)):
        if not _PORT.match(word) or not 0 < int(word) < 65536:
            raise FaultSpecError(f"port {word!r} is not a port number (1-65535)")
        if int(word) == topo.ssh_port:
            raise FaultSpecError(f"port {word} is the SSH port, which is exempt from network faults")
        ports.append(int(word))
    if not ports:
        raise FaultSpecError(f"ports={text!r} names no port")
    return tuple(dict.fromkeys(ports))


def leaf_qdisc(spec: FaultSpec) -> tuple[str, ...]:
    """The fault's qdisc under the reserved root: tbf for bandwidth, netem for delay and loss."""
    kind = spec.kind
    if kind is FaultKind.NET_BANDWIDTH:
        rate = spec.option("rate", "1mbit") or "1mbit"
        # Burst: 10 ms at that rate, at least 16 KiB so a few full frames fit at low rates.
        burst = max(16384, int(rate_bits(rate) / 8 / 100))
        return ("tbf", "rate", rate, "burst", str(burst), "latency", "200ms")
    if kind is FaultKind.NET_DELAY:
        delay = spec.option("delay", "100ms") or "100ms"
        if not _TIME.match(delay):
            raise FaultSpecError(f"delay={delay!r} is not a time like 100ms, 2s or 500us")
        return ("netem", "delay", delay)
    if kind is FaultKind.NET_LOSS:
        loss = spec.option("loss", "10%") or "10%"
        match = _PERCENT.match(loss)
        if not match or float(match.group(1)) > 100:
            raise FaultSpecError(f"loss={loss!r} is not a percentage like 10% (0-100%)")
        return ("netem", "loss", loss)
    raise FaultSpecError(f"{kind.value!r} is not a tc fault")


# --- names and tags ---


def chain_name(run_id: str, fid: str, node: int) -> str:
    """`FFCTL-<fault>-<hash of run, fault and node>`: readable, unique even when two target nodes
    share a host and namespace, within iptables' 28 characters."""
    digest = hashlib.sha1(f"{run_id}\0{fid}\0{node}".encode()).hexdigest()[:8]
    return f"{CHAIN_PREFIX}{safe_id(fid)[:12]}-{digest}"


def link_tag(run_id: str, fid: str) -> str:
    return f"{LINK_TAG_PREFIX}:{safe_id(run_id)}:{safe_id(fid)}"


# --- plans ---


@dataclass(frozen=True)
class _Steps:
    apply: tuple[HostCommand, ...]
    revert: tuple[HostCommand, ...]
    notes: tuple[str, ...] = ()


def _tool(addr: Address) -> str:
    return "iptables" if addr.version == 4 else "ip6tables"


Block = tuple[tuple[str, ...], tuple[str, ...]]  # (match words, verdict words)


def _chain_commands(
    place: NodePlace, tool: str, chain: str, tag: str, ctrl: Address, ssh_port: int, blocks: Sequence[Block]
) -> _Steps:
    def ipt(*words: str) -> HostCommand:
        return HostCommand(place.node, place.host, (tool, "-w", *words), netns=place.netns)

    comment = ("-m", "comment", "--comment", tag)
    accept = ("-j", "ACCEPT")
    exempt: list[tuple[str, ...]] = []
    if _tool(ctrl) == tool:
        exempt += [("-s", str(ctrl)), ("-d", str(ctrl))]
    exempt += [("-p", "tcp", "--dport", str(ssh_port)), ("-p", "tcp", "--sport", str(ssh_port))]
    if any(verdict[-1] == "REJECT" for _, verdict in blocks):
        # The chain also sees the ICMP error REJECT answers with, on its way out to the peer;
        # without this it would be rejected in turn and the peer would only see a timeout.
        exempt.append(("-p", "icmp", "--icmp-type", "destination-unreachable") if tool == "iptables"
                      else ("-p", "ipv6-icmp", "--icmpv6-type", "destination-unreachable"))
    apply = [ipt("-N", chain)]
    # Exemptions first: the controller and SSH must keep working whatever follows.
    apply += [ipt("-A", chain, *match, *comment, *accept) for match in exempt]
    apply += [ipt("-A", chain, *match, *comment, *verdict) for match, verdict in blocks]
    # Jumps last: traffic enters the chain only once every exemption and block is in it.
    apply += [ipt("-I", base, "1", *comment, "-j", chain) for base in ("INPUT", "OUTPUT")]
    revert = HostCommand(place.node, place.host, ("sh", "-c", IPTABLES_REVERT, "sh", tool, chain, tag),
                         netns=place.netns)
    return _Steps(tuple(apply), (revert,))


def _verdict(spec: FaultSpec) -> tuple[str, ...]:
    action = (spec.option("action", "drop") or "drop").lower()
    if action not in ("drop", "reject"):
        raise FaultSpecError(f"action={action!r} is not drop or reject")
    return ("-j", action.upper())


def _partition(spec: FaultSpec, topo: Topology, nodes: tuple[int, ...], fid: str) -> _Steps:
    ctrl = _ip(topo.controller_address, "controller address")
    verdict = _verdict(spec)
    peer_opt = spec.option("peer")
    if peer_opt is not None and (not peer_opt.isdigit() or int(peer_opt) not in {n.node for n in topo.nodes}):
        raise FaultSpecError(f"peer={peer_opt!r} is not a node of this run")
    tag = owner_tag(topo.run_id, fid)
    apply: list[HostCommand] = []
    revert: list[HostCommand] = []
    notes: list[str] = []
    for n in nodes:
        place = topo.node(n)
        own = _ip(place.address, f"address of node {n}")
        if own == ctrl:
            raise FaultUnsupported(
                f"node {n} has the controller's address {ctrl}, which is exempt from network faults"
            )
        peers: dict[Address, int] = {}
        for other in topo.nodes:
            if other.node == n or (peer_opt is not None and other.node != int(peer_opt)):
                continue
            addr = _ip(other.address, f"address of node {other.node}")
            if addr == own:
                raise FaultUnsupported(
                    f"nodes {n} and {other.node} share the address {own}; a partition needs distinct "
                    "node addresses (use --sandbox netns on one machine)"
                )
            if addr == ctrl:
                notes.append(f"node {other.node} shares the controller's address {ctrl} and stays reachable")
                continue
            peers.setdefault(addr, other.node)
        if not peers:
            raise FaultUnsupported(f"net-partition of node {n} leaves no peer to cut off")
        chain = chain_name(topo.run_id, fid, n)
        for tool in sorted({_tool(a) for a in peers}):
            blocks = [((flag, str(a)), verdict) for a in peers if _tool(a) == tool for flag in ("-s", "-d")]
            steps = _chain_commands(place, tool, chain, tag, ctrl, topo.ssh_port, blocks)
            apply += steps.apply
            revert += steps.revert
    return _Steps(tuple(apply), tuple(revert), tuple(dict.fromkeys(notes)))


def _port_block(spec: FaultSpec, topo: Topology, nodes: tuple[int, ...], fid: str) -> _Steps:
    ctrl = _ip(topo.controller_address, "controller address")
    ports = ports_of(spec, topo)
    verdict = _verdict(spec)
    tag = owner_tag(topo.run_id, fid)
    apply: list[HostCommand] = []
    revert: list[HostCommand] = []
    blocks = [(("-p", "tcp", direction, str(p)), verdict) for p in ports for direction in ("--dport", "--sport")]
    for n in nodes:
        place = topo.node(n)
        tool = _tool(_ip(place.address, f"address of node {n}"))
        steps = _chain_commands(place, tool, chain_name(topo.run_id, fid, n), tag, ctrl, topo.ssh_port, blocks)
        apply += steps.apply
        revert += steps.revert
    notes = (f"traffic with the controller ({ctrl}) is exempt, also on the blocked ports",)
    return _Steps(tuple(apply), tuple(revert), notes)


def _exempt_filters(place: NodePlace, dev: str, ctrl: Address, ssh_port: int) -> list[HostCommand]:
    def flt(prio: int, proto: str, *match: str) -> HostCommand:
        argv = ("tc", "filter", "add", "dev", dev, "parent", QDISC_HANDLE, "protocol", proto,
                "prio", str(prio), "u32", *match, "flowid", EXEMPT_CLASS)
        return HostCommand(place.node, place.host, argv, netns=place.netns)

    v = "ip" if ctrl.version == 4 else "ip6"
    bits = "32" if ctrl.version == 4 else "128"
    out = [flt(1, "ip" if ctrl.version == 4 else "ipv6", "match", v, "dst", f"{ctrl}/{bits}")]
    prio = 2
    for proto, m in (("ip", "ip"), ("ipv6", "ip6")):
        for direction in ("dport", "sport"):
            out.append(flt(prio, proto, "match", m, "protocol", "6", "0xff", "match", m, direction,
                           str(ssh_port), "0xffff"))
            prio += 1
    return out


def _shaping(spec: FaultSpec, topo: Topology, nodes: tuple[int, ...]) -> _Steps:
    ctrl = _ip(topo.controller_address, "controller address")
    leaf = leaf_qdisc(spec)
    apply: list[HostCommand] = []
    revert: list[HostCommand] = []
    for n in nodes:
        place = topo.node(n)
        dev = _ifname(place, spec.kind)

        def tc(*words: str, at: NodePlace = place) -> HostCommand:
            return HostCommand(at.node, at.host, ("tc", *words), netns=at.netns)

        apply += [
            tc("qdisc", "add", "dev", dev, "root", "handle", QDISC_HANDLE, "htb", "default", "2"),
            tc("class", "add", "dev", dev, "parent", QDISC_HANDLE, "classid", EXEMPT_CLASS,
               "htb", "rate", _CLASS_RATE, "quantum", "60000"),
            tc("class", "add", "dev", dev, "parent", QDISC_HANDLE, "classid", SHAPED_CLASS,
               "htb", "rate", _CLASS_RATE, "quantum", "60000"),
            # Exempt traffic is steered away before the shaping qdisc exists.
            *_exempt_filters(place, dev, ctrl, topo.ssh_port),
            tc("qdisc", "add", "dev", dev, "parent", SHAPED_CLASS, "handle", LEAF_HANDLE, *leaf),
        ]
        revert.append(HostCommand(place.node, place.host, ("sh", "-c", TC_REVERT, "sh", dev), netns=place.netns))
    notes = (f"egress of the named interface only; the controller ({ctrl}) and SSH port are not shaped",)
    return _Steps(tuple(apply), tuple(revert), notes)


def _link_down(spec: FaultSpec, topo: Topology, nodes: tuple[int, ...], fid: str) -> _Steps:
    tag = link_tag(topo.run_id, fid)
    apply: list[HostCommand] = []
    revert: list[HostCommand] = []
    for n in nodes:
        place = topo.node(n)
        dev = _ifname(place, spec.kind)
        apply.append(HostCommand(n, place.host, ("sh", "-c", LINK_DOWN_APPLY, "sh", dev, tag), netns=place.netns))
        revert.append(HostCommand(n, place.host, ("sh", "-c", LINK_DOWN_REVERT, "sh", dev, tag), netns=place.netns))
    notes = (
        "link-down takes the whole link down: the controller address and SSH port cannot be exempt "
        "on it; the dead man's switch brings it back",
    )
    return _Steps(tuple(apply), tuple(revert), notes)


def plan(spec: FaultSpec, topo: Topology, ranks: tuple[int, ...], nodes: tuple[int, ...]) -> FaultPlan:
    kind = spec.kind
    fid = fault_id(spec)
    if kind is FaultKind.NET_PARTITION:
        steps = _partition(spec, topo, nodes, fid)
    elif kind is FaultKind.NET_PORT_BLOCK:
        steps = _port_block(spec, topo, nodes, fid)
    elif kind in TC_KINDS:
        steps = _shaping(spec, topo, nodes)
    elif kind is FaultKind.LINK_DOWN:
        steps = _link_down(spec, topo, nodes, fid)
    else:
        raise FaultSpecError(f"{kind.value!r} is not a network fault")
    notes = steps.notes
    if spec.duration is None:
        notes += (f"no duration given: reverted after {duration_of(spec):g}s",)
    built = FaultPlan(spec, ranks, nodes, apply=steps.apply, revert=steps.revert, notes=notes)
    return guard(built, topo.run_id, record_dir=topo.record_dir)



# --- preflight ---


# The leaves `ffctl doctor` tries, one per qdisc kind the faults use.
QDISC_TRIALS: dict[str, tuple[str, ...]] = {
    "tbf": ("tbf", "rate", "1mbit", "burst", "32kbit", "latency", "400ms"),
    "netem": ("netem", "delay", "1ms"),
}


def probe_qdisc(transport: Transport, leaf: Sequence[str], timeout: float) -> CommandResult:
    """The one qdisc probe, run by the launch preflight and by `ffctl doctor`: build a network
    fault's qdisc tree (htb root, u32 filter, then `leaf`) on the loopback of a throwaway network
    namespace. Exit 0: the kernel takes it (or it could not be tried: an `@untried` line says so);
    exit 4: the last `@` line names the part refused (`@htb`, `@u32`, `@netem`, ...)."""
    return transport.run(("sh", "-c", _QDISC_PROBE, "sh", *leaf), timeout=timeout)


def probe_iptables(transport: Transport, tool: str, timeout: float) -> CommandResult:
    """The one iptables probe: can `tool` (iptables or ip6tables) read the filter table here."""
    return transport.run((tool, "-w", "-n", "-L", "INPUT"), timeout=timeout)


def _where(cmd: HostCommand) -> str:
    return cmd.host + (f" (netns {cmd.netns})" if cmd.netns else "")


def _probe(transport_for: TransportFor, at: HostCommand, argv: tuple[str, ...], timeout: float) -> tuple[int, str]:
    cmd = HostCommand(at.node, at.host, argv, netns=at.netns)
    result = transport_for(cmd).run(argv, timeout=timeout)
    return result.returncode, (result.stdout + result.stderr).strip()


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("@")]
    return lines[-1].strip() if lines else "no output"


def _check_qdisc(kind: FaultKind, where: str, leaf: tuple[str, ...], output: str) -> None:
    markers = [line[1:] for line in output.splitlines() if line.startswith("@")]
    failed = markers[-1] if markers else leaf[0]
    missing = "unknown" in output.lower() or "not found" in output.lower()
    if failed == "netem" and missing:
        raise FaultUnsupported(
            f"{kind.value} cannot run on {where}: the kernel lacks the netem qdisc (sch_netem), "
            "which net-delay and net-loss need"
        )
    if missing:
        what = "classifier" if failed == "u32" else "qdisc"
        raise FaultUnsupported(f"{kind.value} cannot run on {where}: the kernel lacks the {failed} {what}")
    raise FaultUnsupported(f"{kind.value} cannot run on {where}: tc refuses {failed}: {_last_line(output)}")


def preflight(plan: FaultPlan, transport_for: TransportFor, timeout: float = 30.0) -> None:
    """Raise `FaultUnsupported` if a target host cannot do the plan's network fault.

    Read-only on the hosts: tools present, iptables usable, the interface there and free of
    another ffctl qdisc or link-down, and the kernel able to build the qdisc tree (probed in a
    throwaway namespace). Plans of other families pass.
    """
    kind = plan.spec.kind
    if kind.family is not FaultFamily.NETWORK:
        return
    seen: set[tuple[str, str | None]] = set()
    for cmd in plan.apply:
        if (cmd.host, cmd.netns) in seen:
            continue
        seen.add((cmd.host, cmd.netns))
        where = _where(cmd)
        tools = {c.argv[0] for c in plan.apply if (c.host, c.netns) == (cmd.host, cmd.netns)} - {"sh"}
        tools |= {"tc", "ip", "grep"} if kind in TC_KINDS else {"ip", "cat"} if kind is FaultKind.LINK_DOWN else set()
        rc, out = _probe(transport_for, cmd, ("sh", "-c", _MISSING_TOOL, "sh", *sorted(tools)), timeout)
        if rc == 3:
            raise FaultUnsupported(f"{kind.value} cannot run on {where}: the {_last_line(out)!r} command is missing")
        if rc != 0:
            raise FaultUnsupported(f"{kind.value} cannot run on {where}: {_last_line(out)}")
        if kind in IPTABLES_KINDS:
            for tool in sorted(tools & {"iptables", "ip6tables"}):
                probe = probe_iptables(transport_for(cmd), tool, timeout)
                rc, out = probe.returncode, (probe.stdout + probe.stderr).strip()
                if rc != 0:
                    raise FaultUnsupported(f"{kind.value} cannot run on {where}: {tool}: {_last_line(out)}")
            continue
        for dev in _interfaces(plan, cmd.host, cmd.netns):
            _check_interface(kind, where, dev, transport_for, cmd, timeout)
        if kind in TC_KINDS:
            leaf = leaf_qdisc(plan.spec)
            probe = probe_qdisc(transport_for(cmd), leaf, timeout)
            rc, out = probe.returncode, (probe.stdout + probe.stderr).strip()
            if rc != 0:
                _check_qdisc(kind, where, leaf, out)


def _interfaces(plan: FaultPlan, host: str, netns: str | None) -> list[str]:
    """Interfaces the plan touches on one host: `tc qdisc add dev IF` or a link script's `$1`."""
    out: set[str] = set()
    for c in plan.apply:
        if (c.host, c.netns) != (host, netns):
            continue
        if c.argv[:4] == ("tc", "qdisc", "add", "dev") or c.argv[:3] == ("sh", "-c", LINK_DOWN_APPLY):
            out.add(c.argv[4])
    return sorted(out)


def _check_interface(
    kind: FaultKind, where: str, dev: str, transport_for: TransportFor, at: HostCommand, timeout: float
) -> None:
    rc, out = _probe(transport_for, at, ("ip", "-o", "link", "show", "dev", dev), timeout)
    if rc != 0:
        raise FaultUnsupported(f"{kind.value} cannot run on {where}: no interface {dev!r} ({_last_line(out)})")
    if kind in TC_KINDS:
        rc, out = _probe(transport_for, at, ("tc", "qdisc", "show", "dev", dev), timeout)
        if f" {QDISC_HANDLE} root" in out:
            raise FaultUnsupported(
                f"{kind.value} cannot run on {where}: {dev} already carries an ffctl qdisc "
                "(another net-bandwidth/net-delay/net-loss fault is active)"
            )
    elif f"alias {LINK_TAG_PREFIX}:" in out:
        raise FaultUnsupported(f"{kind.value} cannot run on {where}: ffctl already took {dev} down")

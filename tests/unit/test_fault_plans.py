"""Pure fault plans: GPU, network, dead man's switch, revert --all, seeded targets and MTBF schedules.

Nothing here touches the machine: plans are data, preflight runs against a scripted transport.
"""
from __future__ import annotations

import math
import re
import shlex
from typing import Sequence

import pytest

from fault_injectors import deadman, make_plan, network, parse_spec
from fault_injectors.deadman import fault_id, guard, with_fault_id
from fault_injectors.network import FaultUnsupported, preflight
from fault_injectors.plan import FaultPlan, NodePlace, RankPlace, Topology
from fault_injectors.process import in_step_fault_path
from fault_injectors.revert import revert_all_plan
from fault_injectors.schedule import ChaosSpec, fault_seed, iter_mtbf, mtbf_schedule, parse_chaos
from wire.fault_spec import FaultKind, FaultSpecError, TargetMode
from fault_injectors.targets import resolve
from fault_injectors.transport import CommandResult

CTRL = "10.9.0.1"
SSH = 2222


def topo(nnodes: int = 3, nproc: int = 2, *, has_gpu: bool = False, host: str = "localhost",
         netns: bool = True, iface: str | None = "veth0", store_port: int = 29500) -> Topology:
    nodes = tuple(
        NodePlace(n, host, f"10.9.0.{n + 2}", 100 + n, netns=f"ffctl-t-n{n}" if netns else None,
                  interface=iface)
        for n in range(nnodes)
    )
    ranks = tuple(RankPlace(n * nproc + i, n, 1000 + n * nproc + i) for n in range(nnodes) for i in range(nproc))
    return Topology("run1", nodes, ranks, controller_address=CTRL, store_port=store_port, ssh_port=SSH,
                    has_gpu=has_gpu)


def plan_of(text: str, t: Topology | None = None, fid: str = "f1") -> FaultPlan:
    return make_plan(with_fault_id(parse_spec(text), fid), t or topo())


def iptables_rules(plan: FaultPlan) -> list[tuple[str, ...]]:
    return [c.argv for c in plan.apply if c.argv[0] in ("iptables", "ip6tables")]


def index_of(rules: Sequence[tuple[str, ...]], *words: str) -> int:
    for i, argv in enumerate(rules):
        if all(w in argv for w in words):
            return i
    raise AssertionError(f"no rule with {words}")


# --- GPU ---


@pytest.mark.parametrize("kind", ["gpu-error", "gpu-hang", "gpu-oom", "gpu-xid"])
def test_gpu_fault_acts_inside_the_step_and_is_emulated_without_a_gpu(kind: str) -> None:
    plan = plan_of(f"{kind}:rank=3")
    assert plan.emulated and plan.ranks == (3,) and plan.nodes == (1,)
    assert any("emulated" in n for n in plan.notes)
    (cmd,) = plan.apply
    assert cmd.argv[0:2] == ("sh", "-c") and cmd.netns == "ffctl-t-n1"
    text, path, pid = cmd.argv[-3:]
    assert text.split(":", 1)[0] == kind
    assert path == in_step_fault_path(topo(), 3) and pid == "1003"
    assert not plan.revert


def test_gpu_xid_on_a_gpu_host_also_writes_the_kernel_log() -> None:
    plan = plan_of("gpu-xid:rank=0", topo(has_gpu=True))
    assert not plan.emulated
    kmsg, step = plan.apply
    assert "/dev/kmsg" in kmsg.argv[2]
    assert kmsg.argv[-1].startswith("NVRM: Xid (PCI:0000:00:00): 79, pid=1000")
    assert step.argv[-3].startswith("gpu-xid:NVRM: Xid")


def test_gpu_xid_emulated_puts_the_line_in_the_fault_text_only() -> None:
    plan = plan_of("gpu-xid:rank=0")
    assert len(plan.apply) == 1 and "/dev/kmsg" not in plan.apply[0].argv[2]
    assert "GPU has fallen off the bus" in plan.apply[0].argv[-3]


def test_gpu_oom_size_and_bad_size() -> None:
    assert plan_of("gpu-oom:rank=1,mb=2048").apply[0].argv[-3] == "gpu-oom:2048"
    assert plan_of("gpu-oom:rank=1").apply[0].argv[-3] == "gpu-oom"
    with pytest.raises(FaultSpecError, match=r"mb='lots'"):
        plan_of("gpu-oom:rank=1,mb=lots")


def test_gpu_all_mode_hits_every_rank() -> None:
    plan = plan_of("gpu-error:mode=all")
    assert plan.ranks == tuple(range(6)) and len(plan.apply) == 6


# --- network: partition ---


def test_partition_exempts_controller_and_ssh_before_the_drop() -> None:
    plan = plan_of("net-partition:node=1,duration=5")
    rules = iptables_rules(plan)
    chain = network.chain_name("run1", "f1", 1)
    assert rules[0] == ("iptables", "-w", "-N", chain)
    drops = [i for i, r in enumerate(rules) if r[-1] == "DROP"]
    assert drops, rules
    for exempt in (("-s", CTRL), ("-d", CTRL), ("--dport", str(SSH)), ("--sport", str(SSH))):
        assert index_of(rules, *exempt, "ACCEPT") < min(drops)
    # Both peers, both directions; the node's own address and the controller are never dropped.
    for peer in ("10.9.0.2", "10.9.0.4"):
        assert index_of(rules, "-s", peer, "DROP") >= 0 and index_of(rules, "-d", peer, "DROP") >= 0
    assert not any("10.9.0.3" in r for r in rules)
    # Jumps come last, so no packet meets a half-built chain.
    jumps = [i for i, r in enumerate(rules) if r[-2:] == ("-j", chain)]
    assert len(jumps) == 2 and min(jumps) > max(drops)
    assert {r[r.index("-I") + 1] for r in (rules[i] for i in jumps)} == {"INPUT", "OUTPUT"}


def test_partition_rules_carry_the_owner_tag_and_run_in_the_nodes_namespace() -> None:
    plan = plan_of("net-partition:node=2")
    tag = "ffctl:run1:f1"
    for cmd in plan.apply:
        assert cmd.netns == "ffctl-t-n2" and cmd.node == 2
        if cmd.argv[2] != "-N":
            assert ("--comment", tag) == cmd.argv[cmd.argv.index("--comment"):cmd.argv.index("--comment") + 2]
    chain = network.chain_name("run1", "f1", 2)
    assert chain.startswith("FFCTL-f1-") and len(chain) <= 28
    assert network.chain_name("run2", "f1", 2) != chain != network.chain_name("run1", "f1", 1)
    assert len(network.chain_name("r" * 200, "f" * 200, 99999)) <= 28


def test_partition_of_several_nodes_on_one_host_uses_a_chain_each() -> None:
    plan = plan_of("net-partition:mode=all", topo(netns=False))
    chains = {c.argv[3] for c in plan.apply if c.argv[2] == "-N"}
    assert len(chains) == 3 and len(plan.revert) == 3


def test_partition_reject_and_bad_action() -> None:
    rules = iptables_rules(plan_of("net-partition:node=1,action=reject"))
    assert any(r[-1] == "REJECT" for r in rules) and not any(r[-1] == "DROP" for r in rules)
    # REJECT's own ICMP answer must get out, or the peer sees a timeout instead of a refusal.
    assert index_of(rules, "icmp", "destination-unreachable", "ACCEPT") < index_of(rules, "REJECT")
    assert not any("icmp" in r for r in iptables_rules(plan_of("net-partition:node=1")))
    with pytest.raises(FaultSpecError, match=r"action='explode'"):
        plan_of("net-partition:node=1,action=explode")


def test_partition_with_one_peer_only() -> None:
    rules = iptables_rules(plan_of("net-partition:node=1,peer=0"))
    assert any("10.9.0.2" in r for r in rules) and not any("10.9.0.4" in r for r in rules)
    with pytest.raises(FaultSpecError, match=r"peer='7'"):
        plan_of("net-partition:node=1,peer=7")


def test_partition_needs_distinct_addresses() -> None:
    t = topo()
    same = Topology("run1", tuple(NodePlace(n.node, n.host, "10.9.0.2", n.agent_pid, n.netns, n.interface)
                                  for n in t.nodes), t.ranks, controller_address=CTRL)
    with pytest.raises(FaultUnsupported, match="share the address 10.9.0.2"):
        plan_of("net-partition:node=0", same)


def test_partition_of_the_controllers_node_is_refused_and_a_peer_on_it_stays_open() -> None:
    t = topo()
    on_ctrl = Topology("run1", (NodePlace(0, "h0", CTRL, 1),) + t.nodes[1:], (), controller_address=CTRL)
    with pytest.raises(FaultUnsupported, match="controller's address"):
        plan_of("net-partition:node=0", on_ctrl)
    plan = plan_of("net-partition:node=1", on_ctrl)
    assert any("stays reachable" in n for n in plan.notes)
    assert not any(r[-1] == "DROP" and CTRL in r for r in iptables_rules(plan))


def test_ipv6_nodes_use_ip6tables() -> None:
    nodes = (NodePlace(0, "h", "fd00::2", 1), NodePlace(1, "h", "fd00::3", 2))
    plan = plan_of("net-partition:node=1", Topology("run1", nodes, (), controller_address="fd00::1"))
    assert {c.argv[0] for c in plan.apply} == {"ip6tables"}
    assert index_of(iptables_rules(plan), "-s", "fd00::1", "ACCEPT") < index_of(iptables_rules(plan), "DROP")


def test_network_addresses_must_be_ip_addresses() -> None:
    t = topo()
    named = Topology("run1", t.nodes, (), controller_address="controller.example")
    with pytest.raises(FaultSpecError, match="controller.example"):
        plan_of("net-partition:node=1", named)


# --- network: port block ---


def test_port_block_defaults_to_the_store_port_with_exemptions_first() -> None:
    rules = iptables_rules(plan_of("net-port-block:node=1"))
    drops = [i for i, r in enumerate(rules) if r[-1] == "DROP"]
    assert {r[r.index("-p") + 3] for r in (rules[i] for i in drops)} == {"29500"}
    assert {("--dport" in rules[i]) for i in drops} == {True, False}
    for exempt in (("-s", CTRL), ("-d", CTRL), ("--dport", str(SSH)), ("--sport", str(SSH))):
        assert index_of(rules, *exempt, "ACCEPT") < min(drops)


def test_port_block_ports_and_errors() -> None:
    rules = iptables_rules(plan_of("net-port-block:node=1,ports=7000|7001"))
    assert {r[r.index("-p") + 3] for r in rules if r[-1] == "DROP"} == {"7000", "7001"}
    with pytest.raises(FaultSpecError, match="SSH port"):
        plan_of(f"net-port-block:node=1,port={SSH}")
    with pytest.raises(FaultSpecError, match=r"port '70000'"):
        plan_of("net-port-block:node=1,port=70000")
    with pytest.raises(FaultSpecError, match="port="):
        plan_of("net-port-block:node=1", topo(store_port=0))


# --- network: tc ---


@pytest.mark.parametrize("text, leaf", [
    ("net-bandwidth:node=1,rate=8mbit", ("tbf", "rate", "8mbit")),
    ("net-delay:node=1,delay=100ms", ("netem", "delay", "100ms")),
    ("net-loss:node=1,loss=10%", ("netem", "loss", "10%")),
])
def test_tc_faults_use_the_reserved_handle_and_exempt_before_shaping(text: str, leaf: tuple[str, ...]) -> None:
    plan = plan_of(text)
    argvs = [c.argv for c in plan.apply]
    assert argvs[0] == ("tc", "qdisc", "add", "dev", "veth0", "root", "handle", "ffc1:", "htb", "default", "2")
    last = argvs[-1]
    assert last[:9] == ("tc", "qdisc", "add", "dev", "veth0", "parent", "ffc1:2", "handle", "ffc2:")
    assert last[9:9 + len(leaf)] == leaf
    filters = [a for a in argvs if a[:2] == ("tc", "filter")]
    assert all(a[-2:] == ("flowid", "ffc1:1") for a in filters)
    assert any(f"{CTRL}/32" in a for a in filters)
    assert sum(str(SSH) in a for a in filters) == 4  # sport and dport, IPv4 and IPv6
    assert len({a[a.index("prio") + 1] for a in filters}) == len(filters)
    assert all(c.netns == "ffctl-t-n1" for c in plan.apply)
    (rev,) = plan.revert
    assert rev.argv[-1] == "veth0" and "ffc1:" in rev.argv[2]


@pytest.mark.parametrize("text, bad", [
    ("net-bandwidth:node=1,rate=fast", "rate='fast'"),
    ("net-bandwidth:node=1,rate=1bit", "rate='1bit'"),
    ("net-delay:node=1,delay=soon", "delay='soon'"),
    ("net-loss:node=1,loss=150%", "loss='150%'"),
    ("net-loss:node=1,loss=10", "loss='10'"),
])
def test_tc_fault_bad_values_name_the_value(text: str, bad: str) -> None:
    with pytest.raises(FaultSpecError, match=re.escape(bad)) as info:
        plan_of(text)
    assert "\n" not in str(info.value)


def test_tc_fault_needs_an_interface() -> None:
    with pytest.raises(FaultUnsupported, match="interface of node 1"):
        plan_of("net-delay:node=1", topo(iface=None))


def test_bandwidth_burst_grows_with_rate() -> None:
    small = plan_of("net-bandwidth:node=1,rate=1mbit").apply[-1].argv
    big = plan_of("net-bandwidth:node=1,rate=10gbit").apply[-1].argv
    assert int(small[small.index("burst") + 1]) == 16384
    assert int(big[big.index("burst") + 1]) == 10**10 // 8 // 100


# --- network: link-down ---


def test_link_down_tags_the_link_and_says_it_cannot_exempt() -> None:
    plan = plan_of("link-down:node=0,duration=4")
    (apply,), (revert,) = plan.apply, plan.revert
    assert apply.argv[-2:] == ("veth0", "ffctl-down:run1:f1")
    assert revert.argv[-2:] == ("veth0", "ffctl-down:run1:f1")
    assert any("cannot be exempt" in n for n in plan.notes)


# --- hostile names ---


HOSTILE_HOST = "h;rm -rf /;$(reboot)`id`"
HOSTILE_IF = "e;$(id)`x'\"y"  # the kernel allows these characters in a link name
HOSTILE_NS = "ns'; reboot #"


@pytest.mark.parametrize("kind", ["net-partition", "net-port-block", "net-bandwidth", "net-delay",
                                  "net-loss", "link-down", "gpu-xid", "gpu-error"])
def test_hostile_names_are_never_parsed_by_a_shell(kind: str) -> None:
    nodes = tuple(NodePlace(n, HOSTILE_HOST, f"10.9.0.{n + 2}", 1, netns=HOSTILE_NS, interface=HOSTILE_IF)
                  for n in range(2))
    t = Topology("run'1;x", nodes, (RankPlace(0, 0, 5), RankPlace(1, 1, 6)), controller_address=CTRL,
                 store_port=29500, has_gpu=True, fault_dir="/tmp/a b;c")
    # duration= only where the kind reverts (GPU faults act once, inside the step).
    plan = plan_of(f"{kind}:node=1" + ("" if kind.startswith("gpu-") else ",duration=5"), t)
    commands = plan.apply + plan.revert + plan.deadman + deadman.cancel_commands(plan)
    assert commands
    for cmd in commands:
        if cmd.argv[:2] == ("sh", "-c"):
            script = cmd.argv[2]
            for bad in (HOSTILE_HOST, HOSTILE_IF, HOSTILE_NS, "run'1", "/tmp/a b"):
                assert bad not in script
        # What --dry-run prints is exactly what runs: one word per argv element.
        words = shlex.split(str(cmd).split("] ", 1)[1])
        assert words == ["ip", "netns", "exec", HOSTILE_NS, *cmd.argv] or words == list(cmd.argv)
        assert cmd.host == HOSTILE_HOST


def test_interface_names_the_kernel_refuses_are_refused() -> None:
    for name in ("a/b", "a b", "x:1", "waytoolonginterface"):
        with pytest.raises(FaultSpecError, match="interface"):
            plan_of("net-delay:node=1", topo(iface=name))


# --- dead man's switch ---


def test_every_network_plan_is_guarded_with_duration_plus_grace() -> None:
    plan = plan_of("net-partition:node=1,duration=7.2")
    (dm,) = plan.deadman
    assert dm.argv[:2] == ("sh", "-c") and dm.netns == "ffctl-t-n1"
    assert dm.argv[3] == "ffctl-deadman:run1:f1"
    assert dm.argv[4] == str(math.ceil(7.2 + deadman.DEFAULT_GRACE_S))
    # The revert rides along as counted words.
    (rev,) = plan.revert
    assert dm.argv[5:] == (str(len(rev.argv)), *rev.argv)


def test_default_duration_when_none_given() -> None:
    plan = plan_of("net-delay:node=1")
    assert plan.deadman[0].argv[4] == str(math.ceil(deadman.DEFAULT_DURATION_S + deadman.DEFAULT_GRACE_S))
    assert any("no duration" in n for n in plan.notes)


def test_guard_groups_reverts_per_node_and_leaves_unrevertible_plans_alone() -> None:
    plan = plan_of("hang-rank:mode=all,duration=3")
    guarded = guard(plan, "run1", grace=1)
    assert len(guarded.deadman) == 3  # three nodes
    for dm in guarded.deadman:
        words = dm.argv[5:]
        assert words.count("kill") == 2 and dm.argv[4] == "4"
    assert guard(guarded, "run1") is guarded
    kill = plan_of("kill-rank:rank=0")
    assert guard(kill, "run1") is kill


def test_cancel_pattern_matches_the_switch_but_not_itself() -> None:
    plan = plan_of("net-partition:node=1,duration=5", fid="f1")
    (cancel,) = deadman.cancel_commands(plan)
    pat = cancel.argv[-1]
    assert cancel.argv[-2] == "TERM" and cancel.netns is None
    switch_cmdline = " ".join(plan.deadman[0].argv)
    assert re.search(pat, switch_cmdline)
    assert not re.search(pat, " ".join(cancel.argv))
    other = " ".join(plan_of("net-partition:node=1,duration=5", fid="f10").deadman[0].argv)
    assert not re.search(pat, other)


def test_fault_id_is_given_or_a_stable_digest() -> None:
    spec = parse_spec("net-delay:node=1,step=3")
    assert fault_id(spec) == fault_id(parse_spec("net-delay:node=1,step=3"))
    assert fault_id(spec) != fault_id(parse_spec("net-delay:node=1,step=4"))
    assert fault_id(with_fault_id(spec, "f 9/x")) == "f_9_x"
    assert fault_id(with_fault_id(with_fault_id(spec, "a"), "b")) == "b"
    # The id is a field of the spec, not one of its options: giving it changes no option (nor the
    # digest of a spec without one), and no spec text can set it.
    given = with_fault_id(spec, "f3")
    assert given.fault_id == "f3" and given.options == spec.options and spec.fault_id is None
    with pytest.raises(FaultSpecError, match="id"):
        parse_spec("net-delay:node=1,step=3,id=f1")


# --- preflight against a scripted transport ---


class ScriptedTransport:
    """Answers commands by the first rule whose needle is in the joined argv."""

    def __init__(self, rules: list[tuple[str, int, str]]) -> None:
        self.host = "localhost"
        self.rules = rules
        self.ran: list[tuple[str, ...]] = []

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        self.ran.append(tuple(argv))
        joined = " ".join(argv)
        for needle, rc, out in self.rules:
            if needle in joined:
                return CommandResult(tuple(argv), rc, out, "")
        return CommandResult(tuple(argv), 0, "", "")

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        raise AssertionError("preflight must not start anything")


def test_preflight_refuses_delay_without_netem_and_changes_nothing() -> None:
    plan = plan_of("net-delay:node=1")
    tr = ScriptedTransport([("unshare", 4, "Error: Specified qdisc kind is unknown.\n@netem")])
    with pytest.raises(FaultUnsupported) as info:
        preflight(plan, lambda cmd: tr)
    msg = str(info.value)
    assert "lacks the netem qdisc" in msg and "net-delay and net-loss need" in msg and "\n" not in msg
    assert not any(a[:3] == ("tc", "qdisc", "add") for a in tr.ran)


def test_preflight_reports_missing_tools_and_permissions() -> None:
    tr = ScriptedTransport([("command -v", 3, "iptables\n")])
    with pytest.raises(FaultUnsupported, match="'iptables' command is missing"):
        preflight(plan_of("net-partition:node=1"), lambda cmd: tr)
    tr = ScriptedTransport([("-L INPUT", 4, "iptables: Permission denied (you must be root).")])
    with pytest.raises(FaultUnsupported, match="Permission denied"):
        preflight(plan_of("net-port-block:node=1"), lambda cmd: tr)
    tr = ScriptedTransport([("link show", 1, 'Device "veth0" does not exist.')])
    with pytest.raises(FaultUnsupported, match="no interface 'veth0'"):
        preflight(plan_of("link-down:node=1"), lambda cmd: tr)
    tr = ScriptedTransport([("qdisc show", 0, "qdisc htb ffc1: root refcnt 2")])
    with pytest.raises(FaultUnsupported, match="already carries an ffctl qdisc"):
        preflight(plan_of("net-bandwidth:node=1"), lambda cmd: tr)


def test_preflight_passes_other_families_untouched() -> None:
    tr = ScriptedTransport([])
    preflight(plan_of("kill-rank:rank=0"), lambda cmd: tr)
    preflight(plan_of("net-loss:node=1"), lambda cmd: tr)
    assert tr.ran and all(a[0] in ("sh", "ip", "tc", "iptables") for a in tr.ran)


# --- revert --all ---


def test_revert_all_plan_covers_every_kind_of_leftover() -> None:
    cmds = revert_all_plan("host1", netns="ffctl-x-n0", run_id="run1")
    scripts = [c.argv[2] for c in cmds]
    assert any("pkill -USR1" in s for s in scripts)
    assert any("ip6tables" in s for s in scripts) and any("tc qdisc del" in s for s in scripts)
    assert any("ifalias" in s for s in scripts)
    fire = next(c for c in cmds if "pkill" in c.argv[2])
    assert fire.netns is None and fire.argv[-1] == deadman.pattern("run1")
    assert all(c.netns == "ffctl-x-n0" for c in cmds if c is not fire)
    assert all(c.host == "host1" for c in cmds)
    assert revert_all_plan("h")[0].argv[-1] == "[f]fctl-deadman:"


# --- seeded targets ---


def test_seeded_modes_pick_the_same_targets_for_the_same_seed() -> None:
    t = topo(nnodes=4, nproc=4)
    for text in ("kill-rank:mode=one,seed=5", "kill-rank:mode=fixed:3,seed=5", "net-delay:mode=percent:50,seed=2",
                 "gpu-error:mode=one,seed=9"):
        first = resolve(parse_spec(text), t)
        assert resolve(parse_spec(text), t) == first
    picks = {resolve(parse_spec(f"kill-rank:mode=one,seed={s}"), t)[0] for s in range(40)}
    assert len(picks) > 5  # the seed matters
    ranks, nodes = resolve(parse_spec("net-partition:mode=fixed:2,seed=1"), t)
    assert ranks == () and len(nodes) == 2
    assert len(plan_of("net-partition:mode=fixed:2,seed=1", t).deadman) == 2


# --- MTBF schedules ---


def test_schedule_is_reproducible_and_seed_dependent() -> None:
    a = parse_chaos("mtbf=120s,seed=7,until=3600").schedule()
    b = parse_chaos("mtbf=120s,seed=7,until=3600").schedule()
    c = parse_chaos("mtbf=120s,seed=8,until=3600").schedule()
    assert a == b and a != c
    times = [t for t, _ in a]
    assert times == sorted(times) and all(0 < t < 3600 for t in times)
    for t, spec in a:
        assert spec.target.mode is TargetMode.ONE and spec.trigger.t == t and spec.kind is FaultKind.KILL_RANK
    assert len({spec.seed for _, spec in a}) == len(a)
    assert a[0][1].seed == fault_seed(7, 0)


def test_schedule_mean_gap_is_the_mtbf() -> None:
    events = mtbf_schedule(10.0, 3, until=100000.0)
    mean = events[-1][0] / len(events)
    assert 9.0 < mean < 11.0


def test_schedule_kinds_duration_and_prefix_property() -> None:
    chaos = parse_chaos("mtbf=2m,seed=1,kinds=kill-rank|net-partition|kill-rank,duration=5")
    assert chaos.kinds == (FaultKind.KILL_RANK, FaultKind.NET_PARTITION) and chaos.mtbf == 120
    events = chaos.schedule(until=7200)
    assert {s.kind for _, s in events} == set(chaos.kinds)
    assert all(s.duration == 5 for _, s in events)
    # A longer horizon only adds faults at the end.
    assert chaos.schedule(until=14400)[: len(events)] == events
    gen = iter_mtbf(120, 1, chaos.kinds, 5)
    assert [next(gen) for _ in range(len(events))] == events
    assert parse_chaos(str(chaos)) == chaos


@pytest.mark.parametrize("text, bad", [
    ("mtbf=abc,seed=1", "mtbf='abc'"),
    ("mtbf=0,seed=1", "mtbf='0'"),
    ("mtbf=10s,seed=-1", "seed='-1'"),
    ("mtbf=10s,seed=x", "seed='x'"),
    ("mtbf=10s,kinds=kill-rank|explode", "'explode'"),
    ("mtbf=10s,kinds=", "kinds"),
    ("mtbf=10s,until=0", "until='0'"),
    ("mtbf=10s,colour=red", "'colour'"),
    ("seed=3", "mtbf"),
    ("mtbf=10s,mtbf=20s", "mtbf= given twice"),
])
def test_bad_chaos_specs_name_the_bad_value(text: str, bad: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        parse_chaos(text)
    assert bad in str(info.value) and "\n" not in str(info.value)


def test_schedule_without_an_end_is_refused() -> None:
    with pytest.raises(FaultSpecError, match="until"):
        ChaosSpec(mtbf=10).schedule()


@pytest.mark.parametrize("pid", [0, -1])
def test_a_node_whose_agent_has_no_pid_is_refused_never_sent_to_a_process_group(pid: int) -> None:
    # An agent starting again after an earlier node fault has not reported its pid: `kill -KILL 0`
    # would kill the controller's own process group, and -1 every process it may signal.
    t = topo(2, 1)
    t = Topology("run1", (t.nodes[0], NodePlace(1, "localhost", "10.9.0.3", pid, netns=None)), t.ranks)
    with pytest.raises(FaultSpecError, match=r"node 1's agent has no process yet \(pid " + str(pid)):
        plan_of("kill-node:node=1", t)
    for c in plan_of("kill-node:node=0", t).apply:
        assert all(not a.lstrip("-").isdigit() or int(a) > 0 for a in c.argv[2:])


@pytest.mark.parametrize("kind", ["kill-rank", "term-rank", "hang-rank", "crash-rank"])
def test_a_rank_without_a_pid_is_refused(kind: str) -> None:
    t = topo(1, 2)
    t = Topology("run1", t.nodes, (t.ranks[0], RankPlace(1, 0, 0)))
    with pytest.raises(FaultSpecError, match="rank 1 has no process yet"):
        plan_of(f"{kind}:rank=1", t)


def test_a_seeded_node_pick_is_among_the_nodes_that_are_up() -> None:
    t = topo(4, 1)
    down = {1, 2}
    t = Topology("run1", tuple(NodePlace(n.node, n.host, n.address, 0 if n.node in down else n.agent_pid)
                               for n in t.nodes), t.ranks)
    picked = {resolve(parse_spec(f"kill-node:mode=one,seed={s}"), t)[1] for s in range(40)}
    assert picked == {(0,), (3,)}


def test_commands_others_look_for_carry_their_role_never_guessed_from_argv() -> None:
    from fault_injectors.deadman import tag_of
    from fault_injectors.node import is_node_drain, is_node_kill
    from fault_injectors.plan import HostCommand, Role

    kill, drain = plan_of("kill-node:node=1,drain=yes").apply
    assert (kill.role, drain.role) == (Role.NODE_KILL, Role.NODE_DRAIN) and is_node_kill(kill) and is_node_drain(drain)
    # The same words without the role are someone else's command: not a node kill to cancel.
    assert not is_node_kill(HostCommand(kill.node, kill.host, kill.argv, kill.netns, allow_fail=True))
    assert not is_node_drain(HostCommand(drain.node, drain.host, drain.argv))
    assert drain.about is not None and drain.about.startswith("ffctl:")  # the reason, resumed by it later
    (crash,) = plan_of("crash-rank:rank=3").apply
    assert crash.role is Role.IN_STEP and crash.about == "3"
    # The steps of `ffctl inject revert --all` say which they are: none is found by its script.
    from fault_injectors.revert import STEP_NAMES, Sweep, revert_all_plan, sweep_of

    plan = revert_all_plan("h1", None, "r1")
    assert [sweep_of(c) for c in plan] == list(Sweep) and all(c.role is Role.SWEEP for c in plan)
    assert sweep_of(HostCommand(0, "h1", plan[0].argv)) is None and set(STEP_NAMES) == set(Sweep)
    plan = guard(plan_of("net-partition:node=1,duration=5"), "run1")
    assert plan.deadman and all(c.role is Role.DEADMAN and tag_of(c) == c.about == "ffctl-deadman:run1:f1"
                                for c in plan.deadman)
    assert tag_of(plan.apply[0]) is None

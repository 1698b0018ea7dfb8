"""Network faults on real namespaces: iptables, tc and links between sandbox nodes.

Each test builds its own three-node sandbox (`clean_sandbox`), which on the way out stops the
run's dead man's switches, destroys the namespaces and checks nothing of them is left.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from fault_injectors import make_plan, parse_spec
from fault_injectors.deadman import (
    DEFAULT_GRACE_S,
    apply_guarded,
    deadman_command,
    disarm,
    guard,
    pattern,
    revert_guarded,
    signal_command,
    with_fault_id,
)
from fault_injectors.network import FaultUnsupported, preflight
from fault_injectors.plan import FaultPlan, HostCommand, RankPlace, Topology
from fault_injectors.planner import run_commands
from fault_injectors.revert import revert_all
from ffctl.backends.netns import NetnsSandbox
from tests.conftest import ROOT, needs_root
from tests.helpers.netns import (
    clean_sandbox,
    connect,
    deadman_pids,
    ffctl_chains,
    link,
    qdiscs,
    sh,
    tcp_server,
    topology,
    transport_for,
    wait_for,
)

# A three-node sandbox built per test, faults applied and reverted, the switches' grace waited out.
pytestmark = pytest.mark.timeout(300)

PORT = 7301
OTHER_PORT = 7302


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    return f"it{os.getpid()}-{digest}"


@pytest.fixture
def sb(run_id: str) -> Iterator[NetnsSandbox]:
    with clean_sandbox(run_id, 3) as sandbox:
        yield sandbox


def plan_for(text: str, topo: Topology, fid: str = "f1") -> FaultPlan:
    return make_plan(with_fault_id(parse_spec(text), fid), topo)


def kernel_has_netem() -> bool:
    probe = subprocess.run(["unshare", "-n", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True, check=False)
    return probe.returncode == 0


# --- net-partition ---


@needs_root
def test_partition_drops_peer_traffic_keeps_the_controller_and_reverts(sb: NetnsSandbox, run_id: str) -> None:
    n0, n1, n2 = sb.nodes
    topo = topology(sb, run_id)
    plan = plan_for("net-partition:node=1,duration=60", topo)
    with tcp_server(n0.netns, n0.address, [PORT]), tcp_server(n1.netns, n1.address, [PORT]), \
            tcp_server(n2.netns, n2.address, [PORT]):
        assert connect(n0.netns, [(n1.address, PORT)]) == ["ok"]
        preflight(plan, transport_for)
        try:
            apply_guarded(plan, transport_for)
            assert deadman_pids(run_id), "the dead man's switch is armed"
            assert connect(n0.netns, [(n1.address, PORT), (n2.address, PORT)]) == ["timeout", "ok"]
            assert connect(n1.netns, [(n0.address, PORT), (n2.address, PORT)]) == ["timeout", "timeout"]
            # The controller (the bridge's address, in the root namespace) still reaches everyone.
            assert connect(None, [(n0.address, PORT), (n1.address, PORT), (n2.address, PORT)]) == ["ok"] * 3
            assert any("ffctl:" + run_id in line for line in ffctl_chains(n1.netns))
            assert ffctl_chains(n0.netns) == []
        finally:
            revert_guarded(plan, transport_for)
        assert ffctl_chains(n1.netns) == []
        assert wait_for(lambda: not deadman_pids(run_id), 10), "the switch is cancelled after the revert"
        assert connect(n0.netns, [(n1.address, PORT)]) == ["ok"]
        assert connect(n1.netns, [(n0.address, PORT)]) == ["ok"]
    # Reverting again, or reverting what never was applied, is fine.
    run_commands(plan.revert, transport_for)
    run_commands(plan_for("net-partition:node=2", topo, fid="never").revert, transport_for)


@needs_root
def test_partition_reject_refuses_at_once(sb: NetnsSandbox, run_id: str) -> None:
    n0, n1, _ = sb.nodes
    plan = plan_for("net-partition:node=1,action=reject,duration=60", topology(sb, run_id))
    with tcp_server(n1.netns, n1.address, [PORT]):
        preflight(plan, transport_for)
        try:
            apply_guarded(plan, transport_for)
            t0 = time.monotonic()
            assert connect(n0.netns, [(n1.address, PORT)], timeout=5) == ["refused"]
            assert time.monotonic() - t0 < 4
            assert connect(None, [(n1.address, PORT)]) == ["ok"]
        finally:
            revert_guarded(plan, transport_for)
        assert connect(n0.netns, [(n1.address, PORT)]) == ["ok"]
    assert ffctl_chains(n1.netns) == []


# --- net-port-block ---


@needs_root
def test_port_block_blocks_the_port_only(sb: NetnsSandbox, run_id: str) -> None:
    n0, n1, _ = sb.nodes
    # No port= given: the store port is blocked.
    plan = plan_for("net-port-block:node=1,duration=60", topology(sb, run_id, store_port=PORT))
    with tcp_server(n1.netns, n1.address, [PORT, OTHER_PORT]):
        preflight(plan, transport_for)
        try:
            apply_guarded(plan, transport_for)
            assert connect(n0.netns, [(n1.address, PORT), (n1.address, OTHER_PORT)]) == ["timeout", "ok"]
            assert connect(None, [(n1.address, PORT)]) == ["ok"]  # the controller is exempt
        finally:
            revert_guarded(plan, transport_for)
        assert connect(n0.netns, [(n1.address, PORT)]) == ["ok"]
    assert ffctl_chains(n1.netns) == []
    run_commands(plan.revert, transport_for)


# --- tc ---

_SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8); print("ready", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(65536):
        pass
    c.sendall(b"k"); c.close()
"""

_SEND = """
import socket, sys, time
data = b"x" * int(sys.argv[3])
t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.monotonic() - t0)
"""


def send_seconds(netns: str, address: str, port: int, nbytes: int) -> float:
    out = sh(netns, sys.executable, "-c", _SEND, address, str(port), str(nbytes), timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


# Measures throughput.
@pytest.mark.exclusive
@needs_root
def test_bandwidth_shapes_peers_not_the_controller_and_reverts(sb: NetnsSandbox, run_id: str) -> None:
    n0, n1, _ = sb.nodes
    plan = plan_for("net-bandwidth:node=1,rate=2mbit,duration=60", topology(sb, run_id))
    sinks = []
    try:
        for ns, addr in ((n0.netns, n0.address), (None, sb.controller_address)):
            argv = ["ip", "netns", "exec", ns] if ns else []
            proc = subprocess.Popen([*argv, sys.executable, "-c", _SINK, addr, str(PORT)],
                                    stdout=subprocess.PIPE, text=True)
            sinks.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        preflight(plan, transport_for)
        try:
            apply_guarded(plan, transport_for)
            shown = qdiscs(n1.netns, n1.interface)
            assert "qdisc htb ffc1: root" in shown and "qdisc tbf ffc2: parent ffc1:2 rate 2Mbit" in shown
            # 256 KiB at 2 Mbit/s is about a second; to the exempt controller it is near instant.
            shaped = send_seconds(n1.netns, n0.address, PORT, 256 * 1024)
            exempt = send_seconds(n1.netns, sb.controller_address, PORT, 256 * 1024)
            assert shaped > 0.7 and exempt < shaped / 2, (shaped, exempt)
            # A second shaping fault on the same link is refused up front.
            with pytest.raises(FaultUnsupported, match="already carries an ffctl qdisc"):
                preflight(plan_for("net-bandwidth:node=1,rate=1mbit", topology(sb, run_id), fid="f2"),
                          transport_for)
        finally:
            revert_guarded(plan, transport_for)
        assert "ffc1:" not in qdiscs(n1.netns, n1.interface)
        assert send_seconds(n1.netns, n0.address, PORT, 256 * 1024) < shaped / 2
        run_commands(plan.revert, transport_for)
    finally:
        for proc in sinks:
            proc.kill()
            proc.wait(timeout=30)


@needs_root
@pytest.mark.parametrize("text", ["net-delay:node=1,delay=80ms,duration=60", "net-loss:node=1,loss=30%,duration=60"])
def test_netem_faults_fail_up_front_without_netem(sb: NetnsSandbox, run_id: str, text: str) -> None:
    n1 = sb.nodes[1]
    plan = plan_for(text, topology(sb, run_id))
    before = (qdiscs(n1.netns, n1.interface), ffctl_chains(n1.netns), link(n1.netns, n1.interface))
    if not kernel_has_netem():
        with pytest.raises(FaultUnsupported) as info:
            preflight(plan, transport_for)
        msg = str(info.value)
        assert "the kernel lacks the netem qdisc" in msg and "net-delay and net-loss need" in msg
        assert "\n" not in msg
        assert (qdiscs(n1.netns, n1.interface), ffctl_chains(n1.netns), link(n1.netns, n1.interface)) == before
        assert not deadman_pids(run_id)
        return
    preflight(plan, transport_for)
    try:
        apply_guarded(plan, transport_for)
        assert "netem ffc2: parent ffc1:2" in qdiscs(n1.netns, n1.interface)
    finally:
        revert_guarded(plan, transport_for)
    assert "ffc1:" not in qdiscs(n1.netns, n1.interface)


# --- link-down ---


@needs_root
def test_link_down_and_back_with_the_old_alias(sb: NetnsSandbox, run_id: str) -> None:
    n0, n1, _ = sb.nodes
    assert sh(n1.netns, "ip", "link", "set", "dev", n1.interface, "alias", "keep me").returncode == 0
    plan = plan_for("link-down:node=1,duration=60", topology(sb, run_id))
    with tcp_server(n1.netns, n1.address, [PORT]):
        preflight(plan, transport_for)
        try:
            apply_guarded(plan, transport_for)
            up, alias = link(n1.netns, n1.interface)
            assert not up and alias == f"ffctl-down:{run_id}:f1:keep me"
            assert connect(n0.netns, [(n1.address, PORT)]) != ["ok"]
            with pytest.raises(FaultUnsupported, match="already took"):
                preflight(plan_for("link-down:node=1", topology(sb, run_id), fid="f2"), transport_for)
        finally:
            revert_guarded(plan, transport_for)
        assert link(n1.netns, n1.interface) == (True, "keep me")
        assert wait_for(lambda: connect(n0.netns, [(n1.address, PORT)]) == ["ok"], 15)
    run_commands(plan.revert, transport_for)
    assert link(n1.netns, n1.interface) == (True, "keep me")


# --- the dead man's switch ---

_APPLIER = """
import json, sys, time
sys.path.insert(0, sys.argv[2])
from fault_injectors import make_plan, parse_spec
from fault_injectors.deadman import apply_guarded, with_fault_id
from fault_injectors.network import preflight
from fault_injectors.plan import NodePlace, Topology
from tests.helpers.netns import transport_for
d = json.loads(sys.argv[1])
topo = Topology(d["run_id"], tuple(NodePlace(**n) for n in d["nodes"]), (), controller_address=d["ctrl"])
plan = make_plan(with_fault_id(parse_spec("net-partition:node=1,duration=3"), "f1"), topo)
preflight(plan, transport_for)
apply_guarded(plan, transport_for)
print("applied", flush=True)
time.sleep(600)
"""


@needs_root
def test_deadman_reverts_after_the_applier_is_sigkilled(sb: NetnsSandbox, run_id: str) -> None:
    n0, n1, _ = sb.nodes
    topo = topology(sb, run_id)
    desc = {"run_id": run_id, "ctrl": sb.controller_address,
            "nodes": [{"node": p.node, "host": p.host, "address": p.address, "agent_pid": p.agent_pid,
                       "netns": p.netns, "interface": p.interface} for p in topo.nodes]}
    applier = subprocess.Popen([sys.executable, "-c", _APPLIER, json.dumps(desc), str(ROOT)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert applier.stdout is not None
        line = applier.stdout.readline()
        assert line.strip() == "applied", applier.stderr.read() if applier.stderr else line
        assert ffctl_chains(n1.netns)
        with tcp_server(n1.netns, n1.address, [PORT]):
            assert connect(n0.netns, [(n1.address, PORT)], timeout=1) == ["timeout"]
            os.kill(applier.pid, signal.SIGKILL)
            applier.wait(timeout=30)
            killed = time.monotonic()
            assert wait_for(lambda: not ffctl_chains(n1.netns), 3 + DEFAULT_GRACE_S + 20)
            elapsed = time.monotonic() - killed
            assert elapsed <= 3 + DEFAULT_GRACE_S + 20
            assert connect(n0.netns, [(n1.address, PORT)]) == ["ok"]
        assert wait_for(lambda: not deadman_pids(run_id), 10)
    finally:
        if applier.poll() is None:
            applier.kill()
            applier.wait(timeout=30)


@needs_root
def test_deadman_survives_and_is_cancelled_without_reverting_twice(sb: NetnsSandbox, run_id: str) -> None:
    n1 = sb.nodes[1]
    plan = plan_for("net-partition:node=1,duration=60", topology(sb, run_id))
    apply_guarded(plan, transport_for)
    (pid,) = deadman_pids(run_id)
    run_commands(plan.revert, transport_for)
    disarm(plan, transport_for)
    assert wait_for(lambda: not deadman_pids(run_id), 10)
    # Its sleep went with it: no process of the switch is left.
    assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z"
    assert ffctl_chains(n1.netns) == []


_HOSTILE = "a b;$(touch /tmp/pwned)`id`'\"*"


@pytest.mark.parametrize("how", ["timer", "fire", "cancel"])
def test_deadman_script_runs_its_reverts_word_for_word(tmp_path: Path, how: str) -> None:
    """No root needed: the switch runs harmless reverts; hostile words arrive unchanged."""
    out = tmp_path / "out"
    run_id = f"ut{os.getpid()}-{how}"
    reverts = (
        HostCommand(0, "localhost", ("sh", "-c", 'printf "%s|" "$@" >> "$0"', str(out), _HOSTILE, "x y")),
        HostCommand(0, "localhost", ("sh", "-c", 'printf "%s\\n" "$1" >> "$0"', str(out), "second")),
    )
    delay = 2 if how == "timer" else 30
    switch = deadman_command(run_id, "f1", reverts, delay)
    transport_for(switch).spawn_detached(switch.argv, timeout=10)
    assert wait_for(lambda: bool(deadman_pids(run_id)), 5)
    if how == "fire":
        run_commands((signal_command(0, "localhost", pattern(run_id), "USR1"),), transport_for)
    if how == "cancel":
        run_commands((signal_command(0, "localhost", pattern(run_id, "f1"), "TERM"),), transport_for)
    assert wait_for(lambda: not deadman_pids(run_id), 15)
    if how == "cancel":
        assert not out.exists()
    else:
        assert out.read_text() == f"{_HOSTILE}|x y|second\n"
    assert not Path("/tmp/pwned").exists()


# --- revert --all ---

_HANG_TARGET = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"


@needs_root
def test_revert_all_removes_everything_ffctl_left(sb: NetnsSandbox, run_id: str) -> None:
    n0, n1, n2 = sb.nodes
    victim = subprocess.Popen(["ip", "netns", "exec", n2.netns, sys.executable, "-c", _HANG_TARGET],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "up"
        base = topology(sb, run_id)
        topo = Topology(run_id, base.nodes, (RankPlace(0, 2, victim.pid),), base.controller_address,
                        ssh_port=base.ssh_port)
        plans = [
            plan_for("net-partition:node=1,duration=120", topo, "p1"),
            plan_for("net-port-block:node=2,port=7400,duration=120", topo, "p2"),
            plan_for("net-bandwidth:node=0,rate=5mbit,duration=120", topo, "p3"),
            plan_for("link-down:node=2,duration=120", topo, "p4"),
            guard(plan_for("hang-rank:rank=0,duration=120", topo, "p5"), run_id),
        ]
        for plan in plans:
            preflight(plan, transport_for)
            apply_guarded(plan, transport_for)
        assert len(deadman_pids(run_id)) == 5
        assert wait_for(lambda: _state(victim.pid) == "T", 5)
        for node in sb.nodes:
            revert_all("localhost", transport_for, netns=node.netns, run_id=run_id)
        for node in sb.nodes:
            assert ffctl_chains(node.netns) == []
            assert "ffc1:" not in qdiscs(node.netns, node.interface)
            assert link(node.netns, node.interface) == (True, "")
        assert wait_for(lambda: not deadman_pids(run_id), 10)
        assert _state(victim.pid) != "T"  # its switch resumed the stopped rank
        # Nothing left: a second sweep succeeds and finds nothing.
        for node in sb.nodes:
            revert_all("localhost", transport_for, netns=node.netns, run_id=run_id)
        with tcp_server(n1.netns, n1.address, [PORT]):
            assert connect(n0.netns, [(n1.address, PORT)]) == ["ok"]
    finally:
        victim.kill()
        victim.wait(timeout=30)


def _state(pid: int) -> str:
    # The victim runs behind `ip netns exec`, which execs: the pid is python's own.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]

"""The `--sandbox netns` library: namespaces, veths, bridge, addresses, and leaving nothing behind."""
from __future__ import annotations

import hashlib
import ipaddress
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

import ffctl.backends.netns as sandbox_mod
from fault_injectors import make_plan, parse_spec
from ffctl.backends.netns import NetnsSandbox, SandboxError, cleanup_stale, list_namespaces, pick_subnet
from tests.conftest import needs_root
from tests.helpers.netns import clean_sandbox, connect, leftovers, sh, tcp_server, topology

# Namespaces, veths and a bridge built and torn down, a job run inside them.
pytestmark = pytest.mark.timeout(300)

PORT = 7351


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    return f"sb{os.getpid()}-{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]}"


@pytest.fixture
def sb(run_id: str) -> Iterator[NetnsSandbox]:
    with clean_sandbox(run_id, 3) as sandbox:
        yield sandbox


def links() -> set[str]:
    return {p.name for p in Path("/sys/class/net").iterdir()}


def own_links(sb: NetnsSandbox) -> set[str]:
    """This sandbox's links only: other tests may be adding links of their own meanwhile."""
    return {name for name in links() if sb.short in name}


def addresses_in_root() -> list[ipaddress.IPv4Interface]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return [ipaddress.IPv4Interface(line.split()[3]) for line in out.splitlines()]


@needs_root
def test_layout_names_and_addresses(sb: NetnsSandbox) -> None:
    assert len(sb.bridge) <= 15 and sb.bridge in links()
    assert [n.netns for n in sb.nodes] == [f"ffctl-{sb.short}-n{i}" for i in range(3)]
    assert all(n.netns.startswith("ff") for n in sb.nodes)
    assert list_namespaces(sb.prefix) == sorted(n.netns for n in sb.nodes)
    net = sb.subnet
    assert net.prefixlen == 24 and str(net).startswith("10.")
    ctrl = ipaddress.IPv4Interface(f"{sb.controller_address}/24")
    assert ctrl in addresses_in_root()
    assert len({sb.controller_address, *(n.address for n in sb.nodes)}) == 4
    for node in sb.nodes:
        assert ipaddress.IPv4Address(node.address) in net
        assert len(node.interface) <= 15 and len(node.host_interface) <= 15
        assert node.host_interface in links() and node.interface not in links()
        out = sh(node.netns, "ip", "-o", "-4", "addr", "show", "dev", node.interface).stdout
        assert f"{node.address}/24" in out
        assert "UP" in sh(node.netns, "ip", "link", "show", "dev", "lo").stdout
    assert sb.addresses() == {n.index: n.address for n in sb.nodes}
    assert sb.namespaces() == {n.index: n.netns for n in sb.nodes}
    assert sb.interfaces() == {n.index: n.interface for n in sb.nodes}


@needs_root
def test_nodes_reach_each_other_and_the_controller_reaches_them(sb: NetnsSandbox) -> None:
    n0, n1, n2 = sb.nodes
    with tcp_server(n1.netns, n1.address, [PORT]), tcp_server(None, sb.controller_address, [PORT + 1]):
        assert connect(n0.netns, [(n1.address, PORT)]) == ["ok"]
        assert connect(n2.netns, [(n1.address, PORT), (sb.controller_address, PORT + 1)]) == ["ok", "ok"]
        assert connect(None, [(n1.address, PORT)]) == ["ok"]


@needs_root
def test_topology_from_the_sandbox_plans_real_faults(sb: NetnsSandbox, run_id: str) -> None:
    topo = topology(sb, run_id)
    plan = make_plan(parse_spec("net-delay:node=2"), topo)
    assert {c.netns for c in plan.apply} == {sb.nodes[2].netns}
    assert plan.apply[0].argv[4] == sb.nodes[2].interface
    place = sb.node_place(1, agent_pid=4242, host="h1")
    assert (place.node, place.host, place.address, place.agent_pid, place.netns, place.interface) == (
        1, "h1", sb.nodes[1].address, 4242, sb.nodes[1].netns, sb.nodes[1].interface)


@needs_root
def test_destroy_leaves_nothing_and_is_idempotent(run_id: str) -> None:
    sb = NetnsSandbox(run_id, 2)
    try:
        sb.create()
        assert list_namespaces(sb.prefix)
    finally:
        sb.destroy()
    assert list_namespaces(sb.prefix) == [] and own_links(sb) == set()
    assert not leftovers(sb, run_id)
    sb.destroy()  # again: nothing to do
    NetnsSandbox(run_id + "-never", 2).destroy()  # never created: nothing to do


@needs_root
def test_context_manager_destroys_on_error(run_id: str) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsSandbox(run_id, 2) as sb:
            assert len(list_namespaces(sb.prefix)) == 2
            raise RuntimeError("boom")
    assert list_namespaces(sb.prefix) == [] and own_links(sb) == set()


@needs_root
def test_creating_twice_is_refused_and_changes_nothing(sb: NetnsSandbox) -> None:
    again = NetnsSandbox(sb.run_id, 3)
    with pytest.raises(SandboxError, match="already exists"):
        again.create()
    assert len(list_namespaces(sb.prefix)) == 3 and sb.bridge in links()


@needs_root
def test_cleanup_stale_removes_an_abandoned_sandbox(run_id: str) -> None:
    sb = NetnsSandbox(run_id, 2)
    try:
        sb.create()
        # As if the run died without destroying it: only the prefix is known.
        removed = cleanup_stale(sb.prefix)
        assert set(removed) >= {sb.bridge, *(n.netns for n in sb.nodes), *(n.host_interface for n in sb.nodes)}
        assert list_namespaces(sb.prefix) == [] and own_links(sb) == set()
        assert cleanup_stale(sb.prefix) == []
    finally:
        sb.destroy()


@needs_root
def test_failed_create_cleans_up_what_it_made(run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = sandbox_mod._run
    calls = {"n": 0}

    def failing(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if argv[:3] == ("ip", "netns", "add"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise SandboxError("injected failure")
        return real_run(*argv, check=check)

    monkeypatch.setattr(sandbox_mod, "_run", failing)
    sb = NetnsSandbox(run_id, 3)
    with pytest.raises(SandboxError, match="injected failure"):
        sb.create()
    monkeypatch.undo()
    assert list_namespaces(sb.prefix) == [] and own_links(sb) == set()


@needs_root
def test_subnet_avoids_networks_in_use(run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = pick_subnet(run_id)
    assert pick_subnet(run_id) == first  # derived from the run id
    assert not any(first.overlaps(a.network) for a in addresses_in_root())
    monkeypatch.setattr(sandbox_mod, "_networks_in_use", lambda: [first])
    second = pick_subnet(run_id)
    assert second != first and not second.overlaps(first)
    monkeypatch.setattr(sandbox_mod, "_networks_in_use", lambda: [ipaddress.IPv4Network("10.0.0.0/8")])
    with pytest.raises(SandboxError, match="no free"):
        pick_subnet(run_id)


def test_without_root_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError) as info:
        NetnsSandbox("x", 2).create()
    assert "needs root" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(SandboxError, match="needs root"):
        cleanup_stale("ffctl-nothing-")


@pytest.mark.parametrize("n", [0, 251])
def test_node_count_is_checked(n: int) -> None:
    with pytest.raises(SandboxError, match=str(n)):
        NetnsSandbox("x", n)


def test_names_fit_the_kernel_limits() -> None:
    sb = NetnsSandbox("a-very-long-run-id-" * 10, 250)
    assert len(sb.bridge) <= 15
    names = sb.node_names()
    assert all(len(n.interface) <= 15 and len(n.host_interface) <= 15 for n in names)
    assert all(n.netns.startswith("ffctl-") for n in names)

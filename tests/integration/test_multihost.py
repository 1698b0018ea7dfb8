"""`ffctl launch --hosts` across real sshd hosts in network namespaces.

Each host is a network namespace with its own address and sshd; the controller stays in the root
namespace on the bridge. The job must run, survive the loss of a host's agent and ranks (peer
recovery from the ring neighbour's memory) and a partition of one host, and leave nothing on any
host however it ends (completed, interrupted, controller killed).
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from runs.events import EventKind
from tests.conftest import needs_root
from tests.helpers.launch import shm_left, stop_at_end, wait_event
from tests.helpers.multihost import (
    SETENV,
    Site,
    eventually,
    ffctl_in_namespaces,
    iptables_rules,
    make_site,
    processes_under,
)
from tests.helpers.sshd import checked_sshd_cluster

# Jobs across sshd hosts in network namespaces: hosts checked, agents started over SSH, a host lost.
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 30
LONG_STEPS = 300  # tiny steps take ~20 ms: a job that outlasts a fault applied over SSH


def _dealt(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's faults less a rank the straggler detector named that came back to pace by
    itself: a loaded host deschedules a rank for a second now and then (seen before a partition
    at step 10), the detector is right to name it, and it fails nothing."""
    return [f for f in report["faults"]
            if not (f["kind"] == "detected" and f.get("cause") == "straggler" and f.get("recovered"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with checked_sshd_cluster(2, setenv=SETENV) as cluster:
        yield make_site(cluster, tmp_path_factory.mktemp("multihost"))


@pytest.fixture
def hosts(site: Site) -> Path:
    return site.hostfile("node0 slots=2", "node1 slots=2")


def python_args() -> list[str]:
    # The hosts share this filesystem: their python is the one running the tests.
    return ["--remote-python", sys.executable]


def assert_nothing_left(site: Site, timeout: float = 30.0) -> None:
    left = eventually(lambda: ffctl_in_namespaces(site.cluster) + processes_under(site.remote), timeout)
    assert not left, f"processes outlived the run: {left}"
    assert iptables_rules(site.cluster) == []


def faults(site: Site, run_id: str) -> list[dict[str, object]]:
    found: list[dict[str, object]] = site.report(run_id)["faults"]
    return found


_baseline: dict[str, list[list[float]]] = {}


@needs_root
def test_dry_run_names_the_hosts_and_connects_to_none(site: Site, hosts: Path) -> None:
    sessions = [h.log.read_text().count("Accepted publickey") for h in site.cluster.hosts]
    out = site.launch("dry", hosts, "--dry-run", "--steps", "5", *python_args())
    assert out.returncode == 0, out.stderr
    assert "node 0: agent" in out.stdout and "on node0" in out.stdout
    assert "node 1: agent" in out.stdout and "on node1" in out.stdout
    assert "2 node(s) x 2 rank(s)" in out.stdout
    assert not site.record("dry").exists()
    # No host was logged in to.
    assert [h.log.read_text().count("Accepted publickey") for h in site.cluster.hosts] == sessions


@needs_root
def test_job_runs_across_hosts(site: Site, hosts: Path) -> None:
    out = site.launch("plain", hosts, "--steps", str(STEPS), *python_args())
    assert out.returncode == 0, out.stdout + out.stderr
    report = site.report("plain")
    assert report["status"] == "completed"
    assert report["world_size"] == 4 and report["steps_completed"] == STEPS
    _baseline["plain"] = report["loss_by_step"]

    info = site.run_info("plain")
    cluster = site.cluster
    # The store listens on the launch host's bridge address, never on every interface.
    assert info["controller"]["address"] == f"{cluster.prefix}.1"
    details = info["host_details"]
    assert [d["host"] for d in details] == ["node0", "node1"]
    for d, host in zip(details, cluster.hosts):
        assert d["address"] == host.address
        assert d["interface"] == f"ffs{cluster.uid}n{host.alias[-1]}"
        # Same machine, same clock: the estimate is off by at most half its round trip.
        assert d["clock_offset_s"] is not None and d["clock_rtt_s"] is not None
        assert abs(d["clock_offset_s"]) <= d["clock_rtt_s"] / 2 + 0.01

    started = [ev for ev in site.events("plain") if ev.kind is EventKind.AGENT_STARTED]
    assert sorted(ev.get("node") for ev in started) == [0, 1]
    for ev in started:
        assert ev.get("clock_offset_source") == "ntp"
        assert ev.get("clock_offset_s") == details[ev.get("node")]["clock_offset_s"]

    # The hosts' logs came home; their run directories are gone.
    logs = site.record("plain") / "logs"
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        for rank in ranks:
            assert (logs / str(node) / f"{rank}.log").is_file()
        assert (logs / f"agent-{node}.log").is_file()
    assert not (site.remote / "plain").exists()
    assert_nothing_left(site)


@needs_root
def test_same_losses_as_local_nodes(site: Site, hosts: Path) -> None:
    if "plain" not in _baseline:
        pytest.skip("needs test_job_runs_across_hosts")
    out = site.ffctl("launch", "--nnodes", "2", "--nproc-per-node", "2", "--steps", str(STEPS),
                     "--run-id", "local", "--runs-dir", str(site.runs))
    assert out.returncode == 0, out.stdout + out.stderr
    # Same seed, same world: bit-for-bit the same losses, over SSH or not.
    assert site.report("local")["loss_by_step"] == _baseline["plain"]


@needs_root
def test_kill_node_recovers_from_peer_memory(site: Site, hosts: Path) -> None:
    # Enough steps that the job is still training when the kill, sent over SSH, lands.
    out = site.launch("killnode", hosts, "--steps", str(LONG_STEPS), "--recovery", "peer", "--spares", "1",
                      "--inject", "kill-node:node=1,step=10", *python_args())
    assert out.returncode == 0, out.stdout + out.stderr
    report = site.report("killnode")
    assert report["status"] == "completed" and report["steps_completed"] == LONG_STEPS
    (fault,) = _dealt(report)
    assert fault["kind"] == "kill-node"
    assert fault["restore_source"] == "peer-memory"
    assert fault["detected_at"] is not None and fault["resumed_at"] is not None
    events = site.events("killnode")
    injected = next(ev for ev in events if ev.kind is EventKind.FAULT_INJECTED)
    # The kill ran on node1 itself, over its SSH connection.
    assert all(c.startswith("[node1] kill -KILL") for c in injected.get("commands"))
    lost = [ev for ev in events if ev.kind is EventKind.NODE_LOST]
    assert [ev.get("node") for ev in lost] == [1]
    # node1's agent was started again on the same host.
    assert [ev.get("node") for ev in events if ev.kind is EventKind.AGENT_STARTED].count(1) == 2
    if "plain" in _baseline:  # the recovered run trained exactly as the fault-free one
        assert report["loss_by_step"][:STEPS] == _baseline["plain"]
    assert_nothing_left(site)


@needs_root
def test_partition_of_one_host_is_detected_recovered_and_reverted(site: Site, hosts: Path) -> None:
    # Applying the partition takes a dozen SSH commands (seconds on a loaded machine) and its
    # duration counts from before them: 10 s leaves the hang detector (2 s) a stall to see, and
    # the job is long enough to still be training when the rules are in. A longer partition
    # only makes the test slower: connections caught in it back off exponentially (TCP
    # retransmission), so the rendezvous after the revert can wait about as long again.
    # The job is stopped (Ctrl-C) once it trains again after the revert.
    proc = site.start_launch("partition", hosts, "--steps", "100000", "--hang-timeout", "2",
                             "--inject", "net-partition:node=1,step=10,duration=10", *python_args())
    with stop_at_end(proc) as stopped:
        wait_for_step(site, "partition", 1)
        path = site.record("partition") / "events.jsonl"
        reverted = wait_event(path, lambda ev: ev.kind is EventKind.FAULT_REVERTED, timeout=240)
        again = wait_event(path, lambda ev: ev.kind is EventKind.STEP and ev.t > reverted.t
                           and int(ev.get("gen", 0)) >= 1, timeout=240)
        wait_for_step(site, "partition", int(again.get("step")) + 5)
    assert stopped.code == 130, stopped.stderr
    report = site.report("partition")
    assert report["status"] == "interrupted"
    (fault,) = _dealt(report)
    assert fault["kind"] == "net-partition"
    assert fault["detected_at"] is not None, f"the partition was never detected: {timeline(site, 'partition')}"
    assert fault["resumed_at"] is not None
    events = site.events("partition")
    kinds = [ev.kind for ev in events]
    assert EventKind.FAILURE_DETECTED in kinds and EventKind.FAULT_REVERTED in kinds
    injected = next(ev for ev in events if ev.kind is EventKind.FAULT_INJECTED)
    commands = injected.get("commands")
    assert commands and all(c.startswith("[node1] iptables") for c in commands)
    # The controller and SSH stayed reachable: exempt in node1's chain.
    assert any(f"-s {site.cluster.prefix}.1 " in c for c in commands)
    assert any("--dport 22" in c for c in commands)
    assert any(f"-d {site.cluster.hosts[0].address} " in c and c.endswith("DROP") for c in commands)
    assert_nothing_left(site)  # rules, dead man's switches, agents, ranks


@needs_root
def test_interrupt_stops_every_host_and_brings_logs_home(site: Site, hosts: Path) -> None:
    proc = site.start_launch("interrupted", hosts, "--steps", "100000", *python_args())
    with stop_at_end(proc) as stopped:
        wait_for_step(site, "interrupted", 3)
    assert stopped.code == 130, stopped.stderr
    finished = [ev for ev in site.events("interrupted") if ev.kind is EventKind.RUN_FINISHED]
    assert finished and finished[-1].get("status") == "interrupted"
    assert (site.record("interrupted") / "logs" / "1" / "2.log").is_file()
    assert not (site.remote / "interrupted").exists()
    assert_nothing_left(site)


@needs_root
def test_killed_controller_takes_every_agent_and_rank_with_it(site: Site, hosts: Path) -> None:
    proc = site.start_launch("orphaned", hosts, "--steps", "100000", "--spares", "1", *python_args())
    try:
        wait_for_step(site, "orphaned", 3)
        assert ffctl_in_namespaces(site.cluster), "no agent seen on the hosts"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The SSH connections die with the controller; each host's wrapper then stops its agent's
    # process group (agent, ranks, spares), and each agent removes its node's shared memory
    # before the wrapper's deadline (a store call that waited out its timeout on the dead
    # controller once outlasted it).
    assert_nothing_left(site, timeout=60.0)
    assert not shm_left("orphaned")


def timeline(site: Site, run_id: str) -> list[str]:
    """The run's events but steps and snapshots, in seconds from the first (for failure messages)."""
    events = site.events(run_id)
    t0 = events[0].t if events else 0.0
    skip = {EventKind.STEP, EventKind.SNAPSHOT_TAKEN}
    return [f"{ev.t - t0:.2f} {ev.kind.value} {dict(ev.data)}"[:300] for ev in events if ev.kind not in skip]


def wait_for_step(site: Site, run_id: str, step: int, timeout: float = 240.0) -> None:
    path = site.record(run_id) / "events.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("event") == "step" and ev.get("step", 0) >= step:
                    return
        time.sleep(0.2)
    raise AssertionError(f"{run_id} reached no step {step} within {timeout:g}s")

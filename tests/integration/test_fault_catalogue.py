"""The fault catalogue end to end: every kind of docs/guides/faults.md's table injected into a running
two-node job through `ffctl launch --inject` or `ffctl inject`, with real processes, real gloo
and (for the network kinds) real network namespaces.

Each job carries several faults at different steps, so one start-up pays for many of them; every
fault's own figures are asserted: it was detected (`detection_s`) by the detector its kind
should trip, the job recovered (`recovery_s`) and completed, and GPU kinds say `emulated: true` on
a host without a GPU. Faults that cannot work here (net-delay / net-loss without netem, a rank
that does not exist) are refused with one line and exit 2 before anything is recorded as
injected. Also here: the dead man's switch reverting a partition after the controller is
SIGKILLed, `--dry-run` of `launch` and `inject`, seeded chaos schedules, and `--sandbox netns`
without root.

Every test leaves nothing behind: no process started from its directory, no namespace, iptables
rule, qdisc, dead man's switch or shared-memory file of its runs (checked, then cleaned anyway).
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest

from fault_injectors import FaultKind, deadman
from fault_injectors.plan import HostCommand, NodePlace, RankPlace, Topology
from fault_injectors.revert import revert_all
from fault_injectors.schedule import parse_chaos
from fault_injectors.targets import resolve
from fault_injectors.transport import LocalTransport, Transport
from ffctl.controller.faultplan import chaos_faults
from ffctl.backends.netns import cleanup_stale, list_namespaces, short_id
from runs.events import Event, EventKind
from runs import shm
from runs.store import iter_events
from tests.conftest import is_root, needs_root
from tests.helpers.launch import stop_at_end

# Two-node jobs that each take several faults of the catalogue in turn.
pytestmark = pytest.mark.timeout(420)

CPU_ONLY = not __import__("torch").cuda.is_available()
HANG_MIN_S = 5.0  # the controller's hang_min_s default
# Roomier than the 1 s default: on two shared cores an agent busy starting torch processes can
# miss a second of heartbeats, and a node lost before the first step leaves no state to restore.
HEARTBEAT_S = 3.0
DEADMAN_GRACE_S = deadman.DEFAULT_GRACE_S


# --- running ffctl ----------------------------------------------------------------------------


def rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def ffctl(cwd: Path, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ffctl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def start_launch(cwd: Path, run_id: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ffctl", "launch", "--run-id", run_id, "--runs-dir",
                             str(cwd / "runs"), "--model", "tiny", "--heartbeat-timeout", f"{HEARTBEAT_S:g}", *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"ffctl launch did not finish within {timeout:g}s:\n{err[-3000:]}") from None
    return proc.returncode, out, err


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`ffctl ARGS` inside this process (no interpreter start-up): exit code, stdout, stderr."""
    from ffctl.cli.app import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def events(cwd: Path, run_id: str) -> list[Event]:
    path = cwd / "runs" / run_id / "events.jsonl"
    return list(iter_events(path)) if path.exists() else []


def report(cwd: Path, run_id: str) -> dict[str, Any]:
    out = ffctl(cwd, "report", run_id, "--runs-dir", str(cwd / "runs"), "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def wait_event(cwd: Path, run_id: str, pred: Callable[[Event], bool], timeout: float,
               proc: subprocess.Popen[str] | None = None) -> Event:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in events(cwd, run_id):
            if pred(ev):
                return ev
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"ffctl launch exited ({proc.returncode}) before the awaited event")
        time.sleep(0.1)
    raise AssertionError(f"no matching event in run {run_id} after {timeout:g}s")


def step_at_least(step: int) -> Callable[[Event], bool]:
    return lambda ev: ev.kind is EventKind.STEP and int(ev.get("step")) >= step


# --- leftovers --------------------------------------------------------------------------------


def processes_in(cwd: Path) -> list[psutil.Process]:
    """ffctl processes (controller, agents, ranks, spares, dead man's switches) started from `cwd`,
    inside a sandbox namespace or not (a process's working directory is seen from everywhere)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.pid != os.getpid() and "ffctl" in cmd and Path(proc.cwd()) == cwd:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
            continue
    return found


def sh(*argv: str, netns: str | None = None) -> str:
    full = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    return subprocess.run(full, capture_output=True, text=True, timeout=30, check=False).stdout


def leftovers(cwd: Path, run_ids: list[str]) -> list[str]:
    left = [f"process {p.pid}: {' '.join(p.info['cmdline'] or [])}" for p in processes_in(cwd)]
    for run_id in run_ids:
        left += [f"shm {p}" for p in Path("/dev/shm").glob(f"ffctl-{run_id}-*")]
        if not is_root():
            continue
        left += [f"namespace {ns}" for ns in list_namespaces(f"ffctl-{short_id(run_id)}-")]
        left += [f"link {p.name}" for p in Path("/sys/class/net").iterdir() if short_id(run_id) in p.name]
        left += [f"iptables {line}" for line in sh("iptables", "-w", "-S").splitlines() if f"ffctl:{run_id}:" in line]
        left += [f"switch {pid}" for pid in sh("pgrep", "-f", "--", deadman.pattern(run_id)).split()]
    if is_root():
        left += [f"qdisc {line}" for line in sh("tc", "qdisc", "show").splitlines() if " ffc1: " in line]
    return left


def assert_clean(cwd: Path, run_ids: list[str], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    left = leftovers(cwd, run_ids)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = leftovers(cwd, run_ids)
    assert not left, left


def _local(cmd: HostCommand) -> Transport:
    return LocalTransport(cmd.host, cmd.netns)


def scrub(cwd: Path, run_ids: list[str]) -> None:
    """Take down whatever a failed test left: processes, switches, namespaces, rules, files."""
    for proc in processes_in(cwd):
        try:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    for run_id in run_ids:
        for path in shm.own_run_dirs(run_id=run_id):  # the test's own, even if a killed process holds it
            shm.remove_run_dir(path)
        if not is_root():
            continue
        prefix = f"ffctl-{short_id(run_id)}-"
        for ns in list_namespaces(prefix):
            for pid in sh("ip", "netns", "pids", ns).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                revert_all("localhost", _local, netns=ns, run_id=run_id)
            except Exception:  # the namespace goes next anyway
                pass
        subprocess.run(["pkill", "-TERM", "-f", "--", deadman.pattern(run_id)], check=False)
        cleanup_stale(prefix)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A directory to run ffctl from, and the list of run ids the test uses (cleaned afterwards)."""
    run_ids: list[str] = []
    try:
        yield tmp_path, run_ids
    finally:
        scrub(tmp_path, run_ids)


# --- per-fault checks -------------------------------------------------------------------------


def by_kind(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {f["kind"]: f for f in rep["faults"]}
    assert len(out) == len(rep["faults"]), [f["kind"] for f in rep["faults"]]
    return out


def detection(evs: list[Event], fault_id: str) -> Event:
    found = [ev for ev in evs if ev.kind is EventKind.FAILURE_DETECTED and fault_id in (ev.get("fault_ids") or [])]
    assert found, f"{fault_id} was never detected"
    assert found[0].get("fault_ids") == [fault_id], f"{fault_id} detected together with {found[0].get('fault_ids')}"
    return found[0]


def assert_recovered(f: dict[str, Any], evs: list[Event], cause: str) -> None:
    """Detected by `cause`, recovered, with both figures and a consistent breakdown."""
    ev = detection(evs, f["fault_id"])
    assert cause in ev.get("cause"), (f["kind"], ev.get("cause"), ev.get("detail"))
    assert f["recovered"], f
    assert f["detection_s"] is not None and f["detection_s"] >= 0, f
    assert f["recovery_s"] is not None and f["recovery_s"] >= f["detection_s"], f
    assert f["emulated"] is (CPU_ONLY and f["kind"].startswith("gpu-")), f


def figures(rep: dict[str, Any]) -> str:
    return ", ".join(f"{f['kind']} detect {f['detection_s']} recover {f['recovery_s']}" for f in rep["faults"])


COVERED: set[str] = set()  # kinds the tests below inject (checked against the whole table)
# The stragglers are injected end to end, detected and billed in tests/e2e/test_stragglers.py.
COVERED.update({"slow-rank", "slow-node"})
# corrupt-snapshot, with a kill behind it, in tests/e2e/test_recovery.py (the fallback to another copy).
COVERED.add("corrupt-snapshot")


# --- process and GPU kinds --------------------------------------------------------------------

# Rank 1 and rank 0 in turn, far enough apart that each fault is recovered before the next fires.
# What the rank's error report says for each in-step kind (its first line).
ERROR_TEXT = {"crash-rank": "crash-rank", "gpu-error": "illegal memory access", "gpu-oom": "out of memory",
              "gpu-xid": "xid"}
PROCESS_GPU = [
    ("kill-rank", 1, 20, "process-exit"),
    ("term-rank", 0, 70, "process-exit"),
    ("crash-rank", 1, 120, "step-error"),
    ("gpu-error", 0, 170, "step-error"),
    ("gpu-oom", 1, 220, "step-error"),
    ("gpu-xid", 0, 270, "step-error"),
    ("hang-rank", 1, 320, "hang"),
    ("gpu-hang", 0, 370, "hang"),
]
PROCESS_GPU_STEPS = 450
COVERED.update(k for k, *_ in PROCESS_GPU)


def test_process_and_gpu_faults_are_detected_and_recovered(workdir: tuple[Path, list[str]]) -> None:
    cwd, run_ids = workdir
    run_id = rid("procgpu")
    run_ids.append(run_id)
    injects = [a for kind, rank, step, _ in PROCESS_GPU for a in ("--inject", f"{kind}:rank={rank},step={step}")]
    proc = start_launch(cwd, run_id, "--nnodes", "2", "--nproc-per-node", "1", "--steps", str(PROCESS_GPU_STEPS),
                        "--spares", "1", *injects)
    code, _, err = finish(proc, 360)
    assert code == 0, err[-3000:]
    rep, evs = report(cwd, run_id), events(cwd, run_id)
    assert rep["status"] == "completed" and rep["steps_completed"] == PROCESS_GPU_STEPS, rep
    faults = by_kind(rep)
    assert sorted(faults) == sorted(k for k, *_ in PROCESS_GPU), figures(rep)
    for kind, rank, _, cause in PROCESS_GPU:
        f = faults[kind]
        assert f["target"] == f"rank:{rank}"
        assert_recovered(f, evs, cause)
        if cause == "step-error":
            # The rank said what went wrong before it went down: the error's first line.
            errors = [ev for ev in evs if ev.kind is EventKind.RANK_EXITED and ev.get("reason") == "error-in-step"
                      and ev.get("rank") == rank and ev.t >= f["injected_at"]]
            assert errors and ERROR_TEXT[kind] in errors[0].get("error").lower(), errors
            assert "\n" not in errors[0].get("error")
        if cause == "hang":
            # Found by the hang detector (no progress for max(10 x median step, 5 s)), then the
            # stuck rank, which never acknowledged the abort, was replaced.
            assert f["detection_s"] >= HANG_MIN_S - 0.5, f
            decided = [ev for ev in evs if ev.kind is EventKind.RECOVERY_DECIDED and f["fault_id"] in ev.get("fault_ids")]
            assert decided and decided[0].get("ranks") == [rank], decided
    assert [ev.get("emulated") for ev in evs if ev.kind is EventKind.FAULT_INJECTED and
            str(ev.get("kind")).startswith("gpu-")] == [CPU_ONLY] * 4
    print("process/gpu:", figures(rep))
    assert_clean(cwd, run_ids)


# --- node kinds -------------------------------------------------------------------------------

COVERED.update({"kill-node", "reboot-node"})


def test_node_faults_are_detected_and_recovered(workdir: tuple[Path, list[str]],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cwd, run_ids = workdir
    run_id = rid("node")
    run_ids.append(run_id)
    # No spares. The lost node's rank is forked from node 0's warm template (a CPU host) and
    # restores from the copy node 0 holds as node 1's ring neighbour; node 1's agent comes back
    # empty and holds replicas of node 0's slots (both ranks) again. The reboot then hits node
    # 0, which holds both ranks, once node 1 holds their replicas: they restore from node 1.
    # The kill is injected by hand once the dry run has looked at node 1: scheduled at a step, it
    # could land first (the tiny model trains 20 steps in half a second) and move rank 1 away.
    proc = start_launch(cwd, run_id, "--nnodes", "2", "--nproc-per-node", "1", "--steps", "2000")
    with stop_at_end(proc) as stopped:
        wait_event(cwd, run_id, step_at_least(1), 240, proc)
        # A dry run prints the exact commands (live pids) and changes nothing.
        code, out, _ = in_process(capsys, "inject", "kill-node", "--run", run_id, "--node", "1", "--dry-run",
                                  "--runs-dir", str(cwd / "runs"))
        assert code == 0
        assert re.search(r"apply:\s+\[localhost\] kill -KILL \d+ \d+", out), out
        code, out, err = in_process(capsys, "inject", "kill-rank", "--run", run_id, "--rank", "5",
                                    "--runs-dir", str(cwd / "runs"))
        assert code == 2 and "rank 5" in err and len(err.strip().splitlines()) == 1, err
        wait_event(cwd, run_id, step_at_least(20), 240, proc)
        code, out, err = in_process(capsys, "inject", "kill-node", "--run", run_id, "--node", "1",
                                    "--runs-dir", str(cwd / "runs"))
        assert code == 0, err
        moved = wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.RECOVERY_DECIDED, 120, proc)
        assert moved.get("placement") == {"1": 0}, moved.data  # onto the survivor, not waiting for node 1
        back = wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.AGENT_STARTED and ev.get("node") == 1
                          and ev.t > moved.t, 240, proc)
        # Node 0's snapshots reach node 1 again (a `snapshot_taken` of node 0 held off-node), and
        # node 1's template is warm again.
        wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.SNAPSHOT_TAKEN and ev.get("node") == 0
                   and ev.t > back.t and sorted(ev.get("ranks") or []) == [0, 1], 120, proc)
        wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.SPARES_HELD and ev.get("node") == 1
                   and ev.t > back.t and ev.get("template") is True, 120, proc)
        code, out, err = in_process(capsys, "inject", "reboot-node", "--run", run_id, "--node", "0",
                                    "--runs-dir", str(cwd / "runs"))
        assert code == 0, err
        # Once the job trains again past the second restore, both faults have all their figures:
        # stopping it there (Ctrl-C) spares the test the rest of the 2000 steps.
        rebooted = wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.FAULT_INJECTED
                              and ev.get("kind") == "reboot-node", 60, proc)
        restored = wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.RESTORE_DONE and ev.t > rebooted.t, 240, proc)
        wait_event(cwd, run_id, step_at_least(int(restored.get("step")) + 5), 240, proc)
    assert stopped.code == 130, stopped.stderr[-3000:]
    rep, evs = report(cwd, run_id), events(cwd, run_id)
    assert rep["status"] == "interrupted" and rep["steps_completed"] < 2000
    faults = by_kind(rep)
    assert sorted(faults) == ["kill-node", "reboot-node"], figures(rep)  # nothing from the dry run
    for kind in ("kill-node", "reboot-node"):
        f = faults[kind]
        assert_recovered(f, evs, "node-lost")
        assert f["restore_source"] == "peer-memory", f
    spawned = [ev for ev in evs if ev.kind is EventKind.RANKS_SPAWNED and ev.get("gen") > 0]
    assert [ev.get("started_by") for ev in spawned] == [{"1": "template"}, {"0": "template", "1": "template"}]
    decided = [ev.get("placement") for ev in evs if ev.kind is EventKind.RECOVERY_DECIDED]
    assert decided == [{"1": 0}, {"0": 1, "1": 1}]  # each time onto the surviving node
    print("node:", figures(rep))
    assert_clean(cwd, run_ids)


# --- network kinds, in the sandbox ------------------------------------------------------------

COVERED.update({"net-partition", "net-port-block", "net-bandwidth", "link-down"})


def kernel_has_netem() -> bool:
    probe = subprocess.run(["unshare", "-n", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True, check=False)
    return probe.returncode == 0


def collective_ports(netns: str, pid: int, peer: str) -> list[int]:
    """Local ports of `pid`'s TCP connections to `peer` inside `netns`: its gloo pairs."""
    ports = []
    for line in sh("ss", "-tnpH", "state", "established", netns=netns).splitlines():
        words = line.split()
        local, remote = words[-3], words[-2]
        if f"pid={pid}," in line and remote.rsplit(":", 1)[0] == peer:
            ports.append(int(local.rsplit(":", 1)[1]))
    return sorted(set(ports))


@needs_root
def test_network_faults_in_the_sandbox(workdir: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    cwd, run_ids = workdir
    run_id = rid("net")
    run_ids.append(run_id)
    sb_prefix = f"ffctl-{short_id(run_id)}-"
    ns1 = f"{sb_prefix}n1"
    steps = 1000
    # The partition outlasts the hang timeout by 5 s: the step in flight when it lands can still
    # commit seconds into it (2 s once, on a loaded host), and the hang is counted from the last
    # commit; a 6 s partition then went undetected.
    proc = start_launch(cwd, run_id, "--sandbox", "netns", "--nnodes", "2", "--nproc-per-node", "1",
                        "--steps", str(steps), "--spares", "1",
                        "--inject", f"net-partition:node=1,step=400,duration={HANG_MIN_S + 5:g}",
                        "--inject", "net-bandwidth:node=1,step=600,duration=3,rate=2mbit",
                        "--inject", f"link-down:node=1,step=800,duration={HEARTBEAT_S + 3:g}")
    runs = str(cwd / "runs")
    try:
        spawned = wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.RANKS_SPAWNED, 240, proc)
        wait_event(cwd, run_id, step_at_least(2), 120, proc)
        info = json.loads((cwd / "runs" / run_id / "run.json").read_text())
        ctl = info["controller"]["address"]
        # The store listens on the sandbox bridge only, never on every interface.
        listening = [c.laddr.ip for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == "LISTEN"]
        assert listening and set(listening) == {ctl}, listening
        rank1 = int(spawned.get("pids")["1"])
        environ = Path(f"/proc/{rank1}/environ").read_bytes().split(b"\0")
        assert f"GLOO_SOCKET_IFNAME=ffv{short_id(run_id)}n1".encode() in environ

        # Refused up front: one line, exit 2, nothing recorded, nothing changed.
        code, _, err = in_process(capsys, "inject", "kill-rank", "--run", run_id, "--rank", "3", "--runs-dir", runs)
        assert code == 2 and "rank 3" in err, err
        if not kernel_has_netem():
            for kind in ("net-delay", "net-loss"):
                code, _, err = in_process(capsys, "inject", kind, "--run", run_id, "--node", "1", "--runs-dir", runs)
                assert code == 2 and "netem" in err and len(err.strip().splitlines()) == 1, err
                assert "ffc1:" not in sh("tc", "qdisc", "show", netns=ns1)

        # Block rank 1's collective ports: a dry run first, then for real.
        node0 = str(ipaddress.ip_address(ctl) + 1)  # the sandbox layout: bridge .1, node i at .(i+2)
        ports = collective_ports(ns1, rank1, node0)
        assert ports, sh("ss", "-tnpH", netns=ns1)
        option = "ports=" + "|".join(map(str, ports))
        code, out, _ = in_process(capsys, "inject", "net-port-block", "--run", run_id, "--node", "1", "-o", option,
                                  "--duration", "8", "--dry-run", "--runs-dir", runs)
        assert code == 0 and f"ip netns exec {ns1} iptables -w -N FFCTL-" in out, out
        assert f"--dport {ports[0]}" in out and "guard:" in out and "revert:" in out, out
        assert "FFCTL" not in sh("iptables", "-w", "-S", netns=ns1)
        code, out, err = in_process(capsys, "inject", "net-port-block", "--run", run_id, "--node", "1", "-o", option,
                                    "--duration", "8", "--runs-dir", runs)
        assert code == 0, err
        fid = re.search(r"as (f\d+)", out).group(1)  # type: ignore[union-attr]
        assert "FFCTL" in sh("iptables", "-w", "-S", netns=ns1)
        wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.FAILURE_DETECTED and fid in ev.get("fault_ids"),
                   60, proc)
    finally:
        code, _, err = finish(proc, 420)
    assert code == 0, err[-3000:]
    rep, evs = report(cwd, run_id), events(cwd, run_id)
    assert rep["status"] == "completed" and rep["steps_completed"] == steps, rep
    faults = by_kind(rep)
    assert sorted(faults) == ["link-down", "net-bandwidth", "net-partition", "net-port-block"], figures(rep)
    # A partition and a blocked port stall the collective: the hang detector finds them; the
    # next generation's rendezvous succeeds once the partition is reverted (new ports for the block).
    for kind in ("net-partition", "net-port-block"):
        assert_recovered(faults[kind], evs, "hang")
        assert faults[kind]["detection_s"] >= HANG_MIN_S - 0.5
    part = faults["net-partition"]
    reverted = [ev for ev in evs if ev.kind is EventKind.FAULT_REVERTED and ev.get("fault_id") == part["fault_id"]]
    assert reverted and part["resumed_at"] >= reverted[0].t
    # A downed link takes the node's agent off the controller: lost heartbeat.
    assert_recovered(faults["link-down"], evs, "node-lost")
    assert HEARTBEAT_S - 0.5 <= faults["link-down"]["detection_s"] <= HEARTBEAT_S + 2.0
    # A bandwidth limit slows the job and breaks nothing: no detection, and it was reverted.
    bw = faults["net-bandwidth"]
    assert bw["detection_s"] is None and bw["recovery_s"] is not None, bw
    bw_rev = [ev for ev in evs if ev.kind is EventKind.FAULT_REVERTED and ev.get("fault_id") == bw["fault_id"]]
    assert bw_rev
    # It did slow the job: fewer steps while it held than in as long a stretch just before.
    held = bw_rev[0].t - bw["injected_at"]
    steps_in = lambda a, b: sum(1 for ev in evs if ev.kind is EventKind.STEP and a < ev.t <= b)  # noqa: E731
    shaped, before = steps_in(bw["injected_at"], bw_rev[0].t), steps_in(bw["injected_at"] - held, bw["injected_at"])
    assert shaped < before / 2, (shaped, before)
    assert not any(ev.kind is EventKind.FAULT_INJECTED and ev.get("kind") in ("net-delay", "net-loss", "kill-rank")
                   for ev in evs)
    print("network:", figures(rep))
    assert not list_namespaces(sb_prefix)
    assert_clean(cwd, run_ids)


@needs_root
@pytest.mark.parametrize("kind", ["net-delay", "net-loss"])
def test_netem_kinds_are_refused_before_anything_starts(workdir: tuple[Path, list[str]], kind: str) -> None:
    if kernel_has_netem():
        pytest.skip("this kernel has netem: net-delay and net-loss are possible here")
    cwd, run_ids = workdir
    run_id = rid("netem")
    run_ids.append(run_id)
    out = ffctl(cwd, "launch", "--run-id", run_id, "--runs-dir", str(cwd / "runs"), "--sandbox", "netns",
                "--nproc-per-node", "1", "--steps", "20", "--inject", f"{kind}:node=1,step=5,duration=3", timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and kind in lines[0] and "netem" in lines[0], out.stderr
    assert not (cwd / "runs" / run_id).exists()
    assert_clean(cwd, run_ids, within=2)


# --- the dead man's switch --------------------------------------------------------------------


@needs_root
def test_partition_is_reverted_after_the_controller_is_sigkilled(workdir: tuple[Path, list[str]]) -> None:
    cwd, run_ids = workdir
    run_id = rid("deadman")
    run_ids.append(run_id)
    ns1 = f"ffctl-{short_id(run_id)}-n1"
    duration = 10.0
    proc = start_launch(cwd, run_id, "--sandbox", "netns", "--nnodes", "2", "--nproc-per-node", "1",
                        "--steps", "100000", "--spares", "1",
                        "--inject", f"net-partition:node=1,step=5,duration={duration:g}")
    try:
        injected = wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.FAULT_INJECTED, 240, proc)
        # The injection is recorded before it is applied (the record keeps the intent even if
        # the controller dies while applying): wait for the rule itself.
        applied_by = time.monotonic() + 30.0
        while "FFCTL" not in sh("iptables", "-w", "-S", netns=ns1) and time.monotonic() < applied_by:
            time.sleep(0.1)
        assert "FFCTL" in sh("iptables", "-w", "-S", netns=ns1)
        time.sleep(2.0)  # in the middle of the partition
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # The switch, on the host inside the node's namespace, reverts by itself.
        deadline = injected.t + duration + DEADMAN_GRACE_S + 5.0
        while "FFCTL" in sh("iptables", "-w", "-S", netns=ns1) and time.time() < deadline:
            time.sleep(0.25)
        assert "FFCTL" not in sh("iptables", "-w", "-S", netns=ns1), "the partition outlived its switch"
        assert time.time() >= injected.t + duration, "reverted before its duration was over"
        # Agents see their stdin close and take their ranks and spares down, inside namespaces too.
        assert_clean(cwd, [], within=30)
        for ns in list_namespaces(f"ffctl-{short_id(run_id)}-"):
            assert not sh("ip", "netns", "pids", ns).split(), ns
        # The namespaces outlive the SIGKILL; `revert --all` (for this run) removes them.
        assert list_namespaces(f"ffctl-{short_id(run_id)}-")
        out = ffctl(cwd, "inject", "revert", "--all", "--run", run_id, timeout=120)
        assert out.returncode == 0, out.stderr
        assert not list_namespaces(f"ffctl-{short_id(run_id)}-")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert_clean(cwd, run_ids)


@needs_root
def test_sigterm_removes_the_sandbox(workdir: tuple[Path, list[str]]) -> None:
    cwd, run_ids = workdir
    run_id = rid("term")
    run_ids.append(run_id)
    proc = start_launch(cwd, run_id, "--sandbox", "netns", "--nnodes", "2", "--nproc-per-node", "1",
                        "--steps", "100000")
    with stop_at_end(proc, signal.SIGTERM) as stopped:
        wait_event(cwd, run_id, step_at_least(1), 240, proc)
        assert len(list_namespaces(f"ffctl-{short_id(run_id)}-")) == 2
    assert stopped.code == 130, stopped.stderr[-2000:]
    assert report(cwd, run_id)["status"] == "interrupted"
    assert not list_namespaces(f"ffctl-{short_id(run_id)}-")
    assert_clean(cwd, run_ids)


# --- dry runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sandbox", [False, pytest.param(True, marks=needs_root)])
def test_launch_dry_run_prints_each_hosts_commands_and_changes_nothing(workdir: tuple[Path, list[str]],
                                                                       sandbox: bool) -> None:
    cwd, run_ids = workdir
    run_id = rid("dry")
    run_ids.append(run_id)
    args = ["--nproc-per-node", "1", "--steps", "50", "--inject", "kill-rank:rank=1,step=5",
            "--inject", "hang-rank:rank=0,step=10,duration=4"]
    if sandbox:
        args += ["--sandbox", "netns", "--inject", "net-partition:node=1,step=20,duration=5"]
    out = ffctl(cwd, "launch", "--run-id", run_id, "--runs-dir", str(cwd / "runs"), "--dry-run", *args, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "apply:  [localhost] kill -KILL 20001" in text or "kill -KILL 20001" in text, text
    assert "kill -STOP 20000" in text and "kill -CONT 20000" in text and "ffctl-deadman:" + run_id + ":f2" in text
    if sandbox:
        ns = f"ffctl-{short_id(run_id)}-n1"
        assert f"`ip netns exec {ns} " in text
        assert f"ip netns exec {ns} iptables -w -N FFCTL-f3-" in text
        assert f"--comment ffctl:{run_id}:f3 -j DROP" in text
        assert not list_namespaces(f"ffctl-{short_id(run_id)}-")
    assert not (cwd / "runs" / run_id).exists()
    if is_root():  # this run's rules only: tests beside it may be adding rules of their own
        assert not [line for line in sh("iptables", "-w", "-S").splitlines() if run_id in line or short_id(run_id) in line]
    assert_clean(cwd, run_ids, within=2)


# --- chaos ------------------------------------------------------------------------------------

CHAOS = "mtbf=4s,seed=4,kinds=kill-rank|term-rank|crash-rank,until=12"


def test_chaos_schedule_is_the_same_for_the_same_seed() -> None:
    first = [(t, str(s), s.seed) for t, s in chaos_faults(parse_chaos(CHAOS))]
    again = [(t, str(s), s.seed) for t, s in chaos_faults(parse_chaos(CHAOS))]
    other = [(t, str(s), s.seed) for t, s in chaos_faults(parse_chaos(CHAOS.replace("seed=4", "seed=5")))]
    assert first == again and len(first) >= 2
    assert first != other
    assert all(t < 12 for t, *_ in first)


def test_chaos_run_records_the_schedule(workdir: tuple[Path, list[str]]) -> None:
    cwd, run_ids = workdir
    run_id = rid("chaos")
    run_ids.append(run_id)
    # What the seed says: kinds in order, each target picked with the fault's own seed from
    # the whole world (every rank placed when it fires), and its trigger time.
    world = Topology(run_id, (NodePlace(0, "localhost", "127.0.0.1", 1), NodePlace(1, "localhost", "127.0.0.1", 2)),
                     (RankPlace(0, 0, 1), RankPlace(1, 1, 2)))
    expected = [(spec.kind.value, list(resolve(spec, world)[0]), f"@t={t:g}")
                for t, spec in chaos_faults(parse_chaos(CHAOS))]
    last = f"f{len(expected)}"
    proc = start_launch(cwd, run_id, "--nnodes", "2", "--nproc-per-node", "1", "--steps", "100000", "--spares", "1",
                        "--chaos", CHAOS)
    # Stopped (Ctrl-C) once the schedule's last fault is recovered from and training goes on.
    with stop_at_end(proc) as stopped:
        decided = wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.RECOVERY_DECIDED
                             and last in (ev.get("fault_ids") or []), 240, proc)
        wait_event(cwd, run_id, lambda ev: ev.kind is EventKind.STEP and int(ev.get("gen", 0)) >= int(decided.get("gen"))
                   and int(ev.get("step")) >= int(decided.get("restore_step") or 0) + 10, 240, proc)
    assert stopped.code == 130, stopped.stderr[-3000:]
    rep, evs = report(cwd, run_id), events(cwd, run_id)
    assert rep["status"] == "interrupted"
    injected = [ev for ev in evs if ev.kind is EventKind.FAULT_INJECTED]
    got = [(ev.get("kind"), ev.get("ranks"), ev.get("trigger")) for ev in injected]
    assert got == expected, (got, expected)
    assert [ev.get("fault_id") for ev in injected] == [f"f{i}" for i in range(1, len(got) + 1)]
    assert json.loads((cwd / "runs" / run_id / "run.json").read_text())["spec"]["chaos"] == CHAOS
    for f in rep["faults"]:
        assert f["recovered"] and f["detection_s"] is not None and f["recovery_s"] is not None, f
    print("chaos:", figures(rep))
    assert_clean(cwd, run_ids)


# --- the sandbox without root -----------------------------------------------------------------


def test_sandbox_without_root_is_one_line_and_exit_2(workdir: tuple[Path, list[str]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from ffctl.cli.app import main

    cwd, run_ids = workdir
    run_id = rid("noroot")
    run_ids.append(run_id)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    runner = CliRunner()
    with runner.isolation() as streams:  # (stdout, stderr[, both]) by click version
        with pytest.raises(SystemExit) as exit_info:
            main(["launch", "--sandbox", "netns", "--run-id", run_id, "--runs-dir", str(cwd / "runs"),
                  "--steps", "5"])
        stderr = streams[1].getvalue().decode()
    assert exit_info.value.code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "root" in lines[0], stderr
    assert not (cwd / "runs" / run_id).exists()
    assert not list_namespaces(f"ffctl-{short_id(run_id)}-")
    assert_clean(cwd, run_ids, within=1)


def test_every_kind_of_the_table_is_covered() -> None:
    assert COVERED | {"net-delay", "net-loss"} == {k.value for k in FaultKind}

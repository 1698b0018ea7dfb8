"""SIGKILL of `ffctl launch` during a sandboxed network partition leaves a true record.

After the fault's duration and the dead man's switch's grace, nothing of the job is left but the
sandbox the record names: no process (agents, ranks, spares, switches), no ffctl chain or rule and
no qdisc in the job's namespaces or in the root namespace, no shared-memory file of the run. The
report says `incomplete` (controller lost), exits 1, shows the partition reverted by the dead
man's switch, and names the namespaces left; `ffctl inject revert --all --run` removes them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from fault_injectors import deadman, network
from ffctl.backends.netns import NetnsSandbox, cleanup_stale, list_namespaces
from runs.events import EventKind
from tests.conftest import needs_root
from tests.helpers.launch import processes_in, rid, run_ffctl, shm_left, start_launch, wait_event
from tests.helpers.netns import deadman_pids, ffctl_chains, sh, wait_for

# A sandboxed job partitioned, its controller killed, then the dead man's switch's grace waited out.
pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

DURATION_S = 6.0


def job_processes(cwd: Path, run_id: str) -> list[str]:
    """Every process of the job still running: anything started from `cwd` (controller, agents,
    ranks, spares) and the run's dead man's switches, wherever they run."""
    left = [" ".join(p.info["cmdline"] or []) for p in processes_in(cwd)]
    left += [f"dead man's switch pid {pid}" for pid in deadman_pids(run_id)]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if run_id in cmd and proc.pid != os.getpid() and "pytest" not in cmd:
            left.append(cmd)
    return sorted(set(left))


def qdiscs_of(netns: str | None) -> list[str]:
    """ffctl's qdiscs (reserved handle) in a namespace."""
    out = sh(netns, "tc", "qdisc", "show").stdout
    return [line for line in out.splitlines() if f" {network.QDISC_HANDLE} " in f" {line} "]


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A working directory and a run id; whatever the test leaves of the run is removed after."""
    run_id = rid("killed")
    try:
        yield tmp_path, run_id
    finally:
        for proc in processes_in(tmp_path):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        for pid in deadman_pids(run_id):
            subprocess.run(["kill", "-TERM", str(pid)], check=False)
        cleanup_stale(NetnsSandbox(run_id, 2).prefix)
        for path in shm_left(run_id):  # the run's private directory
            shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_sigkilled_controller_leaves_only_the_recorded_sandbox(job: tuple[Path, str]) -> None:
    cwd, run_id = job
    sb = NetnsSandbox(run_id, 2)
    namespaces = [f"{sb.prefix}n{i}" for i in range(2)]
    proc = start_launch(cwd, run_id, "--sandbox", "netns", "--nnodes", "2", "--nproc-per-node", "1",
                        "--steps", "100000", "--model", "tiny",
                        "--inject", f"net-partition:node=1,step=5,duration={DURATION_S:g}")
    events_path = cwd / "runs" / run_id / "events.jsonl"
    try:
        injected = wait_event(events_path, lambda ev: ev.kind is EventKind.FAULT_INJECTED, 240)
        # Written before it is applied: wait for the rule itself, then kill mid-partition.
        assert wait_for(lambda: bool(ffctl_chains(namespaces[1])), 30, 0.1), "the partition was never applied"
        assert deadman_pids(run_id), "the partition is guarded by a dead man's switch"
        info = json.loads((cwd / "runs" / run_id / "run.json").read_text())
        assert info["controller"]["pid"] == proc.pid
        assert info["sandbox"]["namespaces"] == namespaces
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed_at = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()

    # The switch reverts after the fault's duration plus its grace; nothing else waits that long.
    reverted_by = injected.t + DURATION_S + deadman.DEFAULT_GRACE_S + 10.0
    assert wait_for(lambda: not job_processes(cwd, run_id), max(30.0, reverted_by - time.time()), 0.25), \
        job_processes(cwd, run_id)
    assert time.time() >= injected.t + DURATION_S, "the partition ended before its duration"
    assert time.time() - killed_at < 60
    for ns in [None, *namespaces]:
        assert ffctl_chains(ns) == [], (ns, ffctl_chains(ns))
        assert qdiscs_of(ns) == [], (ns, qdiscs_of(ns))
    for ns in namespaces:
        assert not sh(None, "ip", "netns", "pids", ns).stdout.split(), f"a process still runs in {ns}"
    assert shm_left(run_id) == []

    # The record: incomplete, the partition reverted by the switch, the sandbox named as left.
    out = run_ffctl(cwd, "report", run_id, "--json", timeout=120)
    assert out.returncode == 1, out.stderr
    rep: dict[str, Any] = json.loads(out.stdout)
    assert rep["status"] == "incomplete" and rep["reason"] == "controller lost", rep
    (fault,) = rep["faults"]
    assert fault["kind"] == "net-partition" and fault["reverted_by"] == "deadman" and fault["revert_ok"] is True
    assert fault["reverted_at"] >= injected.t + DURATION_S
    assert rep["left"]["namespaces"] == namespaces
    assert rep["left"]["remove"] == f"ffctl inject revert --all --run {run_id}"
    text = run_ffctl(cwd, "report", run_id, timeout=120)
    assert text.returncode == 1
    assert "incomplete: controller lost" in text.stdout
    assert f"{fault['fault_id']}: reverted by the dead man's switch" in text.stdout
    assert f"left: network namespaces {', '.join(namespaces)}" in text.stdout

    # What the record says is left goes with `revert --all` for this run, and then nothing is.
    out = run_ffctl(cwd, "inject", "revert", "--all", "--run", run_id, timeout=120)
    assert out.returncode == 0, out.stderr
    assert list_namespaces(sb.prefix) == []
    assert not [p.name for p in Path("/sys/class/net").iterdir() if sb.short in p.name]
    rep = json.loads(run_ffctl(cwd, "report", run_id, "--json", timeout=120).stdout)
    assert rep["status"] == "incomplete" and rep["left"] == {}

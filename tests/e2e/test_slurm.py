"""`ffctl launch --backend slurm` against real Slurm daemons (tests/helpers/slurm.py): the
example batch script submitted with `sbatch`, a node killed by cancelling its agent's job step,
recovered from peer memory with the fault-free run's losses, Slurm's node names in the record,
and nothing left in Slurm afterwards."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runs.events import EventKind
from runs.store import read_deadman_lines
from tests.helpers.launch import assert_nothing_left, launch, rid, shm_left, wait_event, wait_step
from tests.helpers.slurm import SlurmCluster, skip_reason, slurm_cluster

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "ffctl.sbatch"
STEPS = 40
KILL_STEP = 8

_reason = skip_reason()
# A private Slurm cluster started, jobs submitted through it and trained: minutes each.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600), pytest.mark.skipif(_reason is not None, reason=_reason or "")]


@pytest.fixture()
def cluster(tmp_path: Path) -> SlurmCluster:
    with slurm_cluster(tmp_path, nnodes=3, netns=True) as c:
        yield c  # type: ignore[misc]


def test_private_cluster_runs_steps_on_named_nodes_and_cancels_them(cluster: SlurmCluster) -> None:
    out = cluster.run(["srun", "--nodes=3", "--ntasks=3", "hostname"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split()) == ["n1", "n2", "n3"]
    # `ffctl doctor --backend slurm` checks each node of an allocation through a step there.
    env = _allocation(cluster, 3)
    doc = subprocess.run([sys.executable, "-m", "ffctl", "doctor", "--backend", "slurm"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert all(n in doc.stdout for n in ("n1", "n2", "n3")), doc.stdout
    cluster.run(["scancel", env["SLURM_JOB_ID"]])


# Slurm's recovery beside the local backend's, both printed (docs/benchmarks.md's figures).
@pytest.mark.exclusive
def test_sbatch_example_kills_a_node_and_recovers_it_from_peer_memory(cluster: SlurmCluster, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    t0 = time.monotonic()
    # The same job on local nodes, fault-free and with the same kill: the reference losses and the
    # local backend's recovery time in this very test run.
    base = launch(work, rid("slurm-base"), "--nnodes", "2", "--nproc-per-node", "2", "--steps", str(STEPS))
    assert base.returncode == 0, base.stderr
    local = launch(work, rid("slurm-local"), "--nnodes", "2", "--nproc-per-node", "2", "--steps", str(STEPS),
                   "--inject", f"kill-node:node=1,step={KILL_STEP}")
    assert local.returncode == 0, local.stderr
    runs = work / "runs"
    env = {**cluster.env, "FFCTL": str(Path(sys.executable).with_name("ffctl")), "FFCTL_RUNS_DIR": str(runs),
           "FFCTL_STEPS": str(STEPS), "FFCTL_KILL_STEP": str(KILL_STEP)}
    sub = subprocess.run(["sbatch", "--wait", "--parsable", f"--chdir={work}", str(SBATCH)], env=env, cwd=work,
                         capture_output=True, text=True, timeout=300)
    job = sub.stdout.strip().split(";")[0]
    output = work / f"ffctl-{job}.out"
    shown = output.read_text() if output.exists() else "(no job output)"
    assert sub.returncode == 0, f"{sub.stderr}\n{shown}"
    # The report is next to the job's output.
    rep = json.loads((work / f"ffctl-{job}.report.json").read_text())
    assert rep["status"] == "completed" and rep["steps_completed"] == STEPS, shown
    (f,) = rep["faults"]
    assert f["kind"] == "kill-node" and f["recovered"] is True
    assert f["restore_source"] == "peer-memory" and f["lost_steps"] <= 1  # at most the step in flight
    assert rep["loss_by_step"] == base.report["loss_by_step"]
    # The record names Slurm's nodes: where each node ran, and the spare node node 1 moved to.
    run_dir = runs / f"slurm-{job}"
    info = json.loads((run_dir / "run.json").read_text())
    assert info["hosts"] == ["n1", "n2"]
    assert info["slurm"]["job_id"] == job
    assert info["slurm"]["nodes"] == ["n1", "n3"] and info["slurm"]["failed_nodes"] == ["n2"]
    # Each node's agent and ranks listened on its own namespace's address and interface.
    addresses = info["slurm"]["addresses"]
    assert sorted(addresses) == ["n1", "n2", "n3"] and len({a for a, _ in addresses.values()}) == 3
    assert all(not a.startswith("127.") and iface != "lo" for a, iface in addresses.values()), addresses
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    started = [e for e in events if e["event"] == "agent_started"]
    assert {e["host"] for e in started} >= {"n1", "n2"}
    # The spare node took node 1's ranks: they stayed node 1's, whose agent came back on n3 (its
    # standby agent) before they were spawned again; node 0 (n1) kept only its own.
    (decided,) = [e for e in events if e["event"] == "recovery_decided"]
    assert sorted(decided["placement"]) == ["2", "3"] and set(decided["placement"].values()) == {1}, decided
    back = [i for i, e in enumerate(events) if e["event"] == "agent_started" and e["node"] == 1 and e["host"] == "n3"]
    respawned = [i for i, e in enumerate(events) if e["event"] == "ranks_spawned" and e["gen"] == decided["gen"]]
    assert back and respawned and back[0] < respawned[0], (back, respawned)
    # Recovery through Slurm beside the local backend's in the same run, printed for docs/benchmarks.md's
    # figures and never asserted: a shared host's load moves either by a factor, and speed is the
    # benchmarks' business. Both recovered the step in flight from peer memory.
    (lf,) = local.report["faults"]
    assert lf["recovered"] is True and lf["restore_source"] == "peer-memory"
    print(f"kill-node recovery: slurm {f['recovery_s']:.2f}s, local {lf['recovery_s']:.2f}s; "
          f"test {time.monotonic() - t0:.1f}s")
    # Every step the job started ended with it (the harness checks squeue and sinfo as well).
    assert cluster.wait_empty() == []


def _sinfo(cluster: SlurmCluster) -> dict[str, tuple[str, str]]:
    """Each node's state and reason as sinfo gives them."""
    from ffctl.backends.slurm_cluster import parse_node_states

    return parse_node_states(cluster.run(["sinfo", "--noheader", "--Node", "--format=%N|%T|%E"]).stdout)


def _allocation(cluster: SlurmCluster, nodes: int) -> dict[str, str]:
    """An allocation with no shell (as `salloc` on a login node gives), as its environment; a
    node of it going down ends only that node's steps (--no-kill)."""
    out = cluster.run(["salloc", f"--nodes={nodes}", "--no-kill", "--no-shell"], timeout=60)
    job = next((w for w in out.stderr.split() if w.isdigit()), None)
    assert out.returncode == 0 and job, out.stderr
    nodelist = cluster.run(["squeue", f"--jobs={job}", "--noheader", "--format=%N"]).stdout.strip()
    return {**cluster.env, "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodelist}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c-after-a-node-down", "controller-killed"])
def test_every_agent_step_ends_with_the_launch(cluster: SlurmCluster, tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C: the launch cancels its steps; SIGKILL (a lost controller): the agents see their
    stdin close and their steps end. Only the allocation itself is left, then cancelled. Before
    the Ctrl-C, Slurm marks node 1's host down: a node fault ffctl did not inject, recovered with
    node 1 back on the spare node, Slurm's word for the host in the record; then Slurm drains
    the spare node node 1 runs on, which is recorded (no spare is left to move to). Before the
    SIGKILL, a kill-node with drain=yes cancels node 1's step and drains its node, which the
    killed launch cannot resume: its dead man's switch does, and says so in the record."""
    env = _allocation(cluster, 3)
    run_id = rid("slurm-stop")
    drain = ["--inject", "kill-node:node=1,step=8,drain=yes"] if sig is signal.SIGKILL else []
    proc = subprocess.Popen([sys.executable, "-m", "ffctl", "launch", "--backend", "slurm", "--nnodes", "2",
                             "--steps", "100000", "--run-id", run_id, "--runs-dir", str(tmp_path / "runs"), *drain],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    events = tmp_path / "runs" / run_id / "events.jsonl"
    try:
        wait_step(tmp_path / "runs", run_id, 3, timeout=90)
        assert len(cluster.steps()) == 3, cluster.steps()  # node 0's and 1's agents, the spare's standby
        if sig is signal.SIGINT:
            down = cluster.run(["scontrol", "update", "nodename=n2", "state=down", "reason=ffctl-test"])
            assert down.returncode == 0, down.stderr
            wait_event(events, lambda ev: ev.kind is EventKind.NODE_LOST and ev.get("node") == 1, timeout=60)
            wait_event(events, lambda ev: ev.kind is EventKind.AGENT_STARTED and ev.get("host") == "n3", timeout=90)
            seen = wait_event(events, lambda ev: ev.kind is EventKind.NODE_STATE and ev.get("host") == "n2", timeout=30)
            assert seen.get("node") == 1 and seen.get("state").startswith("down") and seen.get("reason") == "ffctl-test"
            step = wait_step(tmp_path / "runs", run_id, 0, timeout=5).get("step")
            wait_step(tmp_path / "runs", run_id, step + 3, timeout=90)  # training goes on
            slurm = json.loads((tmp_path / "runs" / run_id / "run.json").read_text())["slurm"]
            assert slurm["nodes"] == ["n1", "n3"] and slurm["failed_nodes"] == ["n2"]
            assert slurm["failed_node_states"]["n2"].startswith("DOWN"), slurm
            assert cluster.run(["scontrol", "update", "nodename=n2", "state=resume"]).returncode == 0
            # Slurm drains n3 (steps keep running on a draining node): seen and recorded.
            assert cluster.run(["scontrol", "update", "nodename=n3", "state=drain", "reason=bad-dimm"]).returncode == 0
            seen = wait_event(events, lambda ev: ev.kind is EventKind.NODE_STATE and ev.get("host") == "n3", timeout=30)
            assert seen.get("node") == 1 and "drain" in seen.get("state") and seen.get("reason") == "bad-dimm"
            assert cluster.run(["scontrol", "update", "nodename=n3", "state=resume"]).returncode == 0
        else:
            wait_event(events, lambda ev: ev.kind is EventKind.AGENT_STARTED and ev.get("host") == "n3", timeout=90)
            state, reason = _sinfo(cluster)["n2"]
            assert "drain" in state and reason.startswith(f"ffctl:{run_id}:"), (state, reason)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while cluster.steps() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.steps() == []
    if sig is signal.SIGKILL:
        # The killed launch could not resume the node it drained: the drain's dead man's switch,
        # which outlived it, did, once the launch was gone, and appended its line to the record.
        deadline = time.monotonic() + 30
        while "drain" in _sinfo(cluster)["n2"][0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "drain" not in _sinfo(cluster)["n2"][0], _sinfo(cluster)
        lines = [line for _, line in read_deadman_lines(tmp_path / "runs" / run_id)]
        assert [(x["trigger"], x["ok"]) for x in lines] == [("controller-gone", True)], lines
        # Nothing is left for the sweep to resume.
        swept = subprocess.run([sys.executable, "-m", "ffctl", "inject", "revert", "--all", "--run", run_id],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert swept.returncode == 0 and "n2" not in swept.stdout, swept.stdout + swept.stderr
    assert_nothing_left(tmp_path)
    assert not shm_left(run_id)  # the agents, told by their closed stdin, removed it
    cluster.run(["scancel", env["SLURM_JOB_ID"]])


# The batch script's part of a preemption notice: the shell gets it (sbatch --signal=B:USR2@90,
# here `scancel --batch --signal=USR2`), traps it and passes it on to ffctl, as the example does.
NOTICE_SBATCH = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --output=notice-%j.out
set -euo pipefail
"$FFCTL" launch --backend slurm --nnodes 2 --nproc-per-node 1 --run-id "notice-$SLURM_JOB_ID" \\
  --runs-dir "$FFCTL_RUNS_DIR" "$NOTICE_SCRIPT" &
pid=$!
trap 'kill -USR2 "$pid"' USR2
status=0
until wait "$pid"; do status=$?; kill -0 "$pid" 2>/dev/null || break; status=0; done
exit "$status"
"""
# Each rank waits for the notice and finishes when it comes (a real script would checkpoint).
NOTICE_SCRIPT = """import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR2, lambda *_: got.append(1))
print("ready", flush=True)
deadline = time.time() + 120
while not got and time.time() < deadline:
    time.sleep(0.05)
print(f"rank {os.environ['RANK']} got SIGUSR2" if got else "no notice", flush=True)
sys.exit(0 if got else 1)
"""


def test_a_preemption_notice_to_the_batch_step_reaches_every_rank(cluster: SlurmCluster, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notice.sbatch").write_text(NOTICE_SBATCH)
    (work / "notice.py").write_text(NOTICE_SCRIPT)
    runs = work / "runs"
    env = {**cluster.env, "FFCTL": str(Path(sys.executable).with_name("ffctl")), "FFCTL_RUNS_DIR": str(runs),
           "NOTICE_SCRIPT": str(work / "notice.py")}
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={work}", str(work / "notice.sbatch")], env=env, cwd=work,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    logs = runs / f"notice-{job}" / "logs"
    ready = lambda: len([p for p in logs.glob("*/[0-9].log") if "ready" in p.read_text()]) == 2  # noqa: E731
    deadline = time.monotonic() + 120
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready(), (work / f"notice-{job}.out").read_text() if (work / f"notice-{job}.out").exists() else job
    sent = cluster.run(["scancel", "--batch", "--signal=USR2", job])
    assert sent.returncode == 0, sent.stderr
    deadline = time.monotonic() + 120
    while cluster.run(["squeue", "--noheader", f"--jobs={job}"]).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.2)
    shown = (work / f"notice-{job}.out").read_text()
    events = [json.loads(line) for line in (runs / f"notice-{job}" / "events.jsonl").read_text().splitlines()]
    (fwd,) = [e for e in events if e["event"] == "signal_forwarded"]
    assert fwd["signal"] == "SIGUSR2" and sorted(fwd["ranks"]) == [0, 1] and fwd["by"] == "scheduler", fwd
    assert all("got SIGUSR2" in p.read_text() for p in logs.glob("*/[0-9].log")), shown
    assert events[-1]["event"] == "run_finished" and events[-1]["status"] == "completed", shown
    assert cluster.wait_empty() == []


def test_a_job_that_fails_before_its_first_step_says_do_not_requeue(cluster: SlurmCluster, tmp_path: Path) -> None:
    """In an allocation (salloc's, no batch shell), a script that fails before training a step
    exits 4: a requeue would fail the same way. (A failure after training exits 1, and the
    example's requeue round trip below resumes it.)"""
    env = _allocation(cluster, 2)
    (tmp_path / "fails.py").write_text("import sys\nprint('starting', flush=True)\nsys.exit(3)\n")
    failed = subprocess.run([sys.executable, "-m", "ffctl", "launch", "--backend", "slurm", "--nnodes", "2",
                             "--runs-dir", str(tmp_path / "runs"), "--step-regex", r"step (\d+)", "--run-id", "rq-fail",
                             str(tmp_path / "fails.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert failed.returncode == 4 and "do not requeue" in failed.stderr, failed.stderr
    cluster.run(["scancel", env["SLURM_JOB_ID"]])


def test_the_example_requeues_itself_after_an_unrecoverable_fault_and_resumes(cluster: SlurmCluster, tmp_path: Path) -> None:
    """The round trip through Slurm: the example's first attempt loses a node it may not recover
    (`--recovery none`) and fails; its batch shell runs `scontrol requeue`; Slurm starts the script
    again with SLURM_RESTART_COUNT=1, and that attempt resumes from the newest complete disk
    checkpoint of the first, trains to the end with the first attempt's losses where both trained,
    and writes its own report beside the first's."""
    from recovery.disk import complete_steps

    work = tmp_path / "work"
    work.mkdir()
    runs = work / "runs"
    steps, kill = 30, 14
    env = {**cluster.env, "FFCTL": str(Path(sys.executable).with_name("ffctl")), "FFCTL_RUNS_DIR": str(runs),
           "FFCTL_STEPS": str(steps), "FFCTL_KILL_STEP": str(kill), "FFCTL_CKPT_EVERY": "4",
           "FFCTL_ARGS": "--recovery none"}
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={work}", str(SBATCH)], env=env, cwd=work,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    output = work / f"ffctl-{job}.out"
    deadline = time.monotonic() + 400
    state, requeued = "", 0.0
    while time.monotonic() < deadline:
        state = cluster.run(["scontrol", "show", "job", job, "--oneliner"]).stdout
        if "JobState=COMPLETED" in state or "JobState=FAILED" in state:
            break
        if "JobState=PENDING" in state and "Restarts=1" in state:
            requeued = requeued or time.monotonic()
            # Slurm holds a requeued job back for about two minutes (and then waits for its next
            # scheduling pass); once every node has cleaned up after the first attempt, and the
            # second in which its credential was revoked has passed (a credential of that same
            # second is refused: "already killed"), the administrator's `StartTime=now` lets it
            # start at once.
            if time.monotonic() - requeued > 2.5 and set(cluster.node_states().values()) == {"idle"}:
                cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        time.sleep(0.5)
    shown = output.read_text() if output.exists() else "(no job output)"
    assert "JobState=COMPLETED" in state and "Restarts=1" in state, f"{state}\n{shown}"
    # Both attempts wrote to the one output (--open-mode=append).
    assert f"run slurm-{job}: failed" in shown and f"run slurm-{job}-r1: completed" in shown, shown
    first = json.loads((work / f"ffctl-{job}.report.json").read_text())
    assert first["status"] == "failed" and [f["recovered"] for f in first["faults"]] == [False], first
    again = json.loads((work / f"ffctl-{job}-r1.report.json").read_text())
    assert again["status"] == "completed" and again["steps_completed"] == steps, shown
    assert again["faults"] == []  # the fault was the first attempt's
    newest = complete_steps(runs / f"slurm-{job}" / "checkpoints")[-1]
    assert 4 <= newest < steps  # (the kill lands while step kill + 1 or so trains)
    info = json.loads((runs / f"slurm-{job}-r1" / "run.json").read_text())["slurm"]
    assert info["restart_count"] == 1 and info["resumed_from"] == {"run": f"slurm-{job}", "step": newest}, info
    losses = [dict(r["loss_by_step"]) for r in (first, again)]
    assert min(losses[1]) == newest + 1 and max(losses[1]) == steps, sorted(losses[1])
    both = sorted(set(losses[0]) & set(losses[1]))
    # (None in common only when the first attempt stopped at its newest checkpoint's very step.)
    assert both or max(losses[0]) == newest, losses
    assert [losses[0][s] for s in both] == [losses[1][s] for s in both], (both, losses)
    assert cluster.wait_empty() == []

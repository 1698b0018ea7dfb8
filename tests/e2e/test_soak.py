"""The chaos soak: two seeded jobs of 60 faults each (six kinds: rank kills, SIGTERMs, crashes,
GPU errors, node kills and reboots, a mean of 1.5 s apart), on two nodes of two ranks with a
spare node, run side by side with their fault-free twin on one host.

Each job must complete with every step's loss equal, bit for bit, to the twin's; every fault it
was dealt is in its report and recovered; no failure the faults do not explain and no recovery
that failed. Two jobs and the twin at once load the host as a shared CI machine does, so this is
also the heartbeat and detection paths under load: a node taken for lost that was fine shows as a
`detected` fault and fails the test (a rank the load slowed for a moment, named a straggler and
back at pace by itself, is reported and does not).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ffctl.controller.injector import chaos_faults
from fault_injectors.schedule import parse_chaos
from tests.helpers.launch import assert_nothing_left, ffctl_argv, shm_left

# Three whole jobs at once on a 2-core host, 120 faults among them: about six minutes here. (A
# third seed took the test to ten minutes alone on the host, a quarter of the suite's time.)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.exclusive]

SEEDS = (1, 2)
FAULTS = 60
KINDS = "kill-rank|term-rank|crash-rank|gpu-error|kill-node|reboot-node"
# Steps enough that every job outlives its schedule: faults wait while a recovery runs. Since
# ranks go home after a node fault (fewer restores from disk), the last fault of a seed has come
# at step 397 to 624; before, at up to 1,477, and a job of 1,400 steps once ended with faults of
# its schedule still to come. A slower host trains fewer steps per second of the schedule. In
# the latest runs the three seeds' schedules ended by step 8 to 28: two node faults a second
# apart on two nodes lose both copies, and the job went back to its checkpoint at step 20 again
# and again while the faults lasted (each such restore waits for a template that imports torch
# on a host shared by four jobs). The steps after the schedule are training only (a third of
# the test's time at 1,200 steps); a job that ends before its schedule does fails the test
# (every fault of it must be dealt). Since one host's nodes stream their copies over a Unix
# socket, jobs train faster under the same schedule (about 10 steps a second each): two seeds of
# 800 steps ended with 56 and 49 of their 60 faults dealt, and at 1,200 steps the schedules
# ended at steps 569, 968 and 1,193. Hence 1,600.
STEPS = 1600
COMMON = ("--nnodes", "2", "--nproc-per-node", "2", "--ckpt-every", "20", "--steps", str(STEPS))


def chaos(seed: int) -> str:
    """The seed's schedule cut just after its FAULTS-th fault."""
    drawn = chaos_faults(parse_chaos(f"mtbf=1.5,seed={seed},kinds={KINDS},until=100000"))
    times = [t for t, _ in (next(drawn) for _ in range(FAULTS))]
    return f"mtbf=1.5,seed={seed},kinds={KINDS},until={times[-1] + 0.05:.2f}"


def _losses(runs: Path, run_id: str) -> dict[int, float]:
    report = json.loads((runs / run_id / "report.json").read_text())
    return {int(step): loss for step, loss in report["loss_by_step"]}


def _start(cwd: Path, run_id: str, *args: str) -> subprocess.Popen[bytes]:
    # Output to a file, not a pipe: three jobs at once, and a pipe nobody reads while the test
    # waits on another job would fill and stop its job.
    with open(cwd / f"{run_id}.out", "wb") as out:  # the job holds its own copy
        return subprocess.Popen(ffctl_argv("launch", "--run-id", run_id, "--runs-dir", str(cwd / "runs"), *args),
                                cwd=cwd, stdout=out, stderr=subprocess.STDOUT)


def _around(faults: list[dict[str, object]], events: list[dict[str, object]]) -> str:
    """The faults and what the record says from 2 s before the first to 20 s after it (not the
    steps): what a failure of this test needs to be understood."""
    t0 = float(faults[0]["injected_at"])  # type: ignore[arg-type]
    near = [e for e in events if e["event"] not in ("step", "snapshot_taken", "replicated")
            and t0 - 2 <= float(e["t"]) <= t0 + 20]  # type: ignore[arg-type]
    return "\n".join([json.dumps(f) for f in faults] + [json.dumps(e) for e in near])


def _unexplained(faults: list[dict[str, object]]) -> list[dict[str, object]]:
    """The faults of a report that are failures no injected fault explains.

    A rank the straggler detector named is not one when it came back to pace by itself: four
    jobs on two cores leave a rank descheduled for a second now and then (seen in the fault-free
    twin too), the detector is right to name it, and it fails nothing. A straggler still slow at
    the end, or any other detected fault (a node taken for lost, a rank's exit no fault
    explains), is one."""
    return [f for f in faults if f["kind"] == "detected"
            and not (f.get("cause") == "straggler" and f.get("recovered"))]


def _stalls(runs: Path, run_id: str) -> str:
    """The stacks ranks wrote when a recovery of theirs stalled (`recovery.job.JOIN_STALL_S`):
    where each waited, for a job that ran into a phase timeout."""
    out = []
    for err in sorted((runs / run_id / "logs").glob("*/*.err")):
        text = err.read_text(errors="replace")
        at = text.find("Timeout (")
        if at >= 0:
            out.append(f"--- {err.relative_to(runs)}\n{text[at:at + 3000]}")
    return "\n".join(out)


def test_two_seeded_soaks_of_sixty_faults_match_the_fault_free_run(tmp_path: Path) -> None:
    procs = {"free": _start(tmp_path, "free", *COMMON)}
    for seed in SEEDS:
        procs[f"soak-{seed}"] = _start(tmp_path, f"soak-{seed}", *COMMON, "--spares", "1", "--chaos", chaos(seed))
    try:
        codes = {name: proc.wait(timeout=1300) for name, proc in procs.items()}
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        raise
    runs = tmp_path / "runs"
    for name, code in codes.items():
        assert code == 0, (f"{name}: " + (tmp_path / f"{name}.out").read_text(errors="replace")[-5000:]
                           + _stalls(runs, name))
    free = _losses(runs, "free")
    assert len(free) == STEPS
    free_faults = json.loads((runs / "free" / "report.json").read_text())["faults"]
    assert not _unexplained(free_faults), free_faults
    for seed in SEEDS:
        run_id = f"soak-{seed}"
        report = json.loads((runs / run_id / "report.json").read_text())
        assert report["status"] == "completed" and report["steps_completed"] == STEPS
        faults = report["faults"]
        events = [json.loads(line) for line in (runs / run_id / "events.jsonl").read_text().splitlines()]
        # Every fault of its schedule dealt, all six kinds, each recovered; nothing else failed
        # (a failure no fault explains is a `detected` fault: shown with the record around it).
        extra = _unexplained(faults)
        assert not extra, (seed, _around(extra, events))
        dealt = [f for f in faults if f["kind"] != "detected"]
        assert len(dealt) == FAULTS, (seed, len(dealt), dealt[-1])
        assert {f["kind"] for f in dealt} == set(KINDS.split("|")), seed
        assert all(f["recovered"] for f in faults), _around([f for f in faults if not f["recovered"]], events)
        assert not [e for e in events if e["event"] == "recovery_failed"]
        # Every step's loss, bit for bit: restores from memory, from disk and (a node fault
        # before the first complete checkpoint) from step 0 all train the same steps again.
        assert _losses(runs, run_id) == free, seed
        assert not shm_left(run_id)
    assert_nothing_left(tmp_path)

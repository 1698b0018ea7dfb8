"""Benchmarks: strategies side by side on the built-in workload, as ratios measured in one run.

Each benchmark launches real jobs (`python -m ffctl launch`) into a scratch runs directory and
reads their records, so what it measures is what users get. Ratios, not absolute times, are the
result: both sides run on the same machine within minutes of each other.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from runs.events import EventKind
from runs.store import iter_events

BENCH_MODEL = "medium"  # a step of at least 50 ms on a CPU host
SNAPSHOT_BATCH = 64  # sequences of 64 tokens per rank per step: 4k tokens
SCALE_GLOBAL_BATCH = 16  # the medium size's default per rank, at 2 ranks


@dataclass(frozen=True)
class Ratio:
    name: str
    numerator: float
    denominator: float
    goal: float  # the ratio must not exceed this
    unit: str = "s"

    @property
    def value(self) -> float:
        return self.numerator / self.denominator if self.denominator else float("inf")

    @property
    def met(self) -> bool:
        return self.value <= self.goal


@dataclass
class BenchResult:
    name: str
    ratios: list[Ratio] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "details": self.details,
                "ratios": [{**asdict(r), "value": r.value, "met": r.met} for r in self.ratios]}


def launch(runs_dir: Path, *args: str, timeout: float = 1800.0) -> tuple[dict[str, Any], list[Any]]:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        [sys.executable, "-m", "ffctl", "launch", "--run-id", run_id, "--runs-dir", str(runs_dir), *args],
        capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    report = json.loads((runs_dir / run_id / "report.json").read_text())
    return report, list(iter_events(runs_dir / run_id / "events.jsonl"))


def median_step_time(events: list[Any], skip: int = 5) -> float:
    times = [float(e.get("step_time_s")) for e in events if e.kind is EventKind.STEP and int(e.get("step")) > skip]
    return statistics.median(times)


def snapshot_overhead(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 30, reps: int = 6,
                      batch: int = SNAPSHOT_BATCH) -> BenchResult:
    """Median step time with a peer-memory snapshot every step / without any snapshot.

    The snapshot's copy, checksum and streaming run beside the step; on a host whose every core
    runs a rank they take CPU from it, in proportion to state size over compute. The batch is
    therefore a realistic 4k tokens per rank per step rather than the size's default."""
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--steps", str(steps), "--model", model,
              "--batch", str(batch))
    with_s, without = [], []
    for _ in range(reps):  # interleaved, so drift in machine load hits both sides
        _, ev = launch(runs_dir, *common, "--recovery", "none")
        without.append(median_step_time(ev))
        _, ev = launch(runs_dir, *common, "--recovery", "peer")
        with_s.append(median_step_time(ev))
    num, den = statistics.median(with_s), statistics.median(without)
    return BenchResult("snapshot-overhead", [Ratio("step time with snapshots / without", num, den, 1.03)],
                       {"model": model, "batch": batch, "with_s": with_s, "without_s": without})


def recovery_vs_disk(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 100, at: int = 75) -> BenchResult:
    """recovery_s and lost GPU-hours of `peer` / `restart-disk` (checkpoint every 50 steps)."""
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--steps", str(steps), "--model", model)
    result = BenchResult("recovery-vs-disk", details={"model": model, "fault_at_step": at})
    for fault in (f"kill-rank:rank=1,step={at}", f"kill-node:node=1,step={at}"):
        peer, _ = launch(runs_dir, *common, "--recovery", "peer", "--spares", "2", "--inject", fault)
        disk, _ = launch(runs_dir, *common, "--recovery", "restart-disk", "--ckpt-every", "50", "--inject", fault)
        (fp,), (fd,) = peer["faults"], disk["faults"]
        kind = fault.split(":")[0]
        result.ratios.append(Ratio(f"{kind} recovery_s peer / restart-disk", fp["recovery_s"], fd["recovery_s"], 0.10))
        result.ratios.append(Ratio(f"{kind} lost_gpu_hours peer / restart-disk", fp["lost_gpu_hours"],
                                   fd["lost_gpu_hours"], 0.10, unit="GPU-h"))
        result.details[kind] = {"peer": fp, "restart-disk": fd}
    return result


def scale(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 40, at: int = 20,
          global_batch: int = SCALE_GLOBAL_BATCH, reps: int = 5) -> BenchResult:
    """recovery_s of kill-rank with a warm spare at 8 ranks / at 2 ranks (medians of `reps` runs).

    The goal asks whether recovery itself grows with the world size, so the two runs must differ
    in that only. On a cluster each rank has its own device and a step takes as long at 8 ranks
    as at 2; on a host with fewer cores than ranks it does not, and a fixed batch per rank would
    make every step (and so the replayed step in recovery_s) 4x slower at 8 ranks. The ratio is
    therefore taken at a fixed global batch, which keeps the host's work per step the same. Runs
    at a fixed batch per rank are reported beside it, in steps (recovery_s / median step time)."""
    def one(world: int, per_rank: int) -> tuple[float, float, dict[str, Any]]:
        rep, events = launch(runs_dir, "--nnodes", str(world // 2), "--nproc-per-node", "2",
                             "--steps", str(steps), "--model", model, "--batch", str(per_rank),
                             "--recovery", "peer", "--spares", "1", "--inject", f"kill-rank:rank=1,step={at}")
        fault = rep["faults"][0]
        return fault["recovery_s"], median_step_time(events), fault

    cases = {"global-2": (2, global_batch // 2), "global-8": (8, global_batch // 8), "rank-8": (8, global_batch // 2)}
    runs: dict[str, list[tuple[float, float, dict[str, Any]]]] = {name: [] for name in cases}
    for _ in range(reps):  # interleaved, so drift in machine load hits every case
        for name, (world, per_rank) in cases.items():
            runs[name].append(one(world, per_rank))
    rec = {name: statistics.median(r[0] for r in rs) for name, rs in runs.items()}
    step = {name: statistics.median(r[1] for r in rs) for name, rs in runs.items()}
    in_steps = {"rank-2": rec["global-2"] / step["global-2"], "rank-8": rec["rank-8"] / step["rank-8"]}
    details = {"model": model, "cores": os.cpu_count(), "global_batch": global_batch, "reps": reps,
               "median_recovery_s": rec, "median_step_s": step,
               "faults": {name: [r[2] for r in rs] for name, rs in runs.items()}}
    return BenchResult("scale", [
        Ratio(f"kill-rank recovery_s at 8 ranks / at 2 ranks (global batch {global_batch})",
              rec["global-8"], rec["global-2"], 1.5),
        Ratio(f"same at {global_batch // 2} sequences per rank, in steps (recovery_s / median step time)",
              in_steps["rank-8"], in_steps["rank-2"], 1.5, unit="steps"),
    ], details)


# A replacement's start-up, up to its first optimizer step: what a worker pays before it can
# rejoin. Run by both sides of `replacement_start` unchanged. It notes when it got there: the
# interpreter's exit (most of a second of module teardown) is no part of a replacement's start.
_FIRST_STEP = """
import sys, time
import torch
import recovery.job
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(8, 64)).sum().backward()
opt.step()
with open(sys.argv[1], "w") as fh:
    fh.write(repr(time.time()))
"""

# Plays the agent (a subreaper, so forked workers become its children) and times each start.
_DRIVER = """
import json, subprocess, sys, time
from pathlib import Path
from ffctl.agent.template import Assignment, Template, set_child_subreaper
from ffctl.agent.workerenv import worker_env
import os
script, reps, log = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
assert set_child_subreaper()
env = worker_env(os.environ, {}, True)
template = Template(sys.executable, env, None, log)
template.start()
assert template.wait_ready(300), "the template did not warm up"
out = {"template": [], "fresh": []}
mark = log.with_name("first_step.t")
for _ in range(reps):  # interleaved, so drift in machine load hits both sides
    t0 = time.time()
    code = template.fork(Assignment(env, (script, str(mark)), str(log), "")).wait(300)
    assert code == 0, f"forked worker exited {code}"
    out["template"].append(float(mark.read_text()) - t0)
    t0 = time.time()
    subprocess.run([sys.executable, script, str(mark)], env=env, check=True, timeout=300)
    out["fresh"].append(float(mark.read_text()) - t0)
template.stop()
print(json.dumps(out))
"""


def replacement_start(runs_dir: Path, reps: int = 5) -> BenchResult:
    """A replacement worker's start-up to its first optimizer step: forked from the agent's warm
    template / started as a fresh interpreter (what a replacement without a warm spare paid
    before, and what `restart-disk` still pays). Medians of `reps` interleaved pairs."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    script = runs_dir / "first_step.py"
    script.write_text(_FIRST_STEP)
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(script), str(reps), str(runs_dir / "template.log")],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"replacement-start benchmark failed: {proc.stderr.strip()[-500:]}")
    times = json.loads(proc.stdout.splitlines()[-1])
    forked, fresh = statistics.median(times["template"]), statistics.median(times["fresh"])
    return BenchResult("replacement-start", [
        Ratio("worker start to first step, template fork / fresh interpreter", forked, fresh, 0.10),
    ], {"reps": reps, **times})


def without_spares(runs_dir: Path, steps: int = 60, at: int = 20) -> BenchResult:
    """Replacements with no warm spare held (`--spares 0`): each from the agent's template.

    recovery_s of `peer` / `restart-disk` (checkpoint every 50) for a kill-rank and a kill-node
    at step `at`, and the sum of both faults' recovery_s in one run with `--spares 1` (kill-rank
    at `at`, kill-node at 2 x `at`: the spare is used by the first, the template covers the
    second) / the same run under `restart-disk`. The default 2 x 2 tiny job, as a user first runs."""
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--steps", str(steps))
    result = BenchResult("without-spares", details={"fault_at_step": at})
    for fault in (f"kill-rank:rank=1,step={at}", f"kill-node:node=1,step={at}"):
        peer, _ = launch(runs_dir, *common, "--recovery", "peer", "--spares", "0", "--inject", fault)
        disk, _ = launch(runs_dir, *common, "--recovery", "restart-disk", "--ckpt-every", "50", "--inject", fault)
        (fp,), (fd,) = peer["faults"], disk["faults"]
        kind = fault.split(":")[0]
        result.ratios.append(Ratio(f"{kind}, --spares 0: recovery_s peer / restart-disk", fp["recovery_s"],
                                   fd["recovery_s"], 0.10))
        result.details[kind] = {"peer": fp, "restart-disk": fd, "spawn_s": fp["breakdown"]["spawn"]}
    pair = ("--inject", f"kill-rank:rank=1,step={at}", "--inject", f"kill-node:node=1,step={2 * at}")
    peer, _ = launch(runs_dir, *common, "--recovery", "peer", "--spares", "1", *pair)
    disk, _ = launch(runs_dir, *common, "--recovery", "restart-disk", "--ckpt-every", "50", *pair)
    total = lambda rep: sum(f["recovery_s"] for f in rep["faults"])  # noqa: E731
    result.ratios.append(Ratio("two faults, --spares 1: sum of recovery_s peer / restart-disk",
                               total(peer), total(disk), 0.10))
    result.details["pair"] = {"peer": peer["faults"], "restart-disk": disk["faults"]}
    return result


BENCHMARKS: dict[str, Callable[[Path], BenchResult]] = {
    "snapshot-overhead": snapshot_overhead,
    "recovery-vs-disk": recovery_vs_disk,
    "scale": scale,
    "replacement-start": replacement_start,
    "without-spares": without_spares,
}


def run(names: list[str] | None = None, runs_dir: Path | None = None) -> list[BenchResult]:
    with tempfile.TemporaryDirectory(prefix="ffctl-bench-") as tmp:
        where = runs_dir or Path(tmp)
        return [BENCHMARKS[n](where) for n in (names or list(BENCHMARKS))]

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


def snapshot_overhead(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 30, reps: int = 2,
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


def scale(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 40, at: int = 20) -> BenchResult:
    """recovery_s of kill-rank with a warm spare at 8 ranks / at 2 ranks.

    Also reported in steps (recovery_s over the run's median step time): on a host with fewer
    cores than ranks, 8 ranks share the cores 2 ranks had, every step and every collective is
    that much slower, and only the step-normalised ratio says whether recovery itself scales."""
    out, step_s = {}, {}
    for nnodes, nproc in ((1, 2), (4, 2)):
        rep, events = launch(runs_dir, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--steps", str(steps),
                             "--model", model, "--recovery", "peer", "--spares", "1",
                             "--inject", f"kill-rank:rank=1,step={at}")
        out[nnodes * nproc] = rep["faults"][0]
        step_s[nnodes * nproc] = median_step_time(events)
    in_steps = {w: out[w]["recovery_s"] / step_s[w] for w in out}
    return BenchResult("scale", [
        Ratio("kill-rank recovery_s at 8 ranks / at 2 ranks", out[8]["recovery_s"], out[2]["recovery_s"], 1.5),
        Ratio("same, in steps (recovery_s / median step time)", in_steps[8], in_steps[2], 1.5, unit="steps"),
    ], {"model": model, "faults": out, "median_step_s": step_s, "cores": os.cpu_count()})


BENCHMARKS: dict[str, Callable[[Path], BenchResult]] = {
    "snapshot-overhead": snapshot_overhead,
    "recovery-vs-disk": recovery_vs_disk,
    "scale": scale,
}


def run(names: list[str] | None = None, runs_dir: Path | None = None) -> list[BenchResult]:
    with tempfile.TemporaryDirectory(prefix="ffctl-bench-") as tmp:
        where = runs_dir or Path(tmp)
        return [BENCHMARKS[n](where) for n in (names or list(BENCHMARKS))]

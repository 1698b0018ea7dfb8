"""Benchmarks: strategies side by side on the built-in workload, as ratios measured in one run.

Each benchmark launches real jobs (`python -m ffctl launch`) into a scratch runs directory and
reads their records, so what it measures is what users get. Ratios, not absolute times, are the
result: both sides run on the same machine within minutes of each other.

`compare_strategies` is what `ffctl bench` runs: the same job and the same seeded fault schedule
under `peer`, `restart-memory` and `restart-disk`, each figure as a ratio to `restart-disk`, whose
checkpoint interval is Young's (sqrt(2 x MTBF x save time), the save time measured first) so that
the baseline is the best it can be. `BENCHMARKS` are the narrower measurements behind the goals in
docs/benchmarks.md (`ffctl bench --only NAME`, `python benchmarks/NAME.py`); `control-plane` among them runs
no training at all: a real controller and up to 1,024 simulated nodes (`ffctl.sim`).
"""
from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ffctl.exits import BadInput, InfraError
from ffctl.workload.sizes import MODELS
from fault_injectors.schedule import fault_seed, iter_mtbf
from wire.fault_spec import FaultKind
from runs.events import Event, EventKind
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


def _newest_step(path: Path, offset: int, newest: int) -> tuple[int, int]:
    """The highest step committed in the events file past byte `offset` (whole lines only)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return offset, newest
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].splitlines():
        try:
            ev = Event.from_json(line.decode())
        except ValueError:
            continue
        if ev.kind is EventKind.STEP:
            newest = max(newest, int(ev.get("step")))
    return offset + end, newest


def launch(runs_dir: Path, *args: str, timeout: float = 1800.0,
           on_step: Callable[[int], None] | None = None) -> tuple[dict[str, Any], list[Any]]:
    """Run one job to its end; its report and events. `on_step` hears the highest step committed
    so far, about twice a second, from the record the job writes."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "ffctl", "launch", "--run-id", run_id, "--runs-dir", str(runs_dir), *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + timeout
    events_path, offset, newest = runs_dir / run_id / "events.jsonl", 0, 0
    while True:
        try:
            _, err = proc.communicate(timeout=0.5)  # retried: no output is lost meanwhile
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                proc.terminate()  # the controller tears its job down on SIGTERM
                try:
                    proc.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate(timeout=10)
                raise InfraError(f"benchmark run {run_id} ({' '.join(args)}) did not end within {timeout:g} s") from None
        if on_step is not None:
            offset, newest = _newest_step(events_path, offset, newest)
            on_step(newest)
    if proc.returncode != 0:
        raise InfraError(f"benchmark run {run_id} ({' '.join(args)}) failed ({proc.returncode}): "
                         f"{' '.join(err.strip().splitlines()[-3:])[-500:]}")
    report = json.loads((runs_dir / run_id / "report.json").read_text())
    events = list(iter_events(events_path))
    if on_step is not None:
        on_step(max((int(e.get("step")) for e in events if e.kind is EventKind.STEP), default=0))
    return report, events


def median_step_time(events: list[Any], skip: int = 5) -> float:
    times = [float(e.get("step_time_s")) for e in events if e.kind is EventKind.STEP and int(e.get("step")) > skip]
    return statistics.median(times)


def _paired_step_times(runs_dir: Path, common: tuple[str, ...], a: tuple[str, ...], b: tuple[str, ...],
                       reps: int) -> tuple[list[float], list[float]]:
    """Median step times of `reps` runs of the job `common` with `a`, and of as many with `b`,
    interleaved, so that drift in the machine's load hits both sides."""
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(reps):
        _, ev = launch(runs_dir, *common, *a)
        times_a.append(median_step_time(ev))
        _, ev = launch(runs_dir, *common, *b)
        times_b.append(median_step_time(ev))
    return times_a, times_b


def snapshot_overhead(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 30, reps: int = 6,
                      batch: int = SNAPSHOT_BATCH, parallel: str = "ddp") -> BenchResult:
    """Median step time with a peer-memory snapshot every step / without any snapshot.

    The snapshot's copy, checksum and streaming run beside the step; on a host whose every core
    runs a rank they take CPU from it, in proportion to state size over compute. The batch is
    therefore a realistic 4k tokens per rank per step rather than the size's default."""
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--steps", str(steps), "--model", model,
              "--batch", str(batch), "--parallel", parallel)
    without, with_s = _paired_step_times(runs_dir, common, ("--recovery", "none"), ("--recovery", "peer"), reps)
    num, den = statistics.median(with_s), statistics.median(without)
    return BenchResult("snapshot-overhead", [Ratio("step time with snapshots / without", num, den, 1.03)],
                       {"model": model, "batch": batch, "parallel": parallel, "with_s": with_s, "without_s": without})


def snapshot_copies(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 30, reps: int = 4,
                    batch: int = SNAPSHOT_BATCH) -> BenchResult:
    """Median step time with each node's snapshots held by two other nodes / by one
    (`--snapshot-copies 2` against 1), three nodes of one rank: what the second copy costs a
    step (it is streamed beside the step, and the rank waits for both before its next update)."""
    common = ("--nnodes", "3", "--nproc-per-node", "1", "--steps", str(steps), "--model", model,
              "--batch", str(batch))
    one, two = _paired_step_times(runs_dir, common, ("--snapshot-copies", "1"), ("--snapshot-copies", "2"), reps)
    num, den = statistics.median(two), statistics.median(one)
    return BenchResult("snapshot-copies", [Ratio("step time with 2 copies / with 1", num, den, 1.10)],
                       {"model": model, "batch": batch, "one_s": one, "two_s": two})


def _peer_and_disk(runs_dir: Path, common: tuple[str, ...], at: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(kind, peer's fault, restart-disk's fault) for a kill-rank then a kill-node at step `at`
    of the job `common` describes: `peer` with 2 spares, `restart-disk` saving every 50 steps."""
    out = []
    for fault in (f"kill-rank:rank=1,step={at}", f"kill-node:node=1,step={at}"):
        peer, _ = launch(runs_dir, *common, "--recovery", "peer", "--spares", "2", "--inject", fault)
        disk, _ = launch(runs_dir, *common, "--recovery", "restart-disk", "--ckpt-every", "50", "--inject", fault)
        (fp,), (fd,) = peer["faults"], disk["faults"]
        out.append((fault.split(":")[0], fp, fd))
    return out


def recovery_vs_disk(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 100, at: int = 75) -> BenchResult:
    """recovery_s and lost GPU-hours of `peer` / `restart-disk` (checkpoint every 50 steps)."""
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--steps", str(steps), "--model", model)
    result = BenchResult("recovery-vs-disk", details={"model": model, "fault_at_step": at})
    for kind, fp, fd in _peer_and_disk(runs_dir, common, at):
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


CHECKSUM_BYTES = 256 << 20  # a rank's shard of a model of about 5B parameters on 64 ranks (AdamW)


def checksum(runs_dir: Path, reps: int = 7, size: int = CHECKSUM_BYTES) -> BenchResult:
    """A snapshot's checksum (CRC-32 of `size` bytes, as a rank writes it and the neighbour's
    agent checks it every step) on the threads the library gives it / in one pass. Medians of
    `reps` interleaved pairs, in this process: no job runs."""
    from recovery import checksum as crc

    threads = max(2, crc.default_threads())
    data = bytearray(os.urandom(1 << 20)) * (size >> 20)
    one: list[float] = []
    many: list[float] = []
    for _ in range(reps):
        for out, n in ((one, 1), (many, threads)):
            t0 = time.perf_counter()
            crc.crc32(data, threads=n)
            out.append(time.perf_counter() - t0)
    return BenchResult("checksum", [
        Ratio(f"checksum of {size >> 20} MiB, {threads} threads / one pass", statistics.median(many),
              statistics.median(one), 0.75),
    ], {"bytes": size, "threads": threads, "one_s": one, "threads_s": many})


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


CONTROL_PLANE_NODES = (8, 64, 256, 1024)
CONTROL_PLANE_GOAL = 2.0  # recovery's control-plane time at the largest size / at the smallest


def parse_nodes(text: str) -> tuple[int, ...]:
    """`--nodes 8,64,256,1024`: simulated cluster sizes, each 2 to MAX_NODES, ascending."""
    from ffctl.launch_spec import MAX_NODES

    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not (part.isascii() and part.isdigit()) or not 2 <= int(part) <= MAX_NODES:
            raise BadInput(f"--nodes {text!r}: {part!r} is not a node count from 2 to {MAX_NODES}")
        sizes.append(int(part))
    return tuple(sorted(set(sizes)))


def control_plane(runs_dir: Path, nodes: tuple[int, ...] = CONTROL_PLANE_NODES) -> BenchResult:
    """The recovery's control plane against cluster size: a real controller and N simulated
    nodes (`ffctl.sim`), one lost; its phases per N, and the whole (from the loss to every rank
    restored) at the largest N / at the smallest."""
    from ffctl.sim.control_plane import run_control_plane

    rows = run_control_plane(list(nodes), runs_dir)
    result = BenchResult("control-plane", details={"sizes": rows})
    small, large = rows[0], rows[-1]
    if len(rows) > 1 and small["complete"] and large["complete"]:
        result.ratios.append(Ratio(f"recovery control-plane s at {large['nodes']} nodes / at {small['nodes']}",
                                   large["recovery_s"], small["recovery_s"], CONTROL_PLANE_GOAL))
    for row in rows:
        if not row["complete"]:
            # A size that did not recover has no phases: a line that is never met says so.
            result.ratios.append(Ratio(f"{row['nodes']} nodes did not recover (run {row['status']})", 1.0, 1.0, 0.0,
                                       unit=""))
    return result


def fsdp_snapshot_overhead(runs_dir: Path) -> BenchResult:
    """`snapshot_overhead` for the GPT sharded with torch's fully_shard (`--parallel fsdp`):
    each rank snapshots its own shards of the parameters and of AdamW's state every step."""
    res = snapshot_overhead(runs_dir, parallel="fsdp")
    return BenchResult("fsdp-snapshot-overhead", res.ratios, res.details)


def fsdp_recovery_vs_disk(runs_dir: Path, model: str = BENCH_MODEL, steps: int = 100, at: int = 75) -> BenchResult:
    """Lost time of a sharded (FSDP2) job's one-step peer recovery / `restart-disk`'s (a
    checkpoint every 50 steps), for a killed rank and a killed node, in one run."""
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--steps", str(steps), "--model", model, "--parallel", "fsdp")
    result = BenchResult("fsdp-recovery-vs-disk", details={"model": model, "fault_at_step": at})
    for kind, fp, fd in _peer_and_disk(runs_dir, common, at):
        result.ratios.append(Ratio(f"{kind} lost_s peer / restart-disk", fp["lost_s"], fd["lost_s"], 0.05))
        result.details[kind] = {"peer": fp, "restart-disk": fd}
    return result


BENCHMARKS: dict[str, Callable[[Path], BenchResult]] = {
    "snapshot-overhead": snapshot_overhead,
    "snapshot-copies": snapshot_copies,
    "recovery-vs-disk": recovery_vs_disk,
    "fsdp-snapshot-overhead": fsdp_snapshot_overhead,
    "fsdp-recovery-vs-disk": fsdp_recovery_vs_disk,
    "scale": scale,
    "replacement-start": replacement_start,
    "checksum": checksum,
    "without-spares": without_spares,
    "control-plane": control_plane,
}


def run_named(names: list[str] | None = None, runs_dir: Path | None = None,
              nodes: tuple[int, ...] | None = None) -> list[BenchResult]:
    """The narrow benchmarks `names` (all of them by default), in a scratch runs directory unless
    `runs_dir` is given; `nodes`: the cluster sizes of `control-plane`."""
    with tempfile.TemporaryDirectory(prefix="ffctl-bench-") as tmp:
        where = runs_dir or Path(tmp)
        return [control_plane(where, nodes) if n == "control-plane" and nodes else BENCHMARKS[n](where)
                for n in (names or list(BENCHMARKS))]


# --- `ffctl bench`: the strategies side by side under one seeded fault schedule -----------------

STRATEGIES = ("peer", "restart-memory", "restart-disk")
BASELINE = "restart-disk"
# Kinds a schedule may draw: each needs no option a schedule cannot give, and ends on its own
# (a hang or a network fault needs a duration and, for the network, a sandbox).
BENCH_KINDS = (FaultKind.KILL_RANK, FaultKind.TERM_RANK, FaultKind.CRASH_RANK, FaultKind.KILL_NODE)
FIGURES = ("recovery_s", "lost_s", "lost_steps", "lost_gpu_hours", "goodput", "snapshot_overhead")
WARMUP_STEPS = 10  # no fault before: the pace before a fault needs steps, a peer a snapshot
FAULT_GAP_STEPS = 10  # faults at least this many steps apart, each seen on its own
TAIL_STEPS = 20  # no fault this close to the end: the job must be seen back at its pace
SKIP_STEPS = 5  # first steps left out of any pace (imports, allocator warm-up)
CALIBRATION_STEPS = 30
CALIBRATION_CKPT_EVERY = 2  # every other step saved: the other intervals are the clean pace
# A fault-free run without snapshots right before each strategy's run (the calibration is the
# one before the first): its pace is what that strategy's overhead is measured against. On a
# shared host the load drifts over minutes; a reference taken next to the run follows it.
REFERENCE_STEPS = 25
SCALE_GLOBAL_BATCH_SEQS = 16  # --scale: sequences per step over all ranks, at every world size
SCALE_STEPS = 40
SCALE_FAULT_STEP = 20
MAX_SCALE_WORLD = 16
MIN_STEPS = WARMUP_STEPS + TAIL_STEPS + 10


def young_interval(mtbf_s: float, save_s: float) -> float:
    """Young's optimal checkpoint interval in seconds: sqrt(2 x MTBF x save time)."""
    if mtbf_s <= 0 or save_s < 0:
        raise ValueError(f"Young's interval needs mtbf_s > 0 and save_s >= 0 (got {mtbf_s!r}, {save_s!r})")
    return math.sqrt(2.0 * mtbf_s * save_s)


def interval_steps(interval_s: float, pace_s: float) -> int:
    """An interval in seconds as a whole number of steps at `pace_s` seconds per step, at least 1."""
    return max(1, round(interval_s / pace_s)) if pace_s > 0 else 1


def parse_scale(text: str) -> tuple[int, ...]:
    """`--scale 2,4,8`: world sizes, each even (nodes of 2 ranks) and from 2 to MAX_SCALE_WORLD."""
    sizes: list[int] = []
    for part in text.split(","):
        word = part.strip()
        if not word.isascii() or not word.isdigit():
            raise BadInput(f"--scale {text!r}: {word!r} is not a world size (a whole number, e.g. --scale 2,4,8)")
        n = int(word)
        if n < 2 or n > MAX_SCALE_WORLD or n % 2:
            raise BadInput(f"--scale {text!r}: world size {n} must be even and from 2 to {MAX_SCALE_WORLD} "
                           "(nodes of 2 ranks; a peer needs another rank)")
        if n in sizes:
            raise BadInput(f"--scale {text!r}: world size {n} given twice")
        sizes.append(n)
    return tuple(sizes)


@dataclass(frozen=True)
class ScheduledFault:
    """One fault of the bench's schedule: drawn at `t_s` seconds of training, fired at `step`."""

    index: int
    t_s: float
    kind: FaultKind
    step: int
    target: str  # rank=N or node=N

    @property
    def inject(self) -> str:
        return f"{self.kind.value}:{self.target},step={self.step}"


@dataclass(frozen=True)
class BenchSpec:
    """What `ffctl bench` runs; `validate` refuses a bad value before anything starts."""

    model: str = "small"
    steps: int = 140
    mtbf_s: float = 12.0
    seed: int = 0
    kinds: tuple[FaultKind, ...] = (FaultKind.KILL_RANK, FaultKind.KILL_NODE)
    nnodes: int = 2
    nproc_per_node: int = 2
    spares: int = 1
    scale: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def validate(self) -> None:
        if self.model not in MODELS:
            raise BadInput(f"--model {self.model!r}: use one of {', '.join(MODELS)}")
        if self.steps < MIN_STEPS:
            raise BadInput(f"--steps {self.steps}: at least {MIN_STEPS} (a warm-up of {WARMUP_STEPS} before the first "
                           f"fault, {TAIL_STEPS} after the last)")
        if not math.isfinite(self.mtbf_s) or self.mtbf_s < 1.0:
            raise BadInput(f"--mtbf {self.mtbf_s!r}: at least 1 second")
        if self.seed < 0:
            raise BadInput(f"--seed {self.seed}: a non-negative integer")
        if not self.kinds:
            raise BadInput("--kinds: give at least one fault kind")
        for kind in self.kinds:
            if kind not in BENCH_KINDS:
                raise BadInput(f"--kinds {kind.value!r}: use {', '.join(k.value for k in BENCH_KINDS)}")
        if self.nnodes < 2 or self.nproc_per_node < 1:
            raise BadInput(f"{self.nnodes} nodes x {self.nproc_per_node} ranks: at least 2 nodes of 1 rank")
        if self.spares < 0:
            raise BadInput(f"--spares {self.spares}: a non-negative integer")


def parse_kinds(text: str) -> tuple[FaultKind, ...]:
    """`--kinds kill-rank,kill-node` (`|` separates as well, as in a chaos spec)."""
    from wire.fault_spec import FaultSpecError, parse_kind

    names = [w.strip() for w in text.replace("|", ",").split(",")]
    kinds: list[FaultKind] = []
    for name in names:
        try:
            kind = parse_kind(name)
        except FaultSpecError as exc:
            raise BadInput(f"--kinds {text!r}: {exc}") from None
        if kind not in BENCH_KINDS:
            raise BadInput(f"--kinds {text!r}: {kind.value} cannot be scheduled here "
                           f"(use {', '.join(k.value for k in BENCH_KINDS)})")
        if kind not in kinds:
            kinds.append(kind)
    return tuple(kinds)


def fault_schedule(spec: BenchSpec, pace_s: float) -> list[ScheduledFault]:
    """The seeded schedule every strategy gets: arrivals of a Poisson process of mean `mtbf_s`
    (`iter_mtbf`, as `--chaos` draws them), each turned into a step at the fault-free pace so that
    every strategy is hit at the same steps (a time trigger would drift with each one's own
    recovery times). The first fault is after a warm-up, faults are at least FAULT_GAP_STEPS
    apart (a later one is pushed back), and none lands in the last TAIL_STEPS. Targets are drawn
    with each fault's own seed (`fault_seed`), as a chaos schedule draws them."""
    out: list[ScheduledFault] = []
    last = WARMUP_STEPS - FAULT_GAP_STEPS
    for index, (t, drawn) in enumerate(iter_mtbf(spec.mtbf_s, spec.seed, spec.kinds)):
        step = max(WARMUP_STEPS + round(t / pace_s), last + FAULT_GAP_STEPS)
        if step > spec.steps - TAIL_STEPS:
            break
        pick = random.Random(fault_seed(spec.seed, index))
        node_kind = drawn.kind in (FaultKind.KILL_NODE, FaultKind.REBOOT_NODE)
        target = f"node={pick.randrange(spec.nnodes)}" if node_kind else f"rank={pick.randrange(spec.world_size)}"
        out.append(ScheduledFault(index, t, drawn.kind, step, target))
        last = step
    return out


def _commits(events: Iterable[Any]) -> list[tuple[float, int, int]]:
    """Each step commit as (controller time, step, generation), in record order."""
    return [(float(e.t), int(e.get("step")), int(e.get("gen") or 0)) for e in events if e.kind is EventKind.STEP]


def clean_intervals(events: Iterable[Any], windows: Iterable[tuple[float, float | None]] = (),
                    skip_after: Iterable[int] = (), skip: int = SKIP_STEPS) -> list[float]:
    """Wall time between consecutive commits (step s to s+1 of one generation) past the first
    `skip` steps, leaving out any interval that overlaps a window (start, end; None: to the end)
    and any that follows a step in `skip_after`."""
    after = set(skip_after)
    spans = [(a, math.inf if b is None else b) for a, b in windows]
    out = []
    commits = _commits(events)
    for (t0, s0, g0), (t1, s1, g1) in zip(commits, commits[1:]):
        if s1 != s0 + 1 or g1 != g0 or s0 < skip or s0 in after:
            continue
        if any(t1 > a and t0 < b for a, b in spans):
            continue
        out.append(t1 - t0)
    return out


def save_time(events: Iterable[Any]) -> float:
    """Median seconds from a step's commit to its disk checkpoint being complete on every rank."""
    events = list(events)
    commit = {s: t for t, s, _ in _commits(events)}
    took = [float(e.t) - commit[int(e.get("step"))] for e in events
            if e.kind is EventKind.SNAPSHOT_TAKEN and e.get("kind") == "disk" and int(e.get("step")) in commit]
    if not took:
        raise InfraError("the calibration run wrote no disk checkpoint: no save time to measure")
    return max(0.0, statistics.median(took))


@dataclass(frozen=True)
class Calibration:
    """The fault-free job under `restart-disk` with a checkpoint every other step: its pace
    without snapshots (mean interval between commits not following a save) and its save time."""

    run_id: str
    pace_s: float
    save_s: float
    steps: int

    @classmethod
    def from_events(cls, run_id: str, events: list[Any], ckpt_every: int) -> Calibration:
        saved = [s for _, s, _ in _commits(events) if s % ckpt_every == 0]
        clean = clean_intervals(events, skip_after=saved)
        if not clean:
            raise InfraError(f"calibration run {run_id} committed too few steps to measure a pace")
        return cls(run_id, statistics.fmean(clean), save_time(events), len(_commits(events)))


def strategy_figures(report: dict[str, Any], events: list[Any], pace_s: float) -> dict[str, Any]:
    """One strategy's figures from its run: sums over the schedule's faults, the run's goodput,
    and its snapshot overhead: the mean interval between commits before the first fault, its
    saves and snapshots included, over `pace_s`, the reference pace without any. Only steps
    before the first fault: a recovery can leave the job slower for a while (replacements still
    warming up, ranks moved onto the surviving node), which is lost time, not snapshot cost."""
    faults = report.get("faults") or []
    first = min((float(f["injected_at"]) for f in faults), default=None)
    steady = clean_intervals(events, [(first, None)] if first is not None else [])
    recovered = [f for f in faults if f.get("recovered")]
    return {
        "run_id": report["run_id"],
        "status": report.get("status"),
        "faults": len(faults),
        "recovered": len(recovered),
        "recovery_s": sum(float(f["recovery_s"]) for f in recovered if f.get("recovery_s") is not None),
        "lost_s": sum(float(f.get("lost_s") or 0.0) for f in faults),
        "lost_steps": sum(int(f.get("lost_steps") or 0) for f in faults),
        "lost_gpu_hours": float(report.get("lost_gpu_hours_total") or 0.0),
        "goodput": report.get("goodput"),
        "snapshot_overhead": statistics.fmean(steady) / pace_s if steady and pace_s > 0 else None,
        "spare_gpu_hours": float(report.get("spare_gpu_hours") or 0.0),
        "wall_s": report.get("wall_s"),
        "per_fault": [{k: f.get(k) for k in ("kind", "target", "at_step", "recovery_s", "lost_s", "lost_steps",
                                              "restore_step", "restore_source", "recovered")} for f in faults],
    }


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline; None where either is unknown or the baseline is zero."""
    if value is None or baseline is None or baseline == 0:
        return None
    return float(value) / float(baseline)


def add_ratios(rows: dict[str, dict[str, Any]], baseline: str = BASELINE) -> None:
    """Each row's FIGURES as ratios to the baseline's, under `ratios` (the baseline's are 1)."""
    base = rows[baseline]
    for row in rows.values():
        row["ratios"] = {fig: ratio(row.get(fig), base.get(fig)) for fig in FIGURES}


class _Steps:
    """Progress over every run of a bench: steps committed so far against those planned."""

    def __init__(self, total: int, report: Callable[[str, int, int], None] | None) -> None:
        self.total, self.done, self.report = total, 0, report

    def run(self, label: str, runs_dir: Path, steps: int, *args: str) -> tuple[dict[str, Any], list[Any]]:
        base = self.done
        hear = None
        if self.report is not None:
            report = self.report
            hear = lambda newest: report(label, base + min(newest, steps), self.total)  # noqa: E731
            report(label, base, self.total)
        try:
            return launch(runs_dir, *args, "--steps", str(steps), on_step=hear)
        finally:
            self.done = base + steps


def compare_strategies(spec: BenchSpec, runs_dir: Path | None = None,
                       progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """`ffctl bench`: calibrate, then run the job once per strategy under one fault schedule
    (and, with `spec.scale`, one kill-rank per strategy at each world size). `progress` hears
    (what runs now, steps done, steps planned) as the runs go. JSON-ready."""
    spec.validate()
    started = time.monotonic()
    planned = (CALIBRATION_STEPS + (len(STRATEGIES) - 1) * REFERENCE_STEPS + len(STRATEGIES) * spec.steps
               + len(spec.scale) * len(STRATEGIES) * SCALE_STEPS)
    steps = _Steps(planned, progress)
    # Every run holds the same spares, references included: on a host this small, idle spare
    # processes are part of the pace a strategy's overhead is measured against.
    layout = ("--nnodes", str(spec.nnodes), "--nproc-per-node", str(spec.nproc_per_node), "--model", spec.model,
              "--seed", str(spec.seed), "--spares", str(spec.spares))
    with tempfile.TemporaryDirectory(prefix="ffctl-bench-") as tmp:
        where = runs_dir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        report, events = steps.run("calibration: pace and save time", where, CALIBRATION_STEPS, *layout,
                                   "--recovery", "restart-disk", "--ckpt-every", str(CALIBRATION_CKPT_EVERY))
        cal = Calibration.from_events(report["run_id"], events, CALIBRATION_CKPT_EVERY)
        tau = young_interval(spec.mtbf_s, cal.save_s)
        every = interval_steps(tau, cal.pace_s)
        schedule = fault_schedule(spec, cal.pace_s)
        injects = [a for f in schedule for a in ("--inject", f.inject)]
        ckpt = {"peer": 0, "restart-memory": 0, "restart-disk": every}
        rows: dict[str, dict[str, Any]] = {}
        reference = (cal.run_id, cal.pace_s)
        for i, strategy in enumerate(STRATEGIES):
            if i:
                reference = _reference(steps, where, layout, f"{strategy}: reference pace")
            report, events = steps.run(strategy, where, spec.steps, *layout, "--recovery", strategy,
                                       "--ckpt-every", str(ckpt[strategy]), *injects)
            rows[strategy] = {"strategy": strategy, "ckpt_every": ckpt[strategy],
                              **strategy_figures(report, events, reference[1]),
                              "reference_run_id": reference[0], "reference_pace_s": reference[1]}
        add_ratios(rows)
        scale_rows = _scale(spec, where, steps, every) if spec.scale else []
    return {
        "model": spec.model, "nnodes": spec.nnodes, "nproc_per_node": spec.nproc_per_node,
        "world_size": spec.world_size, "steps": spec.steps, "seed": spec.seed, "spares": spec.spares,
        "mtbf_s": spec.mtbf_s, "kinds": [k.value for k in spec.kinds], "cores": os.cpu_count(),
        "calibration": asdict(cal),
        "young": {"formula": "sqrt(2 x MTBF x save time)", "mtbf_s": spec.mtbf_s, "save_s": cal.save_s,
                  "interval_s": tau, "interval_steps": every},
        "schedule": [{"index": f.index, "t_s": f.t_s, "kind": f.kind.value, "target": f.target, "step": f.step,
                      "inject": f.inject} for f in schedule],
        "baseline": BASELINE,
        "strategies": [rows[s] for s in STRATEGIES],
        "scale": scale_rows,
        "bench_wall_s": time.monotonic() - started,
    }


def plan(spec: BenchSpec) -> list[str]:
    """The runs `compare_strategies` starts, in order, as `ffctl launch` arguments (`--dry-run`).
    The fault schedule and restart-disk's interval are known only once the calibration ran."""
    layout = (f"--nnodes {spec.nnodes} --nproc-per-node {spec.nproc_per_node} --model {spec.model} "
              f"--seed {spec.seed} --spares {spec.spares}")
    faults = (f"--inject ... (seed {spec.seed}, MTBF {spec.mtbf_s:g} s, "
              f"{'|'.join(k.value for k in spec.kinds)}; steps from the calibrated pace)")
    out = [f"calibration: {layout} --steps {CALIBRATION_STEPS} --recovery restart-disk "
           f"--ckpt-every {CALIBRATION_CKPT_EVERY}"]
    for i, strategy in enumerate(STRATEGIES):
        if i:
            out.append(f"{strategy} reference: {layout} --steps {REFERENCE_STEPS} --recovery none")
        every = "Young's interval in steps" if strategy == BASELINE else "0"
        out.append(f"{strategy}: {layout} --steps {spec.steps} --recovery {strategy} --ckpt-every {every} {faults}")
    for world in spec.scale:
        for strategy in STRATEGIES:
            out.append(f"{strategy} at {world} ranks: --nnodes {max(1, world // 2)} --nproc-per-node {min(2, world)} "
                       f"--model {spec.model} --batch {max(1, SCALE_GLOBAL_BATCH_SEQS // world)} --steps {SCALE_STEPS} "
                       f"--recovery {strategy} --inject kill-rank:rank={world - 1},step={SCALE_FAULT_STEP}")
    return out


def _reference(steps: _Steps, where: Path, layout: tuple[str, ...], label: str) -> tuple[str, float]:
    """A fault-free run without snapshots or checkpoints: its run id and its pace."""
    report, events = steps.run(label, where, REFERENCE_STEPS, *layout, "--recovery", "none")
    clean = clean_intervals(events)
    if not clean:
        raise InfraError(f"reference run {report['run_id']} committed too few steps to measure a pace")
    return report["run_id"], statistics.fmean(clean)


def _scale(spec: BenchSpec, where: Path, steps: _Steps, every: int) -> list[dict[str, Any]]:
    """One kill-rank at step SCALE_FAULT_STEP per strategy and world size, at a fixed global batch
    (the host's work per step stays the same at every size, as on a cluster with a device per
    rank; see `scale`). restart-disk keeps the Young interval of the main comparison."""
    out = []
    for world in spec.scale:
        nnodes, nproc = max(1, world // 2), min(2, world)
        per_rank = max(1, SCALE_GLOBAL_BATCH_SEQS // world)
        by: dict[str, dict[str, Any]] = {}
        for strategy in STRATEGIES:
            ckpt = every if strategy == "restart-disk" else 0
            report, _ = steps.run(f"{strategy} at {world} ranks", where, SCALE_STEPS, "--nnodes", str(nnodes),
                                  "--nproc-per-node", str(nproc), "--model", spec.model, "--seed", str(spec.seed),
                                  "--batch", str(per_rank), "--recovery", strategy, "--ckpt-every", str(ckpt),
                                  "--spares", str(spec.spares),
                                  "--inject", f"kill-rank:rank={world - 1},step={SCALE_FAULT_STEP}")
            (fault,) = report["faults"] or [{}]
            by[strategy] = {"world_size": world, "strategy": strategy, "batch_per_rank": per_rank,
                            "run_id": report["run_id"], "recovery_s": fault.get("recovery_s"),
                            "lost_s": fault.get("lost_s"), "lost_steps": fault.get("lost_steps")}
        for row in by.values():
            row["recovery_ratio"] = ratio(row["recovery_s"], by[BASELINE]["recovery_s"])
            out.append(row)
    return out

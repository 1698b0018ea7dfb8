"""Projection to fleet scale: measured run records in, what a fleet of N GPUs would get out.

Pure functions over what `runs.metrics` computes from a run's events (no torch, no I/O), behind
`ffctl project`. From each run it takes what a fleet would see of the strategy it ran: the
steady-state step time (warm-up, faults and checkpoint writes left out), the per-step snapshot's
overhead as a fraction of the step, the blocking save time and write time of a disk checkpoint,
and per fault that stops the job its lost time, by kind, with and without a spare (the rework of
rolled-back steps set apart, since the models below count rework themselves) and its detection
time. A fleet is a failure rate (per 1,000 node-days, from a preset or given, or an MTBF) and a
GPU count; per strategy and GPU count this gives the MTBF, the effective training time ratio
(ETTR) in Daly's complete model and in the first-order form, lost GPU-hours per day, the spares'
cost and, for a strategy that checkpoints to disk, Daly's optimal checkpoint interval.

docs/projection.md writes down every formula with its source; `FORMULAS` is what is printed
under the table. The headline ETTR is Daly's complete model (`HEADLINE`): it stays right when a
recovery is a large part of the MTBF, where the first-order form drifts away from it.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from runs.events import Event, EventKind
from runs.metrics import commits, step_interval

SECONDS_PER_DAY = 86400.0
DEFAULT_GPUS: tuple[int, ...] = (1024, 16384, 100_000)
DEFAULT_GPUS_PER_NODE = 8
# One spare 8-GPU node per 1,000 GPUs unless told otherwise.
DEFAULT_SPARES_PER_1000 = 8.0
# The first steps of a run (imports, allocator and cache warm-up) are no steady state.
WARMUP_STEPS = 5
# Strategies that snapshot every step (their step time carries the snapshot), those that take
# no per-step snapshot (their step time is the reference the overhead is measured against), and
# those without a recovery to project (`none` fails the job: it only serves as that reference).
PER_STEP_SNAPSHOTS = frozenset({"peer", "restart-memory"})


def strategy_label(strategy: str, copies: int) -> str:
    """How a run's strategy is named in a projection: with `--snapshot-copies` above 1, the
    copies too, so that what K copies cost per step is a strategy of its own beside K = 1."""
    return strategy if copies <= 1 or strategy not in PER_STEP_SNAPSHOTS else f"{strategy} ({copies} copies)"


def base_strategy(label: str) -> str:
    """The strategy a label names (`peer (2 copies)` -> `peer`)."""
    return label.split(" (", 1)[0]
NO_STEP_SNAPSHOTS = frozenset({"none", "restart-disk"})
NOT_PROJECTED = frozenset({"none"})
HEADLINE = "ettr_daly"

FORMULAS: tuple[str, ...] = (
    "nodes = ceil(gpus / gpus_per_node); failures/day = rate per 1,000 node-days / 1000 x nodes",
    "MTBF M = 86400 s / failures/day (or as given: --mtbf T at every size, T@N scaled by N / gpus)",
    "R = mean over the fault kinds measured of (lost_s - lost_steps x pace_s): the restart cost, rework "
    "left to the model; with a spare when spares_per_1000 > 0, else without one + replace time",
    "per-step snapshots: tau = step time / (1 + overhead), delta = step time - tau "
    "(overhead = step time / step time without snapshots - 1)",
    "disk checkpoints: delta = blocking save (interval after a checkpoint - step time; else write time); "
    "tau = Daly: sqrt(2 delta M) x [1 + sqrt(delta / (2M)) / 3 + delta / (18M)] - delta if delta < 2M, else M",
    "ETTR (Daly's complete model, the headline) = tau / (M x e^(R/M) x (e^((tau + delta)/M) - 1))",
    "ETTR (first order) = 1 - delta / (tau + delta) - (R + (tau + delta) / 2) / M, at least 0",
    "lost GPU-h/day = (1 - ETTR) x gpus x 24",
    "spare GPU-h/day = spares_per_1000 / 1000 x gpus x 24",
)


# --- Fleets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetPreset:
    """A published failure rate, with the population it counts and where it comes from."""

    name: str
    label: str
    failures_per_1000_node_days: float
    gpus_per_node: int
    gpus: int  # the size it was measured at (the job's, or the cluster's), marked on the plot
    population: str
    source: str


# Llama 3 405B pretraining: 419 unexpected interruptions of one 16,384-GPU job in 54 days.
LLAMA3_GPUS = 16384
LLAMA3_DAYS = 54.0
LLAMA3_INTERRUPTIONS = 419

PRESETS: dict[str, FleetPreset] = {
    "llama3": FleetPreset(
        "llama3", "Llama 3 405B pretraining",
        LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS / 8 * LLAMA3_DAYS) * 1000.0, 8, LLAMA3_GPUS,
        "unexpected interruptions of one 16,384-GPU job, every cause (about 78 % confirmed hardware): "
        "419 in 54 days, MTBF 3.09 h",
        "Llama Team, AI @ Meta, \"The Llama 3 Herd of Models\", arXiv 2407.21783 (2024), section 3.3.4, "
        "Table 5"),
    "rsc1": FleetPreset(
        "rsc1", "Meta RSC-1", 6.50, 8, 16000,
        "node failures: job failures attributed to a node's hardware, per 1,000 node-days the jobs "
        "ran, over every job of the cluster (about 16,000 A100 GPUs)",
        "Kokolis et al., \"Revisiting Reliability in Large-Scale Machine Learning Research Clusters\", "
        "arXiv 2410.21680 (HPCA 2025)"),
    "rsc2": FleetPreset(
        "rsc2", "Meta RSC-2", 2.34, 8, 8000,
        "node failures: job failures attributed to a node's hardware, per 1,000 node-days the jobs "
        "ran, over every job of the cluster (about 8,000 A100 GPUs)",
        "Kokolis et al., \"Revisiting Reliability in Large-Scale Machine Learning Research Clusters\", "
        "arXiv 2410.21680 (HPCA 2025)"),
}


@dataclass(frozen=True)
class Fleet:
    """How often a job of some size fails: a rate per 1,000 node-days (failures independent, so
    the job's rate grows with its nodes), or a given MTBF, at every size (`mtbf_gpus` None) or
    at `mtbf_gpus` GPUs and scaled with the GPU count from there."""

    name: str
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    failures_per_1000_node_days: float | None = None
    mtbf_s: float | None = None
    mtbf_gpus: int | None = None
    population: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be at least 1 (got {self.gpus_per_node!r})")
        rate, mtbf = self.failures_per_1000_node_days, self.mtbf_s
        if (rate is None) == (mtbf is None):
            raise ValueError("a fleet has either a failure rate or an MTBF")
        if rate is not None and not (0 < rate < math.inf):
            raise ValueError(f"failures per 1,000 node-days must be above 0 (got {rate!r})")
        if mtbf is not None and not (0 < mtbf < math.inf):
            raise ValueError(f"the MTBF must be a positive number of seconds (got {mtbf!r})")
        if self.mtbf_gpus is not None and self.mtbf_gpus < 1:
            raise ValueError(f"the MTBF's GPU count must be at least 1 (got {self.mtbf_gpus!r})")

    @classmethod
    def preset(cls, name: str, gpus_per_node: int | None = None) -> Fleet:
        p = PRESETS[name]
        return cls(p.name, gpus_per_node or p.gpus_per_node, failures_per_1000_node_days=p.failures_per_1000_node_days,
                   population=p.population, source=p.source)

    def nodes(self, gpus: int) -> int:
        # A partly used node is still a node that can fail.
        return math.ceil(gpus / self.gpus_per_node)

    def mtbf_s_at(self, gpus: int) -> float:
        if self.failures_per_1000_node_days is not None:
            per_day = self.failures_per_1000_node_days / 1000.0 * self.nodes(gpus)
            return SECONDS_PER_DAY / per_day
        assert self.mtbf_s is not None
        if self.mtbf_gpus is None:
            return self.mtbf_s
        return self.mtbf_s * self.mtbf_gpus / gpus

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- Models (Daly 2006; the first-order form) -----------------------------------------------


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (J. T. Daly, "A higher order
    estimate of the optimum checkpoint interval for restart dumps", FGCS 22 (2006) 303-312):
    sqrt(2 delta M) [1 + 1/3 sqrt(delta / 2M) + 1/9 (delta / 2M)] - delta for delta < 2M, else M.
    It does not depend on the restart time R."""
    if delta_s < 0 or mtbf_s <= 0:
        raise ValueError(f"Daly's interval needs delta >= 0 and M > 0 (got {delta_s!r}, {mtbf_s!r})")
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta_s


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum (J. W. Young, CACM 17 (1974)): sqrt(2 delta M)."""
    return math.sqrt(2.0 * delta_s * mtbf_s)


def ettr_daly(tau_s: float, delta_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful time over wall time in Daly's complete model (Daly 2006): the wall time of T_s of
    work is M e^(R/M) (e^((tau + delta)/M) - 1) T_s / tau, exponential failures striking during
    work, checkpoints and restarts alike. At tau -> 0 (a snapshot every instant, no overhead) it
    is e^(-R/M)."""
    if tau_s < 0 or delta_s < 0 or restart_s < 0 or mtbf_s <= 0:
        raise ValueError("tau, delta and R must be >= 0 and M > 0")
    if tau_s == 0:
        return math.exp(-restart_s / mtbf_s) if delta_s == 0 else 0.0
    x = (tau_s + delta_s) / mtbf_s
    if x > 700.0:
        return 0.0  # e^x overflows a float; the job would essentially never finish a segment
    # In logs: e^(R/M) and e^((tau + delta)/M) overflow long before their product over tau does.
    log_wall_over_work = restart_s / mtbf_s + math.log(math.expm1(x)) + math.log(mtbf_s / tau_s)
    return min(1.0, math.exp(-log_wall_over_work))


def ettr_first_order(tau_s: float, delta_s: float, restart_s: float, mtbf_s: float) -> float:
    """The first-order form: the share of wall time spent checkpointing, delta / (tau + delta),
    and per failure (1/M of them a second) the restart R plus on average half a segment of work
    done again, (tau + delta) / 2, taken off 1; at least 0."""
    segment = tau_s + delta_s
    overhead = delta_s / segment if segment > 0 else 0.0
    return max(0.0, 1.0 - overhead - (restart_s + segment / 2.0) / mtbf_s)


# --- What the records measured ---------------------------------------------------------------


@dataclass(frozen=True)
class FaultCost:
    """One fault of a run as the projection uses it."""

    run_id: str
    fault_id: str
    kind: str
    lost_s: float
    rework_s: float  # lost_steps x pace_s: steps done again, which the models count themselves
    restart_s: float  # lost_s - rework_s
    detection_s: float | None
    with_spare: bool  # a warm spare took a lost rank's place
    stops_job: bool  # the job cannot go on without a recovery (what a fleet's failure rate counts)
    recovered: bool


@dataclass(frozen=True)
class RunMeasure:
    """What one run measured: its steady step intervals, the intervals right after a disk
    checkpoint, each checkpoint's write time, and its faults."""

    run_id: str
    strategy: str
    world_size: int
    job: str  # what the job was (model or script), so a reference pace is taken from the same job
    intervals: tuple[float, ...]
    after_ckpt: tuple[float, ...]
    ckpt_writes: tuple[float, ...]
    faults: tuple[FaultCost, ...]
    wall_s: float = 0.0  # run_started to run_finished
    goodput: float | None = None  # the final trajectory's step time over the wall time


def measure_run(report: Mapping[str, Any], events: Sequence[Event], job: str = "") -> RunMeasure:
    """A run's measures from its `runs.metrics.compute(...).to_dict()` report and its events.

    Step intervals are those between consecutive commits of one generation past the first
    WARMUP_STEPS steps, away from every fault (from its injection until the job was back at its
    pace, or to the end when it never was); an interval that follows a step whose disk checkpoint
    was taken holds that checkpoint's blocking write and is kept apart."""
    committed = commits(list(events))
    faults = list(report.get("faults") or [])
    windows = [(float(f["injected_at"]),
                math.inf if f.get("back_at_pace_at") is None else float(f["back_at_pace_at"])) for f in faults]
    disk = [ev for ev in events if ev.kind is EventKind.SNAPSHOT_TAKEN and ev.get("kind") == "disk"]
    ckpt_steps = {int(ev.get("step")) for ev in disk}
    intervals: list[float] = []
    after: list[float] = []
    for i in range(1, len(committed)):
        gap = step_interval(committed, i)
        a, b = committed[i - 1], committed[i]
        if gap is None or a.step < WARMUP_STEPS or any(b.t > s and a.t < e for s, e in windows):
            continue
        (after if a.step in ckpt_steps else intervals).append(gap)
    writes = []
    for ev in disk:
        done = [c.t for c in committed if c.step == int(ev.get("step")) and c.t <= ev.t]
        if done:
            writes.append(max(0.0, ev.t - max(done)))
    stops = {str(ev.get("fault_id")): bool(ev.get("breaks_job")) for ev in events
             if ev.kind is EventKind.FAULT_INJECTED and ev.get("breaks_job") is not None}
    costs = []
    for f in faults:
        lost = float(f.get("lost_s") or 0.0)
        rework = min(lost, int(f.get("lost_steps") or 0) * float(f.get("pace_s") or 0.0))
        fid = str(f["fault_id"])
        costs.append(FaultCost(
            run_id=str(report["run_id"]), fault_id=fid, kind=str(f["kind"]), lost_s=lost, rework_s=rework,
            restart_s=lost - rework,
            detection_s=None if f.get("detection_s") is None else float(f["detection_s"]),
            with_spare="spare" in (f.get("started_by") or {}).values(),
            # Older records lack breaks_job: a fault that was detected stopped the job. A straggler
            # nobody injected (kind detected, cause straggler) slowed it and stopped nothing.
            stops_job=stops.get(fid, f.get("detection_s") is not None and f.get("cause") != "straggler"),
            recovered=bool(f.get("recovered"))))
    started = next((ev for ev in events if ev.kind is EventKind.RUN_STARTED), None)
    copies = started.get("snapshot_copies") if started is not None else None
    label = strategy_label(str(report.get("strategy") or "-"), copies if isinstance(copies, int) else 1)
    return RunMeasure(str(report["run_id"]), label, int(report.get("world_size") or 0),
                      job, tuple(intervals), tuple(after), tuple(writes), tuple(costs),
                      wall_s=float(report.get("wall_s") or 0.0),
                      goodput=None if report.get("goodput") is None else float(report["goodput"]))


def _median(values: Iterable[float]) -> float | None:
    vals = list(values)
    return statistics.median(vals) if vals else None


def _mean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return statistics.fmean(vals) if vals else None


@dataclass(frozen=True)
class StrategyInputs:
    """A strategy's measured inputs, pooled over its runs."""

    strategy: str
    runs: tuple[str, ...]
    step_s: float | None  # steady-state step time (mean interval)
    reference_step_s: float | None  # the same job's step time without per-step snapshots
    snapshot_overhead: float | None  # per-step strategies: step_s / reference_step_s - 1 (as measured)
    checkpoints: bool  # takes disk checkpoints: Daly's interval applies
    blocking_save_s: float | None  # mean interval after a checkpoint - step_s
    ckpt_write_s: float | None  # median commit -> checkpoint complete on every rank
    detection_s: float | None  # mean over the faults that stop the job
    faults: int  # recovered faults that stop the job: what R is drawn from
    faults_left_out: int  # the others (slowdowns, never recovered)
    lost_s_by_kind: dict[str, dict[str, float | None]] = field(default_factory=dict)
    restart_s_by_kind: dict[str, dict[str, float | None]] = field(default_factory=dict)
    restart_s_with_spare: float | None = None
    restart_s_without_spare: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["runs"] = list(self.runs)
        return out


def _by_kind(faults: list[FaultCost], value: str) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for kind in sorted({f.kind for f in faults}):
        out[kind] = {
            "with_spare": _mean(getattr(f, value) for f in faults if f.kind == kind and f.with_spare),
            "without_spare": _mean(getattr(f, value) for f in faults if f.kind == kind and not f.with_spare),
        }
    return out


def _per_kind_mean(by_kind: dict[str, dict[str, float | None]], which: str) -> float | None:
    # Each kind measured counts once, however many times it was injected.
    return _mean(x for x in (v[which] for v in by_kind.values()) if x is not None)


def strategy_inputs(measures: Sequence[RunMeasure]) -> list[StrategyInputs]:
    """Per strategy (in the order first met), its inputs pooled over its runs. The reference step
    time is that of the runs of the same job and world size without per-step snapshots."""
    reference: dict[tuple[int, str], list[float]] = {}
    for m in measures:
        if base_strategy(m.strategy) in NO_STEP_SNAPSHOTS:
            reference.setdefault((m.world_size, m.job), []).extend(m.intervals)
    by_strategy: dict[str, list[RunMeasure]] = {}
    for m in measures:
        by_strategy.setdefault(m.strategy, []).append(m)
    out = []
    for strategy, runs in by_strategy.items():
        base = base_strategy(strategy)
        # Means, not medians: commits reach the controller in bursts (a step is reported once its
        # snapshot is durable), so single intervals swing between ~0 and two steps, and only their
        # sum (the mean) is the job's pace.
        step_s = _mean(x for m in runs for x in m.intervals)
        ref_pool = [x for m in runs for x in reference.get((m.world_size, m.job), [])]
        ref_s = step_s if base in NO_STEP_SNAPSHOTS else _mean(ref_pool)
        overhead = None
        if base in PER_STEP_SNAPSHOTS and step_s is not None and ref_s:
            # Kept as measured, below 0 too (the machine's noise shows); the model takes it as 0 then.
            overhead = step_s / ref_s - 1.0
        after = _mean(x for m in runs for x in m.after_ckpt)
        blocking = max(0.0, after - step_s) if after is not None and step_s is not None else None
        used = [f for m in runs for f in m.faults if f.stops_job and f.recovered]
        restart_by_kind = _by_kind(used, "restart_s")
        # A per-step strategy's disk checkpoints are its fallback, not what its recovery costs.
        checkpoints = base not in PER_STEP_SNAPSHOTS and (
            base == "restart-disk" or any(m.ckpt_writes for m in runs))
        out.append(StrategyInputs(
            strategy=strategy, runs=tuple(m.run_id for m in runs), step_s=step_s, reference_step_s=ref_s,
            snapshot_overhead=overhead,
            checkpoints=checkpoints,
            blocking_save_s=blocking, ckpt_write_s=_median(x for m in runs for x in m.ckpt_writes),
            detection_s=_mean(f.detection_s for f in used if f.detection_s is not None),
            faults=len(used), faults_left_out=sum(len(m.faults) for m in runs) - len(used),
            lost_s_by_kind=_by_kind(used, "lost_s"), restart_s_by_kind=restart_by_kind,
            restart_s_with_spare=_per_kind_mean(restart_by_kind, "with_spare"),
            restart_s_without_spare=_per_kind_mean(restart_by_kind, "without_spare"),
        ))
    return out


# --- The projection --------------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectionSpec:
    """What to project to: a fleet, the GPU counts, spares per 1,000 GPUs and the time a node
    takes to be replaced when no spare is held."""

    fleet: Fleet
    gpus: tuple[int, ...] = DEFAULT_GPUS
    spares_per_1000: float = DEFAULT_SPARES_PER_1000
    replace_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.gpus or any(g < 1 for g in self.gpus):
            raise ValueError(f"GPU counts must be at least 1 (got {self.gpus!r})")
        if not (0 <= self.spares_per_1000 < math.inf):
            raise ValueError(f"spares per 1,000 GPUs must be 0 or more (got {self.spares_per_1000!r})")
        if not (0 <= self.replace_s < math.inf):
            raise ValueError(f"the replace time must be 0 or more seconds (got {self.replace_s!r})")


def restart_cost(inputs: StrategyInputs, spares_per_1000: float, replace_s: float) -> tuple[float | None, str]:
    """R and what it was measured as. Per fault kind: its recovery with a spare when the fleet
    holds spares, else without one, or the other way when only that was measured; a fleet without
    spares also waits `replace_s` for each failed node. R is the mean over the kinds."""
    prefer, other = ("with_spare", "without_spare") if spares_per_1000 > 0 else ("without_spare", "with_spare")
    values, fallback = [], []
    for kind, by in inputs.restart_s_by_kind.items():
        value = by[prefer]
        if value is None:
            value = by[other]
            fallback.append(kind)
        if value is not None:
            values.append(value + (replace_s if spares_per_1000 == 0 else 0.0))
    if not values:
        return None, "no fault that stops the job measured"
    said = {"with_spare": "with a spare", "without_spare": "without a spare"}
    basis = said[prefer]
    if fallback:
        basis += f" ({', '.join(fallback)} only {said[other]})"
    if spares_per_1000 == 0 and replace_s:
        basis += " + replace time"
    return statistics.fmean(values), basis


def _segment(inputs: StrategyInputs, mtbf_s: float) -> tuple[float | None, float | None, float | None]:
    """(tau, delta, Daly's checkpoint interval or None) of a strategy at MTBF `mtbf_s`."""
    if inputs.checkpoints:
        delta = inputs.blocking_save_s if inputs.blocking_save_s is not None else inputs.ckpt_write_s
        if delta is None:
            return None, None, None
        tau = daly_interval(delta, mtbf_s)
        return tau, delta, tau
    step = inputs.step_s or 0.0
    # A per-step strategy measured faster than its reference has no negative cost.
    overhead = max(0.0, inputs.snapshot_overhead or 0.0)
    tau = step / (1.0 + overhead)
    return tau, step - tau, None


def project_point(inputs: StrategyInputs, spec: ProjectionSpec, gpus: int) -> dict[str, Any]:
    """One strategy at one GPU count, JSON-ready."""
    mtbf = spec.fleet.mtbf_s_at(gpus)
    restart, _ = restart_cost(inputs, spec.spares_per_1000, spec.replace_s)
    tau, delta, interval = _segment(inputs, mtbf)
    daly = first = lost = None
    if restart is not None and tau is not None and delta is not None:
        daly = ettr_daly(tau, delta, restart, mtbf)
        first = ettr_first_order(tau, delta, restart, mtbf)
        lost = (1.0 - daly) * gpus * 24.0
    spare_gpus = spec.spares_per_1000 / 1000.0 * gpus
    return {
        "gpus": gpus, "nodes": spec.fleet.nodes(gpus), "mtbf_s": mtbf, "mtbf_h": mtbf / 3600.0,
        "failures_per_day": SECONDS_PER_DAY / mtbf, "restart_s": restart, "tau_s": tau, "delta_s": delta,
        "ettr_daly": daly, "ettr_first_order": first, "ettr": daly,
        "lost_gpu_hours_per_day": lost,
        "spare_gpus": spare_gpus, "spare_gpu_hours_per_day": spare_gpus * 24.0,
        "ckpt_interval_s": interval,
        "young_interval_s": young_interval(delta, mtbf) if interval is not None and delta is not None else None,
    }


def _notes(inputs: list[StrategyInputs], spec: ProjectionSpec) -> list[str]:
    notes = []
    for s in inputs:
        if s.strategy in NOT_PROJECTED:
            notes.append(f"{s.strategy}: not projected (the job fails at the first fault); its step time is the "
                         "reference for the snapshot overhead")
            continue
        _, basis = restart_cost(s, spec.spares_per_1000, spec.replace_s)
        if s.faults == 0:
            notes.append(f"{s.strategy}: no recovered fault that stops the job in its runs: nothing to project")
        else:
            notes.append(f"{s.strategy}: R from {s.faults} fault(s) of kind {', '.join(s.restart_s_by_kind)}, "
                         f"measured {basis}")
        if s.faults_left_out:
            notes.append(f"{s.strategy}: {s.faults_left_out} fault(s) left out (slowdowns that stop nothing, or never "
                         "recovered)")
        if base_strategy(s.strategy) in PER_STEP_SNAPSHOTS and s.snapshot_overhead is None:
            notes.append(f"{s.strategy}: snapshot overhead not measured (no run of the same job without per-step "
                         "snapshots, e.g. --recovery none or restart-disk): taken as 0")
        if s.snapshot_overhead is not None and s.snapshot_overhead < 0:
            notes.append(f"{s.strategy}: its steps were {-s.snapshot_overhead:.1%} faster than the reference's "
                         "without per-step snapshots (the machine's noise): overhead taken as 0")
        if s.checkpoints and s.blocking_save_s is None:
            notes.append(f"{s.strategy}: " + ("no blocking save measured: the checkpoint write time is delta"
                                              if s.ckpt_write_s is not None
                                              else "no disk checkpoint in its runs: no interval, no ETTR"))
    return notes


def preset_marks(inputs: list[StrategyInputs], spec: ProjectionSpec) -> list[dict[str, Any]]:
    """Each preset fleet at the size it was measured at, with every strategy's headline ETTR there
    (marked on the plot beside the lines of the fleet asked for)."""
    out = []
    for p in PRESETS.values():
        fleet = Fleet.preset(p.name, spec.fleet.gpus_per_node)
        at = ProjectionSpec(fleet, (p.gpus,), spec.spares_per_1000, spec.replace_s)
        out.append({"name": p.name, "label": p.label, "gpus": p.gpus, "mtbf_h": fleet.mtbf_s_at(p.gpus) / 3600.0,
                    "ettr": {s.strategy: project_point(s, at, p.gpus)[HEADLINE] for s in inputs
                             if s.strategy not in NOT_PROJECTED}})
    return out


CURVE_POINTS = 33


def curve_gpus(gpus: Sequence[int], points: int = CURVE_POINTS) -> list[int]:
    """GPU counts spaced evenly on a log scale over the sizes asked and every preset's, for the
    plot's lines (the points asked are exact points of the table)."""
    lo = min([*gpus, *(p.gpus for p in PRESETS.values())])
    hi = max([*gpus, *(p.gpus for p in PRESETS.values())])
    if hi == lo:
        return [lo]
    ratio = (hi / lo) ** (1.0 / (points - 1))
    return sorted({round(lo * ratio ** i) for i in range(points)} | set(gpus))


def project(measures: Sequence[RunMeasure], spec: ProjectionSpec) -> dict[str, Any]:
    """Per strategy measured and GPU count asked, what the fleet gets (JSON-ready); `curve` holds
    the headline ETTR at more GPU counts, for a plot."""
    inputs = strategy_inputs(measures)
    dense = curve_gpus(spec.gpus)
    return {
        "fleet": spec.fleet.to_dict(),
        "gpus": list(spec.gpus),
        "spares_per_1000": spec.spares_per_1000,
        "replace_s": spec.replace_s,
        "headline": HEADLINE,
        "formulas": list(FORMULAS),
        "notes": _notes(inputs, spec),
        "strategies": [
            {"strategy": s.strategy, "runs": list(s.runs), "inputs": s.to_dict(),
             "restart_basis": restart_cost(s, spec.spares_per_1000, spec.replace_s)[1],
             "projections": [project_point(s, spec, g) for g in spec.gpus],
             "curve": [{"gpus": g, **{k: p[k] for k in ("ettr_daly", "ettr_first_order")}}
                       for g, p in ((g, project_point(s, spec, g)) for g in dense)]}
            for s in inputs if s.strategy not in NOT_PROJECTED
        ],
        "presets": preset_marks(inputs, spec),
    }


# --- A measured run predicted from others ----------------------------------------------------

CHECK_FORMULAS: tuple[str, ...] = (
    "L(k) = mean lost_s of the single-fault runs' recovered faults of kind k (with a spare or without, as the "
    "checked fault was; else the other way); L = the mean of L(kind) over the checked run's faults",
    "M = the checked run's wall time W / its faults (the MTBF it measured)",
    "ETTR predicted = 1 - L / M (the first-order form, rework inside L); measured = 1 - its lost time / W",
    "goodput predicted = goodput measured x ETTR predicted / ETTR measured (the same pace: the machine's "
    "speed is the run's own, what is predicted is what its faults cost)",
)


def _kind_lost(singles: Sequence[RunMeasure]) -> dict[tuple[str, bool], list[float]]:
    out: dict[tuple[str, bool], list[float]] = {}
    for m in singles:
        for f in m.faults:
            if f.recovered:
                out.setdefault((f.kind, f.with_spare), []).append(f.lost_s)
    return out


def check_run(singles: Sequence[RunMeasure], run: RunMeasure) -> dict[str, Any]:
    """How well the per-fault costs measured one fault at a time predict `run`, a run of the same
    job and strategy with many faults (a `--chaos` run) at the MTBF it measured: the projection's
    premise that a fault costs what it cost alone, whatever the faults around it. JSON-ready.
    Raises ValueError when there is nothing to predict from or nothing to predict."""
    same = [m for m in singles if m.strategy == run.strategy and m.run_id != run.run_id]
    if not same:
        raise ValueError(f"no run of strategy {run.strategy!r} besides {run.run_id!r} to predict it from")
    if run.goodput is None or run.wall_s <= 0:
        raise ValueError(f"run {run.run_id!r} measured no goodput (no steps, or no wall time)")
    if not run.faults:
        raise ValueError(f"run {run.run_id!r} had no fault: nothing to predict")
    lost_by = _kind_lost(same)
    predicted: list[float] = []
    unpredicted = []
    for f in run.faults:
        values = lost_by.get((f.kind, f.with_spare)) or lost_by.get((f.kind, not f.with_spare))
        if values:
            predicted.append(statistics.fmean(values))
        else:
            # A kind no single run measured (a straggler the host's load caused): taken as it
            # measured, and named, so the check never hides it.
            predicted.append(f.lost_s)
            unpredicted.append(f.fault_id)
    mtbf = run.wall_s / len(run.faults)
    lost_measured = sum(f.lost_s for f in run.faults)
    ettr_predicted = max(0.0, 1.0 - statistics.fmean(predicted) / mtbf)
    ettr_measured = max(0.0, 1.0 - lost_measured / run.wall_s)
    kinds = dict(Counter(f.kind for f in run.faults))
    return {
        "run": run.run_id, "strategy": run.strategy, "from_runs": [m.run_id for m in same],
        "wall_s": run.wall_s, "faults": len(run.faults), "faults_by_kind": kinds, "mtbf_s": mtbf,
        "lost_s_per_fault_predicted": statistics.fmean(predicted),
        "lost_s_per_fault_measured": lost_measured / len(run.faults),
        "ettr_predicted": ettr_predicted, "ettr_measured": ettr_measured,
        "goodput_measured": run.goodput,
        "goodput_predicted": run.goodput * ettr_predicted / ettr_measured if ettr_measured > 0 else None,
        "difference_points": 100.0 * (ettr_predicted - ettr_measured),
        "unpredicted_faults": unpredicted, "formulas": list(CHECK_FORMULAS),
    }

"""`ffctl bench`'s pure parts and its orchestration, without starting a job.

Young's interval, the seeded schedule, the pace and save time read off a record, the figures and
their ratios to restart-disk, the rendering at 80 columns, argument checks through the real entry
point, and `compare_strategies` end to end with `launch` replaced by hand-made records (written
with the stream builder, reported by `runs.metrics.compute`, as a controller's would be).
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
from rich.console import Console

from ffctl import bench
from tests.helpers.cli import ffctl_in_process
from ffctl.exits import BadInput
from ffctl.render.bench_results import bench_progress, render_bench, render_strategies
from fault_injectors.schedule import iter_mtbf
from wire.fault_spec import FaultKind
from runs.metrics import compute
from tests.helpers.events import StreamBuilder

PACE = 0.25
SAVE = 0.125
# Seconds a recovery takes, by strategy: what the fake runs make each strategy pay.
RECOVERY = {"peer": (0.25, 0.25, 0.25, 0.25), "restart-memory": (0.5, 1.0, 0.5, 0.25),
            "restart-disk": (0.5, 4.0, 1.0, 0.5)}


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`ffctl ARGV` through its entry point, output to a pipe; (exit code, stdout, stderr)."""
    return ffctl_in_process(argv)

def fake_launch(calls: list[list[str]]) -> Callable[..., tuple[dict[str, Any], list[Any]]]:
    """A `launch` that writes the record a job of these arguments would: steps at PACE, a disk
    checkpoint SAVE after each saved step (delaying the next), each --inject fired once at its
    step, recovered by RECOVERY[strategy], restart-disk from its newest checkpoint."""
    def launch(runs_dir: Path, *args: str, timeout: float = 1800.0,
               on_step: Callable[[int], None] | None = None) -> tuple[dict[str, Any], list[Any]]:
        argv = list(args)
        calls.append(argv)
        opt = lambda key: argv[argv.index(key) + 1]  # noqa: E731
        steps, strategy = int(opt("--steps")), opt("--recovery")
        every = int(opt("--ckpt-every")) if "--ckpt-every" in argv else 0
        faults = {int(a.split("step=")[1]): a for a, b in zip(argv[1:], argv) if b == "--inject"}
        b = StreamBuilder(start=1000.0 * len(calls))
        b.run_started(world_size=4, strategy=strategy, steps=steps)
        step, gen, saved, fired = 1, 0, 0, set()
        while step <= steps:
            b.step(step, gen=gen, step_time_s=PACE)
            if every and step % every == 0:
                b.snapshot(step, "disk", dt=SAVE)
                saved = step
            if step in faults and step not in fired:
                fired.add(step)
                fid = f"f{len(fired)}"
                b.fault_injected(fid, at_step=step, kind=faults[step].split(":")[0], dt=0.0625)
                detect, *phases = RECOVERY[strategy]
                b.failure_detected([fid], gen, dt=detect)
                restore = step if strategy != "restart-disk" else saved
                gen += 1
                b.recovery([fid], gen, restore, strategy=strategy, decide_s=0.0625, spawn_s=phases[0],
                           rendezvous_s=phases[1], restore_s=phases[2])
                step = restore
            step += 1
        b.run_finished()
        if on_step is not None:
            on_step(steps)
        return compute(f"run-{len(calls)}", b.events).to_dict(), b.events
    return launch


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []
    monkeypatch.setattr(bench, "launch", fake_launch(calls))
    return calls


def test_young_interval_and_its_steps() -> None:
    assert bench.young_interval(12.0, 0.125) == pytest.approx(math.sqrt(3.0))
    assert bench.young_interval(3600.0, 0.0) == 0.0
    assert bench.interval_steps(math.sqrt(3.0), 0.25) == 7  # 6.93 steps
    assert bench.interval_steps(0.01, 0.25) == 1  # never more often than every step
    with pytest.raises(ValueError):
        bench.young_interval(0.0, 1.0)


def test_the_schedule_is_seeded_spaced_and_drawn_as_chaos_draws_it() -> None:
    spec = bench.BenchSpec(steps=300, mtbf_s=8.0, seed=11)
    one, again = bench.fault_schedule(spec, PACE), bench.fault_schedule(spec, PACE)
    assert one == again and len(one) >= 3
    arrivals = [t for t, _ in zip((t for t, _ in iter_mtbf(8.0, 11, spec.kinds)), one)]
    assert [f.t_s for f in one] == arrivals
    steps = [f.step for f in one]
    assert steps[0] >= bench.WARMUP_STEPS and steps[-1] <= spec.steps - bench.TAIL_STEPS
    assert all(b - a >= bench.FAULT_GAP_STEPS for a, b in zip(steps, steps[1:]))
    for f in one:
        kind, value = f.target.split("=")
        assert kind == ("node" if f.kind is FaultKind.KILL_NODE else "rank")
        assert 0 <= int(value) < (spec.nnodes if kind == "node" else spec.world_size)
        assert f.inject == f"{f.kind.value}:{f.target},step={f.step}"
    assert bench.fault_schedule(bench.BenchSpec(steps=300, mtbf_s=8.0, seed=12), PACE) != one


def test_calibration_reads_the_clean_pace_and_the_save_time() -> None:
    b = StreamBuilder()
    for step in range(1, 31):
        b.step(step, step_time_s=PACE)
        if step % 2 == 0:
            b.snapshot(step, "disk", dt=SAVE)  # the save delays the next step's start
    cal = bench.Calibration.from_events("cal", b.events, 2)
    assert cal.pace_s == pytest.approx(PACE) and cal.save_s == pytest.approx(SAVE)
    # Without leaving out the intervals after a save, the pace would carry half a save.
    everything = bench.clean_intervals(b.events)
    assert sum(everything) / len(everything) > PACE + SAVE / 3


def test_intervals_overlapping_a_fault_window_or_a_rollback_are_left_out() -> None:
    b = StreamBuilder()
    b.steps(1, 12, step_time_s=PACE)
    start = b.t
    b.wait(3.0)
    b.steps(10, 20, gen=1, step_time_s=PACE)  # rolled back to 9: 10 follows 12 in another generation
    intervals = bench.clean_intervals(b.events, [(start + 0.1, b.events[16].t)])
    assert intervals and all(x == pytest.approx(PACE) for x in intervals)
    # Kept: 5->6 .. 11->12 of generation 0, and 14->15 .. 19->20 (the window ends at step 14).
    assert len(intervals) == (12 - bench.SKIP_STEPS) + (20 - 14)


def test_ratios_are_to_restart_disk_and_none_where_its_figure_is_zero() -> None:
    rows = {"peer": {"recovery_s": 1.0, "lost_steps": 0, "goodput": 0.9, "lost_s": None},
            "restart-disk": {"recovery_s": 10.0, "lost_steps": 0, "goodput": 0.6, "lost_s": 4.0}}
    bench.add_ratios(rows)
    assert rows["peer"]["ratios"]["recovery_s"] == pytest.approx(0.1)
    assert rows["peer"]["ratios"]["goodput"] == pytest.approx(1.5)
    assert rows["peer"]["ratios"]["lost_steps"] is None and rows["peer"]["ratios"]["lost_s"] is None
    assert rows["restart-disk"]["ratios"]["recovery_s"] == 1.0


def test_compare_strategies_runs_one_schedule_and_young_for_restart_disk(fake: list[list[str]]) -> None:
    spec = bench.BenchSpec(steps=80, mtbf_s=12.0, seed=3)
    heard: list[tuple[str, int, int]] = []
    result = bench.compare_strategies(spec, progress=lambda *a: heard.append(a))
    calibration, peer_run, ref_memory, memory_run, ref_disk, disk_run = fake
    runs = [peer_run, memory_run, disk_run]
    assert calibration[calibration.index("--ckpt-every") + 1] == "2"
    # A fault-free reference without snapshots right before each strategy (the calibration first).
    for ref in (ref_memory, ref_disk):
        assert ref[ref.index("--recovery") + 1] == "none" and "--inject" not in ref
    # The same spares everywhere: idle spare processes are part of the pace on a small host.
    assert all(argv[argv.index("--spares") + 1] == "1" for argv in fake)
    assert result["calibration"]["pace_s"] == pytest.approx(PACE)
    assert result["young"]["interval_steps"] == 7  # sqrt(2 x 12 x 0.125) = 1.73 s at 0.25 s a step
    schedule = bench.fault_schedule(spec, PACE)
    assert schedule and [f["inject"] for f in result["schedule"]] == [f.inject for f in schedule]
    for argv, strategy in zip(runs, bench.STRATEGIES):
        assert argv[argv.index("--recovery") + 1] == strategy
        assert argv[argv.index("--ckpt-every") + 1] == ("7" if strategy == "restart-disk" else "0")
        assert [a for a, b in zip(argv[1:], argv) if b == "--inject"] == [f.inject for f in schedule]
    rows = {r["strategy"]: r for r in result["strategies"]}
    peer, disk = rows["peer"], rows["restart-disk"]
    assert peer["faults"] == disk["faults"] == len(schedule) and peer["recovered"] == len(schedule)
    assert peer["lost_steps"] == 0 < disk["lost_steps"]
    assert peer["ratios"]["recovery_s"] == pytest.approx(peer["recovery_s"] / disk["recovery_s"])
    assert peer["ratios"]["recovery_s"] < 0.5
    assert peer["snapshot_overhead"] == pytest.approx(1.0)
    assert disk["snapshot_overhead"] > 1.02  # one save of half a step every 7 steps
    assert peer["ratios"]["goodput"] > 1.0
    done = [d for _, d, _ in heard]
    planned = bench.CALIBRATION_STEPS + 2 * bench.REFERENCE_STEPS + 3 * 80
    assert done == sorted(done) and heard[-1][1:] == (planned, planned)
    assert [r["reference_pace_s"] for r in result["strategies"]] == pytest.approx([PACE] * 3)


def test_the_comparison_fits_80_columns_without_cutting_a_value(fake: list[list[str]]) -> None:
    result = bench.compare_strategies(bench.BenchSpec(steps=80, seed=3))
    out = io.StringIO()
    render_strategies(result, Console(file=out, width=80, force_terminal=False))
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for row in result["strategies"]:
        assert f"{row['recovery_s']:.2f}" in text and f"{row['goodput']:.3f}" in text
    assert "every 7 steps" in text and "sqrt(2 x MTBF x save time) = sqrt(2 x 12 s x 0.125 s) = 1.73 s" in text


def test_the_narrow_benchmarks_fit_80_columns_without_cutting_a_value() -> None:
    # The figures `python benchmarks/recovery_vs_disk.py` printed, whose long names and numbers
    # were cut to `recovery-vs…` and `lost_gpu_ho…` in a table drawn for 80 columns.
    res = bench.BenchResult("recovery-vs-disk", [
        bench.Ratio("kill-rank recovery_s peer / restart-disk", 0.5363, 11.24, 0.10),
        bench.Ratio("kill-node lost_gpu_hours peer / restart-disk", 0.002308, 0.01262, 0.10, unit="GPU-h"),
    ])
    out = io.StringIO()
    render_bench([res.to_dict()], Console(file=out, width=80, force_terminal=False, color_system=None))
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    words = set(text.split())
    for ratio in res.ratios:
        assert set(ratio.name.split()) <= words, (ratio.name, text)  # folded at spaces, never cut
        assert f"{ratio.numerator:.4g} / {ratio.denominator:.4g}" in text and f"{ratio.value:.3f}" in text
    assert "recovery-vs-disk" in words
    assert [line.split()[-1] for line in text.splitlines() if line.rstrip().endswith((" yes", " no"))] == ["yes", "no"]


def test_bench_json_through_the_cli_is_clean_json(fake: list[list[str]]) -> None:
    code, out, err = run_cli(["bench", "--json", "--steps", "60", "--mtbf", "6"])
    assert code == 0, err
    result = json.loads(out)  # no progress bar or other text mixed in: stderr is not a terminal
    assert [r["strategy"] for r in result["strategies"]] == list(bench.STRATEGIES)
    assert result["baseline"] == "restart-disk" and result["young"]["mtbf_s"] == 6.0
    assert err == ""


def test_scale_adds_one_kill_per_strategy_and_world_size(fake: list[list[str]]) -> None:
    result = bench.compare_strategies(bench.BenchSpec(steps=60, seed=3, scale=(2, 4)))
    at = {(r["world_size"], r["strategy"]): r for r in result["scale"]}
    assert set(at) == {(w, s) for w in (2, 4) for s in bench.STRATEGIES}
    assert at[(4, "peer")]["batch_per_rank"] == bench.SCALE_GLOBAL_BATCH_SEQS // 4
    assert at[(2, "restart-disk")]["recovery_ratio"] == 1.0 and at[(2, "peer")]["recovery_ratio"] < 1.0
    out = io.StringIO()
    render_strategies(result, Console(file=out, width=80))
    text = out.getvalue()
    # One line each: the title too (rich wraps a title wider than its table).
    assert "kill-rank recovery s by world size (ratio to restart-disk)" in text and "…" not in text


def test_the_progress_bar_is_drawn_only_on_a_terminal() -> None:
    with bench_progress(Console(file=io.StringIO(), force_terminal=False)) as hear:
        assert hear is None
    drawn = io.StringIO()
    with bench_progress(Console(file=drawn, force_terminal=True, width=80)) as hear:
        assert hear is not None
        hear("peer", 40, 160)
    assert "peer" in drawn.getvalue()


@pytest.mark.parametrize("argv, named", [
    (["--scale", "2,x"], "'x'"), (["--scale", "1"], "world size 1"), (["--scale", "4,4"], "4 given twice"),
    (["--scale", "6,3"], "world size 3"), (["--kinds", "hang-rank"], "hang-rank"), (["--kinds", "kill-rnak"], "kill-rnak"),
    (["--model", "huge"], "'huge'"), (["--steps", "12"], "--steps 12"), (["--mtbf", "0.5"], "0.5"),
    (["--spares", "-1"], "-1"), (["--only", "nope"], "'nope'"), (["--only", "scale", "--scale", "2"], "--scale"),
    (["--only", "control-plane", "--nodes", "1"], "'1'"), (["--only", "control-plane", "--nodes", "8,x"], "'x'"),
    (["--only", "control-plane", "--nodes", "2048"], "'2048'"), (["--nodes", "8"], "--nodes '8'"),
    (["--only", "scale", "--nodes", "8"], "only with --only control-plane"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_starts(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                          named: str) -> None:
    def no_launch(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a job was started")
    monkeypatch.setattr(bench, "launch", no_launch)
    code, out, err = run_cli(["bench", *argv])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and named in err


def test_parse_scale_keeps_the_order_given() -> None:
    assert bench.parse_scale("8, 2,4") == (8, 2, 4)
    with pytest.raises(BadInput):
        bench.parse_scale("")


def test_dry_run_prints_the_runs_in_order_and_starts_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_launch(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a job was started")
    monkeypatch.setattr(bench, "launch", no_launch)
    code, out, err = run_cli(["bench", "--dry-run", "--scale", "2,4"])
    assert code == 0, err
    labels = [line.split(":")[0] for line in out.splitlines()]
    assert labels == ["calibration", "peer", "restart-memory reference", "restart-memory",
                      "restart-disk reference", "restart-disk",
                      *(f"{s} at {w} ranks" for w in (2, 4) for s in bench.STRATEGIES)]
    assert "--recovery none" in out.splitlines()[2] and "--inject kill-rank:rank=3,step=20" in out


def test_control_plane_is_the_largest_size_over_the_smallest_and_a_size_that_failed_is_a_miss(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ffctl.sim import control_plane as sim_bench

    def row(n: int, total: float | None) -> dict[str, Any]:
        if total is None:
            return {"nodes": n, "status": "failed", "complete": False}
        phases = {"detection_s": 1.0, "decision_s": total - 1.3, "plan_published_s": 0.1, "joined_s": 0.2}
        return {"nodes": n, "status": "completed", "complete": True, "recovery_s": total, **phases,
                "controller_cpu_share": 0.25, "sim_cpu_share": 0.5, "store_keys": 3 * n}

    got: list[list[int]] = []
    monkeypatch.setattr(sim_bench, "run_control_plane",
                        lambda sizes, where: got.append(sizes) or [row(8, 1.1), row(1024, 2.5)])
    res = bench.control_plane(tmp_path, (8, 1024))
    assert got == [[8, 1024]]
    (ratio,) = res.ratios
    assert ratio.numerator == 2.5 and ratio.denominator == 1.1 and ratio.goal == 2.0 and not ratio.met
    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    render_bench([res.to_dict()], console)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "1024" in text and "2.50" in text and "3072" in text and "25%" in text
    assert max(len(line) for line in text.splitlines()) <= 80

    monkeypatch.setattr(sim_bench, "run_control_plane", lambda sizes, where: [row(8, 1.1), row(64, None)])
    res = bench.control_plane(tmp_path, (8, 64))
    assert [r.met for r in res.ratios] == [False] and "64 nodes did not recover" in res.ratios[0].name

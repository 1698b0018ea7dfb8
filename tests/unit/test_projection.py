"""`runs.projection` and `ffctl project`: the models against published figures, the measures taken
from hand-made run records, and the command through its real entry point.

Validation targets (docs/projection.md gives each source):
- Meta's RSC-1: 6.50 failures per 1,000 node-days at 8 GPUs a node projects an MTTF of 1.80 h at
  16,384 GPUs and 0.225 h at 131,072 (within 2 %).
- Llama 3: 419 unexpected interruptions of 16,384 GPUs in 54 days, an MTBF of 3.09 h.
- FT-HSDP (Salpekar et al., arXiv 2602.00277): at about 100k GPUs with an 18-minute MTBF, a
  10-minute stall gives an ETTR of 44 % and a 3-minute one 80 % (the first-order form; within 4
  points).
- Daly (2006): with R = 10 min and delta = 5 min, optimal intervals of 117, 57 and 9.1 minutes at
  M = 24 h, 6 h and 15 min (within 1 min). Daly's higher-order estimate gives 116.7, 56.7 and
  9.14; Young's sqrt(2 delta M) gives 120, 60 and 12.2, and the first-order sqrt(2 delta M) -
  delta gives 115, 55 and 7.2: only the higher-order estimate meets all three.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from runs.events import EventKind
from runs.metrics import compute
from runs.projection import (PRESETS, FaultCost, Fleet, ProjectionSpec, RunMeasure, check_run, daly_interval,
                             ettr_daly, ettr_first_order, measure_run, project, strategy_inputs, young_interval)
from tests.helpers.events import StreamBuilder
from tests.unit.test_report_cli import run_cli, write_run

MIN = 60.0
HOUR = 3600.0


# --- Validation against published figures ---------------------------------------------------


def test_meta_rsc1_mttf_at_16k_and_131k_gpus() -> None:
    fleet = Fleet.preset("rsc1")
    assert PRESETS["rsc1"].failures_per_1000_node_days == 6.50 and fleet.gpus_per_node == 8
    assert fleet.mtbf_s_at(16384) / HOUR == pytest.approx(1.80, rel=0.02)
    assert fleet.mtbf_s_at(131072) / HOUR == pytest.approx(0.225, rel=0.02)


def test_llama3_preset_is_3_09_hours_at_its_size() -> None:
    fleet = Fleet.preset("llama3")
    assert fleet.mtbf_s_at(16384) / HOUR == pytest.approx(3.09, abs=0.005)
    assert PRESETS["llama3"].failures_per_1000_node_days == pytest.approx(3.79, abs=0.005)
    # The same rate given by hand is the same fleet.
    assert Fleet("rate", 8, failures_per_1000_node_days=3.79).mtbf_s_at(16384) / HOUR == pytest.approx(3.09, abs=0.01)


def test_rsc2_rate() -> None:
    assert PRESETS["rsc2"].failures_per_1000_node_days == 2.34
    assert Fleet.preset("rsc2").mtbf_s_at(16384) / HOUR == pytest.approx(24 * 1000 / (2.34 * 2048))


def test_ft_hsdp_ettr_44_to_80_percent_at_100k_gpus() -> None:
    mtbf = 18 * MIN
    # A job that loses no work but its stall: no checkpoint overhead, no rework.
    slow = ettr_first_order(0.0, 0.0, 10 * MIN, mtbf)
    fast = ettr_first_order(0.0, 0.0, 3 * MIN, mtbf)
    assert slow == pytest.approx(0.44, abs=0.04)
    assert fast == pytest.approx(0.80, abs=0.04)
    # Daly's complete model is kinder where the stall is a large part of the MTBF: e^(-R/M).
    assert ettr_daly(0.0, 0.0, 10 * MIN, mtbf) == pytest.approx(math.exp(-10 / 18))
    assert ettr_daly(0.0, 0.0, 10 * MIN, mtbf) - slow > 0.1


@pytest.mark.parametrize("mtbf_s, published_min", [(24 * HOUR, 117.0), (6 * HOUR, 57.0), (15 * MIN, 9.1)])
def test_daly_published_optimal_intervals(mtbf_s: float, published_min: float) -> None:
    delta = 5 * MIN
    assert daly_interval(delta, mtbf_s) / MIN == pytest.approx(published_min, abs=1.0)
    if mtbf_s == 15 * MIN:
        # Young's estimate misses the short-MTBF case by 3 minutes: why Daly's is used.
        assert abs(young_interval(delta, mtbf_s) / MIN - published_min) > 3.0


def test_daly_interval_is_m_when_delta_is_at_least_2m() -> None:
    assert daly_interval(3 * HOUR, HOUR) == HOUR
    with pytest.raises(ValueError):
        daly_interval(-1.0, HOUR)


def test_daly_ettr_is_the_complete_model_and_first_order_its_expansion() -> None:
    tau, delta, restart, mtbf = 120 * MIN, 5 * MIN, 10 * MIN, 24 * HOUR
    wall_over_work = mtbf * math.exp(restart / mtbf) * (math.exp((tau + delta) / mtbf) - 1) / tau
    assert ettr_daly(tau, delta, restart, mtbf) == pytest.approx(1 / wall_over_work)
    # Small overheads: both forms agree to within a point.
    assert ettr_daly(tau, delta, restart, mtbf) == pytest.approx(ettr_first_order(tau, delta, restart, mtbf), abs=0.01)
    # No overflow at tiny MTBFs: the job gets nowhere.
    assert ettr_daly(100 * HOUR, 0.0, 0.0, 1.0) == 0.0
    assert ettr_first_order(10 * HOUR, 0.0, HOUR, 1.0) == 0.0


def test_mtbf_given_at_a_size_scales_with_the_gpu_count() -> None:
    fleet = Fleet("mtbf", mtbf_s=3 * HOUR, mtbf_gpus=16384)
    assert fleet.mtbf_s_at(16384) == 3 * HOUR and fleet.mtbf_s_at(32768) == 1.5 * HOUR
    assert Fleet("mtbf", mtbf_s=18 * MIN).mtbf_s_at(100_000) == 18 * MIN


@pytest.mark.parametrize("kwargs", [
    {"failures_per_1000_node_days": -1.0}, {"failures_per_1000_node_days": 0.0}, {"mtbf_s": math.nan},
    {}, {"failures_per_1000_node_days": 1.0, "mtbf_s": 1.0},
])
def test_a_fleet_refuses_bad_rates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Fleet("x", **kwargs)


# --- Measures from run records ---------------------------------------------------------------


def fault_run(start: float, strategy: str, *, step_s: float = 0.5, ckpt_every: int = 0, save_s: float = 0.25,
              spare: bool = True, kind: str = "kill-node", lost_steps: int = 0, world: int = 4,
              faults: bool = True, breaks_job: bool = True, copies: int = 1) -> StreamBuilder:
    """Steps 1-20 at `step_s` (a disk checkpoint every `ckpt_every` steps, each blocking `save_s`
    before the next step), a fault at step 20 recovered in 2.25 s back to step 20 - lost_steps,
    then steps to 40."""
    b = StreamBuilder(start=start)
    b.run_started(world_size=world, strategy=strategy, snapshot_copies=copies)

    def steps(first: int, last: int, gen: int) -> None:
        for s in range(first, last + 1):
            b.step(s, gen=gen, step_time_s=step_s)
            if ckpt_every and s % ckpt_every == 0:
                b.snapshot(s, kind="disk", dt=save_s / 2)
                b.wait(save_s / 2)  # the rest of the blocking save before the next step starts

    steps(1, 20, 0)
    if faults:
        b.fault_injected("f1", at_step=20, kind=kind, breaks_job=breaks_job, dt=0.125)
        b.failure_detected(["f1"], gen=0, dt=0.25)
        restore = 20 - lost_steps
        b.recovery_decided(["f1"], gen=1, restore_step=restore, strategy=strategy,
                           restore_source="disk" if ckpt_every else "peer-memory", dt=0.25)
        b.emit(EventKind.RANKS_SPAWNED, 1.0, gen=1, ranks=[1], started_by={"1": "spare" if spare else "cold"})
        b.rendezvous_done(1, dt=0.5)
        b.restore_done(1, step=restore, dt=0.25)
        steps(restore + 1, 40, 1)
    else:
        steps(21, 40, 0)
    b.run_finished("completed", dt=0.25, steps_completed=40)
    return b


def measured(b: StreamBuilder, run_id: str = "r", job: str = ""):  # type: ignore[no-untyped-def]
    return measure_run(compute(run_id, b.events).to_dict(), b.events, job)


def test_steady_step_time_leaves_out_warm_up_faults_and_checkpoint_writes() -> None:
    m = measured(fault_run(1000.0, "restart-disk", ckpt_every=5, lost_steps=3))
    assert m.intervals and all(x == pytest.approx(0.5) for x in m.intervals)
    assert m.after_ckpt and all(x == pytest.approx(0.75) for x in m.after_ckpt)
    assert m.ckpt_writes and all(x == pytest.approx(0.125) for x in m.ckpt_writes)
    (f,) = m.faults
    assert f.kind == "kill-node" and f.stops_job and f.with_spare and f.recovered
    assert f.rework_s == pytest.approx(3 * 0.5) and f.restart_s == pytest.approx(f.lost_s - f.rework_s)
    (inputs,) = strategy_inputs([m])
    assert inputs.step_s == pytest.approx(0.5) and inputs.blocking_save_s == pytest.approx(0.25)
    assert inputs.ckpt_write_s == pytest.approx(0.125) and inputs.checkpoints
    assert inputs.detection_s == pytest.approx(0.25)


def test_warm_up_steps_are_left_out() -> None:
    b = StreamBuilder(start=1.0)
    b.run_started(world_size=2, strategy="restart-disk")
    b.steps(1, 4, step_time_s=3.0)  # imports, allocator warm-up
    b.steps(5, 30, step_time_s=0.5)
    b.run_finished("completed", dt=0.25, steps_completed=30)
    (inputs,) = strategy_inputs([measured(b)])
    assert inputs.step_s == pytest.approx(0.5)


def test_rework_is_set_apart_from_the_restart_cost() -> None:
    (inputs,) = strategy_inputs([measured(fault_run(1000.0, "restart-disk", ckpt_every=5, lost_steps=4))])
    lost = inputs.lost_s_by_kind["kill-node"]["with_spare"]
    assert lost is not None and inputs.restart_s_with_spare == pytest.approx(lost - 4 * 0.5)


def test_snapshot_overhead_against_the_same_job_without_per_step_snapshots() -> None:
    peer = measured(fault_run(1000.0, "peer", step_s=0.55), "p", job="model small")
    ref = measured(fault_run(2000.0, "none", faults=False), "n", job="model small")
    other = measured(fault_run(3000.0, "none", step_s=0.1, faults=False), "o", job="model base")
    by = {s.strategy: s for s in strategy_inputs([peer, ref, other])}
    assert by["peer"].reference_step_s == pytest.approx(0.5)
    assert by["peer"].snapshot_overhead == pytest.approx(0.1)
    # Without a reference of the same job it is unknown, and the projection says so.
    (alone,) = strategy_inputs([peer])
    assert alone.snapshot_overhead is None
    doc = project([peer, other], ProjectionSpec(Fleet.preset("llama3")))
    assert any("snapshot overhead not measured" in n for n in doc["notes"])
    assert [s["strategy"] for s in doc["strategies"]] == ["peer"]  # `none` is only a reference
    # Faster than its reference: shown as measured, taken as no cost.
    quick = measured(fault_run(4000.0, "peer", step_s=0.4), "q", job="model small")
    doc = project([quick, ref], ProjectionSpec(Fleet.preset("llama3")))
    (s,) = doc["strategies"]
    assert s["inputs"]["snapshot_overhead"] == pytest.approx(-0.2)
    assert s["projections"][0]["delta_s"] == 0.0 and any("20.0% faster" in n for n in doc["notes"])


def test_snapshot_copies_are_a_strategy_of_their_own_with_their_own_overhead() -> None:
    """What a second copy of every snapshot costs per step: `--snapshot-copies 2` runs are pooled
    apart from K = 1 runs, each against the same reference."""
    one = measured(fault_run(1000.0, "peer", step_s=0.55), "p1", job="model small")
    two = measured(fault_run(2000.0, "peer", step_s=0.6, copies=2), "p2", job="model small")
    ref = measured(fault_run(3000.0, "none", faults=False, copies=2), "n", job="model small")
    assert two.strategy == "peer (2 copies)" and ref.strategy == "none"  # no copies without snapshots
    by = {s.strategy: s for s in strategy_inputs([one, two, ref])}
    assert by["peer"].snapshot_overhead == pytest.approx(0.1)
    assert by["peer (2 copies)"].snapshot_overhead == pytest.approx(0.2)
    doc = project([one, two, ref], ProjectionSpec(Fleet.preset("llama3")))
    assert [s["strategy"] for s in doc["strategies"]] == ["peer", "peer (2 copies)"]
    assert doc["strategies"][1]["projections"][0]["delta_s"] > doc["strategies"][0]["projections"][0]["delta_s"]


def test_slowdowns_and_unrecovered_faults_are_not_failures() -> None:
    b = fault_run(1000.0, "peer", kind="net-bandwidth", breaks_job=False)
    (inputs,) = strategy_inputs([measured(b)])
    assert inputs.faults == 0 and inputs.faults_left_out == 1
    doc = project([measured(b)], ProjectionSpec(Fleet.preset("llama3")))
    assert doc["strategies"][0]["projections"][0]["ettr_daly"] is None
    assert any("nothing to project" in n for n in doc["notes"])


def test_spare_or_not_picks_the_recovery_measured_that_way() -> None:
    with_spare = measured(fault_run(1000.0, "peer"), "a")
    without = measured(fault_run(2000.0, "peer", spare=False), "b")
    fleet = Fleet.preset("llama3")
    (inputs,) = strategy_inputs([with_spare, without])
    assert inputs.restart_s_with_spare is not None and inputs.restart_s_without_spare is not None
    spared = project([with_spare, without], ProjectionSpec(fleet, (16384,), 8.0))["strategies"][0]
    bare = project([with_spare, without], ProjectionSpec(fleet, (16384,), 0.0, replace_s=600.0))["strategies"][0]
    assert spared["restart_basis"] == "with a spare"
    assert bare["restart_basis"] == "without a spare + replace time"
    assert bare["projections"][0]["restart_s"] == pytest.approx(inputs.restart_s_without_spare + 600.0)
    assert bare["projections"][0]["ettr_daly"] < spared["projections"][0]["ettr_daly"]


def test_a_kind_measured_only_the_other_way_still_counts() -> None:
    # restart-disk restarts every rank: a kill-node's ranks may all start cold, a kill-rank's on spares.
    rank = measured(fault_run(1000.0, "restart-disk", ckpt_every=5, kind="kill-rank"), "a")
    node = measured(fault_run(2000.0, "restart-disk", ckpt_every=5, spare=False), "b")
    (inputs,) = strategy_inputs([rank, node])
    doc = project([rank, node], ProjectionSpec(Fleet.preset("llama3"), (16384,), 8.0))
    (s,) = doc["strategies"]
    assert s["restart_basis"] == "with a spare (kill-node only without a spare)"
    by = inputs.restart_s_by_kind
    assert s["projections"][0]["restart_s"] == pytest.approx(
        (by["kill-rank"]["with_spare"] + by["kill-node"]["without_spare"]) / 2)


def test_projection_point_figures() -> None:
    disk = measured(fault_run(1000.0, "restart-disk", ckpt_every=5), "d")
    spec = ProjectionSpec(Fleet.preset("llama3"), (1024, 16384, 100_000), spares_per_1000=8.0)
    doc = project([disk], spec)
    (s,) = doc["strategies"]
    p = s["projections"][1]
    assert p["gpus"] == 16384 and p["nodes"] == 2048 and p["mtbf_h"] == pytest.approx(3.093, abs=0.001)
    assert p["delta_s"] == pytest.approx(0.25)
    assert p["ckpt_interval_s"] == pytest.approx(daly_interval(0.25, p["mtbf_s"]))
    assert p["young_interval_s"] == pytest.approx(young_interval(0.25, p["mtbf_s"]))
    assert p["ettr_daly"] == pytest.approx(ettr_daly(p["tau_s"], 0.25, p["restart_s"], p["mtbf_s"]))
    assert p["lost_gpu_hours_per_day"] == pytest.approx((1 - p["ettr_daly"]) * 16384 * 24)
    assert p["spare_gpu_hours_per_day"] == pytest.approx(8 / 1000 * 16384 * 24)
    # Bigger jobs fail more often: ETTR falls, the interval shortens.
    ettrs = [q["ettr_daly"] for q in s["projections"]]
    assert ettrs == sorted(ettrs, reverse=True)
    assert [q["ckpt_interval_s"] for q in s["projections"]] == sorted((q["ckpt_interval_s"] for q in s["projections"]),
                                                                       reverse=True)
    assert {m["name"] for m in doc["presets"]} == set(PRESETS) and s["curve"]


# --- The command ------------------------------------------------------------------------------


@pytest.fixture()
def runs_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runs"
    write_run(d, "peer-1", fault_run(1000.0, "peer", step_s=0.55))
    write_run(d, "disk-1", fault_run(2000.0, "restart-disk", ckpt_every=5, lost_steps=2))
    write_run(d, "mem-1", fault_run(3000.0, "restart-memory", step_s=0.6))
    write_run(d, "none-1", fault_run(4000.0, "none", faults=False))
    return d


ALL = ["peer-1", "disk-1", "mem-1", "none-1"]


def test_json_per_strategy_and_gpu_count(runs_dir: Path) -> None:
    code, out = run_cli(["project", *ALL, "--fleet", "llama3", "--json"], runs_dir)
    assert code == 0, out
    doc = json.loads(out)
    assert [s["strategy"] for s in doc["strategies"]] == ["peer", "restart-disk", "restart-memory"]
    assert doc["headline"] == "ettr_daly" and doc["fleet"]["name"] == "llama3"
    for s in doc["strategies"]:
        assert [p["gpus"] for p in s["projections"]] == [1024, 16384, 100_000]
        for p in s["projections"]:
            for key in ("gpus", "mtbf_h", "ettr_daly", "ettr_first_order", "lost_gpu_hours_per_day",
                        "ckpt_interval_s"):
                assert key in p
            assert 0 < p["ettr_daly"] <= 1 and 0 <= p["ettr_first_order"] <= 1
        assert (s["projections"][0]["ckpt_interval_s"] is not None) == (s["strategy"] == "restart-disk")
    by = {s["strategy"]: s for s in doc["strategies"]}
    assert by["peer"]["inputs"]["snapshot_overhead"] == pytest.approx(0.1)
    assert by["restart-memory"]["inputs"]["snapshot_overhead"] == pytest.approx(0.2)
    assert by["peer"]["projections"][1]["mtbf_h"] == pytest.approx(3.09, abs=0.005)


def test_terminal_table_formulas_and_notes(runs_dir: Path) -> None:
    code, text = run_cli(["project", *ALL, "--fleet", "rsc1", "--gpus", "16384,131072"], runs_dir)
    assert code == 0, text
    assert all(len(line) <= 80 for line in text.splitlines())
    for needle in ("ETTR Daly", "ETTR 1st", "lost GPU-h/d", "spare GPU-h/d", "ckpt s", "16,384", "131,072",
                   "1.8", "0.225", "Daly's complete model", "Kokolis", "node failures", "formulas",
                   "e^(R/M)", "sqrt(2 delta M)", "spare GPU-h/day = spares_per_1000 / 1000 x gpus x 24"):
        assert needle in text, needle


def test_markdown(runs_dir: Path) -> None:
    code, md = run_cli(["project", *ALL, "--mtbf", "3h@16384", "--markdown"], runs_dir)
    assert code == 0, md
    assert md.startswith("### projected to fleet mtbf: MTBF 3 h at 16,384 GPUs")
    assert "| GPUs | MTBF h | ETTR Daly |" in md and "#### restart-disk" in md and "- `ETTR (first order)" in md


def test_spare_cost_scales_with_spares_per_1000_not_the_test_job(runs_dir: Path) -> None:
    def spare(k: str) -> list[float]:
        code, out = run_cli(["project", "peer-1", "--fleet", "llama3", "--spares-per-1000", k, "--json"], runs_dir)
        assert code == 0, out
        return [p["spare_gpu_hours_per_day"] for p in json.loads(out)["strategies"][0]["projections"]]

    # The test job held 1 spare for 4 ranks; the fleet's spares are what --spares-per-1000 says.
    assert spare("8") == pytest.approx([8 / 1000 * g * 24 for g in (1024, 16384, 100_000)])
    assert spare("16") == pytest.approx([2 * x for x in spare("8")])
    assert spare("0") == [0.0, 0.0, 0.0]


def test_mtbf_at_every_size_or_scaled(runs_dir: Path) -> None:
    code, out = run_cli(["project", "peer-1", "--mtbf", "18m", "--gpus", "1024,100000", "--json"], runs_dir)
    assert code == 0, out
    assert [p["mtbf_h"] for p in json.loads(out)["strategies"][0]["projections"]] == [0.3, 0.3]
    code, out = run_cli(["project", "peer-1", "--mtbf", "3h@16384", "--gpus", "32768", "--json"], runs_dir)
    assert json.loads(out)["strategies"][0]["projections"][0]["mtbf_h"] == pytest.approx(1.5)


@pytest.mark.parametrize("args, needle", [
    (["--fleet", "frontier"], "--fleet 'frontier': use one of llama3, rsc1, rsc2"),
    (["--failures-per-1000-node-days", "-3"], "--failures-per-1000-node-days '-3'"),
    (["--failures-per-1000-node-days", "lots"], "--failures-per-1000-node-days 'lots'"),
    (["--mtbf", "soon"], "--mtbf 'soon'"),
    (["--mtbf", "0h"], "--mtbf '0h'"),
    (["--mtbf", "3h@many"], "'many'"),
    ([], "give one failure rate"),
    (["--fleet", "llama3", "--mtbf", "3h"], "(got --fleet and --mtbf)"),
    (["--fleet", "llama3", "--gpus", "1024,0"], "--gpus '0'"),
    (["--fleet", "llama3", "--spares-per-1000", "-1"], "--spares-per-1000 -1.0"),
    (["--fleet", "llama3", "--replace-time", "-5m"], "--replace-time '-5m'"),
    (["--fleet", "llama3", "--json", "--markdown"], "--json and --markdown"),
])
def test_bad_input_is_one_line_and_exit_2(runs_dir: Path, args: list[str], needle: str) -> None:
    code, text = run_cli(["project", "peer-1", *args], runs_dir)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ffctl: error: ") and needle in lines[0], text


def test_a_missing_or_garbage_run_is_bad_input(runs_dir: Path) -> None:
    code, text = run_cli(["project", "peer-1", "no-such-run", "--fleet", "llama3"], runs_dir)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "'no-such-run'" in lines[0], text
    garbage = runs_dir / "garbage"
    garbage.mkdir()
    (garbage / "run.json").write_text("{not json")
    (garbage / "events.jsonl").write_text("\x00\x01 not an event\n{}\n")
    code, text = run_cli(["project", "garbage", "--fleet", "llama3"], runs_dir)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "run 'garbage'" in lines[0], text
    # JSON of the right shape with the wrong things in it.
    wrong = runs_dir / "wrong-types"
    wrong.mkdir()
    (wrong / "run.json").write_text("{}")
    (wrong / "events.jsonl").write_text('{"event": "run_started", "t": 1.0, "world_size": 2, "strategy": "peer"}\n'
                                        '{"event": "step", "t": 2.0, "step": "seven"}\n')
    code, text = run_cli(["project", "wrong-types", "--fleet", "llama3"], runs_dir)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "run 'wrong-types'" in lines[0], text
    code, text = run_cli(["project", "none-1", "--fleet", "llama3"], runs_dir)
    assert code == 2 and "no strategy with a recovery to project" in text


def test_html_page_with_the_ettr_plot(runs_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the html extra (matplotlib) is not installed")
    from tests.unit.test_report_html import assert_self_contained, images

    out = tmp_path / "project.html"
    code, text = run_cli(["project", *ALL, "--fleet", "llama3", "--html", str(out)], runs_dir)
    assert code == 0, text
    page = out.read_text()
    assert_self_contained(page)
    sizes = images(page)
    assert len(sizes) == 1 and sizes[0][0] > 300
    for needle in ("ETTR against GPU count", "inputs from the runs", ">restart-disk<", "Llama 3", "formulas"):
        assert needle in page, needle


# --- A chaos run predicted from single-fault runs (`--check`) ----------------------------------


def cost(run_id: str, fid: str, kind: str, lost: float, spare: bool = True, recovered: bool = True) -> FaultCost:
    return FaultCost(run_id, fid, kind, lost, 0.0, lost, 0.1, spare, True, recovered)


def run_of(run_id: str, faults: list[FaultCost], wall: float = 100.0, goodput: float | None = 0.8,
           strategy: str = "peer") -> RunMeasure:
    return RunMeasure(run_id, strategy, 4, "model tiny", (), (), (), tuple(faults), wall_s=wall, goodput=goodput)


def test_check_predicts_each_fault_by_kind_and_spare_from_the_single_fault_runs() -> None:
    single = run_of("s", [cost("s", "f1", "kill-rank", 0.4), cost("s", "f2", "kill-rank", 0.6),
                          cost("s", "f3", "kill-node", 2.0, spare=False),
                          cost("s", "f4", "kill-node", 9.0, spare=False, recovered=False)])
    other = run_of("d", [cost("d", "f1", "kill-rank", 50.0)], strategy="restart-disk")  # another strategy
    chaos = run_of("c", [cost("c", "f1", "kill-rank", 0.7), cost("c", "f2", "kill-node", 1.0),
                         cost("c", "f3", "detected", 0.3)])
    doc = check_run([single, other], chaos)
    assert doc["from_runs"] == ["s"] and doc["faults_by_kind"] == {"kill-rank": 1, "kill-node": 1, "detected": 1}
    # kill-rank: the mean 0.5; kill-node with a spare was only measured without one (2.0, the
    # unrecovered one left out); the straggler no single run had is taken as measured, and named.
    assert doc["lost_s_per_fault_predicted"] == pytest.approx((0.5 + 2.0 + 0.3) / 3)
    assert doc["unpredicted_faults"] == ["f3"]
    assert doc["mtbf_s"] == pytest.approx(100 / 3)
    assert doc["ettr_predicted"] == pytest.approx(1 - (2.8 / 3) / (100 / 3))
    assert doc["ettr_measured"] == pytest.approx(1 - 2.0 / 100)
    assert doc["difference_points"] == pytest.approx(100 * (doc["ettr_predicted"] - doc["ettr_measured"]))
    assert doc["goodput_predicted"] == pytest.approx(0.8 * doc["ettr_predicted"] / doc["ettr_measured"])


def test_a_fault_that_costs_more_beside_others_fails_the_check() -> None:
    single = run_of("s", [cost("s", "f1", "kill-rank", 0.5)])
    # Faults close together each cost a restart from far back: the premise does not hold.
    chaos = run_of("c", [cost("c", f"f{i}", "kill-rank", 4.0) for i in range(1, 5)])
    doc = check_run([single], chaos)
    assert doc["difference_points"] == pytest.approx(100 * (16.0 / 100 - 4 * 0.5 / 100))


@pytest.mark.parametrize("singles, chaos, needle", [
    ([], run_of("c", [cost("c", "f1", "kill-rank", 1.0)]), "no run of strategy 'peer' besides 'c'"),
    ([run_of("s", [cost("s", "f1", "kill-rank", 1.0)])], run_of("c", []), "had no fault"),
    ([run_of("s", [cost("s", "f1", "kill-rank", 1.0)])], run_of("c", [cost("c", "f1", "kill-rank", 1.0)],
                                                                 goodput=None), "measured no goodput"),
])
def test_check_refuses_what_it_cannot_predict(singles: list[RunMeasure], chaos: RunMeasure, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        check_run(singles, chaos)


def test_check_through_the_command(runs_dir: Path) -> None:
    write_run(runs_dir, "peer-2", fault_run(5000.0, "peer", step_s=0.55))
    code, out = run_cli(["project", "peer-1", "--check", "peer-2", "--json"], runs_dir)
    assert code == 0, out
    doc = json.loads(out)
    assert doc["run"] == "peer-2" and doc["from_runs"] == ["peer-1"] and doc["ok"]
    assert abs(doc["difference_points"]) < 1e-6  # the same run twice: the same cost
    code, text = run_cli(["project", "peer-1", "--check", "peer-2"], runs_dir)
    assert code == 0 and "ETTR predicted" in text and "formulas" in text, text
    code, text = run_cli(["project", "peer-1", "--check", "peer-2", "--within", "0"], runs_dir)
    assert code == 0, text
    write_run(runs_dir, "peer-slow", fault_run(6000.0, "peer", step_s=0.55, lost_steps=15))
    code, text = run_cli(["project", "peer-1", "--check", "peer-slow", "--within", "1"], runs_dir)
    assert code == 1 and "NO" in text, text


@pytest.mark.parametrize("args, needle", [
    (["--within", "3"], "--within: only with --check RUN"),
    (["--check", "peer-1"], "--check 'peer-1': no run of strategy 'peer' besides 'peer-1'"),
    (["--check", "no-such-run"], "'no-such-run'"),
    (["--check", "disk-1", "--within", "-1"], "--within -1.0"),
    (["--check", "mem-1", "--markdown"], "--check: prints a table or --json only"),
])
def test_check_bad_input_is_one_line_and_exit_2(runs_dir: Path, args: list[str], needle: str) -> None:
    code, text = run_cli(["project", "peer-1", *args], runs_dir)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ffctl: error: ") and needle in lines[0], text

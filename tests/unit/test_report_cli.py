"""`ffctl report` through its real entry point on hand-made run directories.

Each run directory is written with the run store's own APIs (`RunStore.create`, `append`), from
event streams spelled out with the stream builder, so the report reads exactly what a controller
would have left. The terminal output is checked at 80 columns (what a pipe gets): every value the
JSON report holds must appear whole on some line, never cut or folded.
"""
from __future__ import annotations

import io
import json
import os
import re
import socket
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ffctl.cli.app import main
from ffctl.render.report import render_comparison, render_report, render_run_list
from runs.events import EventKind
from runs.store import RunStore, list_runs
from tests.helpers.events import StreamBuilder

LONG_ID = "20261123-225622-a1b2c3-nightly-chaos-net-bandwidth"


def write_run(runs_dir: Path, run_id: str, builder: StreamBuilder) -> RunStore:
    store = RunStore.create(runs_dir, run_id, {"spec": {}})
    for ev in builder.events:
        store.append(ev.kind, t=ev.t, **ev.data)
    store.close()
    return store


def two_fault_run(start: float, strategy: str = "peer") -> StreamBuilder:
    """A kill recovered from a peer, then a net-bandwidth slowdown that breaks nothing."""
    b = StreamBuilder(start=start)
    b.run_started(world_size=4, strategy=strategy)
    b.spares_held(node=0, count=1)
    b.steps(1, 10)
    b.fault_injected("f1", at_step=10, dt=0.125)
    b.failure_detected(["f1"], gen=0, dt=0.25)
    b.recovery_decided(["f1"], gen=1, restore_step=10, restore_source="peer-memory", strategy=strategy, dt=0.25,
                       survivors_without_products=2)
    b.emit(EventKind.RANKS_SPAWNED, 1.0, gen=1, ranks=[1, 3],
           started_by={"1": "spare", "3": "template"}, started_ahead=[1])
    b.rendezvous_done(1, dt=0.5)
    b.restore_done(1, step=10, dt=0.25)
    b.steps(11, 20, gen=1)
    b.fault_injected("f2", kind="net-bandwidth", target="node:1", ranks=(), nodes=(1,), at_step=20)
    b.steps(21, 24, gen=1, step_time_s=1.5)
    b.fault_reverted("f2")
    b.steps(25, 40, gen=1)
    b.run_finished("completed", dt=0.25, steps_completed=40)
    return b


def clean_run(start: float, strategy: str = "restart-disk", world: int = 2) -> StreamBuilder:
    b = StreamBuilder(start=start)
    b.run_started(world_size=world, strategy=strategy)
    b.steps(1, 5)
    b.run_finished("completed", dt=0.25, steps_completed=5)
    return b


def incomplete_run(start: float) -> StreamBuilder:
    b = StreamBuilder(start=start)
    b.run_started(world_size=4, strategy="peer")
    b.steps(1, 6)
    b.fault_injected("k", at_step=6, dt=0.25)
    b.failure_detected(["k"], gen=0, dt=0.5)
    return b  # the controller died here: no run_finished


@pytest.fixture()
def runs_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runs"
    write_run(d, "old-clean", clean_run(1000.0))
    write_run(d, LONG_ID, two_fault_run(2000.0))
    write_run(d, "mid-memory", clean_run(1500.0, strategy="restart-memory", world=8))
    return d


def run_cli(argv: list[str], runs_dir: Path) -> tuple[int, str]:
    """`ffctl ARGV` with output to a pipe (no terminal: 80 columns); (exit code, what it printed)."""
    runner = CliRunner()
    env = {"FFCTL_RUNS_DIR": str(runs_dir), "COLUMNS": None, "TERM": "dumb"}
    with runner.isolation(env=env) as (out, err, _):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        return code, out.getvalue().decode() + err.getvalue().decode()


def assert_whole(values: list[str], text: str, width: int = 80) -> None:
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    assert "…" not in text
    for value in values:
        assert any(re.search(rf"(?<![\w.:-]){re.escape(value)}(?![\w.:-])", line) for line in lines), (value, text)


def fault_values(fault: dict) -> list[str]:
    out = [fault["fault_id"], fault["kind"], fault["target"], str(fault["at_step"]), f"{fault['lost_s']:.2f}",
           str(fault["lost_steps"]), fault["restore_source"] or "-"]
    if fault["recovery_s"] is not None:
        out.append(f"{fault['recovery_s']:.2f}")
    if fault["detection_s"] is not None:
        out.append(f"{fault['detection_s']:.2f}")
    out += [f"{v:.2f}" for v in fault["breakdown"].values() if v is not None]
    return out


def test_list_runs_is_newest_first(runs_dir: Path) -> None:
    assert [s.run_id for s in list_runs(runs_dir)] == [LONG_ID, "mid-memory", "old-clean"]
    (runs_dir / "not-a-run").mkdir()  # no run.json: skipped
    assert len(list_runs(runs_dir)) == 3
    assert list_runs(runs_dir / "missing") == []


def test_report_without_a_run_lists_the_runs(runs_dir: Path) -> None:
    code, text = run_cli(["report"], runs_dir)
    assert code == 0, text
    assert_whole([LONG_ID, "mid-memory", "old-clean", "restart-memory", "restart-disk", "completed", "40", "8"], text)
    assert text.index(LONG_ID) < text.index("mid-memory") < text.index("old-clean")
    code, out = run_cli(["report", "--json"], runs_dir)
    listed = json.loads(out)
    assert [r["run_id"] for r in listed] == [LONG_ID, "mid-memory", "old-clean"]
    first = listed[0]
    assert (first["status"], first["strategy"], first["world_size"], first["steps_completed"], first["faults"]) == (
        "completed", "peer", 4, 40, 2)
    assert first["lost_s"] > 0 and first["lost_gpu_hours_total"] == pytest.approx(4 * first["lost_s"] / 3600)


def test_report_lists_nothing_in_an_empty_dir(tmp_path: Path) -> None:
    code, text = run_cli(["report"], tmp_path / "none")
    assert code == 0 and "no runs in" in text
    code, text = run_cli(["report", "--json"], tmp_path / "none")
    assert code == 0 and json.loads(text) == []


def test_a_run_s_report_at_80_columns_cuts_no_value(runs_dir: Path) -> None:
    code, out = run_cli(["report", LONG_ID, "--json"], runs_dir)
    assert code == 0, out
    rep = json.loads(out)
    f1, f2 = rep["faults"]
    assert f1["started_by"] == {"1": "spare", "3": "template"} and f1["started_ahead"] == [1]
    assert f1["survivors_without_products"] == 2 and f2["survivors_without_products"] == 0
    assert f2["kind"] == "net-bandwidth" and f2["detection_s"] is None and f2["lost_s"] == pytest.approx(4.0)
    code, text = run_cli(["report", LONG_ID], runs_dir)
    assert code == 0, text
    values = [LONG_ID, "completed", "peer", f"{rep['final_loss']:.4f}", f"{rep['goodput']:.3f}",
              f"{rep['lost_gpu_hours_total']:.6f}", f"{rep['spare_gpu_hours']:.6f}", "rank 1: spare (ahead), rank 3: template",
              "not detected", "peer-memory"]
    assert_whole(values + fault_values(f1) + fault_values(f2), text)
    for label in ("goodput", "lost GPU-hours", "spare GPU-hours", "started by", "emulated", "restore source",
                  "lost steps", "rendezvous", "replay"):
        assert label in text, label


def test_rendering_into_an_80_column_console() -> None:
    """The renderer itself, into a rich Console of 80 columns, with a report wider than that."""
    from runs.metrics import compute

    b = two_fault_run(3000.0, strategy="restart-memory")
    rep = compute(LONG_ID * 2, b.events).to_dict()  # a 100-character run id
    buf = io.StringIO()
    console = Console(width=80, file=buf, force_terminal=False, color_system=None)
    render_report(rep, console)
    text = buf.getvalue()
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    # The run id is wider than the line: folded across lines, but every character is there.
    assert LONG_ID * 2 in "".join(line.strip() for line in text.splitlines())
    assert_whole(fault_values(rep["faults"][0]) + fault_values(rep["faults"][1]), text)
    buf = io.StringIO()
    render_run_list([rep, rep], Console(width=80, file=buf, color_system=None), "runs")
    assert "…" not in buf.getvalue() and f"{rep['lost_gpu_hours_total']:.6f}" in buf.getvalue()


def test_rejected_messages_appear_in_the_summary_only_when_there_were_some() -> None:
    from runs.events import EventKind
    from runs.metrics import compute

    def rendered(rep: dict[str, object]) -> str:
        buf = io.StringIO()
        render_report(rep, Console(width=80, file=buf, force_terminal=False, color_system=None))
        return buf.getvalue()

    b = two_fault_run(3000.0, strategy="peer")
    assert "rejected messages" not in rendered(compute("quiet", b.events).to_dict())
    b.emit(EventKind.MESSAGE_REJECTED, 0.1, queue="snapshot channel", index=-1, raw="",
           reason="a client at 10.0.0.9:4242 failed the job-token handshake", reported_by_node=0,
           unreported_before=2)
    text = rendered(compute("probed", b.events).to_dict())
    assert "rejected messages  3 (message_rejected in events.jsonl)" in text, text


def test_compare_runs_in_one_table(runs_dir: Path) -> None:
    code, text = run_cli(["report", LONG_ID, "mid-memory", "old-clean"], runs_dir)
    assert code == 0, text
    assert_whole([LONG_ID, "mid-memory", "old-clean", "peer", "restart-memory", "restart-disk", "40", "5"], text)
    assert "lost GPU-hours" in text and "goodput" in text
    # Wide enough, it is one table: a row per figure, a column per run.
    buf = io.StringIO()
    from runs.metrics import compute

    reps = [compute(s.run_id, s.events()).to_dict() for s in list_runs(runs_dir)]
    render_comparison(reps, Console(width=160, file=buf, color_system=None))
    rows = [line for line in buf.getvalue().splitlines() if line.split()[:1] == ["strategy"]]
    assert len(rows) == 1 and rows[0].split() == ["strategy", "peer", "restart-memory", "restart-disk"]


def test_markdown_tables(runs_dir: Path) -> None:
    code, md = run_cli(["report", LONG_ID, "--markdown"], runs_dir)
    assert code == 0, md
    tables = [line for line in md.splitlines() if line.startswith("|")]
    assert "| fault | kind | target |" in md
    assert any(re.fullmatch(r"\|( ---:? \|)+", line.replace("|---", "| ---")) or "---" in line for line in tables)
    # Every row of a table has as many cells as its header.
    header_cells = None
    for line in md.splitlines():
        if not line.startswith("|"):
            header_cells = None
            continue
        cells = line.count("|") - line.count("\\|")
        if header_cells is None:
            header_cells = cells
        assert cells == header_cells, line
    assert "| f2 | net-bandwidth | node:1 | 20 | not detected |" in md
    code, md = run_cli(["report", LONG_ID, "old-clean", "--markdown"], runs_dir)
    assert code == 0 and md.splitlines()[0].startswith("| run | `" + LONG_ID + "` | `old-clean` |")
    code, md = run_cli(["report", "--markdown"], runs_dir)
    assert code == 0 and md.splitlines()[0].startswith("| run | status | strategy |")


def test_incomplete_run_renders_what_was_recorded_and_exits_1(runs_dir: Path) -> None:
    store = write_run(runs_dir, "cut-short", incomplete_run(2500.0))
    # This process, but started at another time: a controller that is gone (its pid reused).
    store.update_run_info(controller={"pid": os.getpid(), "host": socket.gethostname(), "started": 1.0})
    code, out = run_cli(["report", "cut-short", "--json"], runs_dir)
    rep = json.loads(out)
    assert rep["status"] == "incomplete" and rep["faults"][0]["lost_s"] > 0
    assert code == 1
    code, text = run_cli(["report", "cut-short"], runs_dir)
    assert code == 1 and "incomplete" in text and "not recovered" in text


def test_json_and_markdown_together_is_bad_input(runs_dir: Path) -> None:
    code, text = run_cli(["report", LONG_ID, "--json", "--markdown"], runs_dir)
    assert code == 2 and text.strip().splitlines() == ["ffctl: error: --json and --markdown: choose one"]


@pytest.mark.parametrize("spec", ["gpus=16384,mtbf=3h", "gpus=8"])
def test_project_option_points_to_ffctl_project(runs_dir: Path, spec: str) -> None:
    # The projection is its own command now (tests/unit/test_projection.py).
    code, text = run_cli(["report", LONG_ID, "--project", spec], runs_dir)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ffctl: error: --project "), text
    assert "ffctl project RUN..." in lines[0]


def test_last_is_the_newest_run_without_its_id(runs_dir: Path, tmp_path: Path) -> None:
    code, text = run_cli(["report", "--last", "--json"], runs_dir)
    assert code == 0, text
    assert json.loads(text)["run_id"] == LONG_ID  # the newest, as the listing's first
    code, text = run_cli(["report", "--last", "mid-memory"], runs_dir)
    assert code == 2 and "--last and run id 'mid-memory'" in text and text.count("\n") == 1
    code, text = run_cli(["report", "--last"], tmp_path / "empty")
    assert code == 2 and "--last: no runs in" in text and text.count("\n") == 1


def test_a_long_run_id_keeps_the_run_list_to_a_line_or_two_per_run(runs_dir: Path) -> None:
    # The table does not fit 80 columns with LONG_ID in it: each run becomes `id  field: value`
    # lines, broken between fields, never a block of eight lines per run.
    code, text = run_cli(["report"], runs_dir)
    assert code == 0, text
    assert_whole([LONG_ID, "status: completed", "strategy: restart-memory"], text)
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(LONG_ID))
    assert len(lines) - first <= 2 * 3, text  # after the title (a long path): 3 runs, 2 lines each

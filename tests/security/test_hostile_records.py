"""`ffctl report` on a record line that is valid JSON of the wrong type (`"step": "abc"`, a list
where a number belongs, a negative count, NaN as a string, an object where a string belongs).

Each run directory is written with the run store's own API from a stream builder, as a
controller would leave it; then one hostile line is appended to events.jsonl by hand (what a
writer to a shared runs dir, or a damaged disk, could leave). Through the real entry point:
naming the run is one line on stderr and exit 2, naming the run, the line, the field and the
value, never a traceback; the run list skips that run with one warning line and lists the others.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import ffctl_in_process
from runs.events import Event, EventKind
from runs.metrics import compute
from runs.report_fields import BadField
from runs.store import RunStore
from tests.helpers.events import StreamBuilder

BAD_RUN = "hostile-run"
GOOD_RUN = "good-run"

# (event the hostile line is, the field it spoils, the value, the rest of the line). A run_started
# line replaces the stream's own (the report reads the first one).
CASES: list[tuple[str, str, Any, dict[str, Any]]] = [
    ("step", "step", "abc", {"loss": 1.0, "step_time_s": 0.5, "gen": 0}),
    ("run_started", "world_size", "two", {"strategy": "peer"}),
    ("fault_injected", "at_step", "x", {"fault_id": "fx", "kind": "kill-rank", "target": "rank:1"}),
    ("step", "step_time_s", [0.5], {"step": 21, "loss": 1.0, "gen": 0}),  # a list where a number is
    ("spares_held", "count", -3, {"node": 0}),  # a negative count
    ("step", "loss", "NaN", {"step": 21, "step_time_s": 0.5, "gen": 0}),  # NaN written as a string
    ("fault_injected", "target", {"rank": 1}, {"fault_id": "fy", "kind": "kill-rank", "at_step": 3}),
    ("recovery_decided", "restore_step", [3], {"fault_ids": ["f1"], "gen": 1}),
    ("message_rejected", "dropped_before", "many", {"queue": "q", "reason": "forged"}),
    ("step", "gen", 1.5, {"step": 21, "loss": 1.0, "step_time_s": 0.5}),
    ("step", "t", "NaN", {"step": 21, "loss": 1.0, "step_time_s": 0.5, "gen": 0}),  # no clock says NaN
]
IDS = [f"{kind}.{name}={value!r}" for kind, name, value, _ in CASES]


def good_stream(start: float, with_run_started: bool = True) -> StreamBuilder:
    b = StreamBuilder(start=start)
    if with_run_started:
        b.run_started(world_size=4, strategy="peer")
    b.spares_held(node=0, count=1)
    b.steps(1, 10)
    b.fault_injected("f1", at_step=10, dt=0.125)
    b.failure_detected(["f1"], gen=0, dt=0.25)
    b.recovery(["f1"], gen=1, restore_step=10)
    b.steps(11, 20, gen=1)
    return b


def write_run(runs_dir: Path, run_id: str, builder: StreamBuilder) -> RunStore:
    store = RunStore.create(runs_dir, run_id, {"spec": {}})
    for ev in builder.events:
        store.append(ev.kind, t=ev.t, **ev.data)
    store.close()
    return store


def hostile_runs(runs_dir: Path, kind: str, name: str, value: Any, rest: dict[str, Any]) -> int:
    """A good run and a run with one hostile line; the line's number in events.jsonl."""
    write_run(runs_dir, GOOD_RUN, good_stream(1000.0))
    builder = good_stream(5000.0, with_run_started=kind != "run_started")
    store = write_run(runs_dir, BAD_RUN, builder)
    line = {"event": kind, "t": builder.t + 1.0, **rest, name: value}
    with open(store.events_path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")
    return len(store.events_path.read_text().splitlines())


def run_cli(argv: list[str], runs_dir: Path) -> tuple[int, str, str]:
    """`ffctl ARGV` through its real entry point: (exit code, stdout, stderr)."""
    return ffctl_in_process(argv, {"FFCTL_RUNS_DIR": str(runs_dir)})

@pytest.mark.parametrize(("kind", "name", "value", "rest"), CASES, ids=IDS)
@pytest.mark.parametrize("mode", [[], ["--json"], ["--markdown"], ["--html", "{out}"]], ids=str)
def test_a_named_run_with_a_hostile_field_is_one_line_and_exit_2(
        kind: str, name: str, value: Any, rest: dict[str, Any], mode: list[str], tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    line = hostile_runs(runs_dir, kind, name, value, rest)
    out = tmp_path / "report.html"
    code, stdout, stderr = run_cli(["report", BAD_RUN, *[m.format(out=out) for m in mode]], runs_dir)
    assert code == 2, stdout + stderr
    assert "Traceback" not in stdout + stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    shown = "nan" if name == "t" else repr(value)  # the store reads `t` with float(): "NaN" is nan
    for part in (f"run {BAD_RUN!r}", f"line {line}", f"({kind} event)", f"field {name!r}", f"is {shown}"):
        assert part in lines[0], (part, lines[0])
    assert stdout == ""
    assert not out.exists()


@pytest.mark.parametrize(("kind", "name", "value", "rest"), CASES, ids=IDS)
@pytest.mark.parametrize("mode", [[], ["--json"], ["--markdown"]], ids=str)
def test_the_run_list_skips_a_hostile_run_with_one_warning(
        kind: str, name: str, value: Any, rest: dict[str, Any], mode: list[str], tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    line = hostile_runs(runs_dir, kind, name, value, rest)
    code, stdout, stderr = run_cli(["report", *mode], runs_dir)
    assert code == 0, stdout + stderr
    assert "Traceback" not in stdout + stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ffctl: warning: run {BAD_RUN!r} skipped:"), stderr
    assert f"line {line}" in lines[0] and f"field {name!r}" in lines[0], lines[0]
    assert GOOD_RUN in stdout and BAD_RUN not in stdout
    if mode == ["--json"]:
        assert [r["run_id"] for r in json.loads(stdout)] == [GOOD_RUN]


def test_the_run_list_as_html_skips_a_hostile_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs_dir = tmp_path / "runs"
    hostile_runs(runs_dir, *CASES[0][:3], CASES[0][3])
    out = tmp_path / "list.html"
    code, stdout, stderr = run_cli(["report", "--html", str(out)], runs_dir)
    assert code == 0 and len(stderr.splitlines()) == 1, stderr
    page = out.read_text()
    assert GOOD_RUN in page and BAD_RUN not in page


def test_a_value_of_the_right_type_still_reads() -> None:
    """What the reader takes: a whole float as a step (a writer that went through a float), a
    NaN loss a diverged job really had, absent and null fields (older records)."""
    b = good_stream(1000.0)
    b.emit(EventKind.STEP, 0.5, step=21.0, loss=math.nan, step_time_s=0.5, gen=1)
    b.emit(EventKind.STEP, 0.5, step=22, loss=None, step_time_s=None, gen=None)
    m = compute("r", b.events)
    assert m.steps_completed == 22 and m.final_loss is None
    assert math.isnan(dict((s, v) for s, v in m.loss_by_step)[21])


def test_the_error_names_event_field_and_value_without_the_file() -> None:
    """Pure: compute on events alone raises BadField (a ValueError) with no line number, the
    value cut short when long and its line breaks escaped."""
    events = [Event(EventKind.STEP, 1.0, {"step": "x\n" * 200})]
    with pytest.raises(BadField) as caught:
        compute("r", events)
    assert isinstance(caught.value, ValueError) and caught.value.line is None
    text = str(caught.value)
    assert "\n" not in text and len(text) < 200 and "field 'step'" in text and "(step event)" in text

"""`ffctl report --html`: the page, its plots and what they are drawn from, on hand-made runs.

The runs are the ones `test_report_cli` writes with the run store's own APIs. The page is read
back as a user's browser would get it: every image must be an embedded PNG that decodes (its
header read here with struct and zlib), nothing may be fetched from elsewhere, and the tables
must hold the figures `--json` reports. Rendering in a real browser is `tests/e2e/test_report_html.py`.
"""
from __future__ import annotations

import base64
import json
import re
import struct
import sys
import zlib
from pathlib import Path

import pytest

from ffctl.render.html import fault_spans, progress_timeline
from runs.events import EventKind
from runs.metrics import compute
from tests.helpers.events import StreamBuilder
from tests.unit.test_report_cli import LONG_ID, incomplete_run, run_cli, runs_dir, two_fault_run, write_run  # noqa: F401

pytest.importorskip("matplotlib", reason="the html extra (matplotlib) is not installed")

IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and its header chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:29]
    (crc,) = struct.unpack(">I", data[29:33])
    assert zlib.crc32(kind + body) == crc
    width, height = struct.unpack(">II", body[:8])
    return width, height


def images(page: str) -> list[tuple[int, int]]:
    return [png_size(base64.b64decode(b64, validate=True)) for b64 in IMG.findall(page)]


def assert_self_contained(page: str) -> None:
    # Nothing the page shows comes from elsewhere: no link, script or image by address.
    assert not re.search(r"""(src|href)\s*=\s*(?!["']?data:)""", page, re.I), page[:500]
    assert "<link" not in page and "@import" not in page and "url(" not in page


def test_a_run_with_two_faults_gets_its_tables_and_two_plots(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    code, text = run_cli(["report", LONG_ID, "--html", str(out)], runs_dir)
    assert code == 0, text
    assert f"HTML report written to {out}" in text
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert_self_contained(page)
    sizes = images(page)
    assert len(sizes) == 2 and all(w > 300 and h > 100 for w, h in sizes), sizes
    _, js = run_cli(["report", LONG_ID, "--json"], runs_dir)
    rep = json.loads(js)
    f1, f2 = rep["faults"]
    for value in (LONG_ID, "summary", "peer-memory", "rank 1: spare (ahead), rank 3: template", "net-bandwidth", "node:1",
                  "not detected", f"{f1['recovery_s']:.2f}", f"{f2['lost_s']:.2f}", f"{rep['goodput']:.3f}",
                  f"{rep['lost_gpu_hours_total']:.6f}", "rendezvous", "replay"):
        assert f">{value}<" in page, value
    # Markup in a value is shown, not obeyed.
    assert "<script" not in page


def test_compared_runs_get_the_comparison_and_each_run_s_plots(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "both.html"
    code, text = run_cli(["report", LONG_ID, "old-clean", "--html", str(out)], runs_dir)
    assert code == 0, text
    page = out.read_text()
    assert_self_contained(page)
    assert len(images(page)) == 4
    assert "runs compared" in page
    assert page.index("runs compared") < page.index(f"run {LONG_ID}") < page.index("run old-clean")


def test_the_run_list_as_a_page(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "list.html"
    code, text = run_cli(["report", "--html", str(out)], runs_dir)
    assert code == 0, text
    page = out.read_text()
    assert_self_contained(page)
    assert images(page) == []
    assert page.index(f">{LONG_ID}<") < page.index(">mid-memory<") < page.index(">old-clean<")


def test_an_incomplete_run_still_renders_and_exits_1(runs_dir: Path, tmp_path: Path) -> None:
    import os
    import socket

    store = write_run(runs_dir, "cut-short", incomplete_run(2500.0))
    store.update_run_info(controller={"pid": os.getpid(), "host": socket.gethostname(), "started": 1.0})
    out = tmp_path / "cut.html"
    code, _ = run_cli(["report", "cut-short", "--html", str(out)], runs_dir)
    page = out.read_text()
    assert code == 1 and len(images(page)) == 2
    assert "incomplete: controller lost" in page and ">not recovered<" in page


def test_without_matplotlib_html_is_one_line_and_exit_2(runs_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "never.html"
    code, text = run_cli(["report", LONG_ID, "--html", str(out)], runs_dir)
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1, text
    assert lines[0] == "ffctl: error: --html needs matplotlib, which is not installed: pip install 'ffctl[html]'"
    assert not out.exists()


def test_html_into_a_missing_directory_is_bad_input(runs_dir: Path, tmp_path: Path) -> None:
    code, text = run_cli(["report", LONG_ID, "--html", str(tmp_path / "no" / "such.html")], runs_dir)
    assert code == 2 and text.strip().splitlines() == [
        f"ffctl: error: --html {str(tmp_path / 'no' / 'such.html')!r}: not a file in an existing directory"]


def test_fault_spans_follow_the_breakdown_and_the_revert() -> None:
    b = two_fault_run(7000.0)
    rep = compute("r", b.events).to_dict()
    f1, f2 = rep["faults"]
    spans = fault_spans(f1, end_t=b.t)
    phases = [s.phase for s in spans]
    assert phases[:6] == ["detect", "decide", "spawn", "rendezvous", "restore", "replay"]
    # One after the other from the injection, ending where the job resumed.
    assert spans[0].start == f1["injected_at"]
    assert all(a.end == pytest.approx(b_.start) for a, b_ in zip(spans, spans[1:]))
    assert spans[5].end == pytest.approx(f1["resumed_at"])
    assert [s.end - s.start for s in spans[:6]] == pytest.approx([f1["breakdown"][p] for p in phases[:6]])
    # The slowdown no detector saw: active from its injection to its revert, when the job was
    # back at its pace at once; had it been later, the wait for it follows.
    (active,) = fault_spans(f2, end_t=b.t)
    assert active.phase == "fault active" and f2["back_at_pace_at"] == f2["reverted_at"]
    assert (active.start, active.end) == (f2["injected_at"], f2["reverted_at"])
    later = {**f2, "back_at_pace_at": f2["reverted_at"] + 1.5}
    (_, back) = fault_spans(later, end_t=b.t)
    assert (back.phase, back.start, back.end) == ("back to pace", f2["reverted_at"], f2["reverted_at"] + 1.5)


def test_a_fault_never_recovered_is_shaded_to_the_record_s_end() -> None:
    b = incomplete_run(8000.0)
    (f,) = compute("r", b.events).to_dict()["faults"]
    spans = fault_spans(f, end_t=b.t + 3.0)
    assert [s.phase for s in spans] == ["detect", "not recovered"]
    assert spans[-1].end == b.t + 3.0


def test_progress_timeline_shows_the_pace_a_stall_and_no_credit_for_replays() -> None:
    b = StreamBuilder(start=100.0)
    b.run_started(world_size=2, strategy="peer")
    b.steps(1, 20)  # 0.5 s a step: 2 steps/s
    b.wait(4.0)  # a stall
    b.steps(21, 40)
    stall_end = b.t - 20 * 0.5
    line = progress_timeline(b.events)
    at = lambda t: line.rates[min(range(len(line.times)), key=lambda i: abs(line.times[i] - t))]  # noqa: E731
    assert at(103.0) == pytest.approx(2.0, rel=0.05)
    assert at(stall_end - 2.0) == pytest.approx(0.0, abs=0.3)  # the middle of the stall
    assert at(b.t - 3.0) == pytest.approx(2.0, rel=0.05)
    # Steps trained again after a rollback are no progress: the same stretch replayed from step 5.
    r = StreamBuilder(start=100.0)
    r.run_started(world_size=2, strategy="peer")
    r.steps(1, 10)
    r.emit(EventKind.RECOVERY_DECIDED, 0.0, fault_ids=["f"], gen=1, restore_step=5)
    r.steps(6, 10, gen=1)  # 2.5 s redoing steps 6-10
    r.steps(11, 20, gen=1)
    replay = progress_timeline(r.events)
    mid_replay = 100.0 + 10 * 0.5 + 1.25
    i = min(range(len(replay.times)), key=lambda k: abs(replay.times[k] - mid_replay))
    assert replay.rates[i] == pytest.approx(0.0, abs=0.3)
    assert progress_timeline([]).rates == []

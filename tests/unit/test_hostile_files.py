"""Readers of files and frames someone else wrote: garbage gets one line (exit 2 for what a user
named, a skipped run with a warning in a listing), never a traceback, a hang or a freeze.

Uses the entry point and the refusal check of test_bad_inputs (one line, exit 2, no traceback).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ffctl.agent.stepscan import StepRegexError, compile_step_regex, parse_line
from ffctl.render.verdicts import junit
from recovery.peer import _LEN, PeerClient
from ffctl.agent.peerstore import PeerStore
from recovery.slots import slot_path
from runs.store import RunStore
from tests.helpers.events import StreamBuilder
from tests.unit.test_bad_inputs import ROOT, RUN, assert_refused, run_cli, runs  # noqa: F401 - `runs` is a fixture

TOKEN = "k" * 64
DEEP = "[" * 100_000 + "]" * 100_000

# events.jsonl lines no ffctl writes, even torn: each makes its run unreadable.
BAD_EVENTS: dict[str, bytes] = {
    "not-utf8": b'{"event": "run_started", "t": 1.0, "note": "\xff\xfe"}\n',
    "not-an-object": b"[1, 2, 3]\n",
    "deep": DEEP.encode() + b"\n",
}


def _good_run(runs_dir: Path, run_id: str, start: float) -> None:
    b = StreamBuilder(start=start)
    b.run_started(world_size=2, strategy="peer")
    b.steps(1, 5)
    b.run_finished("completed", dt=0.25, steps_completed=5)
    store = RunStore.create(runs_dir, run_id, {"spec": {}})
    for ev in b.events:
        store.append(ev.kind, t=ev.t, **ev.data)
    store.close()


def _bad_run(runs_dir: Path, run_id: str, line: bytes) -> None:
    _good_run(runs_dir, run_id, 2000.0)
    with open(runs_dir / run_id / "events.jsonl", "ab") as fh:
        fh.write(line)


def test_a_garbage_run_is_skipped_in_a_listing_and_refused_by_name(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    _good_run(runs_dir, "fine", 1000.0)
    for name, line in BAD_EVENTS.items():
        _bad_run(runs_dir, name, line)
    code, printed = run_cli(["report"], runs_dir, tmp_path)
    assert code == 0 and "Traceback" not in printed, printed
    assert "fine" in printed
    warnings = [line for line in printed.splitlines() if line.startswith("ffctl: warning:")]
    assert len(warnings) == 3, printed
    assert all(any(f"run {name!r} skipped" in w for w in warnings) for name in BAD_EVENTS), warnings
    code, printed = run_cli(["report", "--json"], runs_dir, tmp_path)
    listed = json.loads(printed[printed.index("["):printed.rindex("]") + 1])
    assert [r["run_id"] for r in listed] == ["fine"]
    for name in BAD_EVENTS:
        code, printed = run_cli(["report", name], runs_dir, tmp_path)
        assert_refused(code, printed, "events.jsonl: line 8")


def test_a_torn_last_line_is_still_only_skipped(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    _bad_run(runs_dir, "torn", b'{"event": "step", "t": 2000.9, "st')
    code, printed = run_cli(["report", "torn"], runs_dir, tmp_path)
    assert code == 0 and "torn" in printed, printed


@pytest.mark.parametrize("content", [b"\xff\xfe garbage", b"[1, 2]", b'"text"', DEEP.encode(),
                                     b'{"controller": "x"}', b'{"controller": {"address": 5, "port": "p"}}'])
def test_a_garbage_run_json_is_one_line_for_inject(content: bytes, runs: Path, tmp_path: Path) -> None:
    (runs / RUN / "run.json").write_bytes(content)
    code, printed = run_cli(["inject", "kill-rank", "--run", RUN, "--rank", "1"], runs, tmp_path)
    assert_refused(code, printed, f"run {RUN}")


def test_a_toml_of_20000_nested_brackets_is_one_line(runs: Path, tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("x = " + "[" * 20_000 + "]" * 20_000 + "\n")
    code, printed = run_cli(["run", str(path)], runs, tmp_path)
    assert_refused(code, printed, "nested too deeply")


@pytest.mark.parametrize("argv", [["run", "{fifo}"], ["launch", "--hosts", "{fifo}", "--steps", "5"],
                                  ["doctor", "--hosts", "{fifo}"], ["inject", "revert", "--all", "--hosts", "{fifo}"]])
def test_a_fifo_given_as_a_file_fails_at_once(argv: list[str], tmp_path: Path) -> None:
    """A FIFO nobody writes to: opened without blocking and refused (a real interpreter, under a
    timeout: a reader that waits for a writer would hang here)."""
    fifo = tmp_path / "named.pipe"
    os.mkfifo(fifo)
    env = {**os.environ, "FFCTL_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ffctl", *[a.format(fifo=fifo) for a in argv]], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not a regular file" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_junit_stays_well_formed_whatever_a_name_holds() -> None:
    hostile = "bad\x1b[31mname\x00\x07\ud800"
    outcome = {"name": hostile, "path": f"/x/{hostile}.toml", "passed": False, "seconds": 1.0,
               "error": f"launch failed: {hostile}", "checks": [
                   {"name": "max_lost_steps", "passed": False, "measured": 3, "bound": 1,
                    "detail": f"run {hostile}", "run_id": hostile}]}
    text = junit([outcome])
    root = ET.fromstring(text.encode("utf-8"))  # raises on ill-formed XML
    suite = root.find("testsuite")
    assert suite is not None and suite.get("name") == "bad\\x1b[31mname\\x00\\x07\\ud800"


@pytest.mark.parametrize("flag", ["--junit", "--markdown"])
def test_a_report_path_that_is_a_directory_is_refused_before_any_job(flag: str, runs: Path, tmp_path: Path) -> None:
    scenario = tmp_path / "ok.toml"
    scenario.write_text("[launch]\nsteps = 5\n[expect]\nstatus = \"completed\"\n")
    before = sorted(p.name for p in runs.iterdir())
    code, printed = run_cli(["run", str(scenario), flag, str(tmp_path)], runs, tmp_path)
    assert_refused(code, printed, "is a directory")
    assert sorted(p.name for p in runs.iterdir()) == before  # no job ran


@pytest.mark.parametrize("regex", [r"(?P<step>\d)\1", r"(?<=x)(?P<step>\d+)"])
def test_a_step_regex_the_bounded_engine_cannot_match_is_refused(regex: str, runs: Path, tmp_path: Path) -> None:
    with pytest.raises(StepRegexError):
        compile_step_regex(regex)
    script = tmp_path / "train.py"
    script.write_text("print('step 1')\n")
    code, printed = run_cli(["launch", "--step-regex", regex, str(script)], runs, tmp_path)
    assert_refused(code, printed, "--step-regex")


# The first four backtrack catastrophically in Python's `re`; RE2 matches them in linear time.
@pytest.mark.parametrize("regex", [r"step (?P<step>(\d+)+)x", r"(?P<step>\d+|\d+)+!", r".*(?P<step>\d+)x",
                                   r"(?P<step>\d+) (\w+\s?)+$",
                                   r"step (?P<step>\d+) loss (?P<loss>\S+)", r".*step (\d+).*loss (\S+)",
                                   r"^\[(?P<step>\d+)/\d+\]", r"iter:\s*(\d+)", r"(\d+)\s+(\S+)"])
def test_an_accepted_step_regex_matches_a_hostile_line_in_milliseconds(regex: str) -> None:
    pattern = compile_step_regex(regex)
    for unit in ("1", "a", " ", "step 1 loss 2 ", "iter: 1", "[1/"):
        t0 = time.perf_counter()
        parse_line(pattern, unit * 1_000_000)
        assert time.perf_counter() - t0 < 0.5, (regex, unit)


def _store(tmp_path: Path, refused: list[str]) -> PeerStore:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "ffctl-r-n0-r0-s0").write_bytes(b"\0" * (1 << 20))  # this node's own slot: 1 MiB
    return PeerStore("127.0.0.1", TOKEN, lambda rank, slot: slot_path(str(run_dir), "r", 0, rank, slot),
                     on_refused=lambda why, _: refused.append(why)).start()


def test_a_put_larger_than_a_slot_can_be_is_refused_unallocated(tmp_path: Path) -> None:
    refused: list[str] = []
    store = _store(tmp_path, refused)
    try:
        assert store.slot_cap() == PeerStore.SLOT_CAP_FLOOR  # 2 MiB of slots: the floor holds
        client = PeerClient(store.address, store.port, TOKEN)
        header = json.dumps({"op": "put", "rank": 1, "step": 3, "crc": 0, "meta_len": 1, "len": 3 << 30}).encode()
        client.sock.sendall(_LEN.pack(len(header)) + header)
        client.sock.settimeout(5.0)
        assert client.sock.recv(1) == b""  # refused from the header, connection closed
        client.close()
        assert refused and f"{3 << 30} bytes over the cap of {PeerStore.SLOT_CAP_FLOOR}" in refused[-1]
        assert not store._buffers  # nothing allocated
    finally:
        store.stop()


def test_a_deeply_nested_frame_header_is_a_recorded_refusal(tmp_path: Path) -> None:
    refused: list[str] = []
    store = _store(tmp_path, refused)
    errors: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    try:
        client = PeerClient(store.address, store.port, TOKEN)
        header = ("[" * 400_000 + "]" * 400_000).encode()
        client.sock.sendall(_LEN.pack(len(header)) + header)
        client.sock.settimeout(10.0)
        assert client.sock.recv(1) == b""
        client.close()
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused and "nested too deeply" in refused[-1], refused
        assert not errors
    finally:
        threading.excepthook = hook
        store.stop()


@pytest.mark.parametrize("name", ["events.jsonl", "run.json", "logs/0/deadman.jsonl"])
def test_a_fifo_in_a_run_record_never_blocks_a_report(name: str, tmp_path: Path) -> None:
    """A runs directory others can write to may hold a FIFO where a record file goes: a listing
    skips that run (or reads it without the foreign file), it never waits for a writer."""
    runs_dir = tmp_path / "runs"
    _good_run(runs_dir, "fine", 1000.0)
    _good_run(runs_dir, "piped", 2000.0)
    target = runs_dir / "piped" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    result: list[tuple[int, str]] = []
    worker = threading.Thread(target=lambda: result.append(run_cli(["report"], runs_dir, tmp_path)), daemon=True)
    worker.start()
    worker.join(30)
    assert result, "ffctl report blocked on a FIFO"
    code, printed = result[0]
    assert code == 0 and "fine" in printed and "Traceback" not in printed, printed
    if name == "logs/0/deadman.jsonl":
        assert "piped" in printed and "warning" not in printed  # a foreign line file is only skipped
    elif name == "run.json":
        assert "piped" not in printed  # no run.json file: not a run at all
    else:
        assert "ffctl: warning: run 'piped' skipped" in printed and "not a regular file" in printed, printed


def test_a_deeply_nested_deadman_line_is_skipped(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    _good_run(runs_dir, "switched", 1000.0)
    (runs_dir / "switched" / "logs" / "0").mkdir(parents=True)
    (runs_dir / "switched" / "logs" / "0" / "deadman.jsonl").write_text(DEEP + "\n")
    code, printed = run_cli(["report", "switched"], runs_dir, tmp_path)
    assert code == 0 and "Traceback" not in printed, printed


@pytest.mark.parametrize("content", [None, DEEP.encode(), b"\xff{", b"[1, 2]"], ids=["fifo", "deep", "not-utf8", "a-list"])
def test_a_workers_error_file_never_stops_or_freezes_its_agent(content: bytes | None, tmp_path: Path) -> None:
    """torch's `@record` error file, as a worker's script may leave it: read or ignored, never a
    wait on a FIFO nor an exception in the agent's loop."""
    from ffctl.agent.workers import read_error_file

    path = tmp_path / "1.gen0.error.json"
    if content is None:
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    assert read_error_file(path) is None

"""A run whose controller was lost: the status decision, the dead man's switches' lines merged into
the record, and the switch script writing its line (a real `sh`, a real file, no root needed)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from fault_injectors.deadman import RECORD_NAME, deadman_command, record_file
from fault_injectors.plan import HostCommand
from runs.events import EventKind, RunStatus
from runs.metrics import compute, run_status
from runs.store import (
    DEADMAN_RECORD,
    RunStore,
    controller_alive,
    controller_identity,
    merge_deadman,
    read_deadman_lines,
)
from tests.helpers.events import StreamBuilder

INFO = {"run_id": "r1"}


def partition_stream() -> StreamBuilder:
    """A 2-rank run that got a partition at step 5 and then stopped writing (controller killed)."""
    b = StreamBuilder()
    b.run_started(world_size=2, nnodes=2)
    b.emit(EventKind.AGENT_STARTED, 0.0, node=0, host="localhost", pid=11, clock_offset_s=0.0)
    b.emit(EventKind.AGENT_STARTED, 0.0, node=1, host="localhost", pid=12, clock_offset_s=2.0)
    b.steps(1, 5)
    b.fault_injected("f1", at_step=5, kind="net-partition", target="node:1", ranks=[1], nodes=[1])
    b.steps(6, 7)
    return b


# --- status ---


def test_status_running_incomplete_or_as_finished() -> None:
    b = partition_stream()
    assert run_status(b.events) == "running"  # nobody could tell: never "incomplete" by guess
    assert run_status(b.events, controller_alive=True) == "running"
    assert run_status(b.events, controller_alive=False) == "incomplete"
    b.run_finished("failed", reason="rank 1 failed")
    for alive in (None, True, False):  # a finished record says how it ended, alive or not
        assert run_status(b.events, controller_alive=alive) == "failed"


def test_compute_marks_a_lost_controller_incomplete_with_the_reason() -> None:
    b = partition_stream()
    last = b.events[-1].t
    lost = compute("r1", b.events, controller_alive=False)
    assert lost.status == RunStatus.INCOMPLETE.value and lost.reason == "controller lost"
    assert lost.steps_completed == 7
    live = compute("r1", b.events, controller_alive=True)
    assert live.status == "running" and live.reason == ""
    # A switch reverting long after the controller died does not stretch the run's wall time.
    merged = merge_deadman(b.events, [("1", {"fault_id": "f1", "t": last + 60.0, "ok": True, "exit": 0})])
    after = compute("r1", merged, controller_alive=False)
    assert after.wall_s == lost.wall_s
    assert after.lost_gpu_hours_total == lost.lost_gpu_hours_total
    b.run_finished("interrupted", reason="interrupted")
    assert compute("r1", b.events, controller_alive=False).reason == "interrupted"


def test_fault_reverted_by_whom() -> None:
    b = partition_stream()
    (fault,) = compute("r1", b.events).faults
    assert (fault.reverted_at, fault.reverted_by, fault.revert_ok) == (None, None, None)
    rev = b.fault_reverted("f1", dt=1.0)
    (fault,) = compute("r1", b.events).faults
    assert (fault.reverted_at, fault.reverted_by, fault.revert_ok) == (rev.t, "controller", True)
    c = partition_stream()
    merged = merge_deadman(c.events, [("1", {"fault_id": "f1", "t": c.t + 12.0, "ok": False, "exit": 4})])
    (fault,) = compute("r1", merged).faults
    assert fault.reverted_by == "deadman" and fault.revert_ok is False
    # On node 1's clock, 2 s ahead of the controller's.
    assert fault.reverted_at == c.t + 10.0


# --- merging the switches' lines ---


def test_merge_puts_each_line_at_its_time_on_the_controller_clock() -> None:
    b = partition_stream()
    events = b.events
    t_mid = events[6].t + 0.25 + 2.0  # node 1's clock: lands right after events[6]
    lines = [
        ("1", {"fault_id": "f1", "t": t_mid, "by": "deadman", "trigger": "timer", "ok": True, "exit": 0}),
        ("0", {"fault_id": "f1", "t": None, "ok": True, "exit": 0}),  # no usable clock: at the end
    ]
    merged = merge_deadman(events, lines)
    assert len(merged) == len(events) + 2
    assert merged[7].kind is EventKind.FAULT_REVERTED and merged[7].t == events[6].t + 0.25
    assert merged[7].data == {"fault_id": "f1", "by": "deadman", "trigger": "timer", "ok": True,
                              "exit": 0, "node": 1}
    assert merged[-1].kind is EventKind.FAULT_REVERTED and merged[-1].t == events[-1].t
    assert [e for e in merged if e.kind is not EventKind.FAULT_REVERTED] == events
    # The same line twice (a log copied home twice) is one revert; no lines, nothing changes.
    assert merge_deadman(events, lines[:1] * 2) == merge_deadman(events, lines[:1])
    assert merge_deadman(events, []) is events


def test_merge_never_trusts_a_lines_types() -> None:
    events = partition_stream().events
    merged = merge_deadman(events, [("x", {"fault_id": "f1", "t": float("inf"), "ok": "yes", "exit": True})])
    (rev,) = [e for e in merged if e.kind is EventKind.FAULT_REVERTED]
    assert rev.t == events[-1].t and rev.data["ok"] is False and rev.data["exit"] is None
    assert rev.data["node"] == "x"


def test_store_reads_the_nodes_lines_and_skips_torn_ones(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    st.append(EventKind.RUN_STARTED, t=100.0, world_size=2, strategy="peer")
    st.append(EventKind.FAULT_INJECTED, t=101.0, fault_id="f1", kind="net-partition", target="node:1", at_step=0)
    st.append(EventKind.STEP, t=102.0, step=1, loss=1.0, step_time_s=0.5, gen=0)
    node_dir = st.path / "logs" / "1"
    node_dir.mkdir(parents=True)
    (node_dir / DEADMAN_RECORD).write_text(
        '{"fault_id":"f1","t":101.5,"by":"deadman","trigger":"timer","ok":true,"exit":0}\n'
        '["not", "a", "line"]\n{"t": 3}\n{"fault_id":"f1","t":1'  # foreign and torn lines
    )
    assert read_deadman_lines(st.path) == [
        ("1", {"fault_id": "f1", "t": 101.5, "by": "deadman", "trigger": "timer", "ok": True, "exit": 0})]
    kinds = [e.kind for e in st.events()]
    assert kinds == [EventKind.RUN_STARTED, EventKind.FAULT_INJECTED, EventKind.FAULT_REVERTED, EventKind.STEP]
    assert [e.kind for e in st.events(deadman=False)] == [kinds[0], kinds[1], kinds[3]]
    # events.jsonl itself is never rewritten.
    assert "fault_reverted" not in st.events_path.read_text()


# --- is the controller alive? ---


def test_controller_alive_by_pid_host_and_start_time() -> None:
    me = controller_identity()
    assert me["pid"] == os.getpid() and me["host"] == socket.gethostname()
    assert controller_alive({"controller": me}) is True
    # The same pid with another start time is a reused pid: the controller is gone.
    assert controller_alive({"controller": {**me, "started": me["started"] - 3600}}) is False
    # Another host, or a record without these fields: this machine cannot tell.
    assert controller_alive({"controller": {**me, "host": me["host"] + "-elsewhere"}}) is None
    assert controller_alive({"controller": {"address": "127.0.0.1", "port": 1}}) is None
    assert controller_alive({}) is None
    assert controller_alive({"controller": {**me, "pid": True}}) is None


def test_a_killed_controller_is_gone_even_before_it_is_reaped(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = {"pid": proc.pid, "host": socket.gethostname(), "started": psutil.Process(proc.pid).create_time()}
        st = RunStore.create(tmp_path, "r1", {"controller": ident})
        st.append(EventKind.RUN_STARTED, world_size=1, strategy="peer")
        assert st.controller_alive() is True and st.status() is RunStatus.RUNNING
        proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        # Killed and not yet waited for: a zombie is no controller.
        assert st.controller_alive() is False and st.status() is RunStatus.INCOMPLETE
        proc.wait(timeout=10)
        assert st.status() is RunStatus.INCOMPLETE
        st.append(EventKind.RUN_FINISHED, status="interrupted", steps_completed=0, reason="interrupted")
        assert st.status() is RunStatus.INTERRUPTED
    finally:
        proc.kill()
        proc.wait(timeout=10)


# --- the switch writes its line ---


def run_switch(reverts: list[tuple[str, ...]], record: str | None, usr1: bool = False,
               allow_fail: bool = False) -> None:
    """Run a switch for `reverts` to its end: its 1 s timer runs out, or SIGUSR1 fires it early."""
    cmds = tuple(HostCommand(1, "localhost", argv, allow_fail=allow_fail) for argv in reverts)
    argv = deadman_command("run 'x", "f7", cmds, delay_s=30 if usr1 else 1, record=record).argv
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if usr1:
        time.sleep(0.5)  # the traps are set before the script sleeps
        proc.send_signal(signal.SIGUSR1)
    proc.wait(timeout=20)


def test_switch_appends_one_line_where_told_without_parsing_the_path(tmp_path: Path) -> None:
    odd = tmp_path / "a b;$(touch pwned)'\"" / "logs" / "1"
    odd.mkdir(parents=True)
    record = record_file(str(odd.parent.parent), 1)
    assert record.endswith(f"/logs/1/{RECORD_NAME}") and Path(record).parent == odd
    marker = tmp_path / "reverted"
    run_switch([("touch", str(marker))], record)
    assert marker.exists()
    run_switch([("touch", str(marker)), ("sh", "-c", "exit 3"), ("sh", "-c", "exit 5")], record)
    run_switch([("true",)], record, usr1=True)
    # A command allowed to fail (SIGCONT to a rank that is gone) does not fail the revert.
    run_switch([("sh", "-c", "exit 9"), ("touch", str(marker))], record, allow_fail=True)
    lines = [json.loads(line) for line in Path(record).read_text().splitlines()]
    assert [(x["fault_id"], x["by"], x["trigger"], x["ok"], x["exit"]) for x in lines] == [
        ("f7", "deadman", "timer", True, 0),
        ("f7", "deadman", "timer", False, 3),  # the first failing command's status
        ("f7", "deadman", "signal", True, 0),
        ("f7", "deadman", "timer", True, 0),
    ]
    assert all(abs(x["t"] - time.time()) < 60 for x in lines)
    assert not list(tmp_path.rglob("pwned"))
    assert read_deadman_lines(odd.parent.parent) == [("1", x) for x in lines]


def test_switch_without_a_record_or_with_its_directory_gone_still_reverts(tmp_path: Path) -> None:
    marker = tmp_path / "reverted"
    run_switch([("touch", str(marker))], None)
    assert marker.exists()
    marker.unlink()
    run_switch([("touch", str(marker))], str(tmp_path / "gone" / RECORD_NAME))
    assert marker.exists() and not (tmp_path / "gone").exists()


def test_a_cancelled_switch_records_nothing(tmp_path: Path) -> None:
    # What the controller does after reverting a fault itself: SIGTERM, no revert, no line.
    record = tmp_path / RECORD_NAME
    marker = tmp_path / "reverted"
    argv = deadman_command("r1", "f1", (HostCommand(0, "localhost", ("touch", str(marker))),), 30,
                           record=str(record)).argv
    proc = subprocess.Popen(argv)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
    assert not marker.exists() and not record.exists()

"""A full runs disk does not stop the run record's writer, tear a line or lose an event.

`RunStore.append` meets ENOSPC (simulated: the store's own writes and fsyncs refuse for a while,
some after taking part of a line): the job's call returns, the event waits in memory, stderr says
once that the record is behind, and when the disk takes lines again every event is written, in
order, each line whole. Past the memory bound newer events are dropped and a `record_lost` event
marks the gap; a disk still full at `close` gets one line naming exactly what the record lacks.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

import runs.store as store_mod
from runs.events import EventKind
from runs.store import RunStore, iter_events


class FullDisk:
    """Makes the store's writes to events.jsonl fail with ENOSPC while `full` is set: the first
    write of each failing batch takes half its bytes first (as a disk filling mid-line does),
    and fsync refuses too when `fsync_fails` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, st: RunStore) -> None:
        self.st = st
        self.full = False
        self.fsync_fails = False
        self.partial = True
        self.refused = 0
        real_write, real_fsync = os.write, os.fsync

        def write(fd: int, data: Any) -> int:
            if fd == st._fd and self.full and not self.fsync_fails:
                self.refused += 1
                if self.partial and len(data) > 2:
                    self.partial = False
                    return real_write(fd, bytes(data[: len(data) // 2]))
                self.partial = True
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        def fsync(fd: int) -> None:
            if fd == st._fd and self.full and self.fsync_fails:
                self.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        monkeypatch.setattr(store_mod.os, "write", write)
        monkeypatch.setattr(store_mod.os, "fsync", fsync)


def _store(tmp_path: Path) -> RunStore:
    return RunStore.create(tmp_path / "runs", "r1", {"spec": {}})


def _lines(st: RunStore) -> list[dict[str, Any]]:
    """Every line of the record, each of which must be a whole JSON object."""
    text = st.events_path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("fsync_fails", [False, True], ids=["write-refused", "fsync-refused"])
def test_events_wait_while_the_disk_is_full_and_are_written_in_order_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        fsync_fails: bool) -> None:
    st = _store(tmp_path)
    disk = FullDisk(monkeypatch, st)
    disk.fsync_fails = fsync_fails
    for step in range(1, 6):
        st.append(EventKind.STEP, step=step, loss=1.0 / step)
    disk.full = True
    for step in range(6, 30):
        st.append(EventKind.STEP, step=step, loss=1.0 / step)  # returns: the job trains on
        # Nothing past step 5 is on disk yet, and no half line either.
        assert [e["step"] for e in _lines(st)] == [1, 2, 3, 4, 5]
    assert disk.refused >= 24
    err = capsys.readouterr().err
    assert err.count("is behind") == 1 and "No space left on device" in err
    disk.full = False
    st.append(EventKind.STEP, step=30, loss=1.0 / 30)
    assert [e["step"] for e in _lines(st)] == list(range(1, 31))
    assert [e.get("step") for e in iter_events(st.events_path)] == list(range(1, 31))
    err = capsys.readouterr().err
    assert "caught up: 24 event(s) written late, none lost" in err
    # Full again later: said again, and caught up again.
    disk.full = True
    st.append(EventKind.STEP, step=31, loss=0.5)
    disk.full = False
    st.close()
    assert [e["step"] for e in _lines(st)] == list(range(1, 32))
    assert capsys.readouterr().err.count("is behind") == 1


def test_past_the_memory_bound_newer_events_are_dropped_and_the_gap_is_marked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(store_mod, "BACKLOG_MAX_EVENTS", 5)
    st = _store(tmp_path)
    disk = FullDisk(monkeypatch, st)
    st.append(EventKind.STEP, step=1, loss=1.0)
    disk.full = True
    for step in range(2, 12):  # 2..6 wait, 7..11 are dropped
        st.append(EventKind.STEP, step=step, loss=1.0)
    disk.full = False
    st.append(EventKind.STEP, step=12, loss=1.0)
    st.close()
    lines = _lines(st)
    assert [e.get("step") for e in lines] == [1, 2, 3, 4, 5, 6, None, 12]
    gap = lines[6]
    assert gap["event"] == EventKind.RECORD_LOST.value and gap["lost"] == 5 and gap["kinds"] == {"step": 5}
    assert gap["first_t"] <= gap["last_t"] <= lines[7]["t"]
    assert "5 lost (a record_lost event marks where)" in capsys.readouterr().err


def test_a_disk_still_full_at_the_end_says_exactly_what_the_record_lacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    st = _store(tmp_path)
    disk = FullDisk(monkeypatch, st)
    st.append(EventKind.STEP, step=1, loss=1.0)
    disk.full = True
    st.append(EventKind.STEP, step=2, loss=1.0)
    st.append(EventKind.FAILURE_DETECTED, fault_ids=[], cause="process-exit")
    st.append(EventKind.RUN_FINISHED, status="completed")
    st.close()
    err = capsys.readouterr().err
    assert "is incomplete (No space left on device): 3 event(s) (failure_detected x1, run_finished x1, step x1)" in err
    assert [e["event"] for e in _lines(st)] == ["step"]  # whole lines only


def test_a_full_disk_leaves_no_half_written_json_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = _store(tmp_path)

    def refuse(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_mod.os, "fsync", refuse)
    with pytest.raises(OSError):
        st.write_json("report.json", {"a": 1})
    assert not (st.path / "report.json").exists() and not list(st.path.glob(".report.json*.tmp"))

"""A runs disk that fills up mid-run stops nothing and tears no record line.

The runs directory is a 20 MB tmpfs; once the job trains, the test fills it to the last byte,
holds it full for a few seconds, then frees it. The job trains on throughout, the controller says
once that the record is behind and once that it caught up, and the record afterwards is whole:
every line a JSON object, every step of the run in it. Needs root (mount); skipped otherwise.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from runs.events import EventKind
from runs.store import iter_events
from tests.helpers.launch import assert_nothing_left, rid, start_launch, stop_at_end, wait_event, wait_step

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _fill(path: Path) -> None:
    """Write zeros to `path` until the filesystem refuses another byte."""
    chunk = b"\0" * (1 << 16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_runs_disk_does_not_stop_the_job_and_the_record_is_whole(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        run_id = rid("diskfull")
        events = disk / "runs" / run_id / "events.jsonl"
        proc = start_launch(disk, run_id, "--steps", "100000")
        with stop_at_end(proc, timeout=90) as stopped:
            wait_step(disk / "runs", run_id, 10, timeout=240)
            _fill(disk / "filler")
            full_at = time.time()
            time.sleep(4.0)  # the job trains on; its events wait in the controller's memory
            (disk / "filler").unlink()
            freed_at = time.time()
            # The events of the full stretch reach the disk, then the job goes on.
            wait_event(events, lambda ev: ev.kind is EventKind.STEP and ev.t > freed_at + 2, 120)
        assert stopped.code == 130, stopped.stderr
        assert stopped.stderr.count("is behind") == 1 and "caught up" in stopped.stderr, stopped.stderr
        text = events.read_text()
        assert text.endswith("\n")
        lines = [json.loads(line) for line in text.splitlines()]  # every line whole
        assert all(isinstance(line, dict) for line in lines)
        recorded = list(iter_events(events))
        steps = [int(ev.get("step")) for ev in recorded if ev.kind is EventKind.STEP]
        assert steps == list(range(1, max(steps) + 1))  # nothing lost, in order
        assert any(full_at < ev.t < freed_at for ev in recorded if ev.kind is EventKind.STEP)
        kinds = {ev.kind for ev in recorded}
        assert EventKind.FAILURE_DETECTED not in kinds and EventKind.RECORD_LOST not in kinds
        assert json.loads((disk / "runs" / run_id / "report.json").read_text())["status"] == "interrupted"
        assert_nothing_left(disk)
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)

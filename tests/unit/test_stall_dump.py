"""A rank whose recovery stalls (waiting for a plan, joining, restoring) writes every thread's
stack to its error log once, and one whose recovery ends in time writes nothing: what a
recovery that ran into the controller's phase timeout leaves to find where each rank waited."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, threading, time
import recovery.job as job
job.JOIN_STALL_S = {stall}
threading.Thread(target=lambda: time.sleep(5), name="snapshot-like", daemon=True).start()
with job._stall_dump():
    time.sleep({block})
time.sleep({after})
print("done", flush=True)
"""


def _run(stall: float, block: float, after: float) -> subprocess.CompletedProcess[str]:
    code = SCRIPT.format(stall=stall, block=block, after=after)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_stalled_recovery_dumps_every_threads_stack() -> None:
    out = _run(stall=0.3, block=1.5, after=0.0)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert "Timeout (0:00:00" in out.stderr, out.stderr
    # Both threads: the one blocked in the recovery and the one beside it.
    assert out.stderr.count("Thread 0x") + out.stderr.count("Current thread 0x") >= 2, out.stderr
    assert "<string>" in out.stderr  # where the blocked thread waited


def test_a_recovery_that_ends_in_time_dumps_nothing_later() -> None:
    out = _run(stall=0.5, block=0.05, after=1.0)  # the watch is disarmed when the block ends
    assert out.returncode == 0 and out.stdout.strip() == "done"
    assert "Timeout" not in out.stderr and "Thread" not in out.stderr, out.stderr

"""A rank ends on SIGTERM within the bound, whatever it is doing: stuck in C++ (a store wait that
retries through the signal, where Python never runs the handler), or unwinding through a
`finally` that does not end. Its exit code is torchrun's for the signal, and its output is
flushed. A child it forks does not end it with its own SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from recovery.termination import TERM_EXIT_S

PRELUDE = """
import os, sys, time
from recovery import termination
termination.install()
print("ready", flush=True)
"""


def _run(body: str, tmp_path: Path) -> tuple[subprocess.Popen[str], float]:
    script = tmp_path / "rank.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(0.2)  # into the blocking call
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    return proc, sent


@pytest.mark.parametrize("where", ["store-wait", "endless-finally"])
def test_sigterm_ends_the_rank_within_the_bound(tmp_path: Path, where: str) -> None:
    if where == "store-wait":
        body = """
        import socket
        import torch.distributed as dist
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        from datetime import timedelta
        store.set_timeout(timedelta(seconds=120))
        print("waiting", flush=True)
        store.get("never")
        """
    else:
        body = """
        try:
            print("waiting", flush=True)
            time.sleep(120)
        finally:
            print("unwinding", flush=True)
            while True:
                time.sleep(1)
        """
    proc, sent = _run(body, tmp_path)
    try:
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, code
    # The bound, and a loaded host's margin; a rank left to itself here never ends.
    assert took < TERM_EXIT_S + 10, took
    out = proc.stdout.read() if proc.stdout else ""
    if where == "endless-finally":
        assert "unwinding" in out  # it unwound first; the bound ended it there, output flushed


def test_a_forked_childs_sigterm_does_not_end_the_rank(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(PRELUDE + textwrap.dedent("""
    import signal
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    time.sleep(0.3)
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)
    time.sleep(3 * termination.TERM_EXIT_S)
    print("alive", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "alive" in proc.stdout


def test_without_sigterm_nothing_changes(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(PRELUDE + "os.kill(os.getpid(), __import__('signal').SIGCHLD)\ntime.sleep(0.2)\nprint('done')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ})
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr

"""Test-wide settings, and the guard that no process started by a test outlives it.

Every process a test starts inherits FFCTL_TEST_SESSION (controller, agents, ranks, spares,
dead man's switches), so after each test the guard finds any such process still alive, gives
it a grace period to exit, then kills it and fails the test.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = "FFCTL_TEST_SESSION"
os.environ.setdefault(MARKER, uuid.uuid4().hex)
LEAK_GRACE_S = float(os.environ.get("FFCTL_TEST_LEAK_GRACE", "20"))


def is_root() -> bool:
    return os.geteuid() == 0


needs_root = pytest.mark.skipif(not is_root(), reason="needs root (network namespaces, iptables, tc)")


def _marked() -> list[psutil.Process]:
    needle = f"{MARKER}={os.environ[MARKER]}".encode()
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as fh:
                if needle in fh.read():
                    found.append(proc)
        except OSError:
            continue
    return found


@pytest.fixture(autouse=True)
def no_process_outlives_the_test() -> Iterator[None]:
    before = {p.pid for p in _marked()}
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    left = [p for p in _marked() if p.pid not in before]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in _marked() if p.pid not in before and p.is_running()]
    described = []
    for proc in left:
        try:
            described.append(" ".join(proc.cmdline())[:120])
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            continue
    assert not described, f"processes outlived the test: {described}"

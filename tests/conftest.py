"""Test-wide settings, the guard that no process started by a test outlives it, and the lock
that keeps the suite's parallel workers (pytest-xdist) apart where they must be.

Every process a test starts inherits FFCTL_TEST_SESSION (controller, agents, ranks, spares,
dead man's switches), so after each test the guard finds any such process still alive, gives
it a grace period to exit, then kills it and fails the test. Each worker has a value of its own:
one worker's guard must not take another's jobs for its leftovers.

The suite runs on a few workers (`-n auto` in pyproject, at most MAX_WORKERS): most tests wait on
processes starting, detections and timeouts as much as they compute. A test marked `exclusive`
(it loads the host on purpose, or measures time against the host's pace) runs with no other
test beside it: it takes the workers' shared lock exclusively, every other test takes it shared.
"""
from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Generator, Iterator

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = "FFCTL_TEST_SESSION"
# xdist's workers inherit the value the controlling pytest set: each adds its own id to it.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
os.environ[MARKER] = os.environ.get(MARKER, uuid.uuid4().hex) + (f"-{_WORKER}" if _WORKER else "")
# Workers beyond this add load, not speed: each test's job is several processes.
MAX_WORKERS = 2
LEAK_GRACE_S = float(os.environ.get("FFCTL_TEST_LEAK_GRACE", "20"))


def is_root() -> bool:
    return os.geteuid() == 0


needs_root = pytest.mark.skipif(not is_root(), reason="needs root (network namespaces, iptables, tc)")


def _marked() -> list[psutil.Process]:
    needle = f"{MARKER}={os.environ[MARKER]}".encode() + b"\0"  # whole: gw1 is not gw10
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


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def _lock(path: Path, exclusive: bool) -> int:
    """Take the workers' lock, writers first: a turnstile every test passes, held by an exclusive
    test until it has the lock, so that tests starting meanwhile queue behind it."""
    turnstile = os.open(path.with_suffix(".turnstile"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except BaseException:
        os.close(lock)
        raise
    finally:
        os.close(turnstile)
    return lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if not _WORKER:  # one process runs every test: nothing to keep apart
        yield
        return
    # The workers' temporary folders share a parent that is this run's and private to its user.
    base = item.config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]
    fd = _lock(base / "exclusive.lock", item.get_closest_marker("exclusive") is not None)
    try:
        yield
    finally:
        os.close(fd)  # (closing the last descriptor releases the lock)

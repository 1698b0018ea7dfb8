"""The agent's heartbeat thread, over a real TCPStore: it beats on its own while the agent's loop
is busy (a slow command must not make the node look lost), stops beating when the loop is
wedged, and outlives a store call that fails."""
from __future__ import annotations

import threading
import time
from typing import Any

from ffctl.agent.heartbeat import LOOP_STUCK_S, Heartbeat
from wire import control, messages
from tests.helpers.store import loopback_store

TOKEN = "h" * 64


class _Reporter:
    def __init__(self) -> None:
        self.reports: list[Any] = []

    def report(self, kind: Any, **fields: Any) -> None:
        self.reports.append((kind, fields))

    def rejected(self, where: str, index: int, reason: str, raw: bytes) -> None:
        self.reports.append(("rejected", reason))


def _beats(store: Any, node: int) -> int:
    raw = control.read(store, control.heartbeat_key(node))
    if raw is None:
        return 0
    body = control.Opener(TOKEN).open(raw, control.heartbeat_key(node))
    return messages.Heartbeat.from_dict(body, control.Limits(8, 8)).beat


def _until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_beats_go_on_while_the_loop_is_busy_and_stop_when_it_is_wedged() -> None:
    store = loopback_store()
    hb = Heartbeat(store, control.Sealer(TOKEN, "agent/3"), 3, 0, _Reporter())  # type: ignore[arg-type]
    stopping = threading.Event()
    loop_at = [time.monotonic()]
    thread = hb.start(0.01, stopping, lambda: loop_at[0])
    try:
        # The loop has not come round since (a command that takes a while): beats go on.
        _until(lambda: _beats(store, 3) >= 5)
        # Wedged past LOOP_STUCK_S: no more beats, so the controller takes the node for lost.
        loop_at[0] = time.monotonic() - LOOP_STUCK_S - 1
        time.sleep(0.05)  # a beat that read loop_at just before may still land
        wedged = _beats(store, 3)
        time.sleep(0.2)
        assert _beats(store, 3) == wedged
        # Back: beats again.
        loop_at[0] = time.monotonic()
        _until(lambda: _beats(store, 3) > wedged)
    finally:
        stopping.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_failing_store_call_does_not_end_the_beats() -> None:
    store = loopback_store()

    class _Flaky:
        """The store, refusing its first few writes (a busy or restarting controller)."""

        def __init__(self) -> None:
            self.fails = 3

        def set(self, key: str, value: bytes) -> None:
            if self.fails:
                self.fails -= 1
                raise RuntimeError("store busy")
            store.set(key, value)

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

    hb = Heartbeat(_Flaky(), control.Sealer(TOKEN, "agent/1"), 1, 0, _Reporter())  # type: ignore[arg-type]
    stopping = threading.Event()
    thread = hb.start(0.01, stopping, time.monotonic)
    try:
        _until(lambda: _beats(store, 1) >= 3)
    finally:
        stopping.set()
        thread.join(timeout=10)

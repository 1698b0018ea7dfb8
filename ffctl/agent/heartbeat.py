"""The agent's heartbeat: a sealed value under the node's heartbeat key, written every beat.

The controller reads the key to know the node is alive. The beats come from a thread of their
own (`Heartbeat.run`), not from the agent's loop: a command that takes a while (a cold start of
a worker, a kill with its grace) must not silence the node for longer than the controller's
heartbeat timeout, which is a second by default, and the controller would then take a node that
is fine for lost and kill its ranks. The loop still vouches for itself: the thread stops beating
when the loop has not come round for `LOOP_STUCK_S`, so a wedged agent is still a lost node.

The key is open ground (anyone who reaches the store may write over or delete it), so each beat
first checks that the last one is still there: if not, the controller is told, and this beat
also goes through the controller's queue, which nobody can write over.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ffctl.agent.reporter import Reporter
from wire import control, messages


# Past this long without the agent's loop coming round, the agent is wedged: no more beats.
LOOP_STUCK_S = 10.0


class Heartbeat:
    """One node's heartbeats, for one incarnation of its agent."""

    def __init__(self, store: Any, sealer: control.Sealer, node: int, incarnation: int,
                 reporter: Reporter) -> None:
        self.store = store
        self.sealer = sealer
        self.node = node
        self.incarnation = incarnation
        self.reporter = reporter
        self.beats = 0
        self._last: bytes | None = None  # the sealed value of our last heartbeat

    def beat(self) -> None:
        """Write a sealed heartbeat to our key. If our last one is no longer there, someone
        wrote over (or deleted) it, and may do so again before the controller reads the next:
        the controller is told, and this beat also goes by the queue."""
        key = control.heartbeat_key(self.node)
        if self._last is not None:
            found = control.read(self.store, key)
            if found != self._last:
                self.reporter.rejected(key, -1, "heartbeat key deleted" if found is None else
                                       "heartbeat key written over by someone else", found or b"")
        else:
            found = None
        self.beats += 1
        beat = messages.Heartbeat(node=self.node, incarnation=self.incarnation, beat=self.beats)
        value = self.sealer.seal(key, beat.to_dict()).encode()
        self.store.set(key, value)
        if self._last is not None and found != self._last:
            self.reporter.report(messages.Heartbeat, beat=self.beats)
        self._last = value

    def run(self, period: float, stopping: threading.Event, loop_at: Callable[[], float]) -> None:
        """Beat every `period` seconds until `stopping`, while the agent's loop last came round
        (`loop_at`, a `time.monotonic()` reading) less than LOOP_STUCK_S ago. A beat that fails
        is not retried: the store is the controller's, and the loop sees it gone."""
        while not stopping.wait(period):
            if time.monotonic() - loop_at() > LOOP_STUCK_S:
                continue
            try:
                self.beat()
            except Exception:  # the controller is gone, or its store is busy: the loop decides
                pass

    def start(self, period: float, stopping: threading.Event, loop_at: Callable[[], float]) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(period, stopping, loop_at),
                                  name="ffctl-heartbeat", daemon=True)
        thread.start()
        return thread

"""The agent's heartbeat: a sealed value under the node's heartbeat key, written every beat.

The controller reads the key to know the node is alive. The key is open ground (anyone who
reaches the store may write over or delete it), so each beat first checks that the last one is
still there: if not, the controller is told, and this beat also goes through the controller's
queue, which nobody can write over.
"""
from __future__ import annotations

from typing import Any

from ffctl.agent.reporter import Reporter
from recovery import control, messages


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
            self.reporter.report(messages.Heartbeat, incarnation=self.incarnation, beat=self.beats)
        self._last = value

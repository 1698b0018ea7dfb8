"""A per-second allowance for reporting refusals, so a flood of garbage is counted, not recorded.

Used wherever a refused message becomes a record line or a message to the controller (the
controller's own rejections, an agent's snapshot channel): the first few in each second go
through one by one; the rest are counted, and the count travels with the next one let through.
"""
from __future__ import annotations

import threading
import time


class Throttle:
    """At most `per_s` admissions in any one-second window (thread-safe)."""

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self._window = 0.0  # monotonic start of the current window
        self._admitted = 0  # admitted in it
        self._held = 0  # held back since the last admission
        self._lock = threading.Lock()

    def admit(self) -> int | None:
        """None when this one is held back (and counted); else how many were held back since the
        last one admitted, which the caller reports along with this one."""
        with self._lock:
            now = time.monotonic()
            if now - self._window >= 1.0:
                self._window, self._admitted = now, 0
            if self._admitted >= self.per_s:
                self._held += 1
                return None
            self._admitted += 1
            held, self._held = self._held, 0
            return held

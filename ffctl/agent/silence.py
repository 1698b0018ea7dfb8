"""Whether a node's ranks are still saying anything: the agent's half of the silence detector.

A script's job that reports no steps shows its life only by printing; one whose every rank has
stopped printing, and none has exited, is either busy in silence or stuck for good (a rank
deadlocked after its last line, say), and nothing else would ever end it. The agent watches
its live ranks' logs (stdout's and stderr's, where every line of theirs goes) by their sizes,
once a second, and tells the controller when none of them has grown for `SILENT_AFTER_S`
(`silent`, with each rank's own silence) and when one grows again after that (`output`). The
controller decides, over every node, whether the job as a whole is silent and for how long
(ffctl.controller.barrier).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from wire import messages

LOOK_EVERY_S = 1.0
# How long a node's ranks may print nothing before the controller hears of it: long enough
# that a script printing every few seconds costs no message, short enough that the controller
# can say "silent for 10 s".
SILENT_AFTER_S = 5.0


class OutputWatch:
    def __init__(self, log_dir: str, report: Callable[..., Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.log_dir = Path(log_dir)
        self.report = report
        self.clock = clock
        self.looked_at = -LOOK_EVERY_S
        self.sizes: dict[int, int] = {}  # rank -> its logs' size at the last look
        self.grew_at: dict[int, float] = {}  # rank -> when its logs last grew (or it started)
        self.gen: int | None = None
        self.said_silent = False

    def _size(self, rank: int) -> int:
        total = 0
        for stream in ("log", "err"):
            try:
                total += os.stat(self.log_dir / f"{rank}.{stream}").st_size
            except OSError:
                pass
        return total

    def poll(self, live: Mapping[int, int]) -> None:
        """Look at the logs of `live` (rank -> its generation) once a second."""
        now = self.clock()
        if now - self.looked_at < LOOK_EVERY_S:
            return
        self.looked_at = now
        gens = set(live.values())
        gen = max(gens) if gens else None
        if gen != self.gen:  # a new generation (or none): its ranks start with a clean slate
            self.gen, self.said_silent = gen, False
            self.sizes, self.grew_at = {}, {}
        if gen is None:
            return
        grew = False
        for rank in [r for r, g in live.items() if g == gen]:
            size = self._size(rank)
            if rank not in self.sizes or size != self.sizes[rank]:
                self.sizes[rank] = size
                self.grew_at[rank] = now
                grew = True
        for rank in [r for r in self.grew_at if r not in live]:  # exited: no longer anyone's silence
            del self.grew_at[rank], self.sizes[rank]
        if not self.grew_at:
            return
        if grew and self.said_silent:
            self.said_silent = False
            self.report(messages.Output, gen=gen)
            return
        silent_s = now - max(self.grew_at.values())
        if not self.said_silent and silent_s >= SILENT_AFTER_S:
            self.said_silent = True
            self.report(messages.Silent, gen=gen, silent_s=round(silent_s, 3),
                        ranks={str(r): round(now - t, 3) for r, t in sorted(self.grew_at.items())})

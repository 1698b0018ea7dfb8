"""Which nodes' ranks have no copy of their state on another node, and for how long.

A rank's snapshot survives the loss of its node only through the replica its node's ring
neighbour holds. While a node has no neighbour (every other node is lost or still starting its
agent again), or has a new one that does not hold a copy yet, a second loss of that node takes
its ranks' state with it: the job falls back to disk, or stops. That window is a fact of the
run, recorded as `protection_lost` (node, ranks, reason) when it opens and `protection_restored`
(node, unprotected_s) when the neighbour reports holding the node's copies again (lost again,
with the new list, when a recovery moves more ranks onto the node meanwhile); the report sums it. Only multi-node jobs that keep copies in memory have such a window to tell.
"""
from __future__ import annotations

import time
from typing import Mapping

from ffctl.controller.cluster import Record
from ffctl.controller.state import JobState
from runs.events import EventKind


class Protection:
    def __init__(self, job: JobState, record: Record, enabled: bool) -> None:
        self.job = job
        self.record = record
        self.enabled = enabled
        self.since: dict[int, float] = {}  # node -> when its ranks lost their copy on another node
        self.ranks: dict[int, list[int]] = {}  # node -> the ranks on it last recorded as unprotected
        self.rewired: set[int] = set()  # unprotected nodes that have a neighbour again, not yet a copy

    def wired(self, holders: Mapping[int, int | None]) -> None:
        """The ring as just wired: each live node and the node that now holds its copies (None:
        no other node is up)."""
        if not self.enabled:
            return
        now = time.time()
        # Only nodes without a holder matter to a new window (one pass over the ranks, not one
        # per node: a ring of a thousand nodes is rewired on every loss).
        alone = {node for node, holder in holders.items() if holder is None}
        on: dict[int, list[int]] = {}
        if alone:
            for r, n in sorted(self.job.members.items()):
                if n in alone:
                    on.setdefault(n, []).append(r)
        for node, holder in sorted(holders.items()):
            ranks = on.get(node, [])
            if holder is None and ranks and self.ranks.get(node) != ranks:
                # Recorded when the window opens, and again when a recovery places more ranks on
                # the node while it lasts (the lost node's ranks, moved here).
                self.since.setdefault(node, now)
                self.ranks[node] = ranks
                self.record(EventKind.PROTECTION_LOST, t=now, node=node, ranks=ranks,
                            reason="no other node is up to hold a copy of its ranks' state")
            elif holder is not None and node in self.since:
                self.rewired.add(node)

    def replicated(self, node: int) -> None:
        """`node`'s neighbour holds its ranks' newest copies (its agent's `replicated` report)."""
        if node in self.rewired:
            now = time.time()
            since = self.since.pop(node)
            self.rewired.discard(node)
            self.ranks.pop(node, None)
            self.record(EventKind.PROTECTION_RESTORED, t=now, node=node, unprotected_s=now - since)

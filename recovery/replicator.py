"""Streams a node's snapshot slots to its ring neighbour's agent (node n -> node n+1 mod N).

A background thread watches the headers of the node's slots, woken by the ranks' doorbell when
a slot becomes valid (and every SCAN_S in case a ring was lost); each newly valid slot is read
(seqlock-consistent), sent over the authenticated channel with its checksum, committed at the
receiver only if the writer left it alone meanwhile, and acknowledged in the slot's header so the
rank knows its step is safe off-node. It also reports the newest step held off-node (the agent
sends it to the controller as a `replicated` message (a snapshot_taken event): at once the first time, then at most every
REPORT_S, since every node reporting every step would make the controller write (and fsync) a
record line per node per step).

It runs inside the node agent, which hands it what it needs as callables: how to list the
node's slot files and how to report progress.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

from recovery.doorbell import Doorbell
from recovery.peer import ChannelError, PeerClient
from recovery.slots import HeaderWatch, write_ack
from runs.shm import slot_rank

SCAN_S = 0.05  # look at the headers this often even without a ring
RESCAN_FILES_S = 0.2
REPORT_S = 1.0


class Replicator:
    def __init__(self, run_id: str, node: int, token: str, slot_files: Callable[[], list[Path]],
                 report: Callable[..., None]) -> None:
        """`slot_files` lists the node's slot files; `report(kind, **fields)` tells the controller."""
        self.run_id, self.node = run_id, node
        self.slot_files = slot_files
        self.report = report
        self.token = token
        self.target: tuple[str, int] | None = None
        self.client: PeerClient | None = None
        self.sent: dict[Any, tuple[int, int]] = {}  # slot path -> (step, seq) sent
        self.watches: dict[Any, HeaderWatch] = {}
        self.reported = 0
        self._reported_at = -math.inf  # the first step held off-node is reported at once, however young the clock
        self._stop = threading.Event()
        self.bell = Doorbell(run_id, node, token)
        self._thread = threading.Thread(target=self._run, name="ffctl-replicator", daemon=True)

    def set_target(self, address: str | None, port: int | None) -> None:
        new = (address, int(port)) if address and port else None
        if new != self.target:
            self.target = new
            if self.client is not None:
                self.client.close()
                self.client = None
            self.sent.clear()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.bell.close()
        if self.client is not None:
            self.client.close()
        for watch in self.watches.values():
            watch.close()

    def _run(self) -> None:
        files: list[Any] = []
        next_scan = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_scan:
                files = self.slot_files()  # ranks come and go; rescan now and then
                next_scan = now + RESCAN_FILES_S
                for gone in set(self.watches) - set(files):
                    self.watches.pop(gone).close()
            for path in files:
                try:
                    self._maybe_send(path)
                except (ChannelError, OSError):
                    if self.client is not None:
                        self.client.close()
                    self.client = None
                    self._stop.wait(0.05)
            self._report_progress(files)
            # Without a doorbell (its name taken) fall back to polling often.
            self.bell.wait(SCAN_S if self.bell.listening else 0.002)

    def _watch(self, path: Any) -> HeaderWatch | None:
        watch = self.watches.get(path)
        if watch is None:
            try:
                watch = self.watches[path] = HeaderWatch(path)
            except (OSError, ValueError):  # not created or not sized yet
                return None
        return watch

    def _maybe_send(self, path: Any) -> None:
        watch = self._watch(path)
        header = watch.read() if watch is not None else None
        if header is None or not header.valid or self.sent.get(path) == (header.step, header.seq):
            return
        if self.target is None:
            # No neighbour (one node, or the ring is broken until a node returns): release the
            # rank at once; the controller's inventory knows that no replica exists.
            self.sent[path] = (header.step, header.seq)
            write_ack(path, header.step)
            return
        if self.client is None:
            assert self.target is not None
            self.client = PeerClient(self.target[0], self.target[1], self.token, timeout=5.0)
        rank = slot_rank(path, self.run_id, self.node)
        held = self.client.put_slot(rank, path)
        if held is None:
            return  # rewritten while in flight: the newer content goes on the next pass
        self.sent[path] = (header.step, header.seq)
        write_ack(path, held)

    def _report_progress(self, files: list[Any]) -> None:
        now = time.monotonic()
        if self.target is None or now - self._reported_at < REPORT_S:
            return
        by_rank: dict[int, int] = {}
        for path, (step, _) in list(self.sent.items()):
            rank = slot_rank(path, self.run_id, self.node)
            by_rank[rank] = max(by_rank.get(rank, -1), step)
        if not by_rank:
            return
        held = min(by_rank.values())
        if held > self.reported:
            self.reported, self._reported_at = held, now
            try:
                self.report("replicated", step=held, ranks=sorted(by_rank))
            except Exception:
                pass

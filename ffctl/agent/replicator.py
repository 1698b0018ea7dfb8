"""Streams a node's snapshot slots to its ring neighbour's agent (node n -> node n+1 mod N), and
with `--snapshot-copies` K to the next K - 1 nodes' too: a slot is acknowledged once every one of
them holds it, so a rank's step is safe off-node on K nodes before its next update.

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


class _TargetDown(Exception):
    """A put to one target failed: its connection is dropped and the slot tried again."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(target)
        self.target = target


class Replicator:
    def __init__(self, run_id: str, node: int, token: str, slot_files: Callable[[], list[Path]],
                 report: Callable[..., None]) -> None:
        """`slot_files` lists the node's slot files; `report(kind, **fields)` tells the controller."""
        self.run_id, self.node = run_id, node
        self.slot_files = slot_files
        self.report = report
        self.token = token
        self.targets: list[tuple[str, int]] = []
        self.clients: dict[tuple[str, int], PeerClient] = {}
        self.sent: dict[Any, tuple[int, int]] = {}  # slot path -> (step, seq) held by every target
        self._sent_to: dict[tuple[tuple[str, int], Any], tuple[int, int]] = {}  # (target, path) -> (step, seq)
        self.watches: dict[Any, HeaderWatch] = {}
        self.reported = 0
        self._reported_at = -math.inf  # the first step held off-node is reported at once, however young the clock
        self._stop = threading.Event()
        self.bell = Doorbell(run_id, node, token)
        self._thread = threading.Thread(target=self._run, name="ffctl-replicator", daemon=True)

    @property
    def target(self) -> tuple[str, int] | None:
        """The ring neighbour (the first target), None without one."""
        return self.targets[0] if self.targets else None

    def set_target(self, address: str | None, port: int | None) -> None:
        self.set_targets([(address, int(port))] if address and port else [])

    def set_targets(self, targets: list[tuple[str, int]]) -> None:
        new = list(dict.fromkeys(targets))
        if new != self.targets:
            for gone in set(self.clients) - set(new):
                self.clients.pop(gone).close()
            # A kept target keeps what it holds; the slots are acknowledged again once every
            # target of the new ring holds them.
            self._sent_to = {k: v for k, v in self._sent_to.items() if k[0] in new}
            self.targets = new
            self.sent.clear()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.bell.close()
        for client in self.clients.values():
            client.close()
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
                except _TargetDown as down:
                    client = self.clients.pop(down.target, None)
                    if client is not None:
                        client.close()
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

    def _acknowledge(self, path: Any, step: int) -> None:
        """Write the ack into the slot's header and answer the ranks at once, before the next
        slot is streamed: a rank reports its step only once it sees the ack, and a fault that
        lands meanwhile finds the step restorable but unreported."""
        write_ack(path, step)
        self.bell.answer()

    def _maybe_send(self, path: Any) -> None:
        """Stream the slot at `path` if it holds a step not yet sent, and acknowledge it."""
        watch = self._watch(path)
        header = watch.read() if watch is not None else None
        if header is None or not header.valid or self.sent.get(path) == (header.step, header.seq):
            return
        if not self.targets:
            # No neighbour (one node, or the ring is broken until a node returns): release the
            # rank at once; the controller's inventory knows that no replica exists.
            self.sent[path] = (header.step, header.seq)
            self._acknowledge(path, header.step)
            return
        rank = slot_rank(path, self.run_id, self.node)
        held_by_all: int | None = None
        for target in list(self.targets):
            held: int | None
            if self._sent_to.get((target, path)) == (header.step, header.seq):
                held = header.step
            else:
                try:
                    client = self.clients.get(target)
                    if client is None:
                        client = self.clients[target] = PeerClient(target[0], target[1], self.token, timeout=5.0)
                    held = client.put_slot(rank, path)
                except (ChannelError, OSError):
                    raise _TargetDown(target) from None
                if held is None:
                    return  # rewritten while in flight: the newer content goes on the next pass
                self._sent_to[(target, path)] = (header.step, header.seq)
            held_by_all = held if held_by_all is None else min(held_by_all, held)
        assert held_by_all is not None
        self.sent[path] = (header.step, header.seq)
        self._acknowledge(path, held_by_all)

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

"""The node's snapshot store, as its agent holds it: the node's claim, its ranks' shared-memory
slots, the snapshot channel that serves them (and the ring neighbour's replicas) to a
replacement, and the replicator that streams the slots to the neighbour.

A node is claimed on its host before anything of it is touched: two agents of one node would
wipe each other's slots. A node started again may find its previous agent on the same host
still shutting down (a node Slurm marked down, whose processes live on until they see their
stdin close); its claim is released when it exits, so a restarted node waits a little for it.
A (re)started node is an empty node: its slots are wiped when it is claimed and when it ends.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from ffctl.agent.config import AgentConfig
from ffctl.agent.reporter import Reporter
from wire import messages
from ffctl.agent.peerstore import PeerStore
from ffctl.agent.replicator import Replicator
from recovery.slots import NodeBusy, claim_node, read_header, release_node, slot_path
from runs import shm

# How long a restarted node's agent waits for its predecessor on the same host to let go of the
# node's claim.
CLAIM_WAIT_S = 10.0
# corrupt-snapshot copy=replica hits a rank's copies once none has come in for QUIET_S (or after
# QUIET_WITHIN_S of a rank that keeps training, whose next copy replaces the one hit).
QUIET_S = 0.3
QUIET_WITHIN_S = 3.0


class NodeSnapshots:
    """One node's slots and replicas, from its claim to its release."""

    def __init__(self, cfg: AgentConfig, reporter: Reporter) -> None:
        """Claim the node (raises NodeBusy or UnsafeShm, reported as `agent_failed`), wipe its
        slots and open its snapshot channel; replication starts with `start`."""
        self.shm_dir, self.run_id, self.node = cfg.shm_dir, cfg.run_id, cfg.node
        deadline = time.monotonic() + (CLAIM_WAIT_S if cfg.incarnation else 0.0)
        while True:
            try:
                self._claim = claim_node(cfg.shm_dir, cfg.run_id, cfg.node)
                break
            except NodeBusy as exc:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                reporter.report(messages.AgentFailed, reason=str(exc))
                raise
            except shm.UnsafeShm as exc:
                reporter.report(messages.AgentFailed, reason=str(exc))
                raise
        self.wipe()
        self.reporter = reporter
        self.fault_file = shm.agent_fault_path(cfg.shm_dir, cfg.run_id, cfg.node) if cfg.shm_dir else None
        self._taking = False
        self._fault: Path | None = None  # the fault being taken: its file goes when it is done
        self.peer = PeerStore(cfg.address, cfg.token, self.slot, on_refused=reporter.peer_refused,
                              slots=cfg.snapshot_slots).start()
        self.replicator = Replicator(cfg.run_id, cfg.node, cfg.token, self.slot_files, reporter.report_kind)

    def slot(self, rank: int, index: int) -> Path:
        return slot_path(self.shm_dir, self.run_id, self.node, rank, index)

    def slot_files(self) -> list[Path]:
        return shm.node_slots(self.shm_dir, self.run_id, self.node)

    def wipe(self) -> None:
        for path in self.slot_files():
            path.unlink(missing_ok=True)

    def inventory(self) -> dict[str, Any]:
        """The steps this node holds: its ranks' valid slots, and the replicas it keeps."""
        local: dict[str, list[int]] = {}
        for path in self.slot_files():
            rank = shm.slot_rank(path, self.run_id, self.node)
            header = read_header(path)
            if header is not None and header.valid:
                local.setdefault(str(rank), []).append(header.step)
        return {"local": local, "replica": self.peer.inventory()["replica"]}

    def take_fault(self) -> None:
        """A fault dropped for this agent (`corrupt-replica:<rank>`, from corrupt-snapshot
        copy=replica), carried out beside the agent's loop and reported; anything else in the
        file, or a file that is not ours, is refused and reported, never fatal. The file goes
        once the fault is done: the command that dropped it waits for that."""
        if self.fault_file is None or self._taking:
            return
        dropped = shm.mailbox(self.fault_file)
        if not dropped:
            return
        self._fault = dropped[0]  # one at a time, oldest first: the next turns take the others
        try:
            text = shm.read_small(self._fault).decode("ascii", "replace").strip()
        except OSError as exc:
            self._done_with_fault()
            self.reporter.rejected("agent fault file", -1, str(exc), b"")
            return
        what, _, rank = text.partition(":")
        if what != "corrupt-replica" or not rank.isdigit():
            self._done_with_fault()
            self.reporter.rejected("agent fault file", -1, "not a fault this agent knows", text.encode()[:200])
            return
        self._taking = True
        threading.Thread(target=self._corrupt, args=(int(rank),), name="ffctl-fault", daemon=True).start()

    def _corrupt(self, rank: int) -> None:
        # The copies a stopped rank's stream still brings (its last slots, a few milliseconds
        # behind) are hit too: the fault waits for the stream to go quiet, a few seconds at most.
        try:
            self.peer.quiet(rank, QUIET_S, QUIET_WITHIN_S)
            self.reporter.report(messages.ReplicasCorrupted, rank=rank, steps=self.peer.corrupt(rank))
        finally:
            self._done_with_fault()
            self._taking = False

    def _done_with_fault(self) -> None:
        try:
            os.unlink(self._fault or "")
        except OSError:
            pass

    def set_holders(self, holders: list[tuple[str, int]]) -> None:
        """Where the node's slots are streamed to: the ring neighbour's snapshot channel, and
        the next ones' with `--snapshot-copies` above 1 (none: nowhere)."""
        self.replicator.set_targets(holders)

    def start(self) -> None:
        self.replicator.start()

    def stop_replicating(self) -> None:
        self.replicator.stop()

    def close(self) -> None:
        """Stop serving, wipe the slots and let go of the node."""
        self.peer.stop()
        self.wipe()
        release_node(self.shm_dir, self.run_id, self.node, self._claim)
        # The host's last holder of the run's directory takes it away (over SSH there is nobody
        # else to; locally the launcher holds it until its own sweep).
        if not shm.in_use(self.shm_dir):
            shm.remove_run_dir(Path(self.shm_dir))

"""The agent's replicator: streams fresh slots to the neighbour, acknowledges them to the rank,
and reports progress to the controller without a record line per step."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ffctl.agent.replicator as replicator
from ffctl.agent.replicator import Replicator
from ffctl.agent.peerstore import PeerStore
from recovery.slots import SlotWriter, read_slot, slot_path
from recovery.snapshot import StateEntry, capture
from tests.helpers.netns import wait_for

TOKEN = "t" * 64


@dataclass
class _Cfg:
    run_id: str
    node: int
    shm_dir: str


class _Agent:
    """The part of an agent the replicator uses: its config, its slot files, its reports."""

    def __init__(self, shm_dir: Path) -> None:
        self.cfg = _Cfg(f"rep-{uuid.uuid4().hex[:6]}", 0, str(shm_dir))
        self.reports: list[dict[str, Any]] = []

    def _slot_files(self) -> list[Path]:
        return sorted(Path(self.cfg.shm_dir).glob(f"ffctl-{self.cfg.run_id}-n0-r*-s*"))

    def _report(self, kind: str, **fields: Any) -> None:
        self.reports.append({"type": kind, **fields})


def _entries() -> list[StateEntry]:
    weights = torch.arange(1000, dtype=torch.float32)
    return [StateEntry("w", lambda: {"w": weights}, lambda s: None, True)]


def test_slots_are_streamed_acknowledged_and_progress_reported_sparingly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replicator, "REPORT_S", 3600.0)
    agent = _Agent(tmp_path)
    neighbour = PeerStore("127.0.0.1", TOKEN, lambda rank, slot: slot_path(str(tmp_path), "other", 1, rank, slot)).start()
    writer = SlotWriter(str(tmp_path), agent.cfg.run_id, 0, 0, TOKEN)
    rep = Replicator(agent.cfg.run_id, agent.cfg.node, TOKEN, agent._slot_files, agent._report)
    rep.set_target(str(neighbour.address), neighbour.port)
    rep.start()
    try:
        for step in (1, 2, 3):
            writer.begin(capture(_entries(), step, 0, 1))
            writer.fence()
            assert wait_for(lambda: writer.replicated_step(step) == step, 30.0, 0.01)  # the neighbour holds it
        # The rank that rang was answered once its slots were acknowledged: its wait ends at once.
        writer.begin(capture(_entries(), 4, 0, 1))
        writer.fence()
        deadline = time.monotonic() + 30.0
        while writer.replicated_step(4) != 4 and time.monotonic() < deadline:
            writer.wait_ack(60.0)  # only an answer ends this wait early
        assert writer.replicated_step(4) == 4 and time.monotonic() < deadline
        assert neighbour.find(0, 3, "replica") == read_slot(writer.paths[1])
        assert neighbour.find(0, 4, "replica") == read_slot(writer.paths[0])
        # The first step held off-node is reported at once; later ones wait for REPORT_S.
        assert [(r["type"], r["step"], r["ranks"]) for r in agent.reports] == [("replicated", 1, [0])]
        monkeypatch.setattr(replicator, "REPORT_S", 0.0)
        assert wait_for(lambda: len(agent.reports) == 2, 30.0, 0.01)
        assert agent.reports[-1]["step"] == 4  # the newest step, not each one in between
    finally:
        rep.stop()
        writer.close()
        neighbour.stop()

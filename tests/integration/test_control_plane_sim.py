"""The control plane at small scale, by simulation: a real controller (its store, sealed messages,
heartbeats, detection, coordinator and plan) and 8 and 32 simulated nodes (`ffctl.sim`), one
of them lost mid-run. What the bench reports is checked against the run record itself."""
from __future__ import annotations

from pathlib import Path

import pytest

from ffctl.sim.control_plane import run_control_plane
from runs import shm
from runs.events import EventKind
from runs.store import iter_events

# Simulated agents of 8 and 32 nodes started, and a node of each recovered.
pytestmark = pytest.mark.timeout(300)

HEARTBEAT_TIMEOUT_S = 1.0  # the launch default the bench runs with


def test_a_simulated_node_lost_at_8_and_32_nodes_is_recovered_by_every_rank(tmp_path: Path) -> None:
    rows = run_control_plane([32, 8], tmp_path, step_s=0.5)
    assert [r["nodes"] for r in rows] == [8, 32]  # smallest first
    for row in rows:
        n, lost = row["nodes"], row["killed_node"]
        assert row["status"] == "completed" and row["complete"], row
        events = list(iter_events(tmp_path / row["run_id"] / "events.jsonl"))
        kinds = [e.kind for e in events]
        # The silent node was found by its heartbeat (the simulator reports no agent exit), and
        # no other node was taken for lost.
        (node_lost,) = [e for e in events if e.kind is EventKind.NODE_LOST and e.get("node") == lost]
        assert node_lost.get("reason") == "heartbeat"
        assert [e.get("node") for e in events if e.kind is EventKind.NODE_LOST] == [lost]
        # Its rank (one a node) was placed on a survivor, and every rank of the job joined the
        # new generation and restored the step the decision named.
        (decided,) = [e for e in events if e.kind is EventKind.RECOVERY_DECIDED]
        gen = decided.get("gen")
        assert decided.get("ranks") == [lost] and decided.get("placement")[str(lost)] != lost
        assert any(e.kind is EventKind.RENDEZVOUS_DONE and e.get("gen") == gen for e in events)
        (restored,) = [e for e in events if e.kind is EventKind.RESTORE_DONE and e.get("gen") == gen]
        assert restored.get("step") == decided.get("restore_step") > 0
        assert sorted(r for ranks in restored.get("transfer").values() for r in ranks) == list(range(n))
        assert row["plan_reads"] == n  # each rank read the new plan once
        # The job trained on in the new generation to its last step, then finished.
        assert any(e.kind is EventKind.STEP and e.get("gen") == gen for e in events)
        assert kinds[-1] is EventKind.RUN_FINISHED and events[-1].get("status") == "completed"
        # Phases: each positive, and in order (their ends are the loss, node_lost, the decision,
        # the last plan read and restore_done, each after the one before).
        phases = [row["detection_s"], row["decision_s"], row["plan_published_s"], row["joined_s"]]
        assert all(p > 0 for p in phases), phases
        assert abs(sum(phases) - row["recovery_s"]) < 1e-6
        assert node_lost.t < decided.t < restored.t
        # Detection waits out the heartbeat timeout from the last beat (a beat or so before the
        # loss on a loaded host), plus a read period and a pump (generous: 2 shared cores).
        assert HEARTBEAT_TIMEOUT_S / 2 <= row["detection_s"] <= HEARTBEAT_TIMEOUT_S + 2.0
        assert row["store_keys"] > n  # at least a heartbeat key a node, besides the queues
        assert 0 < row["controller_cpu_share"] and 0 < row["sim_cpu_share"]
        # Nothing left behind: no shared memory of the run (simulated agents make none).
        assert shm.own_run_dirs(run_id=row["run_id"]) == []

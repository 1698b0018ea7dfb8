"""The in-step faults' mailbox, with the real drop commands (`fault_injectors.process`) and the
rank's reader (`recovery.faults.InStepFaults`): two faults for one rank dropped before its step
looks are both taken, oldest first. With one file per rank the second overwrote the first: a
slow-rank's revert (`slow:off`), sent just as a kill-rank with phase= was armed for the same rank,
took the kill's place, and the kill never landed (a campaign's fault that was never dealt)."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from fault_injectors.plan import NodePlace, RankPlace, Topology
from fault_injectors.process import DROP_FAULT_SCRIPT, in_step_command
from recovery.faults import InStepFaults
from runs import shm
from runs.events import StepPhase


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return shm.ensure_private_dir(tmp_path / "run")


def drop(run_dir: Path, what: str) -> None:
    """Drop `what` for rank 0 (this process) as the injector does: the file, then SIGUSR1."""
    topo = Topology("r", (NodePlace(0, "localhost", "127.0.0.1", 1),), (RankPlace(0, 0, os.getpid()),),
                    fault_dir=str(run_dir))
    out = subprocess.run(in_step_command(topo, 0, what).argv, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_two_faults_before_the_step_looks_are_both_taken_in_order(run_dir: Path) -> None:
    faults = InStepFaults(str(run_dir), "r", 0)
    faults.install()
    try:
        faults.fire("slow:3:60")
        drop(run_dir, "kill-at:collective:7")
        drop(run_dir, "slow:off")  # the straggler's revert, a moment after the kill was armed
        assert faults.pending and len(shm.mailbox(faults.path or "")) == 2
        faults.check()
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert faults.armed == (StepPhase.COLLECTIVE, 7)  # the kill is armed
    assert faults.slow_factor is None  # and the slowdown is over
    assert shm.mailbox(faults.path or "") == [] and not faults.pending


def test_a_fault_that_raises_leaves_the_later_ones_for_the_next_step(run_dir: Path) -> None:
    faults = InStepFaults(str(run_dir), "r", 0)
    faults.install()
    try:
        drop(run_dir, "crash-rank:exception")
        drop(run_dir, "slow:2:60")
        with pytest.raises(RuntimeError, match="crash-rank"):
            faults.check()
        assert faults.pending and faults.slow_factor is None
        faults.check()
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert faults.slow_factor == 2.0 and shm.mailbox(faults.path or "") == []


def test_a_fault_whose_signal_never_came_is_taken_at_the_next_look(run_dir: Path) -> None:
    # The file, without the SIGUSR1 that follows it (missed: sent before the rank's handler was
    # in place, or merged with another). A kill armed for a later step once never landed so.
    faults = InStepFaults(str(run_dir), "r", 0)
    assert faults.path is not None
    out = subprocess.run(("sh", "-c", DROP_FAULT_SCRIPT, "sh", str(run_dir), "kill-at:snapshot:48", str(faults.path)),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert not faults.pending
    faults.check()
    assert faults.armed == (StepPhase.SNAPSHOT, 48) and shm.mailbox(faults.path) == []


def test_a_link_in_the_mailbox_is_removed_unread(run_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("crash-rank:exception")
    faults = InStepFaults(str(run_dir), "r", 0)
    assert faults.path is not None
    link = Path(f"{faults.path}.AAAAAAAA")
    link.symlink_to(victim)
    faults.pending = True
    faults.check()  # nothing fired: the link was not followed
    assert not link.is_symlink() and victim.read_text() == "crash-rank:exception"


class _Peer:
    """The agent's snapshot channel, as far as a replica fault goes: what it corrupted."""

    def __init__(self) -> None:
        self.hit: list[int] = []

    def quiet(self, rank: int, quiet_s: float, within_s: float) -> None:
        pass

    def corrupt(self, rank: int) -> list[int]:
        self.hit.append(rank)
        return [5]


class _Reporter:
    def __init__(self) -> None:
        self.sent: list[tuple[object, dict[str, object]]] = []

    def report(self, kind: object, **fields: object) -> None:
        self.sent.append((kind, fields))

    def rejected(self, *args: object) -> None:
        raise AssertionError(f"refused: {args}")


def test_an_agent_takes_two_replica_faults_dropped_together(run_dir: Path) -> None:
    """Two corrupt-snapshot copy=replica faults for one holder at once (ranks 1 and 2): each
    command ends once the agent has taken its own fault, and both ranks' replicas are hit."""
    import time

    from fault_injectors.corruption import replica_command
    from ffctl.agent.snapshots import NodeSnapshots

    topo = Topology("r", tuple(NodePlace(n, "localhost", "127.0.0.1", 1) for n in range(3)),
                    tuple(RankPlace(r, r, 1000 + r) for r in range(3)), fault_dir=str(run_dir))
    agent = NodeSnapshots.__new__(NodeSnapshots)  # only its fault path: no claim, no channel
    agent.fault_file = shm.agent_fault_path(str(run_dir), "r", 0)
    agent._taking, agent._fault = False, None
    agent.peer, agent.reporter = _Peer(), _Reporter()  # type: ignore[assignment]
    procs = [subprocess.Popen(list(replica_command(topo, 0, rank).argv), stderr=subprocess.PIPE, text=True)
             for rank in (1, 2)]
    try:
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            agent.take_fault()  # the agent's loop, a turn at a time
            time.sleep(0.01)
        assert [p.wait(timeout=30) for p in procs] == [0, 0], [p.stderr.read() for p in procs if p.stderr]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(agent.peer.hit) == [1, 2]  # type: ignore[attr-defined]
    assert shm.mailbox(agent.fault_file) == []

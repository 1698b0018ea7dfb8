"""corrupt-snapshot: the plan, and its command run for real against slot files in a private
directory: one byte of each slot's content flipped, the header untouched (the slot still says it
is valid), so only the checksum over the content tells, and nothing outside the run's directory
is written through a symlink."""
from __future__ import annotations

import os
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from fault_injectors import make_plan, parse_spec
from fault_injectors.deadman import with_fault_id
from fault_injectors.plan import NodePlace, RankPlace, Topology
from wire.fault_spec import FaultFamily, FaultKind
from fault_injectors.corruption import CONTENT_OFFSET, SLOTS
from recovery.slots import ACK, ACK_OFFSET, DATA_OFFSET, HEADER, MAGIC, VALID, read_slot
from runs.shm import slot_path


def test_the_content_offset_is_the_slots() -> None:
    assert CONTENT_OFFSET == DATA_OFFSET


def write_slot(path: Path, step: int, meta: bytes, shard: bytes) -> None:
    crc = zlib.crc32(shard, zlib.crc32(meta))
    head = HEADER.pack(MAGIC, VALID, step, len(meta), len(shard), crc, 2)
    raw = bytearray(DATA_OFFSET) + meta + shard
    raw[:len(head)] = head
    raw[ACK_OFFSET:ACK_OFFSET + ACK.size] = ACK.pack(step)
    path.write_bytes(bytes(raw))
    path.chmod(0o600)


def world(shm: Path) -> Topology:
    return Topology("run1", (NodePlace(0, "localhost", "127.0.0.1", 100), NodePlace(1, "localhost", "127.0.0.1", 101)),
                    (RankPlace(0, 0, 1000), RankPlace(1, 1, 1001)), fault_dir=str(shm))


def run(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)


@pytest.fixture()
def shm(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


def test_corrupt_snapshot_targets_the_ranks_slots_on_its_node_and_reverts_nothing(shm: Path) -> None:
    kind = FaultKind("corrupt-snapshot")
    assert kind.family is FaultFamily.STATE and kind.targets_rank and not kind.breaks_job
    plan = make_plan(with_fault_id(parse_spec("corrupt-snapshot:rank=1,step=5"), "f1"), world(shm))
    assert plan.ranks == (1,) and plan.nodes == (1,) and not plan.revert and not plan.revertible
    (cmd,) = plan.apply
    assert cmd.node == 1 and cmd.argv[:2] == ("sh", "-c")
    assert cmd.argv[-SLOTS:] == tuple(str(slot_path(str(shm), "run1", 1, 1, i)) for i in range(SLOTS))


def test_each_slot_keeps_its_header_and_fails_its_checksum(shm: Path) -> None:
    slots = [slot_path(str(shm), "run1", 1, 1, i) for i in range(2)]
    other = slot_path(str(shm), "run1", 0, 0, 0)
    for i, path in enumerate(slots):
        write_slot(path, 10 + i, b"meta" * 8, bytes(range(256)) * 4)
    write_slot(other, 11, b"meta", b"shard")
    before = {p: p.read_bytes() for p in (*slots, other)}
    assert all(read_slot(p).verify() for p in before)  # type: ignore[union-attr]
    (cmd,) = make_plan(parse_spec("corrupt-snapshot:rank=1,step=5"), world(shm)).apply
    done = run(cmd.argv)
    assert done.returncode == 0, done.stderr
    for path in slots:
        after = path.read_bytes()
        diff = [i for i, (a, b) in enumerate(zip(before[path], after)) if a != b]
        assert diff == [DATA_OFFSET] and after[DATA_OFFSET] == before[path][DATA_OFFSET] ^ 0xFF
        content = read_slot(path)
        assert content is not None and not content.verify()  # valid by its header, wrong by its checksum
    assert other.read_bytes() == before[other]  # another rank's slot is untouched


def test_a_symlink_or_a_missing_slot_is_never_written_through(shm: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * (DATA_OFFSET + 10))
    os.symlink(victim, slot_path(str(shm), "run1", 1, 1, 0))
    (cmd,) = make_plan(parse_spec("corrupt-snapshot:rank=1,step=5"), world(shm)).apply
    done = run(cmd.argv)
    assert done.returncode == 1 and "no snapshot slot to corrupt" in done.stderr
    assert victim.read_bytes() == b"x" * (DATA_OFFSET + 10)
    # Nor is a run directory that is a symlink.
    link = tmp_path / "link"
    os.symlink(shm, link)
    write_slot(slot_path(str(shm), "run1", 1, 1, 1), 3, b"m", b"s")
    (cmd,) = make_plan(parse_spec("corrupt-snapshot:rank=1,step=5"), world(link)).apply
    done = run(cmd.argv)
    assert done.returncode == 1 and "not a directory of ours" in done.stderr



def test_copy_replica_drops_the_fault_for_every_other_nodes_agent_and_waits_for_it(shm: Path) -> None:
    """copy=replica: one command per holder (every node but the rank's own, or holder=N), each
    dropping `corrupt-replica:<rank>` into that agent's fault file and ending once the agent has
    taken it; holder= the rank's own node (or one not in the job) is refused."""
    from runs.shm import agent_fault_path

    plan = make_plan(parse_spec("corrupt-snapshot:rank=1,step=5,copy=replica"), world(shm))
    (cmd,) = plan.apply  # node 0 is the only other node
    assert cmd.node == 0 and cmd.argv[-2:] == ("corrupt-replica:1", agent_fault_path(str(shm), "run1", 0))
    with pytest.raises(Exception, match="holder=1: rank 1's replicas are held by node"):
        make_plan(parse_spec("corrupt-snapshot:rank=1,step=5,copy=replica,holder=1"), world(shm))
    with pytest.raises(Exception, match="holder=.* goes with copy=replica"):
        parse_spec("corrupt-snapshot:rank=1,step=5,holder=0")
    # Run for real: the "agent" takes the file; the command ends when it has, and succeeds.
    from runs.shm import mailbox

    box = agent_fault_path(str(shm), "run1", 0)
    proc = subprocess.Popen(list(cmd.argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not mailbox(box) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        (target,) = mailbox(box)
        assert target.read_text() == "corrupt-replica:1" and (target.stat().st_mode & 0o777) == 0o600
        assert proc.poll() is None  # still waiting for the agent
        target.unlink()
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

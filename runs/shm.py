"""The names a run gives its files in a host's shared memory (/dev/shm), and nothing else.

One owner for the naming contract between the processes that write, list, parse and remove them:
ranks write snapshot slots (`ffctl-<run>-n<node>-r<rank>-s<slot>`) and read in-step fault files
(`ffctl-<run>-fault-r<rank>`); the agent claims its node's names with a lock file
(`ffctl-<run>-n<node>.lock`), lists, streams and wipes its slots, and keeps the FIFOs its forked
spares wait on in `ffctl-<run>-n<node>.spares/`; the fault planners write the
fault files and wipe a rebooted node's slots; the controller sweeps what a killed node left.

Here, beside the run record, because `recovery` (the ranks and the agent's replicator) and
`fault_injectors` may both import `runs`, and neither may import the other. No torch.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

PREFIX = "ffctl-"
_SLOT_TAIL = re.compile(r"r([0-9]{1,9})-s([01])")
_FAULT_TAIL = re.compile(r"r([0-9]{1,9})")


def node_prefix(run_id: str, node: int) -> str:
    """What every snapshot slot of a node starts with (not its claim lock, which ends `.lock`)."""
    return f"{PREFIX}{run_id}-n{node}-"


def slot_path(shm_dir: str, run_id: str, node: int, rank: int, slot: int) -> Path:
    return Path(shm_dir) / f"{node_prefix(run_id, node)}r{rank}-s{slot}"


def claim_path(shm_dir: str, run_id: str, node: int) -> Path:
    return Path(shm_dir) / f"{PREFIX}{run_id}-n{node}.lock"


def fault_prefix(run_id: str) -> str:
    return f"{PREFIX}{run_id}-fault-"


def fault_path(fault_dir: str, run_id: str, rank: int) -> str:
    """Where an in-step fault for `rank` is dropped (a string: it goes on a command line)."""
    return f"{fault_dir.rstrip('/') or ''}/{fault_prefix(run_id)}r{rank}"


def parse_slot(name: str, run_id: str, node: int) -> tuple[int, int] | None:
    """(rank, slot) of a slot file name of this run and node; None for any other name.

    Matched whole after the node's prefix: a glob would also take the slots of another run whose
    id extends this one (`run` and `run-n0-r5`)."""
    prefix = node_prefix(run_id, node)
    if not name.startswith(prefix):
        return None
    m = _SLOT_TAIL.fullmatch(name[len(prefix):])
    return (int(m.group(1)), int(m.group(2))) if m else None


def slot_rank(path: Path | str, run_id: str, node: int) -> int:
    """The rank a slot file of this run and node belongs to (ValueError for any other name)."""
    parsed = parse_slot(Path(path).name, run_id, node)
    if parsed is None:
        raise ValueError(f"{Path(path).name!r} is not a snapshot slot of run {run_id!r}, node {node}")
    return parsed[0]


def node_slots(shm_dir: str, run_id: str, node: int) -> list[Path]:
    """The node's slot files that exist now, sorted."""
    prefix = node_prefix(run_id, node)
    try:
        return sorted(p for p in Path(shm_dir).glob(prefix + "r*-s*") if parse_slot(p.name, run_id, node))
    except OSError:
        return []


def fault_files(fault_dir: str, run_id: str) -> list[Path]:
    """The run's in-step fault files that exist now (one a rank, until the rank reads it)."""
    prefix = fault_prefix(run_id)
    return sorted(p for p in Path(fault_dir).glob(prefix + "r*") if _FAULT_TAIL.fullmatch(p.name[len(prefix):]))


def spare_dir(shm_dir: str, run_id: str, node: int) -> Path:
    """Where the node's agent keeps the FIFOs its forked spares wait on for their assignment."""
    return Path(shm_dir) / f"{PREFIX}{run_id}-n{node}.spares"


def sweep_node(shm_dir: str, run_id: str, node: int) -> int:
    """Remove the node's slots (and its spares' FIFOs); how many slots went. The caller holds
    the node's claim (or knows no live process writes them)."""
    gone = 0
    for path in node_slots(shm_dir, run_id, node):
        path.unlink(missing_ok=True)
        gone += 1
    shutil.rmtree(spare_dir(shm_dir, run_id, node), ignore_errors=True)
    return gone


def sweep_faults(fault_dir: str, run_id: str) -> int:
    """Remove the run's in-step fault files nobody read; how many went."""
    gone = 0
    for path in fault_files(fault_dir, run_id):
        path.unlink(missing_ok=True)
        gone += 1
    return gone

"""State faults: corrupt-snapshot, a byte flipped in each of a rank's snapshot slots in memory
after the rank took their checksum, as a bit flip in host memory or a bad write would leave them.

The slots are the shared-memory files the rank's next recovery reads (its node's agent serves
them, and a spare on that node restores from them); nothing about them changes but one byte of
their content, so each still says it is valid and only the checksum over the content can tell.
A recovery that reads one must refuse it and fall back to another copy (the ring neighbour's
replica, then a disk checkpoint). The rank's next snapshot overwrites a slot with good content,
so the fault matters to a failure that follows it closely (`--inject corrupt-snapshot:rank=1,
step=20 --inject kill-rank:rank=1,step=20`). Nothing to revert.
"""
from __future__ import annotations

from fault_injectors.plan import FaultPlan, HostCommand, Topology
from fault_injectors.spec import FaultSpec
from runs.shm import slot_path

SLOTS = 2  # a rank writes slot step % 2 (recovery.slots)
CONTENT_OFFSET = 4096  # the first byte behind a slot's header (recovery.slots.DATA_OFFSET)

# $1 the run's directory, $2 the content offset, then the slot files. The directory must be a
# real directory of ours (0700: nobody else puts anything in it), each slot a regular file of
# ours; the byte at the offset is read and written back with every bit flipped, so the content
# always changes. Positional parameters: no path reaches the shell's parser.
CORRUPT_SCRIPT = (
    r'd=$1; o=$2; shift 2; '
    r'[ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ] || { echo "$d: not a directory of ours" >&2; exit 1; }; '
    r'n=0; for f in "$@"; do '
    r'[ -f "$f" ] && [ ! -L "$f" ] && [ -O "$f" ] || continue; '
    r'b=$(od -An -tu1 -j "$o" -N1 -- "$f" | tr -d " "); [ -n "$b" ] || continue; '
    r'printf "$(printf "\%03o" $((b ^ 255)))" | dd of="$f" bs=1 seek="$o" count=1 conv=notrunc status=none || exit 1; '
    r'n=$((n + 1)); done; '
    r'[ "$n" -gt 0 ] || { echo "no snapshot slot to corrupt" >&2; exit 1; }'
)


def corrupt_command(topo: Topology, rank: int) -> HostCommand:
    place = topo.rank(rank)
    node = topo.node(place.node)
    slots = [str(slot_path(topo.fault_dir, topo.run_id, place.node, rank, i)) for i in range(SLOTS)]
    argv = ("sh", "-c", CORRUPT_SCRIPT, "sh", topo.fault_dir, str(CONTENT_OFFSET), *slots)
    return HostCommand(node.node, node.host, argv, node.netns)


def plan(spec: FaultSpec, topo: Topology, ranks: tuple[int, ...], nodes: tuple[int, ...]) -> FaultPlan:
    return FaultPlan(spec, ranks, nodes, apply=tuple(corrupt_command(topo, r) for r in ranks))

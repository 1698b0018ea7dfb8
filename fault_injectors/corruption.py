"""State faults: corrupt-snapshot, a byte flipped in each of a rank's snapshot slots in memory
after the rank took their checksum, as a bit flip in host memory or a bad write would leave them.
With copy=replica the copies other nodes hold of them are hit instead (holder=N: node N's only).

The slots are the shared-memory files the rank's next recovery reads (its node's agent serves
them, and a spare on that node restores from them); nothing about them changes but one byte of
their content, so each still says it is valid and only the checksum over the content can tell.
A recovery that reads one must refuse it and fall back to another copy (the ring neighbour's
replica, then a disk checkpoint). The rank's next snapshot overwrites a slot with good content,
so the fault matters to a failure that follows it closely (`--inject corrupt-snapshot:rank=1,
step=20 --inject kill-rank:rank=1,step=20`). Nothing to revert.

A replica lives in its holder's agent (`ffctl.agent.peerstore.PeerStore`), not in a file: the plan drops
`corrupt-replica:<rank>` into that agent's fault file, and the agent flips a byte of each copy of
the rank's slots it holds, after the checksum it verified when it kept them, and reports which
(`fault_landed`, where "replica"). A replacement that restores from such a copy finds the
checksum wrong, and the recovery falls back to the next copy (another holder, then disk).
"""
from __future__ import annotations

from fault_injectors.plan import FaultPlan, HostCommand, Topology
from fault_injectors.process import DROP_FAULT_SCRIPT
from wire.fault_spec import FaultSpec, FaultSpecError
from runs.shm import agent_fault_path, slot_path

# The most slots a rank writes (step % 2, or step % 3 under --verify-restore: recovery.slots); a
# slot file that does not exist is skipped.
SLOTS = 3
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


# $1 the run's directory, $2 what, $3 the agent's mailbox, dropped in as the ranks' in-step
# faults are ($f the fault's own file). The agent takes it (and removes it) at the next turn of its
# loop; the command ends once it has, so that a fault injected after this one (the kill it is
# meant to precede) finds the replicas already hit, and fails if the agent never does.
AGENT_FAULT_SCRIPT = DROP_FAULT_SCRIPT + (
    r'i=0; while [ -e "$f" ]; do i=$((i + 1)); '
    r'[ "$i" -le 100 ] || { rm -f -- "$f"; echo "the agent did not take the fault within 10s" >&2; exit 1; }; '
    r'sleep 0.1; done'
)


def replica_command(topo: Topology, holder: int, rank: int) -> HostCommand:
    node = topo.node(holder)
    argv = ("sh", "-c", AGENT_FAULT_SCRIPT, "sh", topo.fault_dir, f"corrupt-replica:{rank}",
            agent_fault_path(topo.fault_dir, topo.run_id, holder))
    return HostCommand(node.node, node.host, argv, node.netns)


def _holders(spec: FaultSpec, topo: Topology, rank: int) -> list[int]:
    """The nodes whose replicas of `rank` a copy=replica fault hits: holder=N, or every node
    but the rank's own (a node that holds none does nothing)."""
    own = topo.rank(rank).node
    others = [n.node for n in topo.nodes if n.node != own]
    text = spec.option("holder")
    if text is None:
        return others
    holder = int(text)
    if holder not in others:
        raise FaultSpecError(f"holder={holder}: rank {rank}'s replicas are held by node(s) "
                             f"{', '.join(map(str, others)) or 'none'} (never its own node {own})")
    return [holder]


def plan(spec: FaultSpec, topo: Topology, ranks: tuple[int, ...], nodes: tuple[int, ...]) -> FaultPlan:
    if spec.option("copy") == "replica":
        return FaultPlan(spec, ranks, nodes, apply=tuple(replica_command(topo, h, r) for r in ranks
                                                         for h in _holders(spec, topo, r)))
    return FaultPlan(spec, ranks, nodes, apply=tuple(corrupt_command(topo, r) for r in ranks))

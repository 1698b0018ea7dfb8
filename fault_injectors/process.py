"""Process faults: kill-rank, term-rank, hang-rank (SIGSTOP / SIGCONT) and crash-rank.

crash-rank (and the emulated GPU faults) act inside the rank's training step: the plan drops the
fault's name in a file in the run's private shared-memory directory and sends SIGUSR1; the rank's
step hook raises it. A kill-rank with `phase=` goes the same way (`kill-at:<phase>:<step>`): the
rank arms it and SIGKILLs itself when it reaches that phase of that step, which no signal sent
from outside can aim at (a step's collective lasts milliseconds).
"""
from __future__ import annotations

from fault_injectors.plan import FaultPlan, HostCommand, Role, Topology, pid_arg
from wire.fault_spec import FaultKind, FaultSpec
from runs.shm import fault_path

SIGNALS = {FaultKind.KILL_RANK: "KILL", FaultKind.TERM_RANK: "TERM", FaultKind.HANG_RANK: "STOP"}


def in_step_fault_path(topo: Topology, rank: int) -> str:
    return fault_path(topo.fault_dir, topo.run_id, rank)


# $1 the run's directory, $2 what, $3 the mailbox (`runs.shm.mailbox`). The directory must be a
# real directory of ours (it is 0700: nobody else can put anything in it); the fault is written
# under a name mktemp creates exclusively (O_EXCL, mode 0600) and renamed to the mailbox's name
# and mktemp's eight characters ($f): a file of its own, so a fault dropped just before for the
# same rank is not overwritten, and the rename never writes through a symlink. (An agent's
# mailbox too: `fault_injectors.corruption`.)
DROP_FAULT_SCRIPT = (
    r'[ -d "$1" ] && [ ! -L "$1" ] && [ -O "$1" ] || { echo "$1: not a directory of ours" >&2; exit 1; }; '
    r't=$(mktemp -p "$1" .fault.XXXXXXXX) || exit 1; f="$3.${t##*.}"; '
    r'{ printf %s "$2" > "$t" && mv -f -T -- "$t" "$f"; } || { rm -f -- "$t"; exit 1; }; '
)
# Then $4 the rank's pid: the signal that makes its step look.
IN_STEP_SCRIPT = DROP_FAULT_SCRIPT + r'kill -USR1 "$4"'


def in_step_command(topo: Topology, rank: int, what: str) -> HostCommand:
    place = topo.rank(rank)
    node = topo.node(place.node)
    # Positional parameters, not string pasting: nothing in the path or name reaches the shell.
    argv = ("sh", "-c", IN_STEP_SCRIPT, "sh", topo.fault_dir, what, in_step_fault_path(topo, rank),
            pid_arg(place.pid, f"rank {rank}"))
    return HostCommand(node.node, node.host, argv, netns=node.netns, role=Role.IN_STEP, about=str(rank))


def plan(spec: FaultSpec, topo: Topology, ranks: tuple[int, ...], nodes: tuple[int, ...]) -> FaultPlan:
    if spec.kind is FaultKind.CRASH_RANK:
        what = spec.option("signal", "exception") or "exception"
        return FaultPlan(spec, ranks, nodes, apply=tuple(in_step_command(topo, r, f"crash-rank:{what}") for r in ranks))
    phase = spec.option("phase")
    if spec.kind is FaultKind.KILL_RANK and phase:
        step = spec.trigger.step or 0  # ad hoc: the next time the rank is in that phase
        return FaultPlan(spec, ranks, nodes, apply=tuple(in_step_command(topo, r, f"kill-at:{phase}:{step}")
                                                         for r in ranks))
    sig = SIGNALS[spec.kind]
    apply: list[HostCommand] = []
    revert: list[HostCommand] = []
    for rank in ranks:
        place = topo.rank(rank)
        node = topo.node(place.node)
        apply.append(HostCommand(node.node, node.host, ("kill", f"-{sig}", pid_arg(place.pid, f"rank {rank}")), node.netns))
        if spec.kind is FaultKind.HANG_RANK:
            revert.append(
                HostCommand(node.node, node.host, ("kill", "-CONT", pid_arg(place.pid, f"rank {rank}")), node.netns,
                            allow_fail=True)
            )
    return FaultPlan(spec, ranks, nodes, apply=tuple(apply), revert=tuple(revert))

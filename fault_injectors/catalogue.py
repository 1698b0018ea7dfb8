"""The fault catalogue a user reads (`ffctl faults`): each kind the spec parser accepts, what it
does, the keys it takes and what it needs to run. The keys come from the parser itself
(`wire.fault_spec.allowed_keys`), so the list cannot drift from what `--inject` accepts; a kind
added without a line here fails the catalogue's test."""
from __future__ import annotations

from dataclasses import dataclass

from wire.fault_spec import (ACTIONS, COPIES, CRASH_SIGNALS, PHASES, REQUIRED_OPTIONS, REVERTIBLE, FaultKind,
                             allowed_keys)

# Every spec takes these; the catalogue lists only what a kind adds to them.
COMMON_KEYS = ("rank", "node", "host", "mode", "seed", "step", "t")
# How each kind-specific key's value is written.
VALUES = {
    "phase": "|".join(PHASES), "signal": "|".join(CRASH_SIGNALS), "drain": "yes|no", "mb": "MIB",
    "action": "|".join(ACTIONS), "peer": "NODE", "port": "PORT", "ports": "P1|P2...", "rate": "RATE (1mbit)",
    "delay": "TIME (100ms)", "loss": "PERCENT (10%)", "factor": "X (3)", "copy": "|".join(COPIES),
    "holder": "NODE", "duration": "DURATION",
}
_IN_STEP = "the built-in GPT or a script on the recovery library (it acts inside the step)"
_GPU = _IN_STEP + "; emulated on a host without a GPU (the record says so)"
_NET = "root, and nodes with addresses of their own (--sandbox netns, --hosts or Slurm)"
# kind: (what it does, what it needs: "" for any job)
_TEXT: dict[FaultKind, tuple[str, str]] = {
    FaultKind.KILL_RANK: ("SIGKILL a rank's process (phase=: itself, inside that phase of the step)",
                          "phase=: " + _IN_STEP),
    FaultKind.TERM_RANK: ("SIGTERM a rank's process", ""),
    FaultKind.HANG_RANK: ("SIGSTOP a rank, SIGCONT when duration= is over", ""),
    FaultKind.CRASH_RANK: ("an exception (or a segfault) inside the rank's step", _IN_STEP),
    FaultKind.KILL_NODE: ("kill a node's agent and every rank on it (drain=yes: drain the Slurm node too)",
                          "drain=: --backend slurm"),
    FaultKind.REBOOT_NODE: ("kill-node, then the node comes back empty", ""),
    FaultKind.GPU_ERROR: ("the rank's step raises as a failed CUDA call would", _GPU),
    FaultKind.GPU_HANG: ("the rank's device work never completes (its step blocks)", _GPU),
    FaultKind.GPU_OOM: ("a device-memory hog of mb= MiB; without mb= the step raises out-of-memory", _GPU),
    FaultKind.GPU_XID: ("failing device calls and the driver's Xid 79 line (to /dev/kmsg on a GPU host)", _GPU),
    FaultKind.NET_PARTITION: ("cut a node off the others (peer=: from that node only)", _NET + ", iptables"),
    FaultKind.NET_PORT_BLOCK: ("block the node's traffic on some ports", _NET + ", iptables"),
    FaultKind.NET_BANDWIDTH: ("limit the node's bandwidth", _NET + ", tc tbf"),
    FaultKind.NET_DELAY: ("delay the node's packets", _NET + ", tc netem"),
    FaultKind.NET_LOSS: ("drop a share of the node's packets", _NET + ", tc netem"),
    FaultKind.LINK_DOWN: ("take the node's link down", _NET),
    FaultKind.SLOW_RANK: ("the rank's steps take factor= times as long", _IN_STEP),
    FaultKind.SLOW_NODE: ("slow-rank on every rank of a node", _IN_STEP),
    FaultKind.CORRUPT_SNAPSHOT: ("flip a byte in each of the rank's snapshot slots (copy=replica: in the "
                                 "copies other nodes hold; holder=: node N's only)",
                                 "snapshots in memory: --recovery peer or restart-memory, " + _IN_STEP),
}


@dataclass(frozen=True)
class KindInfo:
    """One line of the catalogue."""

    kind: FaultKind
    what: str
    keys: tuple[str, ...]  # beyond COMMON_KEYS, in the parser's order
    required: tuple[str, ...]
    revertible: bool
    needs: str


def catalogue() -> list[KindInfo]:
    """Every kind the parser accepts, in its order."""
    return [KindInfo(kind, _TEXT[kind][0], tuple(k for k in allowed_keys(kind) if k not in COMMON_KEYS),
                     REQUIRED_OPTIONS.get(kind, ()), kind in REVERTIBLE, _TEXT[kind][1]) for kind in FaultKind]

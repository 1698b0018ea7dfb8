"""GPU faults: gpu-error, gpu-hang, gpu-oom and gpu-xid, acting inside the rank's training step.

Each plan drops a fault text into the rank's fault file and sends SIGUSR1 (see
`process.in_step_command`); the rank's step hook reads the text and misbehaves as the device
would. The text is `KIND` or `KIND:ARG`:

- `gpu-error`            the step raises as a failed CUDA call would
- `gpu-hang`             device work never completes (the step blocks)
- `gpu-oom` / `gpu-oom:<MiB>`  a memory hog; without a size the step raises out-of-memory
- `gpu-xid:<kernel line>` failing device calls; the line is the Xid message the driver would log

On a host with a GPU, gpu-xid also writes the Xid line to /dev/kmsg so kernel-log based detection
(DCGM, node-problem-detector) sees it. Without a GPU every kind runs emulated and the plan says so.
"""
from __future__ import annotations

import re

from fault_injectors.plan import FaultPlan, HostCommand, Topology
from fault_injectors.process import in_step_command
from wire.fault_spec import FaultFamily, FaultKind, FaultSpec, FaultSpecError

# Xid 79: "GPU has fallen off the bus", the classic unrecoverable one.
XID_CODE = 79
XID_PCI = "0000:00:00"
_MB = re.compile(r"^[1-9]\d{0,7}$")


def xid_line(pid: int, code: int = XID_CODE) -> str:
    """The kernel-log line the NVIDIA driver writes for an Xid, as log scrapers expect it."""
    return f"NVRM: Xid (PCI:{XID_PCI}): {code}, pid={pid}, name=python, GPU has fallen off the bus."


def _oom_mb(spec: FaultSpec) -> int | None:
    text = spec.option("mb")
    if text is None:
        return None
    if not _MB.match(text):
        raise FaultSpecError(f"mb={text!r} is not a positive whole number of MiB")
    return int(text)


def fault_text(spec: FaultSpec, pid: int) -> str:
    """What the rank's fault file says for this kind (the rank hook's contract, see module doc)."""
    name: str = spec.kind.value
    if spec.kind is FaultKind.GPU_OOM:
        mb = _oom_mb(spec)
        return name if mb is None else f"{name}:{mb}"
    if spec.kind is FaultKind.GPU_XID:
        return f"{name}:{xid_line(pid)}"
    return name


def kmsg_command(topo: Topology, rank: int) -> HostCommand:
    """Write the fake Xid line to the kernel log of the rank's host (needs root there)."""
    place = topo.rank(rank)
    node = topo.node(place.node)
    # <3> is KERN_ERR, the level the driver uses; the line travels as a positional parameter.
    argv = ("sh", "-c", 'printf "<3>%s\\n" "$1" > /dev/kmsg', "sh", xid_line(place.pid))
    return HostCommand(node.node, node.host, argv, netns=node.netns)


def plan(spec: FaultSpec, topo: Topology, ranks: tuple[int, ...], nodes: tuple[int, ...]) -> FaultPlan:
    if spec.kind.family is not FaultFamily.GPU:
        raise FaultSpecError(f"{spec.kind.value!r} is not a GPU fault")
    emulated = not topo.has_gpu
    apply: list[HostCommand] = []
    for rank in ranks:
        if spec.kind is FaultKind.GPU_XID and not emulated:
            # The log line first: a detector that sees the step fail looks for it right away.
            apply.append(kmsg_command(topo, rank))
        apply.append(in_step_command(topo, rank, fault_text(spec, topo.rank(rank).pid)))
    notes = ("no GPU on this host: the fault is emulated inside the step",) if emulated else ()
    return FaultPlan(spec, ranks, nodes, apply=tuple(apply), emulated=emulated, notes=notes)


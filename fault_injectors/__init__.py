"""What can break and how: fault specs, targets, and plans of commands run through a Transport.

Every fault is a pure plan (apply, revert, dead man's switch) so `--dry-run` shows each host's
commands. This package never imports ffctl.
"""
from __future__ import annotations

from fault_injectors.plan import FaultPlan, HostCommand, NodePlace, RankPlace, Topology
from fault_injectors.planner import PlanError, make_plan, run_commands
from wire.fault_spec import FaultKind, FaultSpec, FaultSpecError, Target, TargetMode, Trigger, parse_spec
from fault_injectors.transport import CommandResult, LocalTransport, Transport, TransportError

__all__ = [
    "CommandResult", "FaultKind", "FaultPlan", "FaultSpec", "FaultSpecError", "HostCommand",
    "LocalTransport", "NodePlace", "PlanError", "RankPlace", "Target", "TargetMode", "Topology",
    "Transport", "TransportError", "Trigger", "make_plan", "parse_spec", "run_commands",
]

"""Fault specifications: kinds, targets and triggers, parsed from `KIND:key=value,...`.

A spec says what to break and when; `fault_injectors.planner` turns it into commands.
Parsing errors are `FaultSpecError` with one line naming the bad value.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class FaultSpecError(ValueError):
    """A fault spec, target or trigger that cannot be used; the message names the bad value."""


class FaultFamily(str, Enum):
    PROCESS = "process"
    NODE = "node"
    GPU = "gpu"
    NETWORK = "network"


class FaultKind(str, Enum):
    """DESIGN.md's fault table."""

    KILL_RANK = "kill-rank"  # SIGKILL the rank's process
    TERM_RANK = "term-rank"  # SIGTERM
    HANG_RANK = "hang-rank"  # SIGSTOP, SIGCONT on revert
    CRASH_RANK = "crash-rank"  # exception inside the step
    KILL_NODE = "kill-node"  # agent and every worker of a node
    REBOOT_NODE = "reboot-node"  # kill-node, then the node comes back empty
    GPU_ERROR = "gpu-error"
    GPU_HANG = "gpu-hang"
    GPU_OOM = "gpu-oom"
    GPU_XID = "gpu-xid"
    NET_PARTITION = "net-partition"
    NET_PORT_BLOCK = "net-port-block"
    NET_BANDWIDTH = "net-bandwidth"
    NET_DELAY = "net-delay"
    NET_LOSS = "net-loss"
    LINK_DOWN = "link-down"

    @property
    def family(self) -> FaultFamily:
        if self.value.startswith("gpu-"):
            return FaultFamily.GPU
        if self.value.startswith(("net-", "link-")):
            return FaultFamily.NETWORK
        if self.value.endswith("-node"):
            return FaultFamily.NODE
        return FaultFamily.PROCESS

    @property
    def targets_rank(self) -> bool:
        return self.family in (FaultFamily.PROCESS, FaultFamily.GPU)


class TargetMode(str, Enum):
    RANK = "rank"
    NODE = "node"
    HOST = "host"
    ONE = "one"  # one rank (or node) picked with the seed
    ALL = "all"
    FIXED = "fixed"  # fixed:N picked with the seed
    PERCENT = "percent"  # percent:P picked with the seed


@dataclass(frozen=True)
class Target:
    mode: TargetMode
    value: int | str | None = None

    def __str__(self) -> str:
        return self.mode.value if self.value is None else f"{self.mode.value}:{self.value}"


@dataclass(frozen=True)
class Trigger:
    """When to inject: at a committed step, at seconds after start, or now (ad hoc)."""

    step: int | None = None
    t: float | None = None

    def __str__(self) -> str:
        if self.step is not None:
            return f"@step={self.step}"
        if self.t is not None:
            return f"@t={self.t:g}"
        return "now"


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    target: Target
    trigger: Trigger = Trigger()
    duration: float | None = None  # seconds until revert (revertible faults)
    seed: int = 0
    options: tuple[tuple[str, str], ...] = ()  # kind-specific (rate=, delay=, loss=, port=, action=)

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)

    def __str__(self) -> str:
        return f"{self.kind.value} {self.target} {self.trigger}"


_INT = re.compile(r"^\d+$")
_KEYS = {"rank", "node", "host", "step", "t", "duration", "seed", "mode"}
_OPTION_KEYS = {"rate", "delay", "loss", "port", "ports", "action", "mb", "signal", "peer"}


def parse_kind(text: str) -> FaultKind:
    try:
        return FaultKind(text)
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise FaultSpecError(f"unknown fault kind {text!r} (known: {known})") from None


def _int(key: str, value: str) -> int:
    if not _INT.match(value):
        raise FaultSpecError(f"{key}={value!r} is not a non-negative integer")
    return int(value)


def _seconds(key: str, value: str) -> float:
    try:
        out = float(value.rstrip("s"))
    except ValueError:
        raise FaultSpecError(f"{key}={value!r} is not a number of seconds") from None
    if out < 0:
        raise FaultSpecError(f"{key}={value!r} must not be negative")
    return out


def parse_mode(text: str) -> Target:
    """`one`, `all`, `fixed:N`, `percent:P`."""
    name, _, arg = text.partition(":")
    if name == "one" and not arg:
        return Target(TargetMode.ONE)
    if name == "all" and not arg:
        return Target(TargetMode.ALL)
    if name == "fixed" and arg:
        return Target(TargetMode.FIXED, _int("fixed", arg))
    if name == "percent" and arg:
        pct = _int("percent", arg)
        if not 0 < pct <= 100:
            raise FaultSpecError(f"percent:{arg} must be between 1 and 100")
        return Target(TargetMode.PERCENT, pct)
    raise FaultSpecError(f"unknown target mode {text!r} (use one, all, fixed:N or percent:P)")


def parse_spec(text: str) -> FaultSpec:
    """Parse `KIND:key=value,...`, e.g. `kill-rank:rank=1,step=25`."""
    kind_text, _, rest = text.partition(":")
    kind = parse_kind(kind_text.strip())
    fields: dict[str, str] = {}
    options: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not value:
            raise FaultSpecError(f"bad field {part!r} in fault spec {text!r} (expected key=value)")
        if key in _KEYS:
            fields[key] = value
        elif key in _OPTION_KEYS:
            options.append((key, value))
        else:
            raise FaultSpecError(f"unknown key {key!r} in fault spec {text!r}")
    targets = [k for k in ("rank", "node", "host", "mode") if k in fields]
    if len(targets) > 1:
        raise FaultSpecError(f"fault spec {text!r} names more than one target ({', '.join(targets)})")
    if "rank" in fields:
        target = Target(TargetMode.RANK, _int("rank", fields["rank"]))
    elif "node" in fields:
        target = Target(TargetMode.NODE, _int("node", fields["node"]))
    elif "host" in fields:
        target = Target(TargetMode.HOST, fields["host"])
    elif "mode" in fields:
        target = parse_mode(fields["mode"])
    else:
        target = Target(TargetMode.ONE)
    if "step" in fields and "t" in fields:
        raise FaultSpecError(f"fault spec {text!r} has both step= and t=; pick one trigger")
    trigger = Trigger(
        step=_int("step", fields["step"]) if "step" in fields else None,
        t=_seconds("t", fields["t"]) if "t" in fields else None,
    )
    return FaultSpec(
        kind=kind,
        target=target,
        trigger=trigger,
        duration=_seconds("duration", fields["duration"]) if "duration" in fields else None,
        seed=_int("seed", fields["seed"]) if "seed" in fields else 0,
        options=tuple(options),
    )

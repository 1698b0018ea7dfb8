"""Fault specifications: kinds, targets and triggers, parsed from `KIND:key=value,...`.

A spec says what to break and when; `fault_injectors.planner` turns it into commands. It is
part of the wire: `ffctl inject` sends one to the controller (`messages.InjectRequest`), its text
(`FaultSpec.to_text`) decoded by this one parser.
Parsing errors are `FaultSpecError` with one line naming the bad value. Every key is checked
against the kind (an option another kind reads is refused, not ignored), given once, and every
number is ASCII digits, finite and within its bound; `parse_injection` further wants what a user
must say: the target, the trigger of a scheduled fault, and options without a useful default.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from runs.events import StepPhase


class FaultSpecError(ValueError):
    """A fault spec, target or trigger that cannot be used; the message names the bad value."""


class FaultFamily(str, Enum):
    PROCESS = "process"
    NODE = "node"
    GPU = "gpu"
    NETWORK = "network"
    STRAGGLER = "straggler"  # slow ranks: the job runs on, at the pace of its slowest rank
    STATE = "state"  # what a rank's recovery will read: its snapshot slots


class FaultKind(str, Enum):
    """The fault kinds (`ffctl faults` lists each with its keys and needs)."""

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
    SLOW_RANK = "slow-rank"  # the rank's steps take `factor` times as long, for `duration`
    SLOW_NODE = "slow-node"  # slow-rank on every rank of a node
    CORRUPT_SNAPSHOT = "corrupt-snapshot"  # flip a byte in each of the rank's snapshot slots

    @property
    def family(self) -> FaultFamily:
        if self.value.startswith("slow-"):
            return FaultFamily.STRAGGLER
        if self is FaultKind.CORRUPT_SNAPSHOT:
            return FaultFamily.STATE
        if self.value.startswith("gpu-"):
            return FaultFamily.GPU
        if self.value.startswith(("net-", "link-")):
            return FaultFamily.NETWORK
        if self.value.endswith("-node"):
            return FaultFamily.NODE
        return FaultFamily.PROCESS

    @property
    def targets_rank(self) -> bool:
        return self.family in (FaultFamily.PROCESS, FaultFamily.GPU, FaultFamily.STATE) or self is FaultKind.SLOW_RANK

    @property
    def breaks_job(self) -> bool:
        """The fault ends or wedges its ranks for good, so only a recovery brings the job back.
        The others (hang-rank, the network kinds, a gpu-oom that only hogs memory) can be
        survived: training may simply go on once they end."""
        return self in _BREAKS_JOB


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

    @property
    def number(self) -> int:
        """The number of a rank, node, fixed or percent target (the parser makes it an int)."""
        if not isinstance(self.value, int):
            raise TypeError(f"a {self.mode.value} target carries no number")
        return self.value


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
    # The controller's id of this fault (`fault_injectors.deadman.with_fault_id`), which tags what
    # the fault installs on a host; None until given. Not an option: no spec text can set it.
    fault_id: str | None = None

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)

    def __str__(self) -> str:
        return f"{self.kind.value} {self.target} {self.trigger}"

    def to_text(self) -> str:
        """The spec as `parse_spec` reads it back, equal field for field (the fault id aside:
        no text sets it). Seconds are plain decimals, as the grammar takes no exponent."""
        t = self.target
        fields = [f"{t.mode.value}={t.value}" if t.mode in (TargetMode.RANK, TargetMode.NODE, TargetMode.HOST)
                  else f"mode={t}"]
        if self.trigger.step is not None:
            fields.append(f"step={self.trigger.step}")
        if self.trigger.t is not None:
            fields.append(f"t={_decimal(self.trigger.t)}")
        if self.duration is not None:
            fields.append(f"duration={_decimal(self.duration)}")
        if self.seed and t.mode not in (TargetMode.RANK, TargetMode.NODE, TargetMode.HOST):
            fields.append(f"seed={self.seed}")
        fields += [f"{k}={v}" for k, v in self.options]
        return f"{self.kind.value}:{','.join(fields)}"


def _decimal(seconds: float) -> str:
    return f"{seconds:.9f}".rstrip("0").rstrip(".")


# ASCII only: `\d` and float() also take other scripts' digits ("١", "５"), which a user would
# not expect a fault spec to mean.
_UINT = re.compile(r"[0-9]{1,19}", re.ASCII)
_SECONDS = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,9})?)(ms|s|min|m|h|d)?", re.ASCII)
_RATE = re.compile(r"([0-9]{1,12}(?:\.[0-9]{1,9})?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)",
                   re.ASCII | re.IGNORECASE)
_TIME = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,9})?)(us|ms|s)", re.ASCII)
_PERCENT = re.compile(r"([0-9]{1,3}(?:\.[0-9]{1,6})?)%", re.ASCII)
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}", re.ASCII)
_TIME_SCALE = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "us": 1e-6}
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}

# The controller's fault ids, `f1`, `f2`, ... (`fault_injectors.deadman.with_fault_id`).
FAULT_ID = re.compile(r"f[1-9][0-9]{0,8}", re.ASCII)
MAX_DURATION_S = 86_400.0  # a fault lasts at most a day: its dead man's switch must fire some day
MAX_T_S = 7 * 86_400.0  # t= at most a week after the start
MAX_STEP = 1_000_000_000
MAX_INDEX = 1 << 20  # ranks, nodes: far beyond any job; the job's own size is checked where known
MAX_SEED = (1 << 63) - 1
MAX_DELAY_S = 3_600.0  # netem: an hour of delay is already a partition
MIN_RATE_BITS = 8_000  # below this tbf cannot shape (see fault_injectors.network)
MAX_RATE_BITS = 10**13
MAX_OOM_MB = 16 * 1024 * 1024  # 16 TiB
MAX_SLOW_FACTOR = 100.0  # a rank 100 times slower has stopped in all but name: that is hang-rank

_TARGET_KEYS = ("rank", "node", "host", "mode")
_TRIGGER_KEYS = ("step", "t")
_KEYS = {*_TARGET_KEYS, *_TRIGGER_KEYS, "duration", "seed"}
_OPTION_KEYS = {"rate", "delay", "loss", "port", "ports", "action", "mb", "signal", "peer", "factor", "drain", "phase",
                "copy", "holder"}
_BREAKS_JOB = frozenset({FaultKind.KILL_RANK, FaultKind.TERM_RANK, FaultKind.CRASH_RANK, FaultKind.KILL_NODE,
                         FaultKind.REBOOT_NODE, FaultKind.GPU_ERROR, FaultKind.GPU_HANG, FaultKind.GPU_XID})
_NETWORK = frozenset(k for k in FaultKind if k.family is FaultFamily.NETWORK)
_SLOW = frozenset({FaultKind.SLOW_RANK, FaultKind.SLOW_NODE})
REVERTIBLE = frozenset({FaultKind.HANG_RANK, *_NETWORK, *_SLOW})  # the kinds a duration= applies to
# The kind-specific options each kind reads; any other is refused rather than ignored.
KIND_OPTIONS: dict[FaultKind, tuple[str, ...]] = {
    FaultKind.CRASH_RANK: ("signal",),
    # phase=: the rank is SIGKILLed by itself in that phase of the step (`recovery.faults`).
    FaultKind.KILL_RANK: ("phase",),
    FaultKind.KILL_NODE: ("drain",),  # drain=yes: the Slurm node is drained too (--backend slurm)
    FaultKind.GPU_OOM: ("mb",),
    FaultKind.NET_PARTITION: ("action", "peer"),
    FaultKind.NET_PORT_BLOCK: ("port", "ports", "action"),
    FaultKind.NET_BANDWIDTH: ("rate",),
    FaultKind.NET_DELAY: ("delay",),
    FaultKind.NET_LOSS: ("loss",),
    FaultKind.SLOW_RANK: ("factor",),
    FaultKind.SLOW_NODE: ("factor",),
    # copy=replica: the copies other nodes' agents hold of the rank's slots (holder=N: only node
    # N's), instead of the rank's own slots (copy=local, the default).
    FaultKind.CORRUPT_SNAPSHOT: ("copy", "holder"),
}
# Options without a default that means anything: a net-bandwidth without a rate shapes nothing
# a user chose, so it must say which.
REQUIRED_OPTIONS: dict[FaultKind, tuple[str, ...]] = {FaultKind.NET_BANDWIDTH: ("rate",),
                                                       FaultKind.SLOW_RANK: ("factor",),
                                                       FaultKind.SLOW_NODE: ("factor",)}
CRASH_SIGNALS = ("exception", "segv")
# Where in its step a kill-rank with phase= lands: the step's start (forward), the backward pass
# (DDP's root module), the step's first collective (its peers are in it), the optimizer update,
# the snapshot of the step (its collectives done: peers may commit it).
PHASES = tuple(p.value for p in StepPhase)
# A fault at phase= reaches the rank ahead of its step, so it is armed when the step begins: at
# least this many committed steps before it, and at least PHASE_LEAD_S of the job's steps. A lead
# in steps alone was too short on a loaded host: the controller sees commits late and the fault's
# command takes a shell's start-up (2 steps of 0.1 s were run past; 6 steps of 30 ms once ran 8
# past). An early arming costs nothing: the rank waits for its step.
PHASE_LEAD_STEPS = 6
PHASE_LEAD_S = 3.0
ACTIONS = ("drop", "reject")
COPIES = ("local", "replica")  # corrupt-snapshot's copy=


def _q(value: str, limit: int = 40) -> str:
    """`value` quoted for a one-line message: repr escapes control characters and line breaks;
    a value longer than `limit` is cut (the user knows the rest)."""
    return repr(value if len(value) <= limit else value[: limit - 3] + "...")


def allowed_keys(kind: FaultKind) -> tuple[str, ...]:
    """Every key a `kind` spec may have, in the order the grammar documents them."""
    keys = [*_TARGET_KEYS, "seed", *_TRIGGER_KEYS]
    if kind in REVERTIBLE:
        keys.append("duration")
    return (*keys, *KIND_OPTIONS.get(kind, ()))


def parse_kind(text: str) -> FaultKind:
    try:
        return FaultKind(text)
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise FaultSpecError(f"unknown fault kind {_q(text, 80)} (known: {known})") from None


def _int(key: str, value: str, maximum: int = MAX_INDEX) -> int:
    if not _UINT.fullmatch(value):
        raise FaultSpecError(f"{key}={_q(value)} is not a non-negative integer")
    out = int(value)
    if out > maximum:
        raise FaultSpecError(f"{key}={_q(value)} is too large (at most {maximum})")
    return out


def parse_seconds(text: str) -> float | None:
    """A duration as every ffctl option and spec writes it: `5`, `2.5s`, `500ms`, `2m`, `3h`,
    `1d` -> seconds; None when `text` is not one."""
    match = _SECONDS.fullmatch(text.strip())
    return None if match is None else float(match.group(1)) * _TIME_SCALE[match.group(2)]


def _seconds(key: str, value: str, maximum: float, *, positive: bool = False) -> float:
    match = _SECONDS.fullmatch(value)
    if not match:
        raise FaultSpecError(f"{key}={_q(value)} is not a duration (like 5, 2.5s, 100ms or 2m)")
    out = float(match.group(1)) * _TIME_SCALE[match.group(2)]
    if positive and out <= 0:
        raise FaultSpecError(f"{key}={_q(value)} must be more than zero")
    if out > maximum:
        raise FaultSpecError(f"{key}={_q(value)} is too long (at most {maximum:g}s)")
    return out


def parse_mode(text: str) -> Target:
    """`one`, `all`, `fixed:N` (N >= 1), `percent:P` (1-100)."""
    name, _, arg = text.partition(":")
    if name == "one" and not arg:
        return Target(TargetMode.ONE)
    if name == "all" and not arg:
        return Target(TargetMode.ALL)
    if name == "fixed" and arg:
        count = _int("fixed", arg)
        if count < 1:
            raise FaultSpecError(f"mode=fixed:{_q(arg)[1:-1]} targets nothing (fixed:N needs N >= 1)")
        return Target(TargetMode.FIXED, count)
    if name == "percent" and arg:
        if not _UINT.fullmatch(arg) or not 0 < int(arg) <= 100:
            raise FaultSpecError(f"percent:{_q(arg)[1:-1]} must be between 1 and 100")
        return Target(TargetMode.PERCENT, int(arg))
    raise FaultSpecError(f"unknown target mode {_q(text, 80)} (use one, all, fixed:N or percent:P)")


def check_option(kind: FaultKind, key: str, value: str) -> None:
    """Refuse an option value the fault could not use; the message names key and value."""
    bad = f"{key}={_q(value)}"
    if key == "rate":
        match = _RATE.fullmatch(value)
        if not match:
            raise FaultSpecError(f"{bad} is not a rate like 1mbit, 500kbit or 10mbps")
        bits = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
        if bits < MIN_RATE_BITS:
            raise FaultSpecError(f"{bad} is below 8kbit, too slow to shape with tbf")
        if bits > MAX_RATE_BITS:
            raise FaultSpecError(f"{bad} is above 10tbit, no link to shape")
    elif key == "delay":
        match = _TIME.fullmatch(value)
        if not match:
            raise FaultSpecError(f"{bad} is not a time like 100ms, 2s or 500us")
        if float(match.group(1)) * _TIME_SCALE[match.group(2)] > MAX_DELAY_S:
            raise FaultSpecError(f"{bad} is too long (at most {MAX_DELAY_S:g}s)")
    elif key == "loss":
        match = _PERCENT.fullmatch(value)
        if not match or float(match.group(1)) > 100:
            raise FaultSpecError(f"{bad} is not a percentage like 10% (0-100%)")
    elif key in ("port", "ports"):
        words = [w for w in re.split(r"[|+;\s]", value, flags=re.ASCII) if w]
        if not words:
            raise FaultSpecError(f"{bad} names no port")
        for word in words:
            if not re.fullmatch(r"[0-9]{1,5}", word, re.ASCII) or not 0 < int(word) < 65536:
                raise FaultSpecError(f"port {_q(word)} is not a port number (1-65535)")
    elif key == "action":
        if value.lower() not in ACTIONS:
            raise FaultSpecError(f"{bad} is not drop or reject")
    elif key == "peer":
        _int("peer", value)
    elif key == "mb":
        if _int("mb", value, MAX_OOM_MB) < 1:
            raise FaultSpecError(f"{bad} is not a positive whole number of MiB")
    elif key == "factor":
        match = re.fullmatch(r"([0-9]{1,3}(?:\.[0-9]{1,6})?)x?", value, re.ASCII)
        if not match or not 1.0 < float(match.group(1)) <= MAX_SLOW_FACTOR:
            raise FaultSpecError(f"{bad} is not a slowdown factor above 1 (like 3 or 1.5, at most {MAX_SLOW_FACTOR:g})")
    elif key == "drain":
        if value not in ("yes", "no"):
            raise FaultSpecError(f"{bad} is not yes or no")
    elif key == "signal":
        if value not in CRASH_SIGNALS:
            raise FaultSpecError(f"{bad} is not one of {', '.join(CRASH_SIGNALS)}")
    elif key == "phase":
        if value not in PHASES:
            raise FaultSpecError(f"{bad} is not one of {', '.join(PHASES)}")
    elif key == "copy":
        if value not in COPIES:
            raise FaultSpecError(f"{bad} is not one of {', '.join(COPIES)}")
    elif key == "holder":
        _int("holder", value)


def slow_factor(spec: FaultSpec) -> float:
    """How many times slower a slow-rank or slow-node fault makes its ranks' steps."""
    text = spec.option("factor")
    if text is None:
        raise FaultSpecError(f"{spec.kind.value} needs factor= (how many times slower, like 3)")
    check_option(spec.kind, "factor", text)
    return float(text.rstrip("x"))


def _fields(text: str) -> tuple[FaultKind, dict[str, str]]:
    """The kind and the key=value fields of `text`, every key once and allowed for the kind."""
    kind_text, _, rest = text.partition(":")
    kind = parse_kind(kind_text.strip())
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not value or not key:
            raise FaultSpecError(f"bad field {_q(part)} in fault spec {_q(text, 80)} (expected key=value)")
        if key not in _KEYS and key not in _OPTION_KEYS:
            raise FaultSpecError(f"unknown key {_q(key)} in fault spec {_q(text, 80)}")
        if key not in allowed_keys(kind):
            raise FaultSpecError(
                f"{key}={_q(value)} does not apply to {kind.value} (its keys: {', '.join(allowed_keys(kind))})"
            )
        if key in fields:
            raise FaultSpecError(f"{key}= given twice in fault spec {_q(text, 80)} ({_q(fields[key])} and {_q(value)})")
        fields[key] = value
    return kind, fields


def parse_spec(text: str) -> FaultSpec:
    """Parse `KIND:key=value,...`, e.g. `kill-rank:rank=1,step=25`.

    The grammar alone: a missing target means mode `one` and a missing trigger means now. What a
    user schedules or injects goes through `parse_injection`, which wants both said.
    """
    kind, fields = _fields(text)
    targets = [k for k in _TARGET_KEYS if k in fields]
    if len(targets) > 1:
        raise FaultSpecError(f"fault spec {_q(text, 80)} names more than one target ({', '.join(targets)})")
    if "rank" in fields:
        target = Target(TargetMode.RANK, _int("rank", fields["rank"]))
    elif "node" in fields:
        target = Target(TargetMode.NODE, _int("node", fields["node"]))
    elif "host" in fields:
        if not _HOST.fullmatch(fields["host"]):
            raise FaultSpecError(f"host={_q(fields['host'])} is not a host name")
        target = Target(TargetMode.HOST, fields["host"])
    elif "mode" in fields:
        target = parse_mode(fields["mode"])
    else:
        target = Target(TargetMode.ONE)
    if "seed" in fields and target.mode in (TargetMode.RANK, TargetMode.NODE, TargetMode.HOST):
        # The seed only picks targets; beside a fixed target it would be silently ignored.
        raise FaultSpecError(f"seed={_q(fields['seed'])} only goes with mode= (the target {target} is fixed)")
    if "step" in fields and "t" in fields:
        raise FaultSpecError(f"fault spec {_q(text, 80)} has both step= and t=; pick one trigger")
    options = tuple((k, v) for k, v in fields.items() if k in _OPTION_KEYS)
    for key, value in options:
        check_option(kind, key, value)
    if "port" in fields and "ports" in fields:
        raise FaultSpecError(f"fault spec {_q(text, 80)} has both port= and ports=; pick one")
    if "phase" in fields and "t" in fields:
        raise FaultSpecError(f"phase={_q(fields['phase'])} goes with step= (the step it lands in), not t=")
    if "holder" in fields and fields.get("copy") != "replica":
        raise FaultSpecError(f"holder={_q(fields['holder'])} names a node holding a replica: it goes with copy=replica")
    trigger = Trigger(
        step=_int("step", fields["step"], MAX_STEP) if "step" in fields else None,
        t=_seconds("t", fields["t"], MAX_T_S) if "t" in fields else None,
    )
    return FaultSpec(
        kind=kind,
        target=target,
        trigger=trigger,
        duration=_seconds("duration", fields["duration"], MAX_DURATION_S, positive=True)
        if "duration" in fields else None,
        seed=_int("seed", fields["seed"], MAX_SEED) if "seed" in fields else 0,
        options=options,
    )


def parse_injection(text: str, *, scheduled: bool) -> FaultSpec:
    """A fault a user asked for: `parse_spec`, and the target said (rank=, node=, host= or mode=),
    the options without a meaningful default given, and a trigger (step= or t=) when `scheduled`
    (`--inject`, a scenario) or none when not (`ffctl inject` applies it now)."""
    spec = parse_spec(text)
    kind, fields = _fields(text)
    if not any(k in fields for k in _TARGET_KEYS):
        raise FaultSpecError(f"fault spec {_q(text, 80)} names no target (give rank=, node=, host= or mode=)")
    for key in REQUIRED_OPTIONS.get(kind, ()):
        if key not in fields:
            raise FaultSpecError(f"fault spec {_q(text, 80)} needs {key}= ({kind.value} has no default worth applying)")
    triggers = [k for k in _TRIGGER_KEYS if k in fields]
    if scheduled and not triggers:
        raise FaultSpecError(f"fault spec {_q(text, 80)} names no trigger (give step=N or t=SECONDS)")
    if not scheduled and triggers:
        raise FaultSpecError(f"{triggers[0]}={_q(fields[triggers[0]])}: an injection into a running job applies now "
                             "(schedule faults with launch --inject)")
    return spec

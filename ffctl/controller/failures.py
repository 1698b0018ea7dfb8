"""What the controller knows of a failure: its cause, the ranks and nodes it took, what each
failed rank said, and how that reads on screen and in the run record's root cause.

Values only: the detectors (the controller's message handlers and watchdogs) build them, the
recovery coordinator consumes them; neither side's machinery is needed to make or read one.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

from runs.events import Label

TAIL_LINES = 20


class Cause(Label):
    """Why a generation failed, as the `failure_detected` event's `cause` names it. A failure that
    absorbed another one while pending names both, joined with `+` (`process-exit+node-lost`)."""

    PROCESS_EXIT = "process-exit"  # an agent saw a rank exit
    NODE_LOST = "node-lost"  # an agent exited or its heartbeat stopped
    HANG = "hang"  # no step committed for the hang limit
    STEP_ERROR = "step-error"  # a rank reported an exception raised inside its step
    RESTORE_FAILED = "restore-failed"  # a rank found the copy it was given unusable
    RENDEZVOUS_TIMEOUT = "rendezvous-timeout"  # a new generation's ranks did not all join
    RESTORE_TIMEOUT = "restore-timeout"  # ... or did not all restore
    STRAGGLER = "straggler"  # `--straggler replace`: a rank too slow for too long, replaced


def signal_name(exitcode: int) -> str | None:
    """`SIGKILL` for an exit code of -9 (killed by a signal), None for a normal exit."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def error_line(tail: list[str]) -> str:
    """The line of a log tail that names the error: the exception line ending the last Python
    traceback (what follows it, such as library warnings at interpreter exit, is not the error),
    else the last non-empty line."""
    lines = [line.rstrip() for line in tail]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if line and not line[0].isspace():
                return line.strip()
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return ""


def error_and_tail(out: list[str], err: list[str]) -> tuple[str, list[str]]:
    """What names a dead rank's error, and the lines shown with it, from the ends of its stdout
    (`out`) and stderr (`err`): a Python traceback's exception line wherever one is (stderr
    first, where Python writes it), else the last line of stderr (an abort's message, a signal's
    shell notice), else the last line of stdout."""
    for lines in (err, out):
        if any(line.startswith("Traceback (most recent call last)") for line in lines):
            return error_line(lines), lines
    if any(line.strip() for line in err):
        return error_line(err), [*out[-5:], *err]
    return error_line(out), out


@dataclass
class RankFailure:
    """What is known of one rank's failure: from its `error` message (an exception in the step,
    with its traceback), from the agent's exit report (exit code, the tail of the rank's log), or
    both, whichever came first filled in by the other."""

    rank: int
    node: int
    host: str
    t: float
    step: int | None = None  # the step it was training, None where unknown (a plain script)
    step_exact: bool = False  # reported by the rank itself, not inferred from its last commit
    pid: int | None = None
    exitcode: int | None = None  # None: still running when it reported the error
    error: str = ""  # one line: the exception, or the log's error line
    tail: list[str] = field(default_factory=list)  # last lines of its traceback or log

    def how(self) -> str:
        """`exit code 1: RuntimeError: boom`, `SIGKILL`, `RuntimeError: boom`."""
        parts = []
        if self.exitcode is not None:
            parts.append(signal_name(self.exitcode) or f"exit code {self.exitcode}")
        if self.error and (self.exitcode is None or self.exitcode > 0):
            parts.append(self.error)  # after a signal the log's last line is not about the death
        return ": ".join(parts) or "failed"

    def summary(self) -> str:
        """One line for the screen: `rank 1 (node 0) failed at step 10: exit code 1: ...`."""
        where = ""
        if self.step is not None:
            where = f" at step {self.step}" if self.step_exact else f" after step {self.step - 1}"
        return f"rank {self.rank} (node {self.node}) failed{where}: {self.how()}"

    def signature(self) -> tuple[int, int | None, str]:
        """What makes two failures the same for the crash-loop guard. The error's text where
        there is one: whether the exit code had arrived by then is a matter of timing."""
        return (self.rank, self.step, self.error or self.how())

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "host": self.host, "t": self.t, "step": self.step,
                "pid": self.pid, "exitcode": self.exitcode,
                "signal": signal_name(self.exitcode) if self.exitcode is not None else None,
                "error": self.error, "summary": self.summary(), "tail": list(self.tail[-TAIL_LINES:])}


@dataclass
class Failure:
    """A detected failure, pending until the coordinator takes it. `cause` is a `Cause` value, or
    several joined with `+` once failures seen before the recovery began were merged."""

    cause: str
    ranks: set[int] = field(default_factory=set)
    nodes: set[int] = field(default_factory=set)
    t: float = field(default_factory=time.time)
    detail: str = ""
    rank_failures: dict[int, RankFailure] = field(default_factory=dict)  # what each failed rank said
    # When the failure began, as far as the controller can tell (`onset_t` in the record, the time
    # a failure no injected fault explains is measured from): `t` itself when it was seen at once
    # ("reported": a rank's exit or error, which its agent sees within 0.1 s; "agent-exit"), else
    # the start of the silence that revealed it ("last-heartbeat", "last-progress").
    since: float | None = None
    since_what: str = "reported"

    def __post_init__(self) -> None:
        self.cause = str(self.cause)  # a Cause member is stored (and recorded) as its value

    @property
    def onset(self) -> float:
        """When the failure began (`since`, else the time it was detected)."""
        return self.since if self.since is not None else self.t

    @property
    def causes(self) -> tuple[Cause, ...]:
        return tuple(Cause(c) for c in self.cause.split("+"))

    def merge(self, other: Failure) -> None:
        self.ranks |= other.ranks
        self.nodes |= other.nodes
        for r, rf in other.rank_failures.items():
            self.rank_failures.setdefault(r, rf)
        if other.cause not in self.cause.split("+"):
            self.cause += "+" + other.cause
        if other.onset < self.onset:  # the merged failure began with the earlier of the two
            self.since, self.since_what = other.onset, other.since_what

    def signature(self) -> tuple[object, ...] | None:
        """The crash-loop signature of its first rank failure; None for a failure naming no rank
        (a lost node, a hang): the restart budget bounds those."""
        if not self.rank_failures:
            return None
        return min(self.rank_failures.values(), key=lambda f: (f.t, f.rank)).signature()


def root_cause(failure: Failure) -> dict[str, Any]:
    """The failure's first observed rank failure (torchrun's "Root Cause"), or what is known of
    a failure that names no rank (a lost node, a hang)."""
    if failure.rank_failures:
        first = min(failure.rank_failures.values(), key=lambda f: (f.t, f.rank))
        out = first.to_dict()
        out["cause"] = failure.cause
        out["others"] = [f.summary() for f in sorted(failure.rank_failures.values(), key=lambda f: f.rank)
                         if f is not first]
        return out
    return {"cause": failure.cause, "t": failure.t, "nodes": sorted(failure.nodes), "ranks": sorted(failure.ranks),
            "error": failure.detail, "summary": describe(failure)}


def describe(failure: Failure) -> str:
    """The failure in one line per failed rank (or one line for a failure that names none)."""
    if failure.rank_failures:
        return "; ".join(f.summary() for f in sorted(failure.rank_failures.values(), key=lambda f: f.rank))
    names: dict[str, str] = {Cause.NODE_LOST: f"node(s) {sorted(failure.nodes)} lost", Cause.HANG: "hang"}
    what = names.get(failure.cause.split("+")[0], failure.cause)
    return f"{what}: {failure.detail}" if failure.detail else what

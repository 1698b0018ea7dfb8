"""The controller's recovery coordinator: from a detected failure to the next generation running.

It aborts the failed generation, waits for survivors to acknowledge (killing those that cannot),
collects the agents' snapshot inventories, decides the restore step and sources (`decide`),
places the lost ranks (warm spares on surviving nodes, or the lost node's restarted agent), and
opens and awaits generation g+1 (DESIGN.md, One-step restoration, steps 3 to 5). A failure that
arrives meanwhile abandons the attempt and the recovery starts over with both failures merged.
It acts through the controller, which owns the control plane, the agents and the run record.

Restarts are bounded (`restart_verdict`): `--max-restarts` recoveries from failures ffctl did not
cause itself, and a crash loop (the same rank failing at the same step with the same error after
a restore) stops the job at once. A job that stops says why on screen and in the record, with the
root cause as torchrun reports it: the failed rank, its host, exit code or signal, time, and the
last lines of its error.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ffctl.controller.decide import Decision, Inventory, decide
from recovery import control
from recovery.jobenv import Strategy
from runs.events import EventKind

if TYPE_CHECKING:
    from ffctl.controller.controller import Controller, Failure

ABORT_ACK_TIMEOUT = 5.0
NODE_RESTART_DELAY_S = 5.0
# How long a stopping job waits for a rank that reported an error to exit by itself, so that the
# root cause shows its exit code and the traceback it printed.
EXIT_WAIT_S = 3.0
TAIL_LINES = 20


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


@dataclass(frozen=True)
class Verdict:
    """What to do with a failure: recover (stop is None) or stop the job, and whether the
    recovery spends one of the restarts `--max-restarts` allows."""

    stop: str | None
    counted: bool


def restart_verdict(max_restarts: int, used: int, injected: bool,
                    current: tuple[object, ...] | None, previous: tuple[object, ...] | None) -> Verdict:
    """Decide whether the job recovers from a failure.

    `used`: restarts already spent; `injected`: the failure is blamed on a fault ffctl injected
    itself; `current`/`previous`: the failure's signature (rank, step, error) and that of the last
    counted failure the job was restored from (None when the failure names no rank).

    A chaos run's injected faults are its experiment: recovering from them never spends the
    budget, so `--chaos mtbf=...` or many `--inject`s run as long as they are asked to. Any other
    failure (a bug in the script, a recovery that itself fails) spends one restart, as
    torchrun's `--max-restarts` counts them; with the budget spent the job stops, and a crash loop
    (the same failure again right after a restore) stops it at once, since a restore cannot
    change what happens next.
    """
    if injected:
        return Verdict(None, False)
    if current is not None and current == previous:
        rank, step, how = current
        at = f" at step {step}" if step is not None else ""
        return Verdict(f"crash loop: rank {rank} failed again{at} with the same error ({how}) after a restore", True)
    if used >= max_restarts:
        return Verdict(f"restart budget spent: {used} of --max-restarts {max_restarts} used", True)
    return Verdict(None, True)


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
    what = {"node-lost": f"node(s) {sorted(failure.nodes)} lost", "hang": "hang"}.get(
        failure.cause.split("+")[0], failure.cause)
    return f"{what}: {failure.detail}" if failure.detail else what


class RecoveryAbandoned(Exception):
    """A new failure arrived while recovering: start the recovery over."""


class FatalRun(Exception):
    """The run cannot go on (recovery none, no usable state, infrastructure gone)."""


class RecoveryCoordinator:
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        # Inventory requests are numbered for the whole run: a late answer to an earlier
        # recovery's request must not pass for an answer to this one.
        self._req = 0
        self.restarts = 0  # recoveries that spent the --max-restarts budget
        self._restored_from: tuple[object, ...] | None = None  # signature of the last such failure

    def recover(self) -> None:
        """Recover from the pending failure, and from any that arrive before the job resumes;
        stop the job (FatalRun) when the restart budget or the crash-loop guard says so."""
        ctl = self.ctl
        while ctl.pending is not None:
            failure, ctl.pending = ctl.pending, None
            ctl.phase = "recovering"
            ids = ctl.injector.attribute(failure.ranks, failure.nodes)
            ctl.record(EventKind.FAILURE_DETECTED, t=failure.t, fault_ids=ids, cause=failure.cause,
                       ranks=sorted(failure.ranks), nodes=sorted(failure.nodes), gen=ctl.gen,
                       detail=failure.detail, summary=describe(failure))
            blame = f" (fault {', '.join(ids)})" if ids else ""
            for line in describe(failure).split("; "):
                ctl.announce(line + blame)
            self._abort(ctl.gen)
            if ctl.spec.recovery == Strategy.NONE:
                self._stop(failure, ids, f"{failure.cause} and --recovery none: the job stops")
            sig = self._signature(failure)
            verdict = restart_verdict(ctl.spec.max_restarts, self.restarts, bool(ids), sig, self._restored_from)
            if verdict.stop is not None:
                self._stop(failure, ids, f"{verdict.stop}: the job stops")
            if verdict.counted:
                self.restarts += 1
                # Compared with the next failure even when that one cuts this recovery short: a
                # rank failing at the same step again has been restored (it got that far), even
                # when its "restored" arrived in the same breath as its error.
                self._restored_from = sig
            try:
                self._recover_once(failure, ids)
            except RecoveryAbandoned:
                continue  # the new failure is pending: abort this generation too and start over
            except FatalRun:
                if ctl.root_cause is None:
                    ctl.root_cause = root_cause(failure)
                raise
        ctl.phase = "running"

    @staticmethod
    def _signature(failure: Failure) -> tuple[object, ...] | None:
        if not failure.rank_failures:
            return None  # a lost node or a hang: the budget bounds those
        return min(failure.rank_failures.values(), key=lambda f: (f.t, f.rank)).signature()

    def _stop(self, failure: Failure, ids: list[str], reason: str) -> None:
        """End the job over `failure`: record why, with its root cause, and raise FatalRun (the
        controller then stops every process and records the run as failed)."""
        ctl = self.ctl
        # A rank that reported an exception is still unwinding: its exit code and the traceback
        # it prints belong in the root cause.
        unwinding = [r for r, f in failure.rank_failures.items() if f.exitcode is None and ctl.pids.get(r)]
        if unwinding:
            ctl.wait_for(lambda: all(ctl.pids.get(r) is None for r in unwinding), EXIT_WAIT_S, "exit",
                         abandon_on_failure=False)
        ctl.root_cause = root_cause(failure)
        ctl.fatal_reason = reason
        ctl.announce(reason)
        ctl.record(EventKind.RECOVERY_FAILED, fault_ids=ids, reason=reason, root_cause=ctl.root_cause,
                   restarts=self.restarts, max_restarts=ctl.spec.max_restarts)
        raise FatalRun(reason)

    def _abort(self, gen: int) -> None:
        assert self.ctl.store is not None
        # Sealed: ranks ignore (and report) an abort flag anyone else wrote.
        keys, values = control.abort_values(self.ctl.sealer, gen, self.ctl.spec.world_size)
        self.ctl.store.multi_set(keys, values)

    def _kill(self, ranks: set[int], grace: float = 3.0) -> None:
        """Ask the agents to stop these ranks. Their pids stay known until the agents report the
        exits: a next generation must not open while an old process could still join it."""
        ctl = self.ctl
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            if ctl.pids.get(r):
                by_node.setdefault(ctl.members[r], []).append(r)
        for node, rs in by_node.items():
            if ctl.nodes[node].up:
                ctl.send(node, {"type": "kill", "ranks": rs, "grace": grace})
            else:
                for r in rs:
                    ctl.pids[r] = None  # no agent left to stop or report it

    def _recover_once(self, failure: Failure, ids: list[str]) -> None:
        ctl = self.ctl
        old_gen = ctl.gen
        lost_nodes = set(failure.nodes) | {n for n, st in ctl.nodes.items() if not st.up}
        for n in lost_nodes:
            ctl.nodes[n].up = False
        ctl.wire_ring()  # survivors must not wait on a dead neighbour's copy
        lost = set(failure.ranks) | {r for r, n in ctl.members.items() if n in lost_nodes}
        lost |= {r for r, pid in ctl.pids.items() if pid is None}
        for r in lost:
            if ctl.members[r] in lost_nodes:
                ctl.pids[r] = None  # gone with their node; no agent is left to report the exit
        if ctl.spec.recovery == Strategy.PEER:
            lost |= self._collect_survivors(old_gen, lost)
            # Nodes lost while survivors were acknowledging belong to this recovery too.
            newly = {n for n, st in ctl.nodes.items() if not st.up} - lost_nodes
            if newly:
                lost_nodes |= newly
                ctl.wire_ring()
                for r, n in ctl.members.items():
                    if n in newly:
                        lost.add(r)
                        ctl.pids[r] = None
            self._kill({r for r in lost if ctl.pids.get(r)})  # e.g. a rank whose restore failed
        else:
            lost = set(ctl.members)
            self._kill(lost)
        decision = self._decide(lost, lost_nodes)
        new_gen = old_gen + 1
        if decision is None and ctl.progress.committed_step == 0:
            # Nothing was trained yet: starting over from step 0 loses nothing.
            decision = Decision(0, "none", {r: {"kind": "none"} for r in ctl.members})
            self._kill(set(ctl.members) - lost)
            lost = set(ctl.members)
        if decision is None:
            ctl.fatal_reason = (f"no copy of the state of rank(s) {sorted(lost)} survives and there is no "
                                f"complete disk checkpoint: the job stops")
            ctl.announce(ctl.fatal_reason)
            ctl.root_cause = root_cause(failure)
            ctl.record(EventKind.RECOVERY_FAILED, fault_ids=ids, reason=ctl.fatal_reason, root_cause=ctl.root_cause)
            raise FatalRun(ctl.fatal_reason)
        if decision.restore_source == "disk" and ctl.spec.recovery != Strategy.RESTART_DISK:
            ctl.announce(f"every memory copy of rank(s) {list(decision.lost_both_copies) or sorted(lost)} is "
                         f"gone: falling back to the disk checkpoint of step {decision.restore_step}")
            ctl.show(force=True)
            # Survivors hold no memory copy of the disk step: every rank restarts from disk.
            self._kill(set(ctl.members) - lost)
            lost = set(ctl.members)
        respawn = sorted(lost)
        self._place(respawn, lost_nodes)
        ctl.record(EventKind.RECOVERY_DECIDED, fault_ids=ids, gen=new_gen, restore_step=decision.restore_step,
                   restore_source=decision.restore_source, strategy=ctl.spec.recovery, ranks=respawn,
                   placement={str(r): ctl.members[r] for r in respawn},
                   lost_both_copies=list(decision.lost_both_copies))
        needed = sorted({ctl.members[r] for r in respawn} & lost_nodes)
        for n in sorted(lost_nodes):
            ctl.deferred_restarts.pop(n, None)
            if n in needed:
                ctl.start_agent(n)
            else:
                # Its ranks run on spares elsewhere: bring the node back once the job has
                # resumed, so its start-up does not compete with the recovery.
                ctl.deferred_restarts[n] = time.monotonic() + NODE_RESTART_DELAY_S
        if needed:
            ctl.wait_agents(needed)
        wait_dead = lambda: all(ctl.pids.get(r) is None for r in respawn)  # noqa: E731
        if not ctl.wait_for(wait_dead, 15.0, "teardown", abandon_on_failure=False):
            raise FatalRun(f"rank(s) {[r for r in respawn if ctl.pids.get(r)]} did not stop within 15s")
        if ctl.pending is not None:
            if ctl.pending.ranks <= set(respawn) and ctl.pending.nodes <= lost_nodes:
                ctl.pending = None  # exits of ranks we are replacing anyway
            else:
                raise RecoveryAbandoned("another rank failed while recovering")
        ctl.open_generation(new_gen, decision, respawn)
        ctl.await_generation(new_gen, respawn, decision.restore_step, decision.restore_source)

    def _collect_survivors(self, old_gen: int, lost: set[int]) -> set[int]:
        """Wait for survivors to acknowledge the abort; return those that are stuck (hung,
        stopped) and were killed, plus any that exited meanwhile."""
        ctl = self.ctl
        survivors = set(ctl.members) - lost
        acked = lambda: survivors <= (ctl.gen_msgs.get(("aborted", old_gen), set())  # noqa: E731
                                      | {r for r in survivors if ctl.pids.get(r) is None})
        ctl.wait_for(acked, ABORT_ACK_TIMEOUT, "abort", abandon_on_failure=False)
        gone = survivors - ctl.gen_msgs.get(("aborted", old_gen), set())
        self._kill(gone, grace=0.5)
        if ctl.pending is not None:  # exits seen meanwhile belong to this failure
            gone |= ctl.pending.ranks
            ctl.pending = None
        return gone

    def _place(self, ranks: list[int], lost_nodes: set[int]) -> None:
        """Ranks of a lost node go to warm spares on surviving nodes when there are any (no wait
        for the node to come back); otherwise they wait for the node's restarted agent."""
        ctl = self.ctl
        # A spare still warming up is further along than a node restart, so count it too.
        free = {n: st.spares_total for n, st in ctl.nodes.items() if st.up and n not in lost_nodes}
        for r in ranks:
            if ctl.members[r] in lost_nodes and free:
                n = max(free, key=lambda k: (free[k], -k))
                if free[n] > 0:
                    ctl.members[r] = n
                    free[n] -= 1

    def _decide(self, lost: set[int], lost_nodes: set[int]) -> Decision | None:
        ctl = self.ctl
        if ctl.spec.recovery == Strategy.RESTART_DISK:
            return decide(ctl.spec.recovery, ctl.members, lost, lost_nodes, {}, sorted(ctl.nodes), ctl.disk_step)
        self._req += 1
        req = self._req
        live = [n for n, st in ctl.nodes.items() if st.up]
        for n in live:
            ctl.send(n, {"type": "inventory", "req": req})
        ctl.wait_for(lambda: all((n, req) in ctl.inventories for n in live), 10.0, "inventory",
                     abandon_on_failure=False)
        invs: dict[int, Inventory] = {}
        for n in live:
            msg = ctl.inventories.get((n, req))
            if msg is None:
                continue
            peer = ctl.nodes[n].peer or ("", 0)
            invs[n] = Inventory(
                n, peer[0], peer[1],
                {int(r): frozenset(s) for r, s in msg["local"].items()},
                {int(r): frozenset(s) for r, s in msg["replica"].items()},
            )
        # Nodes that restarted hold nothing from before; count them as lost for the decision.
        return decide(ctl.spec.recovery, ctl.members, lost, lost_nodes, invs, sorted(ctl.nodes), ctl.disk_step,
                      frozenset(ctl.bad_sources))

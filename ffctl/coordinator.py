"""The controller's recovery coordinator: from a detected failure to the next generation running.

It aborts the failed generation, waits for survivors to acknowledge (killing those that cannot),
collects the agents' snapshot inventories, decides the restore step and sources (`decide`),
places the lost ranks (warm spares on surviving nodes, or the lost node's restarted agent), and
opens and awaits generation g+1 (DESIGN.md, One-step restoration, steps 3 to 5). A failure that
arrives meanwhile abandons the attempt and the recovery starts over with both failures merged.
It acts through the controller, which owns the control plane, the agents and the run record.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ffctl.decide import Decision, Inventory, decide
from recovery import control
from recovery.jobenv import Strategy
from runs.events import EventKind

if TYPE_CHECKING:
    from ffctl.controller import Controller, Failure

ABORT_ACK_TIMEOUT = 5.0
NODE_RESTART_DELAY_S = 5.0


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

    def recover(self) -> None:
        """Recover from the pending failure, and from any that arrive before the job resumes."""
        ctl = self.ctl
        while ctl.pending is not None:
            failure, ctl.pending = ctl.pending, None
            ctl.phase = "recovering"
            ids = ctl.injector.attribute(failure.ranks, failure.nodes)
            ctl.record(EventKind.FAILURE_DETECTED, t=failure.t, fault_ids=ids, cause=failure.cause,
                       ranks=sorted(failure.ranks), nodes=sorted(failure.nodes), gen=ctl.gen,
                       detail=failure.detail)
            self._abort(ctl.gen)
            if ctl.spec.recovery == Strategy.NONE:
                ctl.fatal_reason = f"{failure.cause} and --recovery none: the job stops"
                ctl.record(EventKind.RECOVERY_FAILED, fault_ids=ids, reason=ctl.fatal_reason)
                raise FatalRun(ctl.fatal_reason)
            try:
                self._recover_once(failure, ids)
            except RecoveryAbandoned:
                continue  # the new failure is pending: abort this generation too and start over
        ctl.phase = "running"

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
            ctl.notice = ctl.fatal_reason
            ctl.record(EventKind.RECOVERY_FAILED, fault_ids=ids, reason=ctl.fatal_reason)
            raise FatalRun(ctl.fatal_reason)
        if decision.restore_source == "disk" and ctl.spec.recovery != Strategy.RESTART_DISK:
            ctl.notice = (f"every memory copy of rank(s) {list(decision.lost_both_copies) or sorted(lost)} is "
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

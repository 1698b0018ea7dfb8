"""The controller's recovery coordinator: from a detected failure to the next generation running.

It aborts the failed generation, waits for survivors to acknowledge (killing those that cannot),
collects the agents' snapshot inventories, decides the restore step and sources (`decide`),
places the lost ranks (warm spares on surviving nodes, or the lost node's restarted agent), and
opens and awaits generation g+1 (DESIGN.md, One-step restoration, steps 3 to 5: start ahead, decide, open). A failure that
arrives meanwhile abandons the attempt and the recovery starts over with both failures merged.
It acts through a `Cluster` (the controller implements it: control plane, agents, run record,
screen), reads and updates the shared `JobState`, and returns what it did as a `RecoveryOutcome`
(or raises FatalRun with the reason and root cause); it never reaches into the controller.

Restarts are bounded (`restart_verdict`): `--max-restarts` recoveries from failures ffctl did not
cause itself, and a crash loop (the same rank failing at the same step with the same error after
a restore) stops the job at once. A job that stops says why on screen and in the record, with the
root cause as torchrun reports it: the failed rank, its host, exit code or signal, time, and the
last lines of its error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

from ffctl.controller.cluster import Cluster, FatalRun, RecoveryAbandoned
from ffctl.controller.decide import Decision, Inventory, decide
from ffctl.controller.failures import (  # RankFailure, error_line, signal_name: re-exported from their old home
    Cause,
    Failure,
    RankFailure,
    describe,
    error_line,
    root_cause,
    signal_name,
)
from ffctl.controller.state import JobState, Report
from wire import messages
from wire.jobenv import Strategy
from wire.generation_plan import LocalSlot, Source
from runs.events import EventKind, RestoreSource

__all__ = ["FatalRun", "RankFailure", "RecoveryAbandoned", "RecoveryCoordinator", "RecoveryOutcome", "Verdict",
           "ahead_of_decision", "await_answers", "describe", "error_line", "kept_ahead", "place",
           "restart_verdict", "root_cause", "signal_name", "start_ahead"]

ABORT_ACK_TIMEOUT = 5.0
# A running rank's abort watcher answers within milliseconds; this leaves room for a loaded host.
ABORT_SEEN_TIMEOUT = 1.5
# However long answers keep coming in, waiting for survivors' answers ends after this.
ANSWERS_MAX_S = 60.0
# A node whose ranks moved elsewhere comes back as soon as the job has resumed (its agent is
# started by the controller's loop, after the recovery): until it holds replicas again, the ranks
# that moved share one node, and a second fault of that node would lose both copies of them.
NODE_RESTART_DELAY_S = 0.0
# How long a stopping job waits for a rank that reported an error to exit by itself, so that the
# root cause shows its exit code and the traceback it printed. Only a failing job waits, and a rank
# that exits promptly ends the wait: generous, since on a loaded host a rank tearing down its process
# group and printing its traceback took over 3 s (the root cause then lacked its exit code).
EXIT_WAIT_S = 10.0
# How long a lost node's agent that still runs is given to stop by itself before it is killed
# (see `fence`): it is stopped, wedged or cut off, so it is not expected to answer.
FENCE_STOP_S = 0.5


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
    change what happens next. A copy a rank refused on restore (`restore-failed`) is passed as
    `injected` too: the same recovery moves on to the next copy (another holder's, an older step,
    disk), and the copies are finite, so the chain ends without a budget.
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


def lost_meanwhile(cluster: Cluster, nodes: set[int], ids: list[str], gen: int, failures: int,
                   handling: list[str]) -> int:
    """Nodes lost while a recovery collected its survivors are handled by it (two nodes killed
    in one step: the second loss seen as the first's survivors answer): recorded as failure
    `failures + 1` (added to `handling`), their injected faults added to the recovery's `ids`.
    Returns the failures counted now."""
    failure_id = f"d{failures + 1}"
    handling.append(failure_id)
    more = [i for i in cluster.faults_on(nodes) if i not in ids]
    ids += more
    now = time.time()
    cluster.record(EventKind.FAILURE_DETECTED, t=now, fault_ids=more, cause=Cause.NODE_LOST, ranks=[],
                   nodes=sorted(nodes), gen=gen, detail="lost during the recovery", summary=f"node(s) {sorted(nodes)} lost",
                   failure_id=failure_id, onset_t=now, onset="detection", explained_by=more or list(ids))
    return failures + 1


def blamed(cluster: Cluster, failure: Failure, recovering: list[str]) -> list[str]:
    """The injected faults `failure` is laid to (marked detected). A copy refused while a
    recovery restores (`recovering`: its faults) is that recovery's, none of its own: never laid
    to another open fault that happens to touch the rank (a slow rank reverted a moment before,
    with no step committed since to show it was survived)."""
    if set(failure.causes) == {Cause.RESTORE_FAILED} and recovering:
        return []
    return cluster.attribute_faults(failure.ranks, failure.nodes)


@dataclass(frozen=True)
class RecoveryOutcome:
    """What a recovery did: the generation now running, the step and source it restored from,
    the ranks (re)started, and the failures it handled (more than one when a failure arriving
    during the recovery made it start over)."""

    gen: int
    restore_step: int
    restore_source: RestoreSource
    ranks: tuple[int, ...]
    fault_ids: tuple[str, ...]
    attempts: int  # recoveries started, the last one completed
    restarts: int  # of the --max-restarts budget, spent in the whole run so far


def fence(job: JobState, nodes: set[int]) -> None:
    """End the agents of `nodes`, which a recovery counts as lost, with their ranks, before the
    next generation opens. A node lost by its heartbeat is not necessarily dead: an agent that is
    SIGSTOPped, wedged or cut off stops beating, but its ranks (which a stopped agent does
    not stop) run on. Left alone they see the abort like any survivor and join generation
    g+1 under the same rank numbers as their replacements: two processes per rank in one
    rendezvous, a job that hangs at once, and a recovery from that hang whose survivors'
    copies share no step. Stopping the agent (the node is restarted later anyway, which
    stops it too; `stop` is idempotent) ends them: a local agent's workers die with it
    (PR_SET_PDEATHSIG), a remote agent's host wrapper ends its whole process group. An agent
    that already exited returns at once."""
    for n in sorted(nodes):
        st = job.nodes.get(n)
        if st is not None and st.proc.poll() is None:
            st.proc.stop(timeout=FENCE_STOP_S)


class RecoveryCoordinator:
    def __init__(self, cluster: Cluster, job: JobState, strategy: str, max_restarts: int,
                 crash_loop_guard: bool = True, script_restores_itself: bool = False,
                 start_over_before_checkpoint: bool = False, verify_restore: bool = False) -> None:
        self.cluster = cluster
        self.job = job
        self.strategy = Strategy(strategy)
        self.max_restarts = max_restarts
        # Off for an unchanged script, which torchrun restarts until the budget is spent.
        self.crash_loop_guard = crash_loop_guard
        # An unchanged script restores itself from its own checkpoint (or starts over), as under
        # torchrun: ffctl restarts the group and restores nothing, whatever steps it reported.
        self.script_restores_itself = script_restores_itself
        # A job that keeps disk checkpoints (--ckpt-every) and loses every copy of a rank's state
        # before its first complete one starts over from step 0, its initial state, as it would
        # from a checkpoint (a chaos run lost a node 2 steps in, before step 20's checkpoint,
        # and stopped). Without disk checkpoints losing every copy stops the job: starting over
        # silently is not what a job that chose memory copies alone asked for.
        self.start_over_before_checkpoint = start_over_before_checkpoint
        # --verify-restore: restore one snapshot further back and check the replayed steps.
        self.verify_restore = verify_restore
        # Inventory requests are numbered for the whole run: a late answer to an earlier
        # recovery's request must not pass for an answer to this one.
        self._req = 0
        self.restarts = 0  # recoveries that spent the --max-restarts budget
        # Every detected failure is numbered for the run (`failure_id` "d1", "d2", ...), so the
        # record ties a failure no injected fault explains to the recovery that handled it.
        self._failures = 0
        self._handling: list[str] = []  # failure ids of the recovery under way
        self._restored_from: tuple[object, ...] | None = None  # signature of the last such failure

    def recover(self) -> RecoveryOutcome:
        """Recover from the pending failure, and from any that arrive before the job resumes;
        stop the job (FatalRun) when the restart budget or the crash-loop guard says so."""
        job, cluster = self.job, self.cluster
        attempts = 0
        fault_ids: list[str] = []
        self._handling = []
        while True:
            failure = job.take_pending()
            if failure is None:
                raise RuntimeError("recover() with no pending failure")
            attempts += 1
            ids = blamed(cluster, failure, fault_ids)
            # A failure that cuts short the recovery from injected faults is laid to them (a
            # partition still in force, a survivor failing as its group is torn down): the report
            # counts it in their loss rather than as a fault of its own. `ids` alone decides
            # whether the restart budget is spent, as before.
            explained = ids or list(fault_ids)
            fault_ids += [i for i in ids if i not in fault_ids]
            self._failures += 1
            failure_id = f"d{self._failures}"
            self._handling.append(failure_id)
            cluster.record(EventKind.FAILURE_DETECTED, t=failure.t, fault_ids=ids, cause=failure.cause,
                           ranks=sorted(failure.ranks), nodes=sorted(failure.nodes), gen=job.gen,
                           detail=failure.detail, summary=describe(failure), failure_id=failure_id,
                           onset_t=failure.onset, onset=failure.since_what, explained_by=explained)
            blame = f" (fault {', '.join(ids)})" if ids else ""
            for line in describe(failure).split("; "):
                cluster.announce(line + blame)
            cluster.abort_generation(job.gen)
            if self.strategy is Strategy.NONE:
                self._stop(failure, ids, f"{failure.cause} and --recovery none: the job stops")
            sig = failure.signature() if self.crash_loop_guard else None
            verdict = restart_verdict(self.max_restarts, self.restarts,  # a refused copy: on to the next
                                      bool(ids) or Cause.RESTORE_FAILED in failure.causes, sig, self._restored_from)
            if verdict.stop is not None:
                self._stop(failure, ids, f"{verdict.stop}: the job stops")
            if verdict.counted:
                self.restarts += 1
                # Compared with the next failure even when that one cuts this recovery short: a rank
                # failing at the same step again was restored, though its "restored" came with its error.
                self._restored_from = sig
            try:
                decision, respawn = self._recover_once(failure, ids)
            except RecoveryAbandoned:
                continue  # the new failure is pending: abort this generation too and start over
            except FatalRun as exc:
                if exc.root_cause is None:
                    exc.root_cause = root_cause(failure)
                raise
            fault_ids += [i for i in ids if i not in fault_ids]  # and those found on the way
            if job.pending is None:
                return RecoveryOutcome(job.gen, decision.restore_step, RestoreSource(decision.restore_source),
                                       tuple(respawn), tuple(fault_ids), attempts, self.restarts)

    def _stop(self, failure: Failure, ids: list[str], reason: str) -> None:
        """End the job over `failure`: record why, with its root cause, and raise FatalRun (the
        controller then stops every process and records the run as failed)."""
        job = self.job
        # A rank that reported an exception is still unwinding: its exit code and the traceback
        # it prints belong in the root cause.
        unwinding = [r for r, f in failure.rank_failures.items() if f.exitcode is None and job.pids.get(r)]
        if unwinding:
            self.cluster.wait_for(lambda: all(job.pids.get(r) is None for r in unwinding), EXIT_WAIT_S, "exit",
                                  abandon_on_failure=False)
        cause = root_cause(failure)
        self.cluster.announce(reason)
        self.cluster.record(EventKind.RECOVERY_FAILED, fault_ids=ids, reason=reason, root_cause=cause,
                            restarts=self.restarts, max_restarts=self.max_restarts,
                            failure_ids=list(self._handling))
        raise FatalRun(reason, cause)

    def _kill(self, ranks: set[int], grace: float = 3.0) -> None:
        """Ask the agents to stop these ranks, those still on their way too (an agent holds a
        spawn while its template warms up: left alone, it would start them into a generation
        that is over, to join the next one beside their replacements). Their pids stay known
        until the agents report the exits, and a spawn until the agent says it is dropped: a
        next generation must not open while an old process could still join it."""
        job = self.job
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            if job.pids.get(r):
                by_node.setdefault(job.members[r], []).append(r)
            elif r in job.spawning:
                by_node.setdefault(job.spawning[r][1], []).append(r)
        for node, rs in by_node.items():
            if job.nodes[node].up:
                self.cluster.send(node, messages.Kill(ranks=sorted(rs), grace=grace))
            else:
                for r in rs:
                    job.pids[r] = None  # no agent left to stop or report it
                    job.spawning.pop(r, None)

    def _recover_once(self, failure: Failure, ids: list[str]) -> tuple[Decision, list[int]]:
        job, cluster = self.job, self.cluster
        old_gen = job.gen
        # A node whose agent is still starting is not lost: started again, the agent on its way
        # would be replaced (16-18 times per chaos soak, each a start paid again on a busy host).
        # The watchdog loses it if it exits or never comes up; a rank placed on it waits for it.
        lost_nodes = set(failure.nodes) | {n for n, st in job.nodes.items() if st.lost}
        for n in lost_nodes:
            job.nodes[n].declare_lost()
        job.forget_spawns(lost_nodes)
        fence(job, set(failure.nodes))
        cluster.wire_ring()  # survivors must not wait on a dead neighbour's copy
        lost = set(failure.ranks) | {r for r, n in job.members.items() if n in lost_nodes}
        lost |= {r for r, pid in job.pids.items() if pid is None}
        # Replacements an abandoned attempt started ahead are in no generation yet: not survivors.
        lost |= set(job.ahead)
        for r in lost:
            if job.members[r] in lost_nodes:
                job.pids[r] = None  # gone with their node; no agent is left to report the exit
        if self.strategy is Strategy.PEER:
            if not self.script_restores_itself:  # (an unchanged script's group restarts whole)
                start_ahead(cluster, job, lost, lost_nodes, old_gen + 1)
            lost |= self._collect_survivors(old_gen, lost)
            # Nodes lost while survivors were acknowledging belong to this recovery too, and so
            # do their faults (two nodes killed in one step: the second seen meanwhile).
            newly = {n for n, st in job.nodes.items() if st.lost} - lost_nodes
            if newly:
                lost_nodes |= newly
                job.forget_spawns(newly)
                self._failures = lost_meanwhile(cluster, newly, ids, old_gen, self._failures, self._handling)
                fence(job, newly)
                cluster.wire_ring()
                for r, n in job.members.items():
                    if n in newly:
                        lost.add(r)
                        job.pids[r] = None
            self._kill({r for r in lost if not job.stopped(r)} - set(job.ahead))  # e.g. a rank whose restore failed
        else:
            lost = set(job.members)
            self._kill(lost)
        new_gen = old_gen + 1
        if self.script_restores_itself:
            decision: Decision | None = Decision.fresh(new_gen, len(job.members), self.strategy, RestoreSource.SCRIPT)
        else:
            decision = self._decide(new_gen, lost, lost_nodes)
        if decision is None and (job.progress.committed_step == 0 or self.start_over_before_checkpoint):
            # Nothing was trained yet: starting over from step 0 loses nothing. (With disk
            # checkpoints, none complete yet: step 0 is the newest state there is.)
            if job.progress.committed_step > 0:
                cluster.announce(f"no copy of the state of rank(s) {sorted(lost)} survives and no disk checkpoint is "
                                 f"complete yet: every rank starts over from step 0 "
                                 f"({job.progress.committed_step} steps lost)")
            decision = Decision.fresh(new_gen, len(job.members), self.strategy)
            self._kill(set(job.members) - lost)
            lost = set(job.members)
        if decision is None:
            # Without a lost rank, "no copy survives" would be false and name no one: every rank
            # still holds its own slots, and they share no step only when the generation held
            # processes it should not have (e.g. a lost node's ranks that ran on, see `fence`).
            what = (f"no copy of the state of rank(s) {sorted(lost)} survives" if lost else
                    "the ranks' memory copies hold no step in common")
            reason = f"{what} and there is no complete disk checkpoint: the job stops"
            cause = root_cause(failure)
            cluster.announce(reason)
            cluster.record(EventKind.RECOVERY_FAILED, fault_ids=ids, reason=reason, root_cause=cause,
                           failure_ids=list(self._handling))
            raise FatalRun(reason, cause)
        if decision.restore_source == RestoreSource.DISK and self.strategy is not Strategy.RESTART_DISK:
            gone = list(decision.lost_both_copies) or sorted(lost)
            cluster.announce((f"every memory copy of rank(s) {gone} is gone" if gone else
                              "the ranks' memory copies hold no step in common") +
                             f": falling back to the disk checkpoint of step {decision.restore_step}")
            # Survivors hold no memory copy of the disk step: every rank restarts from disk.
            self._kill(set(job.members) - lost)
            lost = set(job.members)
        respawn = sorted(lost)
        place(job, respawn, lost_nodes, cluster.spare_nodes(), cluster.has_gpu(), decision.sources)
        # Replacements started ahead that the generation keeps; the others stop, to start again.
        ahead = kept_ahead(job, new_gen, lost_nodes)
        self._kill(set(job.ahead) - ahead)
        job.ahead = {r: job.ahead[r] for r in ahead}
        # (The step a script goes back to is its own business: unknown here until it reports one.)
        restore_step = None if decision.restore_source is RestoreSource.SCRIPT else decision.restore_step
        cluster.record(EventKind.RECOVERY_DECIDED, fault_ids=ids, gen=new_gen, restore_step=restore_step,
                       restore_source=decision.restore_source, strategy=self.strategy, ranks=respawn,
                       placement={str(r): job.members[r] for r in respawn},
                       lost_both_copies=list(decision.lost_both_copies), failure_ids=list(self._handling),
                       # How many survivors left their failed step without computing its products.
                       survivors_without_products=len(job.reported(Report.SKIPPED_PRODUCTS, old_gen) - set(respawn)),
                       **({"verify_until": decision.verify_until} if decision.verify_until else {}))
        cluster.wire_ring()  # the same ring; the record learns which ranks now sit on a node without a neighbour
        needed = sorted({job.members[r] for r in respawn} & lost_nodes)
        for n in sorted(lost_nodes):
            job.deferred_restarts.pop(n, None)
            if n in needed:
                cluster.start_agent(n)
            else:
                # Its ranks run elsewhere: bring the node back once the job has resumed, so its
                # start-up does not compete with the recovery, and at once after that, so that
                # it holds replicas again (see NODE_RESTART_DELAY_S).
                job.deferred_restarts[n] = time.monotonic() + NODE_RESTART_DELAY_S
        # And the agents still starting that ranks are placed on (a recovery that waited for them
        # was abandoned): waited for, not started again.
        coming = sorted(set(needed) | {n for n in (job.members[r] for r in respawn) if job.nodes[n].starting})
        if coming:
            cluster.wait_agents(coming)
        wait_dead = lambda: all(job.stopped(r) for r in respawn if r not in ahead)  # noqa: E731
        if not cluster.wait_for(wait_dead, 15.0, "teardown", abandon_on_failure=False):
            raise FatalRun(f"rank(s) {[r for r in respawn if r not in ahead and not job.stopped(r)]} "
                           "did not stop within 15s")
        if job.pending is not None:
            if job.pending.ranks <= set(respawn) and job.pending.nodes <= lost_nodes:
                job.pending = None  # exits of ranks we are replacing anyway
            else:
                raise RecoveryAbandoned("another rank failed while recovering")
        cluster.open_generation(new_gen, decision, respawn, frozenset(ahead))
        job.ahead.clear()  # members of the generation now, like the rest
        cluster.await_generation(new_gen, respawn, decision.restore_step, RestoreSource(decision.restore_source))
        return decision, respawn

    def _collect_survivors(self, old_gen: int, lost: set[int]) -> set[int]:
        """Wait for survivors to acknowledge the abort; return those that are stuck (hung,
        stopped) and were killed, plus any that exited meanwhile.

        Two answers tell them apart. A rank's abort watcher (a thread of its own) says
        `abort_seen` as soon as the flag is set; its training thread says `aborted` once it has
        left the generation, which may take a step's compute. A rank that does not even say
        `abort_seen` within ABORT_SEEN_TIMEOUT is not running (stopped, wedged with the GIL
        held, its host frozen) and is replaced at once; a busy one gets ABORT_ACK_TIMEOUT."""
        job = self.job
        survivors = set(job.members) - lost
        exited = lambda: {r for r in survivors if job.pids.get(r) is None}  # noqa: E731
        answered = lambda: job.reported(Report.ABORTED, old_gen) | job.reported(Report.ABORT_SEEN, old_gen) | exited()  # noqa: E731
        await_answers(self.cluster, survivors, answered, ABORT_SEEN_TIMEOUT)
        silent = survivors - answered()
        busy = survivors - silent
        await_answers(self.cluster, busy, lambda: job.reported(Report.ABORTED, old_gen) | exited(),
                      ABORT_ACK_TIMEOUT - ABORT_SEEN_TIMEOUT)
        gone = survivors - job.reported(Report.ABORTED, old_gen)
        self._kill(gone, grace=0.5)
        if job.pending is not None:  # exits seen meanwhile belong to this failure
            gone |= job.take_pending().ranks  # type: ignore[union-attr]
        return gone

    def _decide(self, gen: int, lost: set[int], lost_nodes: set[int]) -> Decision | None:
        """Generation `gen`'s plan, from what the live agents hold (their inventories)."""
        job = self.job
        if self.strategy is Strategy.RESTART_DISK:
            return decide(self.strategy, job.members, lost, lost_nodes, {}, sorted(job.nodes), job.disk_step,
                          gen=gen)
        self._req += 1
        req = self._req
        live = job.live_nodes()
        for n in live:
            self.cluster.send(n, messages.InventoryRequest(req=req))
        self.cluster.wait_for(lambda: all((n, req) in job.inventories for n in live), 10.0, "inventory",
                              abandon_on_failure=False)
        invs: dict[int, Inventory] = {}
        for n in live:
            msg = job.inventories.get((n, req))
            if msg is None:
                continue
            peer = job.nodes[n].peer or ("", 0)
            invs[n] = Inventory(
                n, peer[0], peer[1],
                {int(r): frozenset(s) for r, s in msg.local.items()},
                {int(r): frozenset(s) for r, s in msg.replica.items()},
            )
        # Nodes that restarted hold nothing from before; count them as lost for the decision.
        return decide(self.strategy, job.members, lost, lost_nodes, invs, sorted(job.nodes), job.disk_step,
                      frozenset(job.bad_sources), gen=gen, replay=self.verify_restore, homes=job.away(lost))


def await_answers(cluster: Cluster, ranks: set[int], answered: Callable[[], set[int]], quiet_s: float) -> None:
    """Wait until every rank of `ranks` has answered, or none more has for `quiet_s`. With a
    thousand ranks the answers take longer than that to arrive one after another (each is a
    message the controller reads in turn), and a fixed limit would replace healthy ranks
    whose answers are still queued; a rank that never answers is given up `quiet_s` after
    the last one that did, as soon as with a handful."""
    deadline = time.monotonic() + ANSWERS_MAX_S
    while True:
        before = len(ranks & answered())
        cluster.wait_for(lambda: ranks <= answered() or len(ranks & answered()) != before, quiet_s,
                         "abort", abandon_on_failure=False)
        if ranks <= answered() or len(ranks & answered()) == before or time.monotonic() > deadline:
            return


def ahead_of_decision(job: JobState, lost: set[int], lost_nodes: set[int]) -> list[int]:
    """The lost ranks whose replacements start now, into the next generation, before the
    survivors have left the failed step and the plan is decided (DESIGN.md, One-step restoration, step 4): their
    start (the script's imports and model, a first look at the optimizer's sharded state) then
    runs while the survivors leave their step, instead of after the decision.

    Only where the decision cannot put the rank elsewhere: a rank with no process (its exit
    seen, or its node lost), at home on a node that lives (a lost node's ranks once `start_ahead`
    has placed them), with a warm template or spare there: a cold start would spend seconds of
    CPU beside the survivors on a replacement the decision may still not keep (`kept_ahead`)."""
    ranks = []
    for r in sorted(lost):
        node = job.members[r]
        st = job.nodes.get(node)
        at_home = job.home.get(r, node) == node or job.home.get(r) in lost_nodes
        if (r not in job.ahead and job.stopped(r) and st is not None and st.up and node not in lost_nodes
                and at_home and (st.template or st.spares > 0)):
            ranks.append(r)
    return ranks


def start_ahead(cluster: Cluster, job: JobState, lost: set[int], lost_nodes: set[int], gen: int) -> None:
    """Start the replacements `ahead_of_decision` picks, into generation `gen`. The lost nodes'
    ranks are placed first, as the decision would place them (`place`), when all of them are at
    home (its sources only matter for a rank away from home) and the backend holds no spare node
    (they would come back on it). A spare they take is taken off its node's count at once, as
    `place` counts them: a node lost meanwhile must not have its ranks placed on it too before
    its agent has said it has fewer."""
    on_lost = [r for r in sorted(lost) if job.members[r] in lost_nodes]
    if on_lost and all(job.home.get(r, job.members[r]) == job.members[r] for r in on_lost) and not cluster.spare_nodes():
        place(job, on_lost, lost_nodes, 0, cluster.has_gpu(), {})
        for r in on_lost:
            if job.members[r] not in lost_nodes:
                st = job.nodes[job.members[r]]
                st.spares_total = max(0, st.spares_total - 1)
    ranks = ahead_of_decision(job, lost, lost_nodes)
    if ranks:
        job.ahead.update({r: (gen, job.members[r]) for r in ranks})
        cluster.spawn_ahead(gen, ranks)


def kept_ahead(job: JobState, gen: int, lost_nodes: set[int]) -> set[int]:
    """Those of the replacements started ahead that generation `gen` keeps: started into it, on
    the node the decision places them on, alive or on their way."""
    return {r for r, (g, node) in job.ahead.items()
            if g == gen and node == job.members[r] and node not in lost_nodes and not job.stopped(r)}


def place(job: JobState, ranks: list[int], lost_nodes: set[int], spare_nodes: int, has_gpu: bool,
          sources: Mapping[int, Source]) -> None:
    """Ranks of a lost node go to warm spares on surviving nodes when there are any (no wait
    for the node to come back), or to surviving nodes whose worker template is warm when the
    hosts have no GPU (a CPU host can run another rank; a GPU host's devices are taken);
    otherwise they wait for the node's restarted agent, whose template must warm up first.
    While the backend holds spare nodes (a scheduler's idle hosts), a lost node's ranks stay
    with it: it comes back on a spare node, and the survivors keep their own load.

    A rank started again goes home first: to the node it was launched on, when that node is up
    and can start it warm (its template or a spare), or is being started again anyway. Without
    that, every node fault moves ranks onto the survivors and nothing moves them back: in a
    soak all four ranks of a 2 x 2 job ended up on one node, whose next fault left no copy of
    any of them but the disk checkpoint. A rank whose plan reads its own slot on another node
    (`sources`) stays there: that slot is in the other node's memory."""
    # The first lost nodes, as many as there are spare nodes, come back there (in the order
    # their agents are started again).
    ranks = [r for r in ranks if job.members[r] not in sorted(lost_nodes)[:spare_nodes]]
    for r in ranks:
        home = job.home.get(r, job.members[r])
        st = job.nodes.get(home)
        src = sources.get(r)
        if home == job.members[r] or (isinstance(src, LocalSlot) and src.node != home):
            continue
        warm = st is not None and st.up and home not in lost_nodes and (st.template or st.spares_total > 0)
        # A lost home is started again when a rank waits for it, as the rank's own lost node
        # would be; one still starting is waited for.
        waits = job.members[r] in lost_nodes and (home in lost_nodes or (st is not None and st.starting))
        if warm or waits:
            job.members[r] = home
    # A spare still warming up is further along than a node restart, so count it too.
    free = {n: st.spares_total for n, st in job.nodes.items() if st.up and n not in lost_nodes}
    if not has_gpu:
        for n, st in job.nodes.items():
            if n in free and st.template:
                free[n] = max(free[n], len(ranks))
    for r in ranks:
        if job.members[r] in lost_nodes and free:
            n = max(free, key=lambda k: (free[k], -k))
            if free[n] > 0:
                job.members[r] = n
                free[n] -= 1

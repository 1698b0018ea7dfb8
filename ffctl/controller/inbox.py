"""The controller's inbox: every report of the job's agents and ranks, checked, then acted on.

Each message on the controller's queue is decoded with every field checked (a bad one is refused
and recorded as `message_rejected`, never a crash) and handed to its handler, one per kind
(`Inbox.HANDLERS`, held to `messages.Kind` by a unit test). The handlers update `JobState` (who
runs where, what each generation's ranks reported, snapshots and checkpoints), record what the
run record keeps, and turn a rank's exit, an error in a step or a failed restore into a pending
failure for the recovery coordinator.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from ffctl.controller.barrier import ExitBarrier
from ffctl.controller.cluster import Record
from ffctl.controller.failures import Cause, Failure, RankFailure, error_and_tail
from ffctl.controller.fleet import Fleet
from ffctl.controller.injector import Injector
from ffctl.controller.plane import ControlPlane
from ffctl.controller.progress import StepReport
from ffctl.controller.restorecheck import RestoreCheck
from ffctl.controller.state import JobState, Report
from ffctl.controller.stragglers import Finding, Replace, StragglerDetector, Straggling
from ffctl.controller.watchdog import Watchdog
from recovery import disk
from wire import control, messages
from wire.fault_spec import FaultSpecError
from runs.events import EventKind


def _lines(value: Any, limit: int = 50) -> list[str]:
    """A list of text lines from a message field, bounded; anything else gives none."""
    if not isinstance(value, list):
        return []
    return [line[:500] for line in value[-limit:] if isinstance(line, str)]


def _of_open_generation(job: JobState, msg: messages.StepError) -> bool:
    """Whether `msg` comes from a rank of the open generation, on the node it was placed on,
    whether or not its agent's spawn report (its pid) has come. On a loaded host a rank failed
    in its first steps before that report, its error was dropped, and its exit, filed later than
    a peer's, lost the root cause to the peer it had brought down."""
    return msg.gen == job.gen and job.members.get(msg.rank) == msg.node


def _replaced(job: JobState, msg: messages.Message) -> int | None:
    """The node's current agent incarnation when `msg` comes from another one (its report is
    recorded, and nothing acted on); None for the current one's and a rank's.

    A recovery may start a node's agent again while the previous one still runs (it was still
    starting, or cut off by a partition), and that one may report before it sees it is stopped.
    Taken for the node's, its `agent_up` made its pid the one a kill-node kills (the node's real
    agent ran on and the fault was never seen, in a chaos soak), and its `spares` said the node
    held no template. Decided here, for every kind an agent sends, not in each handler."""
    incarnation: int | None = getattr(msg, "incarnation", None)
    if incarnation is None:  # a rank's report
        return None
    st = job.nodes.get(msg.node)  # type: ignore[attr-defined]  # every kind with an incarnation has one
    return None if st is None or incarnation == st.incarnation else st.incarnation


# Reports handed on as they come (kept out of the class, which reads in one sitting).
def _on_training(inbox: Inbox, msg: messages.Training) -> None:
    inbox.training_api = msg.api


def _on_silence(inbox: Inbox, msg: messages.Silent | messages.Output) -> None:
    inbox.barrier.heard(msg)


def _on_heartbeat(inbox: Inbox, msg: messages.Heartbeat) -> None:
    inbox.watchdog.heartbeat(msg)


def _on_revert_request(inbox: Inbox, msg: messages.RevertRequest) -> None:
    error = inbox.injector.revert_by_id(msg.fault_id, bool(msg.dry_run))
    reply = messages.InjectReply(req=msg.req, ok=error is None, fault_id=msg.fault_id, error=error,
                                 bad_input=error is not None or None)
    inbox.plane.reply(messages.inject_reply_key(msg.req), reply.to_dict())


class Inbox:
    def __init__(self, job: JobState, record: Record, plane: ControlPlane, fleet: Fleet, watchdog: Watchdog,
                 barrier: ExitBarrier, injector: Injector, stragglers: StragglerDetector,
                 announce: Callable[[str], None], checkpoints: Path | None, plain_script: bool,
                 straggler_policy: object) -> None:
        self.job = job
        self.record = record
        self.plane = plane
        self.fleet = fleet
        self.watchdog = watchdog
        self.barrier = barrier
        self.injector = injector
        self.stragglers = stragglers
        self.announce = announce
        self.checkpoints = checkpoints  # where complete disk checkpoints are marked; None: hosts' own dirs
        self.plain_script = plain_script
        self.straggler_policy = straggler_policy
        self.training_api: str | None = None  # what the ranks' library says (`training` message)
        self.restore_check = RestoreCheck(job, record, announce, lambda node: self.fleet.host(node))

    def handle(self, raw: dict[str, Any]) -> None:
        # Every field is checked before any is used: a sealed message from one of our own
        # processes with a bad value is still refused, never a crash.
        try:
            msg = messages.decode(raw, self.plane.limits)
        except messages.DecodeError as exc:
            self.plane.rejected(control.CTL_QUEUE, -1, exc.reason, json.dumps(raw)[:200].encode())
            return
        self.dispatch(msg)

    def dispatch(self, msg: messages.Message) -> None:
        current = _replaced(self.job, msg)
        if current is not None:
            inc, report = msg.incarnation, msg.to_dict()  # type: ignore[attr-defined]  # `_replaced` saw it
            if inc > current:  # the controller numbers them: no agent of ours says this
                self.plane.rejected(control.CTL_QUEUE, -1, f"{msg.kind.value}: agent incarnation {inc} of node "
                                    f"{report['node']}, which runs {current}", json.dumps(report)[:200].encode())
            else:
                self.record(EventKind.AGENT_STALE, t=time.time(), node=report["node"], incarnation=inc,
                            current=current, kind=msg.kind.value, report=report)
            return
        handler = self.HANDLERS.get(msg.kind)  # type: ignore[call-overload]
        if handler is None:
            # A valid message nobody here acts on is recorded, never dropped unseen.
            self.plane.rejected(control.CTL_QUEUE, -1, f"unhandled: no handler for {msg.kind.value!r}",
                                json.dumps(msg.to_dict())[:200].encode(), unhandled=True)
            return
        try:
            handler(self, msg)
        except (KeyError, ValueError, TypeError) as exc:
            self.plane.rejected(control.CTL_QUEUE, -1, f"{msg.kind.value}: {type(exc).__name__}: {exc}"[:200],
                                json.dumps(msg.to_dict())[:200].encode())

    # -- one handler per kind, each given its decoded message ----------------------------------
    def _on_step(self, msg: messages.Step) -> None:
        rep = StepReport(msg.gen, msg.step, msg.rank, None if msg.loss is None else float(msg.loss), float(msg.dt))
        if rep.gen == self.job.gen:
            self.job.last_progress = time.monotonic()
        replay = self.job.progress.check_replay(rep)
        if self.job.progress.report(rep):
            self.record(EventKind.STEP, t=time.time(), step=rep.step, loss=rep.loss,
                        step_time_s=rep.dt, gen=rep.gen, rank=rep.rank)
        if replay is not None:
            self.restore_check.replayed(replay)
        for finding in self.stragglers.report(msg.gen, msg.step, msg.rank, float(msg.dt),
                                              None if msg.wait is None else float(msg.wait), time.time()):
            self.straggler(finding)

    def straggler(self, f: Finding) -> None:
        """Record what the straggler detector found; under `--straggler replace`, fail the rank."""
        node = self.job.members.get(f.rank)
        if isinstance(f, Replace):
            self.announce(f"rank {f.rank} is {f.factor:.1f}x slower than the others: replaced (--straggler replace)")
            self.job.fail(Failure(Cause.STRAGGLER, {f.rank}, t=time.time(),
                                  detail=f"rank {f.rank} {f.factor:.1f}x slower than the median at step {f.step}"))
            return
        ids = self.injector.explain_straggler(f.rank, f.onset_t)
        if isinstance(f, Straggling):
            self.announce(f"straggler: rank {f.rank} (node {node}) is {f.factor:.1f}x slower since step {f.onset_step}")
            self.record(EventKind.STRAGGLER_DETECTED, rank=f.rank, node=node, gen=f.gen, factor=f.factor,
                        onset_step=f.onset_step, onset_t=f.onset_t, step=f.step,
                        policy=str(self.straggler_policy), fault_ids=ids)
        else:
            self.record(EventKind.STRAGGLER_ENDED, rank=f.rank, node=node, factor=f.factor, onset_step=f.onset_step,
                        last_step=f.last_step, steps=f.steps, onset_t=f.onset_t, end_t=f.end_t, lost_s=f.lost_s,
                        fault_ids=ids)

    def _on_agent_failed(self, msg: messages.AgentFailed) -> None:
        self.job.nodes[msg.node].failed = msg.reason

    def _on_agent_up(self, msg: messages.AgentUp) -> None:
        now = time.time()
        st = self.job.nodes[msg.node]  # the current incarnation's (`_replaced`)
        self.job.start_failures.pop(st.node, None)
        st.pid, st.peer, st.up = msg.pid, (msg.peer_address, int(msg.peer_port)), True  # type: ignore[arg-type]
        # Events stay stamped on receipt with our clock; the offset is what converts the
        # agent's own stamps. Measured NTP-style before the start (SSH hosts) when we can,
        # else estimated from this message (its latency counts as offset).
        measured = self.fleet.launcher.clock_offset(st.node)
        offset = float(measured) if measured is not None else float(msg.time) - now
        self.fleet.clock_offsets[st.node] = offset
        self.record(EventKind.AGENT_STARTED, t=now, node=st.node, host=msg.host, pid=st.pid,
                    clock_offset_s=offset, clock_offset_source="ntp" if measured is not None else "receipt",
                    agent_up_at=self.fleet.agent_time(st.node, float(msg.time)))
        st.hb_seen, st.hb_first = time.monotonic(), False
        st.up_at = st.hb_seen
        if self.job.phase != "starting":
            self.fleet.wire_ring()  # a node came back: it holds replicas again

    def _on_spares(self, msg: messages.Spares) -> None:
        st = self.job.nodes[msg.node]
        st.spares_total = msg.count if msg.total is None else msg.total
        if msg.count != st.spares or bool(msg.template) != st.template:
            # Whether the node's worker template is warm is on record too: a template that died
            # and was restarted shows as a gap, during which replacements start cold.
            st.spares, st.template = msg.count, bool(msg.template)
            self.record(EventKind.SPARES_HELD, t=time.time(), node=st.node, count=st.spares,
                        template=st.template)

    def _on_spawned(self, msg: messages.Spawned) -> None:
        for settled in [*(int(r) for r in msg.pids), *(msg.dropped or [])]:
            if self.job.spawning.get(settled, (None, None))[0] == msg.gen:
                del self.job.spawning[settled]
        for r, pid in msg.pids.items():
            self.job.pids[int(r)] = pid
        self.job.reports.add(Report.SPAWNED, msg.gen, (int(r) for r in msg.pids))
        for r, how in (msg.how or {}).items():
            self.job.started_by[(msg.gen, int(r))] = (how, (msg.start_s or {}).get(r))

    def _on_step_error(self, msg: messages.StepError) -> None:
        now = time.time()
        trace = _lines(msg.traceback)
        self.record(EventKind.RANK_EXITED, t=now, node=msg.node, rank=msg.rank, error=msg.error,
                    gen=msg.gen, reason="error-in-step", step=msg.step, traceback=trace)
        if self.job.pids.get(msg.rank) or _of_open_generation(self.job, msg):
            rf = RankFailure(msg.rank, msg.node, self.fleet.host(msg.node), now, step=msg.step,
                             step_exact=msg.step is not None, pid=self.job.pids.get(msg.rank),
                             error=msg.error or "", tail=trace)
            self.job.rank_failed[rf.rank] = rf
            self.job.fail(Failure("step-error", {rf.rank}, t=now, detail=str(msg.error),
                                  rank_failures={rf.rank: rf}))

    def _on_generation_report(self, msg: messages.Started | messages.Joined | messages.Done
                              | messages.AbortSeen) -> None:
        self.job.reports.add(Report(msg.kind.value), msg.gen, (msg.rank,))

    def _on_restored(self, msg: messages.Restored) -> None:
        self.job.reports.add(Report.RESTORED, msg.gen, (msg.rank,))
        if msg.how:
            self.job.restore_how.setdefault(msg.gen, {})[msg.rank] = msg.how
        if msg.loss is not None:
            self.job.restore_loss.setdefault(msg.gen, float(msg.loss))

    def _on_aborted(self, msg: messages.Aborted) -> None:
        self.job.reports.add(Report.ABORTED, msg.gen, (msg.rank,))
        self.job.reports.add(Report.SKIPPED_PRODUCTS, msg.gen, (msg.rank,) if msg.skipped else ())

    def _on_restore_failed(self, msg: messages.RestoreFailed) -> None:
        self.job.reports.add(Report.RESTORE_FAILED, msg.gen, (msg.rank,))
        # That copy is never offered again: the next decision picks another (a replica another
        # node holds of the same step, an older step) or disk.
        self.job.bad_sources.add((msg.rank, msg.step, msg.source, msg.holder or ""))
        # The detail names the copy refused: the report lists each one under the fault.
        at = f" at {msg.holder}" if msg.holder else ""
        self.job.fail(Failure("restore-failed", {msg.rank}, t=time.time(),
                              detail=f"rank {msg.rank}'s {msg.source.value} copy of step {msg.step}{at}: {msg.reason}"))

    def _on_ckpt(self, msg: messages.Ckpt) -> None:
        got = self.job.ckpt_reports.setdefault(msg.step, set())
        got.add(msg.rank)
        if len(got) == len(self.job.members):
            if self.checkpoints is not None:  # remote checkpoints: hosts' dirs
                disk.mark_complete(self.checkpoints, msg.step)
            self.job.disk_step = max(self.job.disk_step or 0, msg.step)
            self.record(EventKind.SNAPSHOT_TAKEN, t=time.time(), step=msg.step, kind="disk", ranks=sorted(got))
            if msg.loss is not None and msg.gen is not None:
                rep = StepReport(msg.gen, msg.step, msg.rank, float(msg.loss), float(msg.dt or 0.0))
                if self.job.progress.checkpointed(rep):
                    self.record(EventKind.STEP, t=time.time(), step=rep.step, loss=rep.loss,
                                step_time_s=rep.dt, gen=rep.gen, rank=rep.rank)

    def _on_replicated(self, msg: messages.Replicated) -> None:
        # Every agent says this about once a second: written without an fsync of its own (the
        # next event's covers it), else a thousand nodes cost a thousand fsyncs a second.
        self.record(EventKind.SNAPSHOT_TAKEN, t=time.time(), sync=False, step=msg.step, kind="memory",
                    node=msg.node, ranks=msg.ranks)
        self.fleet.protection.replicated(msg.node)

    def _on_inventory(self, msg: messages.Inventory) -> None:
        self.job.inventories[(msg.node, msg.req)] = msg

    def _on_agent_error(self, msg: messages.AgentError) -> None:
        # A command the agent accepted and could not carry out.
        self.record(EventKind.MESSAGE_REJECTED, t=time.time(), queue="agent", index=-1, node=msg.node,
                    reason=msg.error[:500], raw="")

    def _on_refusal(self, msg: messages.Refusal) -> None:
        # An agent or rank refused something it read (its queue, a plan, an abort flag).
        self.plane.rejected(msg.where[:200], -1 if msg.index is None else msg.index, msg.reason[:500],
                            (msg.raw or "")[:200], reported_by_node=msg.node,
                            **({"reported_by_rank": msg.rank} if msg.rank is not None else {}),
                            **({"unreported_before": msg.unreported} if msg.unreported else {}))

    def _on_fault_landed(self, msg: messages.FaultLanded) -> None:
        self.injector.landed(msg.rank, node=msg.node, gen=msg.gen, step=msg.step, phase=msg.phase)

    def _on_replicas_corrupted(self, msg: messages.ReplicasCorrupted) -> None:
        # Where a corrupt-snapshot copy=replica landed: the holder and the steps of its copies.
        self.record(EventKind.FAULT_LANDED, rank=msg.rank, node=msg.node, steps=msg.steps, where="replica")

    def _on_rank_exited(self, msg: messages.RankExited) -> None:
        now = time.time()
        rank, pid, code = msg.rank, msg.pid, msg.exitcode
        tail, err_tail = _lines(msg.log_tail), _lines(msg.err_tail)
        self.record(EventKind.RANK_EXITED, t=now, node=msg.node, rank=rank, pid=pid, exitcode=code,
                    gen=msg.gen, expected=bool(msg.expected), **({"log_tail": tail} if tail else {}),
                    **({"err_tail": err_tail} if err_tail else {}),
                    **({"error_file": msg.error} if msg.error else {}),
                    **({"stacks_file": msg.stacks_file} if msg.stacks_file else {}))
        self.barrier.exited(rank, tail, bool(msg.expected), _lines(msg.stacks, 200), msg.stacks_file)
        if self.job.pids.get(rank) != pid:
            return  # a process of an earlier generation, already replaced
        self.job.pids[rank] = None
        if msg.expected or rank in self.job.reported(Report.DONE, self.job.gen):
            return
        if code == 0 and (self.plain_script or not self._ever_announced(rank)):
            # A script without the recovery library has no other way to say it finished; and a
            # rank that ends cleanly without ever announcing itself (the library's `started`)
            # ran no library, whatever its source looked like.
            self.job.reports.add(Report.DONE, msg.gen, (rank,))
            return
        node = msg.node
        rf = self.job.rank_failed.get(rank)
        if rf is not None and rf.pid in (pid, None) and rf.exitcode is None:
            rf.pid, rf.exitcode = pid, code  # the end of the exception it reported: keep its traceback
            rf.tail = rf.tail or error_and_tail(tail, err_tail)[1]
        else:
            host = msg.host if msg.host is not None else self.fleet.host(node)
            error, shown = error_and_tail(tail, err_tail)
            rf = RankFailure(rank, node, host[:255], now, step=self._failing_step(rank), pid=pid,
                             exitcode=code, error=(msg.error or error)[:500], tail=shown)
            self.job.rank_failed[rank] = rf
        self.job.fail(Failure("process-exit", {rank}, t=now, detail=f"exit code {code}", rank_failures={rank: rf}))

    def _on_inject_request(self, msg: messages.InjectRequest) -> None:
        spec = msg.fault  # parsed by the decoder: what can still be wrong is the job's (a rank it lacks)
        try:
            if msg.dry_run:
                reply = messages.InjectReply(req=msg.req, ok=True, plan=self.injector.plan(spec).describe())
            else:
                fault, err = self.injector.inject(spec, raise_refused=True)
                reply = messages.InjectReply(req=msg.req, ok=err is None, error=err,
                                             fault_id=fault.fault_id if fault else None)
        except FaultSpecError as exc:
            reply = messages.InjectReply(req=msg.req, ok=False, error=str(exc), bad_input=True)
        self.plane.reply(messages.inject_reply_key(msg.req), reply.to_dict())

    # Every kind of report has its handler (a unit test holds this table to `messages.Kind`).
    HANDLERS: dict[messages.Kind, Callable[[Inbox, Any], None]] = {
        messages.Kind.STEP: _on_step,
        messages.Kind.STARTED: _on_generation_report,
        messages.Kind.JOINED: _on_generation_report,
        messages.Kind.RESTORED: _on_restored,
        messages.Kind.DONE: _on_generation_report,
        messages.Kind.ABORT_SEEN: _on_generation_report,
        messages.Kind.ABORTED: _on_aborted,
        messages.Kind.RESTORE_FAILED: _on_restore_failed,
        messages.Kind.ERROR: _on_step_error,
        messages.Kind.CKPT: _on_ckpt,
        messages.Kind.AGENT_FAILED: _on_agent_failed,
        messages.Kind.AGENT_UP: _on_agent_up,
        messages.Kind.AGENT_ERROR: _on_agent_error,
        messages.Kind.SPARES: _on_spares,
        messages.Kind.SPAWNED: _on_spawned,
        messages.Kind.RANK_EXITED: _on_rank_exited,
        messages.Kind.REPLICATED: _on_replicated,
        messages.Kind.INVENTORY: _on_inventory,
        messages.Kind.INJECT_REQUEST: _on_inject_request,
        messages.Kind.REVERT_REQUEST: _on_revert_request,
        messages.Kind.REJECTED: _on_refusal,
        messages.Kind.TRAINING: _on_training,
        messages.Kind.HEARTBEAT: _on_heartbeat,
        messages.Kind.FAULT_LANDED: _on_fault_landed,
        messages.Kind.REPLICAS_CORRUPTED: _on_replicas_corrupted,
        messages.Kind.SILENT: _on_silence,
        messages.Kind.OUTPUT: _on_silence,
    }

    def _ever_announced(self, rank: int) -> bool:
        """Whether the rank has spoken the library's protocol in any generation."""
        return self.job.reports.ever(rank, (Report.STARTED, Report.JOINED))

    def _failing_step(self, rank: int) -> int | None:
        """The step a rank that exited was most likely in: the one after its newest commit in this
        generation (or after the restore step). Unknown for a script that reports no steps."""
        if self.plain_script:
            return None
        return max(self.job.progress.restore_step, self.job.progress.everywhere([rank])) + 1

"""The event schema of a run record: one `Event` per line of `events.jsonl`.

Every fact of a run (fault injected, rank exited, snapshot taken, restore done, step committed)
is an event with a controller-clock timestamp `t` (seconds since the epoch) and a few fields.
Kinds are `str` enums so the JSON stays readable and stable.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable


class Label(str, Enum):
    """A `str` enum that is its value wherever a string is: printed, formatted, written to JSON,
    hashed (a dict keyed by the string finds the member and the other way round), so values read
    back from a record or a message compare and look up the same as the members."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    __hash__ = str.__hash__


class StepPhase(Label):
    """Where in its step a rank is, as a kill-rank with `phase=` aims at it: the step's start
    (forward), the backward pass, the step's first collective, the optimizer update, the step's
    snapshot."""

    FORWARD = "forward"
    BACKWARD = "backward"
    COLLECTIVE = "collective"
    OPTIMIZER = "optimizer"
    SNAPSHOT = "snapshot"


class EventKind(str, Enum):
    """What happened. The fields each kind carries are listed beside it."""

    RUN_STARTED = "run_started"  # world_size, strategy, nnodes, nproc_per_node, steps, seed
    AGENT_STARTED = "agent_started"  # node, host, pid, clock_offset_s
    # A report (`kind`, the whole of it in `report`) from an agent the controller has since
    # replaced by starting its node again (`incarnation` the stale one's, `current` the node's):
    # it is stopping and is not the node's agent, so nothing it said is acted on.
    AGENT_STALE = "agent_stale"  # node, incarnation, current, kind, report
    SPARES_HELD = "spares_held"  # node, count (warm spares now held on that node)
    STEP = "step"  # step, loss, step_time_s, gen, rank (the first rank to commit the step)
    SNAPSHOT_TAKEN = "snapshot_taken"  # step, kind ("memory" | "disk"), ranks
    FAULT_INJECTED = "fault_injected"  # fault_id, kind, target, ranks, nodes, at_step, emulated, breaks_job
    FAULT_REVERTED = "fault_reverted"  # fault_id; by, trigger, ok, exit when a dead man's switch did it
    FAULT_FAILED = "fault_failed"  # fault_id, error (the fault could not be applied)
    # fault_id, kind, target, trigger, reason: a fault asked for that never took effect before the
    # run ended (its trigger never came, it was held back behind others, or it was armed in a
    # rank and its step's phase never came); recorded at the run's end
    FAULT_MISSED = "fault_missed"
    # rank, node, gen, step, phase: an armed in-step fault (kill-rank with phase=) fired there,
    # as the rank said just before it killed itself
    FAULT_LANDED = "fault_landed"
    RANK_EXITED = "rank_exited"  # node, rank, pid, exitcode, gen; log_tail, err_tail (a failed rank's last lines of stdout, of stderr)
    # node, reason; starting (its agent ended, or was not up in time, while it started),
    # agent_error (its own word), restart_in_s (no rank waits for it: started again then)
    NODE_LOST = "node_lost"
    # node, silent_s: a node's heartbeat was silent past the limit while its agent, a running
    # process of the controller's own host and network, was not lost (the host's load)
    HEARTBEAT_LATE = "heartbeat_late"
    # node (None: a spare node), host, state, reason, by ("scheduler"): the scheduler took a
    # node's host out during the run (Slurm: DOWN, DRAIN, FAIL), as ffctl saw it
    NODE_STATE = "node_state"
    # signal, ranks, by ("scheduler"): a signal the launch received (a preemption notice such as
    # sbatch --signal=USR2@90) and passed on to the job's ranks
    SIGNAL_FORWARDED = "signal_forwarded"
    # fault_ids (the injected faults it is blamed on), cause, ranks, nodes, gen, summary (one line
    # per rank); failure_id ("d1", "d2", ...: every detected failure, numbered for the run);
    # onset_t, onset (when it began as far as the controller can tell, and how that is known:
    # "reported" (when the report of a rank's exit or error arrived, within 0.1 s of it),
    # "agent-exit", "last-heartbeat", "last-progress"); explained_by (the injected faults that
    # explain it: fault_ids, else those of the recovery it cut short; empty: the report makes it
    # a fault of kind `detected`)
    FAILURE_DETECTED = "failure_detected"
    # fault_ids, gen, restore_step, restore_source, strategy; failure_ids (every failure this
    # recovery handles, those that cut an earlier attempt short included); verify_until (with
    # --verify-restore: the newest step it could have restored, trained again to check)
    RECOVERY_DECIDED = "recovery_decided"
    RANKS_SPAWNED = "ranks_spawned"  # gen, ranks
    RENDEZVOUS_DONE = "rendezvous_done"  # gen
    RESTORE_DONE = "restore_done"  # gen, step, source, transfer, loss (the step's, as its copies recorded it)
    # gen, restore_step, until, verified (every rank's loss of every step trained again equal to
    # its loss before the fault), unchecked (ranks whose earlier loss never arrived): the check
    # of a --verify-restore recovery, once every rank has trained up to `until` again
    RESTORE_VERIFIED = "restore_verified"
    # gen, step, rank, node, restore_step, loss_before, loss_after: a step trained again after a
    # --verify-restore recovery gave the rank another loss than before the fault; the job stops
    RESTORE_DIVERGED = "restore_diverged"
    RECOVERY_FAILED = "recovery_failed"  # fault_ids, reason, root_cause, restarts, max_restarts, failure_ids
    RUN_FINISHED = "run_finished"  # status, steps_completed, reason; root_cause when it failed
    # gen, ranks (still running), finished (exited 0), waited_s, timeout_s: some ranks finished
    # and others linger (said once per generation; the exit barrier stops them at timeout_s)
    EXIT_BARRIER = "exit_barrier"
    # gen, ranks (each {rank, node, silent_s}), silent_s (the job's), timeout_s: no rank of a
    # script's job printed a line or committed a step for a while (said once per generation;
    # the job is stopped as hung at timeout_s, --silence-timeout)
    RANKS_SILENT = "ranks_silent"
    # queue (or key), index, reason, raw (short repr); node/rank when an agent or rank refused it
    MESSAGE_REJECTED = "message_rejected"
    # rank, node, gen, factor (its step time over what the step would have taken had it been as
    # fast as the others), onset_step, onset_t (when its first slow step began), step (the step
    # that made it known), policy, fault_ids (the injected slow-rank/slow-node faults that
    # explain it; empty: a fault of kind `detected`)
    STRAGGLER_DETECTED = "straggler_detected"
    # rank, node, factor (median over the slowdown), onset_step, last_step, steps, onset_t, end_t,
    # lost_s (what the others waited for it: its busy time beyond theirs, summed), fault_ids
    STRAGGLER_ENDED = "straggler_ended"
    # node, ranks, reason: from now on no other node holds a copy of these ranks' state (their
    # node has no ring neighbour up, or a new one without a copy yet): a loss of the node loses it;
    # said again, with the new list, when a recovery places more ranks on the node meanwhile
    PROTECTION_LOST = "protection_lost"
    # node, unprotected_s: the node's ring neighbour holds its ranks' copies again
    PROTECTION_RESTORED = "protection_restored"
    # lost (count), kinds ({kind: count}), first_t, last_t, error: events dropped while the runs
    # disk was full and more waited in memory than it may hold; written where they would have been
    RECORD_LOST = "record_lost"


class RunStatus(str, Enum):
    """How a run ended; `running` while no `run_finished` event exists."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    # No run_finished event and the controller is gone (SIGKILL, a crash of the host): the record
    # stops where it died. Decided when the record is read, never written as an event.
    INCOMPLETE = "incomplete"


class RestoreSource(Label):
    """Where a rank's state came from (`none`: a fresh start from step 0)."""

    LOCAL_MEMORY = "local-memory"
    PEER_MEMORY = "peer-memory"
    REPLICA = "replica"
    REPLICA_GROUP = "replica-group"  # sharded state healed from live ranks holding the same shards (HSDP)
    DISK = "disk"
    NONE = "none"
    SCRIPT = "script"  # an unchanged script restarted: it restores itself (its own checkpoint)


class RestoreHow(Label):
    """How a rank got the state of the restore step (`recovery.restore`)."""

    KEPT = "kept"  # its live state matched the step: it loaded nothing of it
    RECEIVED = "received"  # the slices it lacked came from ranks that kept theirs
    GATHERED = "gathered"  # no rank kept its state: every rank gathered every slice
    CONTINUED = "continued"  # kept, and it goes on with the step it was in (`Job._collective`)
    HEALED = "healed"  # its shards from a live replica of them (HSDP), checked against its copy
    LOADED = "loaded"  # its replicated state kept, its shards from its own copy


@dataclass(frozen=True)
class Event:
    """One line of events.jsonl."""

    kind: EventKind
    t: float
    data: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def to_json(self) -> str:
        # `event` and `t` first so a human tailing the file reads the essentials. The event's own
        # kind is `event`, so a fault's or snapshot's `kind` field never collides with it.
        return json.dumps({"event": self.kind.value, "t": self.t, **self.data}, sort_keys=False)

    @classmethod
    def from_json(cls, line: str) -> Event:
        raw = json.loads(line)
        kind = EventKind(raw.pop("event"))
        t = float(raw.pop("t"))
        return cls(kind=kind, t=t, data=raw)


def finish_reason(events: Iterable[Event]) -> str:
    """Why the run ended, in the controller's words ("" when it completed or is still running)."""
    reason = ""
    for ev in events:
        if ev.kind is EventKind.RUN_FINISHED:
            reason = str(ev.get("reason") or "")
    return reason

"""The controller's failure detectors that watch rather than listen: lost nodes and hangs.

A node is lost when its agent process exits or its heartbeat goes silent for longer than the
heartbeat timeout (longer while the job starts, and for an agent whose process runs on the
controller's own host and network, whose silence is that host's load), or when its agent exits or takes too long while
it starts; the heartbeat keys are read a share per pump, each once per period, so a thousand
nodes never hold up the messages. The job hangs when the
open generation commits no step for the hang limit. Each makes a failure pending in `JobState`;
the recovery coordinator takes it from there. (A rank's exit and an error in a step arrive as
messages: `ffctl.controller.inbox`.)
"""
from __future__ import annotations

import time

from ffctl.controller.cluster import Record
from ffctl.controller.failures import Cause, Failure
from ffctl.controller.plane import ControlPlane
from ffctl.controller.state import JobState, NodeState, Phase
from wire import control, messages
from runs.events import EventKind

STARTUP_HANG_S = 120.0
# How long an agent may take to say it is up (its host busy importing torch in every process).
AGENT_START_TIMEOUT = 60.0
# The wait before starting again a node whose agent ended before it was up, no rank waiting for
# it: doubled after each such start, up to the most.
START_RETRY_S = 1.0
START_RETRY_MAX_S = 30.0
STARTUP_HEARTBEAT_S = 10.0
# How long an agent may be silent while its process runs on the controller's own host and
# network (`AgentProcess.running_here`): nothing but this host's CPU lies between them, so a
# silence is the host's load (a chaos soak's four jobs on 2 cores held an agent's beats back for
# over a second right after a recovery, and a node that was fine was taken for lost). A stopped
# agent is lost at the usual limit; a wedged one stops beating after its own LOOP_STUCK_S and is
# lost this long after.
RUNNING_HERE_HEARTBEAT_S = 10.0
# How long an agent started again keeps the start-up limit while its worker template warms up.
RESTART_WARMUP_S = 30.0
# How often each node's heartbeat key is read (its agent beats every 0.2 s); with many nodes, at
# most one key per HEARTBEAT_READ_PER_NODE_S (0.2 s per key at 1,024 nodes: about 5,000 reads a
# second, a tenth of a core, where every 0.05 s would be 20,000 and more time than there is).
HEARTBEAT_READ_S = 0.05
HEARTBEAT_READ_PER_NODE_S = 0.0002


def wall(monotonic_t: float) -> float:
    """A `time.monotonic()` reading as wall-clock time (the record's clock)."""
    return time.time() - (time.monotonic() - monotonic_t)


class Watchdog:
    def __init__(self, job: JobState, plane: ControlPlane, record: Record, heartbeat_timeout: float,
                 hang_min_s: float, plain_script: bool, last_step: int | None = None) -> None:
        self.job = job
        # The job's last step where the controller knows it (the built-in workload's --steps;
        # a script's own loop decides, unknown here).
        self.last_step = last_step
        self.plane = plane
        self.record = record
        self.heartbeat_timeout = heartbeat_timeout
        self.hang_min_s = hang_min_s
        self.plain_script = plain_script  # reports no steps: no progress to judge
        # Heartbeat reads (`read_heartbeats`): reads earned and not made yet, when they were
        # last counted, and where on the ring of up nodes the next one is.
        self.hb_credit, self.hb_checked, self.hb_cursor = 0.0, 0.0, 0

    def check_nodes(self) -> None:
        now = time.monotonic()
        self.read_heartbeats(now)
        for n, st in self.job.nodes.items():
            if st.lost:
                continue
            if not st.up:
                self.check_starting(st, now)
                continue
            if st.proc.poll() is not None:
                st.declare_lost()
                self.record(EventKind.NODE_LOST, node=n, reason="agent-exit")
                self.job.fail(Failure(Cause.NODE_LOST, nodes={n}, since_what="agent-exit"))
                continue
            silent = now - st.hb_seen
            if silent > self.heartbeat_limit(st):
                if silent <= RUNNING_HERE_HEARTBEAT_S and st.proc.running_here():
                    st.hb_late = True  # recorded, with how long, at the beat that ends it
                    continue
                st.declare_lost()
                self.record(EventKind.NODE_LOST, node=n, reason="heartbeat")
                # It began with the silence: the last genuine beat is the failure's onset.
                self.job.fail(Failure(Cause.NODE_LOST, nodes={n}, since=wall(st.hb_seen),
                                      since_what="last-heartbeat"))

    def check_starting(self, st: NodeState, now: float) -> None:
        """A starting agent that exits, or is not up within AGENT_START_TIMEOUT, loses its node.
        A recovery waits for a starting agent rather than start it again, and one started after a
        recovery, its ranks elsewhere, is waited for by nobody: unwatched, its death left the node
        without an agent, holding no replicas, for the rest of the run.

        With ranks placed on it (the job's start, a recovery waiting for it) that is a failure.
        Without, no training waits for it: it is started again, each time twice as late as the
        last (START_RETRY_S up to START_RETRY_MAX_S), and no recovery is spent. As a failure, a
        node whose link was down failed again at once on every start, and four empty recoveries
        in half a second spent the job's restart budget and stopped it."""
        if st.proc.poll() is not None:
            reason = "agent-exit"
        elif now - st.started_at > AGENT_START_TIMEOUT:
            reason = "start-timeout"
        else:
            return
        st.declare_lost()
        delay: float | None = None  # ranks wait for it: a failure
        if self.job.phase is not Phase.STARTING and st.node not in self.job.members.values():
            tries = self.job.start_failures[st.node] = self.job.start_failures.get(st.node, 0) + 1
            delay = min(START_RETRY_MAX_S, START_RETRY_S * 2 ** (tries - 1))
            self.job.deferred_restarts[st.node] = now + delay
        self.record(EventKind.NODE_LOST, node=st.node, reason=reason, starting=True, agent_error=st.failed,
                    restart_in_s=delay)
        if delay is None:
            self.job.fail(Failure(Cause.NODE_LOST, nodes={st.node}, since_what=reason))

    def read_heartbeats(self, now: float) -> None:
        """Read the up nodes' heartbeat keys, each once per period, round the ring a share per
        pump: the reads are spread evenly, so a thousand nodes' keys never hold up the messages
        for tens of milliseconds at a time."""
        up = [st for st in self.job.nodes.values() if st.up]
        if not up:
            return
        period = max(HEARTBEAT_READ_S, HEARTBEAT_READ_PER_NODE_S * len(up))
        self.hb_credit = min(float(len(up)), self.hb_credit + len(up) * (now - self.hb_checked) / period)
        self.hb_checked = now
        reads = int(self.hb_credit)
        self.hb_credit -= reads
        for i in range(reads):
            st = up[(self.hb_cursor + i) % len(up)]
            st.hb_read_at = now
            self.read_heartbeat(st)
        self.hb_cursor = (self.hb_cursor + reads) % len(up)

    def read_heartbeat(self, st: NodeState) -> None:
        """Take the node's heartbeat key: a sealed beat of its current agent, newer than the last
        one, is a sign of life; anything else there is refused and recorded (once per value)."""
        store = self.plane.store
        assert store is not None
        key = control.heartbeat_key(st.node)
        raw = control.read(store, key)
        if raw is None or raw == st.hb_raw:
            return  # no beat yet, or none since the last read (a deleted key: its agent says so)
        st.hb_raw = raw
        try:
            beat = messages.Heartbeat.from_dict(self.plane.hb_opener.open(raw, key), self.plane.limits)
            if beat.node != st.node:
                raise messages.DecodeError(f"heartbeat of node {beat.node} under {key}")
            self.heartbeat(beat)
        except (control.Rejected, messages.DecodeError) as exc:
            self.plane.rejected(key, -1, exc.reason, raw)
        except (KeyError, ValueError) as exc:
            self.plane.rejected(key, -1, str(exc)[:200], raw)

    def heartbeat(self, msg: messages.Heartbeat) -> None:
        # From the node's key (`read_heartbeat`) or, while that key is written over, the queue;
        # sealed either way, and news only when newer than the last from its agent process.
        st = self.job.nodes[msg.node]
        if msg.incarnation > st.incarnation:
            raise ValueError(f"heartbeat of agent incarnation {msg.incarnation}, node {msg.node} "
                             f"runs {st.incarnation}")
        if msg.incarnation == st.incarnation and st.up:
            now = time.monotonic()
            if st.hb_late:
                st.hb_late = False
                self.record(EventKind.HEARTBEAT_LATE, node=msg.node, silent_s=round(now - st.hb_seen, 3))
            st.hb_seen, st.hb_first = now, True
        # (An older incarnation's beat is what the node's previous agent left in its key: no news.)

    def heartbeat_limit(self, st: NodeState) -> float:
        # While the job starts, every host imports torch in several processes at once and an
        # agent can be starved of CPU for more than a second; a node lost then costs nothing to
        # wait for, so allow a longer silence until the first step is committed. So for an agent
        # started again (a node back after a kill or a reboot) until its first beat: it starts
        # on a host busy with the recovery (every rank restoring, a template importing torch),
        # and taking it for lost a second after it said it was up (seen in a chaos run, again
        # and again) fails a recovery over a node that is fine. And after its first beat, for as
        # long as its template imports torch (at most RESTART_WARMUP_S): a chaos soak's host,
        # with three jobs' nodes coming back at once, held a new agent's beats back for over a
        # second then, and the recovery waiting for it stopped the job. One that dies meanwhile
        # is seen at once by its exit; one that hangs, by the longer limit.
        if (self.job.gen == 0 and not self.job.progress.started(0)) or not st.hb_first:
            return max(self.heartbeat_timeout, STARTUP_HEARTBEAT_S)
        # And once the last step is committed: every rank has trained it, its loss is in the
        # record, and the ranks are finishing (the last copies acknowledged, processes ending on
        # every node at once). A chaos soak's host, four jobs ending on 2 cores, held an agent's
        # beats back for 1.15 s there, and a recovery began for a job that had nothing left to
        # train. An agent that dies then is still seen at once by its exit.
        if self.last_step is not None and self.job.progress.committed_step >= self.last_step:
            return max(self.heartbeat_timeout, STARTUP_HEARTBEAT_S)
        if st.incarnation > 0 and not st.template and time.monotonic() - st.up_at < RESTART_WARMUP_S:
            return max(self.heartbeat_timeout, STARTUP_HEARTBEAT_S)
        return self.heartbeat_timeout

    def check_hang(self) -> None:
        if self.job.phase is not Phase.RUNNING or self.job.pending is not None or self.plain_script:
            return  # (a plain script reports no steps: no progress to judge)
        if not self.job.progress.started():
            limit = STARTUP_HANG_S
        else:
            limit = self.job.progress.hang_limit(self.hang_min_s)
        if time.monotonic() - self.job.last_progress > limit:
            self.job.fail(Failure(Cause.HANG, detail=f"no step progress for {limit:.1f}s",
                                  since=wall(self.job.last_progress), since_what="last-progress"))

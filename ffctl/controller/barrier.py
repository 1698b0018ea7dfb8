"""A job never waits forever: ranks lingering after their peers finished, and a script's job silent.

Two ways a job can stop making progress with nothing failing:

- The exit barrier: some ranks of the open generation exited 0 while others still run. Said on
  screen after a few seconds; once they have lingered `--exit-barrier-timeout` seconds (torchrun's
  agent's exit barrier, 300 s) they are stopped.
- Silence: no rank of a script's job has printed a line or committed a step for a while, and
  none has exited (the agents say when their ranks go quiet: ffctl.agent.silence). Said on
  screen after `SILENCE_NOTICE_S`; at `--silence-timeout` the job is stopped as hung.

Either way each rank still running is asked for its Python stacks first (kept beside its log),
then stopped, and the run fails with a root cause naming each rank, its last line and how long
it lingered or was silent, and pointing at its stacks.

States of a generation here: `running` -> `waiting` (some finished, or all silent; said once)
-> `stopped` (the run fails); `waiting` -> `running` when the generation changes, a recovery
starts, or (silence) a rank prints or steps again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ffctl.controller.cluster import FatalRun, Record
from ffctl.controller.state import JobState, Phase, Report
from ffctl.controller.watchdog import wall
from wire import messages
from runs.events import EventKind

# How long after some ranks finished (exit 0) the ones still running are named on screen.
EXIT_NOTICE_S = 5.0
# How long a script's job may be silent as a whole before it is named on screen.
SILENCE_NOTICE_S = 10.0
# How long the barrier waits, once it stopped lingering ranks, for their exits (and logs).
EXIT_STOP_WAIT_S = 15.0


def rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


@dataclass
class Stopped:
    """What a rank stopped by the barrier left: the end of its log and its stacks."""

    tail: list[str]
    stacks: list[str] = field(default_factory=list)
    stacks_file: str | None = None

    @property
    def last_line(self) -> str:
        return next((line for line in reversed(self.tail) if line.strip()), "")


class ExitBarrier:
    def __init__(self, job: JobState, timeout: float, record: Record, announce: Callable[[str], None],
                 send: Callable[[int, messages.Message], None], wait_for: Callable[..., bool],
                 host: Callable[[int], str], silence_timeout: float | None = None) -> None:
        self.job = job
        self.timeout = timeout
        # None: not watched (the built-in workload, whose steps the hang detector watches).
        self.silence_timeout = silence_timeout
        self.record = record
        self.announce = announce
        self.send = send
        self.wait_for = wait_for
        self.host = host
        # (gen, since when some of its ranks finished, whether that was said)
        self.waiting: tuple[int, float, bool] | None = None
        self.lingering: dict[int, Stopped | None] = {}  # rank stopped by the barrier -> what it left
        # Silence: node -> (gen, wall-clock time since when its ranks of gen printed nothing,
        # each rank's own since); the generation whose silence was said.
        self.silent: dict[int, tuple[int, float, dict[int, float]]] = {}
        self.silence_said: int | None = None

    # -- what the inbox hands over ------------------------------------------------------------
    def exited(self, rank: int, tail: list[str], expected: bool, stacks: list[str] | None = None,
               stacks_file: str | None = None) -> None:
        """A rank's exit: one the barrier stopped brings the end of its log (what it was doing)
        and the stacks it wrote before it was stopped."""
        if rank in self.lingering and expected:
            self.lingering[rank] = Stopped(tail, stacks or [], stacks_file)

    def heard(self, msg: messages.Silent | messages.Output) -> None:
        """A node's ranks went silent, or spoke again."""
        if isinstance(msg, messages.Silent):
            now = time.time()
            self.silent[msg.node] = (msg.gen, now - msg.silent_s,
                                     {int(r): now - s for r, s in msg.ranks.items()})
        else:
            self.silent.pop(msg.node, None)

    # -- the checks, each pump ----------------------------------------------------------------
    def check(self, world: set[int]) -> None:
        self.check_lingering(world)
        self.check_silence(world)

    def check_lingering(self, world: set[int]) -> None:
        """Some ranks of the generation finished (exit 0) while others still run: say so after
        a few seconds, and once they have lingered `exit_barrier_timeout` seconds stop them and
        fail the run naming them. A job never waits forever for a rank whose peers have nothing
        left to do with it."""
        job = self.job
        done = job.reported(Report.DONE, job.gen)
        if not done or world <= done or job.pending is not None:
            self.waiting = None
            return
        now = time.monotonic()
        if self.waiting is None or self.waiting[0] != job.gen:
            self.waiting = (job.gen, now, False)
        gen, since, said = self.waiting
        waited, limit = now - since, self.timeout
        left, finished = sorted(world - done), sorted(done)
        if not said and waited >= min(EXIT_NOTICE_S, limit):
            self.waiting = (gen, since, True)
            self.record(EventKind.EXIT_BARRIER, gen=gen, ranks=left, finished=finished, waited_s=round(waited, 3),
                        timeout_s=limit)
            self.announce(f"{rank_list(left)} still running {waited:.0f}s after {rank_list(finished)} "
                          f"finished: stopped at {limit:g}s (--exit-barrier-timeout)")
        if waited < limit:
            return
        error = (f"still running {waited:.0f}s after {rank_list(finished)} exited 0; stopped by the exit "
                 f"barrier (--exit-barrier-timeout {limit:g})")
        self.stop(left, "exit-barrier", error, {r: waited for r in left}, finished=finished,
                  headline=f"exit barrier: {rank_list(left)} still running {waited:.0f}s after the others finished")

    def silence(self, world: set[int]) -> tuple[float, dict[int, float]] | None:
        """How long the open generation has been silent as a whole (no rank printed, none
        stepped), and each rank's silence; None while any of its ranks speaks."""
        job = self.job
        if job.phase is not Phase.RUNNING or job.pending is not None or job.reported(Report.DONE, job.gen):
            return None
        nodes = {job.members[r] for r in world}
        heard = {n: self.silent.get(n) for n in nodes}
        if any(v is None or v[0] != job.gen for v in heard.values()):
            return None
        progress = wall(job.last_progress)  # a step (or the generation's start) is a sign of life
        since = max([progress, *(v[1] for v in heard.values() if v is not None)])
        now = time.time()
        each = {r: now - max(progress, t) for v in heard.values() if v is not None for r, t in v[2].items()}
        return now - since, each

    def check_silence(self, world: set[int]) -> None:
        """No rank of a script's job has printed or stepped for a while: say so after
        `SILENCE_NOTICE_S`, and at `--silence-timeout` stop every rank as hung."""
        if self.silence_timeout is None:
            return
        found = self.silence(world)
        if found is None:
            return
        silent_s, each = found
        limit, gen = self.silence_timeout, self.job.gen
        if self.silence_said != gen and silent_s >= min(SILENCE_NOTICE_S, limit):
            self.silence_said = gen
            ranks = [{"rank": r, "node": self.job.members[r], "silent_s": round(each.get(r, silent_s), 3)}
                     for r in sorted(world)]
            self.record(EventKind.RANKS_SILENT, gen=gen, ranks=ranks, silent_s=round(silent_s, 3), timeout_s=limit)
            self.announce(f"no output and no step from any rank for {silent_s:.0f}s ({rank_list(sorted(world))}): "
                          f"stopped as hung at {limit:g}s of silence (--silence-timeout)")
        if silent_s < limit:
            return
        error = (f"printed nothing and committed no step for {silent_s:.0f}s, nor did any other rank; "
                 f"stopped as hung (--silence-timeout {limit:g})")
        self.stop(sorted(world), "silence", error, {r: each.get(r, silent_s) for r in world},
                  headline=f"hang: no output and no step from any rank for {silent_s:.0f}s")

    # -- stopping -----------------------------------------------------------------------------
    def stop(self, left: list[int], cause_name: str, error: str, lingered: dict[int, float],
             headline: str, finished: list[int] | None = None) -> None:
        """Ask each rank of `left` for its stacks, stop it, and fail the run naming each one."""
        job = self.job
        self.lingering = {r: None for r in left}
        by_node: dict[int, list[int]] = {}
        for r in left:
            by_node.setdefault(job.members[r], []).append(r)
        for node, ranks in by_node.items():
            if job.nodes[node].up:
                self.send(node, messages.Kill(ranks=ranks, tail=True))
        self.wait_for(lambda: all(self.lingering[r] is not None for r in left), EXIT_STOP_WAIT_S,
                      cause_name, abandon_on_failure=False)
        each = []
        for r in left:
            got = self.lingering.get(r) or Stopped([])
            each.append({"rank": r, "node": job.members[r], "lingered_s": round(lingered[r], 3),
                         "last_line": got.last_line, "stacks_file": got.stacks_file})
        first = self.lingering.get(left[0]) or Stopped([])
        node = job.members[left[0]]
        summary = f"rank {left[0]} (node {node}): {error}; its last line: {first.last_line!r}"
        cause: dict[str, Any] = {
            "cause": cause_name, "t": time.time(), "rank": left[0], "node": node, "host": self.host(node),
            "ranks": left, "lingered_s": round(lingered[left[0]], 3), "last_line": first.last_line,
            "error": error, "summary": summary, "tail": first.tail[-20:], "stacks": first.stacks,
            "stacks_file": first.stacks_file, "lingering": each,
            "others": [f"rank {e['rank']} (node {e['node']}) {'silent' if cause_name == 'silence' else 'still running'} "
                       f"{e['lingered_s']:.0f}s, last line {e['last_line']!r}"
                       + (f", stacks in {e['stacks_file']}" if e["stacks_file"] else "") for e in each[1:]]}
        if finished is not None:
            cause["finished"] = finished
        raise FatalRun(headline, root_cause=cause)

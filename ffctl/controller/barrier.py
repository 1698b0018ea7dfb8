"""The exit barrier: a job never waits forever for a rank whose peers have finished.

Some ranks of the open generation exited 0 while others still run: said on screen after a few
seconds, and once they have lingered `--exit-barrier-timeout` seconds they are stopped (with the
end of their logs, which their agents send back) and the run fails naming them.
"""
from __future__ import annotations

import time
from typing import Callable

from ffctl.controller.cluster import FatalRun, Record
from ffctl.controller.state import JobState, Report
from wire import messages
from runs.events import EventKind

# How long after some ranks finished (exit 0) the ones still running are named on screen.
EXIT_NOTICE_S = 5.0
# How long the exit barrier waits, once it stopped lingering ranks, for their exits (and logs).
EXIT_STOP_WAIT_S = 15.0


_HEADERS = ("Thread 0x", "Current thread 0x")


def python_stacks(lines: list[str]) -> list[str]:
    """The last stack dump in `lines` (what `faulthandler` writes: a "Thread 0x..." or "Current
    thread 0x..." header per thread, each followed by its "  File ..." frames and a blank line),
    or nothing."""
    starts = [i for i, line in enumerate(lines) if line.startswith(_HEADERS)]
    if not starts:
        return []
    first = starts[-1]
    while first > 0 and (not lines[first - 1].strip() or lines[first - 1].startswith(("  File ", *_HEADERS))):
        first -= 1
    # Frames just above the dump may be another traceback's: the dump starts at a header.
    return lines[min(i for i in starts if i >= first):]


def rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class ExitBarrier:
    def __init__(self, job: JobState, timeout: float, record: Record, announce: Callable[[str], None],
                 send: Callable[[int, messages.Message], None], wait_for: Callable[..., bool],
                 host: Callable[[int], str]) -> None:
        self.job = job
        self.timeout = timeout
        self.record = record
        self.announce = announce
        self.send = send
        self.wait_for = wait_for
        self.host = host
        # (gen, since when some of its ranks finished, whether that was said)
        self.waiting: tuple[int, float, bool] | None = None
        self.lingering: dict[int, list[str] | None] = {}  # rank stopped by the barrier -> its log's end
        self.stacks: dict[int, list[str]] = {}  # ... and the Python stacks it wrote when stopped

    def exited(self, rank: int, tail: list[str], expected: bool, err_tail: list[str] | None = None) -> None:
        """A rank's exit: one the barrier stopped brings the end of its log (what it was doing)
        and of its stderr log, where it wrote its stacks before it was stopped."""
        if rank in self.lingering and expected:
            self.lingering[rank] = tail
            self.stacks[rank] = python_stacks(err_tail or []) or python_stacks(tail)

    def check(self, world: set[int]) -> None:
        """Some ranks of the generation finished (exit 0) while others still run: say so after
        a few seconds, and once they have lingered `exit_barrier_timeout` seconds stop them and
        fail the run naming them, with the end of their logs. A job never waits forever for a
        rank whose peers have nothing left to do with it."""
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
        self.lingering = {r: None for r in left}
        by_node: dict[int, list[int]] = {}
        for r in left:
            by_node.setdefault(job.members[r], []).append(r)
        for node, ranks in by_node.items():
            if job.nodes[node].up:
                self.send(node, messages.Kill(ranks=ranks, tail=True))
        self.wait_for(lambda: all(self.lingering[r] is not None for r in left), EXIT_STOP_WAIT_S,
                      "exit barrier", abandon_on_failure=False)
        rank = left[0]
        tail = self.lingering.get(rank) or []
        last = next((line for line in reversed(tail) if line.strip()), "")
        node = job.members[rank]
        error = (f"still running {waited:.0f}s after {rank_list(finished)} exited 0; stopped by the exit "
                 f"barrier (--exit-barrier-timeout {limit:g})")
        summary = f"rank {rank} (node {node}): {error}; its last line: {last!r}"
        cause = {"cause": "exit-barrier", "t": time.time(), "rank": rank, "node": node, "host": self.host(node),
                 "ranks": left, "finished": finished, "lingered_s": round(waited, 3), "last_line": last,
                 "error": error, "summary": summary, "tail": tail[-20:], "stacks": self.stacks.get(rank, []),
                 "others": [f"rank {r} (node {job.members[r]}) still running too" for r in left[1:]]}
        raise FatalRun(f"exit barrier: {rank_list(left)} still running {waited:.0f}s after the others finished",
                       root_cause=cause)

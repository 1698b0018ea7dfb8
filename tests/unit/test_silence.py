"""The silence detector in-process: the agent's look at its ranks' logs (a fake clock, real
files) and the controller's judgement over every node (a JobState and fakes of its boundary:
the record, the console, the agents' queues)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ffctl.agent.silence import SILENT_AFTER_S, OutputWatch
from ffctl.controller.barrier import SILENCE_NOTICE_S, ExitBarrier
from ffctl.controller.cluster import FatalRun
from ffctl.controller.state import JobState, NodeState, Phase, Report
from runs.events import EventKind
from wire import messages


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_an_agent_says_when_its_ranks_go_quiet_and_when_they_speak_again(tmp_path: Path) -> None:
    sent: list[tuple[type, dict[str, Any]]] = []
    clock = Clock()
    watch = OutputWatch(str(tmp_path), lambda kind, **f: sent.append((kind, f)), clock)
    live = {0: 0, 1: 0}
    (tmp_path / "0.log").write_text("epoch 0\n")
    watch.poll(live)
    for _ in range(int(SILENT_AFTER_S) - 1):  # rank 0 prints every second: never silent
        clock.t += 1.0
        with open(tmp_path / "0.log", "a") as fh:
            fh.write("epoch\n")
        watch.poll(live)
    assert sent == []
    clock.t += SILENT_AFTER_S + 0.5  # nobody prints
    watch.poll(live)
    clock.t += 3.0
    watch.poll(live)  # said once, not every look
    [(kind, fields)] = sent
    assert kind is messages.Silent and fields["gen"] == 0
    assert fields["silent_s"] == pytest.approx(SILENT_AFTER_S + 0.5)
    assert set(fields["ranks"]) == {"0", "1"}
    with open(tmp_path / "1.err", "a") as fh:  # stderr counts as output
        fh.write("warning\n")
    clock.t += 1.0
    watch.poll(live)
    assert sent[-1] == (messages.Output, {"gen": 0})
    # A new generation starts afresh: its ranks get their own silence, said again.
    clock.t += 1.0
    watch.poll({0: 1, 1: 1})
    clock.t += SILENT_AFTER_S + 1.0
    watch.poll({0: 1, 1: 1})
    assert sent[-1][0] is messages.Silent and sent[-1][1]["gen"] == 1


class Fakes:
    def __init__(self) -> None:
        self.events: list[tuple[EventKind, dict[str, Any]]] = []
        self.said: list[str] = []
        self.sent: list[tuple[int, messages.Message]] = []
        self.barrier: ExitBarrier | None = None

    def record(self, kind: EventKind, /, t: float | None = None, **data: Any) -> None:
        self.events.append((kind, data))

    def send(self, node: int, msg: messages.Message) -> None:
        self.sent.append((node, msg))
        assert isinstance(msg, messages.Kill) and msg.tail  # asked for their stacks
        assert self.barrier is not None
        for r in msg.ranks:  # each agent reports the exit with the log's end and the stacks
            self.barrier.exited(r, [f"rank {r} done", ""], True, [f"Current thread of rank {r}"], f"logs/{node}/{r}.stacks")

    def wait_for(self, cond: Any, timeout: float, what: str, abandon_on_failure: bool = True) -> bool:
        return bool(cond())


def _barrier(silence_timeout: float | None) -> tuple[ExitBarrier, JobState, Fakes]:
    job = JobState.for_world(4, 2)
    job.nodes = {n: NodeState(n, None, up=True) for n in (0, 1)}  # type: ignore[arg-type]  # no agent process here
    job.phase = Phase.RUNNING
    fakes = Fakes()
    barrier = ExitBarrier(job, 300.0, fakes.record, fakes.said.append, fakes.send, fakes.wait_for,
                          lambda n: f"host{n}", silence_timeout)
    fakes.barrier = barrier
    return barrier, job, fakes


def _silent(node: int, gen: int, seconds: float) -> messages.Silent:
    ranks = {str(r): seconds for r in (2 * node, 2 * node + 1)}
    return messages.Silent(node=node, gen=gen, silent_s=seconds, ranks=ranks)


def test_a_job_silent_on_every_node_is_said_then_stopped_naming_every_rank() -> None:
    barrier, job, fakes = _barrier(60.0)
    world = set(job.members)
    job.last_progress = time.monotonic() - 1000  # the generation opened long ago
    barrier.heard(_silent(0, 0, 30.0))
    barrier.check(world)
    assert fakes.events == []  # node 1 still speaks
    barrier.heard(_silent(1, 0, SILENCE_NOTICE_S + 1))
    barrier.check(world)
    barrier.check(world)
    [(kind, data)] = fakes.events
    assert kind is EventKind.RANKS_SILENT and data["timeout_s"] == 60.0
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert data["silent_s"] == pytest.approx(SILENCE_NOTICE_S + 1, abs=1)
    assert len(fakes.said) == 1 and "--silence-timeout" in fakes.said[0]
    # A rank speaks again: no longer silent; then quiet again past the limit: stopped.
    barrier.heard(messages.Output(node=1, gen=0))
    barrier.check(world)
    assert fakes.sent == []
    barrier.heard(_silent(1, 0, 59.0))
    barrier.check(world)
    assert fakes.sent == []  # node 0 has been silent longer, but the job only as long as node 1
    barrier.heard(_silent(1, 0, 61.0))
    barrier.heard(_silent(0, 0, 70.0))
    with pytest.raises(FatalRun) as failed:
        barrier.check(world)
    cause = failed.value.root_cause
    assert cause is not None and cause["cause"] == "silence" and cause["ranks"] == [0, 1, 2, 3]
    assert [e["last_line"] for e in cause["lingering"]] == [f"rank {r} done" for r in range(4)]
    assert [e["stacks_file"] for e in cause["lingering"]] == [f"logs/{r // 2}/{r}.stacks" for r in range(4)]
    assert all(e["lingered_s"] >= 60.0 for e in cause["lingering"])
    assert cause["stacks"] == ["Current thread of rank 0"]
    assert sorted(node for node, _ in fakes.sent) == [0, 1]


def test_a_step_an_older_generation_a_recovery_or_a_finished_rank_is_no_silence() -> None:
    barrier, job, fakes = _barrier(20.0)
    world = set(job.members)
    job.last_progress = time.monotonic() - 1000
    for node in (0, 1):
        barrier.heard(_silent(node, 0, 100.0))
    job.last_progress = time.monotonic() - 5  # a step 5 s ago: silent only since then
    barrier.check(world)
    assert fakes.sent == [] and fakes.events == []
    job.last_progress = time.monotonic() - 1000
    job.gen = 1  # the silences were the previous generation's
    barrier.check(world)
    job.gen = 0
    job.phase = Phase.RECOVERING
    barrier.check(world)
    job.phase = Phase.RUNNING
    job.reports.add(Report.DONE, 0, (0,))  # one rank finished: the exit barrier's business
    barrier.check(world)
    assert fakes.sent == [] and not any(k is EventKind.RANKS_SILENT for k, _ in fakes.events)


def test_the_built_in_workload_is_not_watched_for_silence() -> None:
    barrier, job, fakes = _barrier(None)
    job.last_progress = time.monotonic() - 1000
    for node in (0, 1):
        barrier.heard(_silent(node, 0, 5000.0))
    barrier.check(set(job.members))
    assert fakes.sent == [] and fakes.events == []

"""Opening and awaiting a generation (`ffctl.controller.generations`) against fakes of the
control plane and the agents: what is sent, and when a phase counts as done."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ffctl.controller.generations import Generations
from ffctl.controller.state import JobState, Report
from ffctl.launch_spec import LaunchSpec
from wire import messages
from runs.events import EventKind, RestoreSource


class Plane:
    port = 29400

    def __init__(self) -> None:
        self.published: list[int] = []

    def publish(self, gen: int, plan: Any) -> None:
        self.published.append(gen)

    def rendezvous_port(self, gen: int) -> int:
        return 0


class Launcher:
    run_dir = None

    def has_gpu(self) -> bool:
        return False


def _generations(tmp_path: Path, job: JobState,
                 on_wait: Callable[[str, Callable[[], bool]], None]) -> tuple[Generations, list[Any], list[Any]]:
    """Generations over fakes; `on_wait(what, cond)` plays the messages that arrive during each wait."""
    sent: list[tuple[int, messages.Message]] = []
    recorded: list[tuple[EventKind, dict[str, Any]]] = []

    def wait_for(cond: Callable[[], bool], timeout: float, what: str, abandon_on_failure: bool = True) -> bool:
        on_wait(what, cond)
        return cond()

    gens = Generations(LaunchSpec(), job, Launcher(), Plane(), lambda n, m: sent.append((n, m)),  # type: ignore[arg-type]
                       wait_for, lambda kind, t=None, **data: recorded.append((kind, data)), "run1", tmp_path,
                       plain_script=False, max_restarts=3)
    return gens, sent, recorded


def test_a_rank_started_ahead_is_not_spawned_again_and_is_recorded_as_such(tmp_path: Path) -> None:
    job = JobState.for_world(4, 2)
    gens, sent, recorded = _generations(tmp_path, job, lambda what, cond: None)
    gens.spawn(1, [1])  # ahead of the plan
    gens.open(1, None, [1, 3], ahead=frozenset({1}))
    assert [(n, [r["rank"] for r in m.ranks]) for n, m in sent if isinstance(m, messages.Spawn)] == [(0, [1]), (1, [3])]
    job.spawning.clear()
    job.reports.add(Report.STARTED, 1, [1, 3])
    job.reports.add(Report.JOINED, 1, [0, 1, 2, 3])
    gens.await_running(1, [1, 3], 0, RestoreSource.NONE)
    (spawned,) = [data for kind, data in recorded if kind is EventKind.RANKS_SPAWNED]
    assert spawned["started_ahead"] == [1] and spawned["ranks"] == [1, 3]


def test_a_started_said_by_a_replacement_stopped_before_the_generation_opened_does_not_count(tmp_path: Path) -> None:
    # Rank 1's replacement, started ahead, said `started` into generation 1 and was stopped (its
    # node was lost meanwhile); its successor is asked for: the spawn phase is not over on the
    # stopped one's word, only once the agent says it started the successor.
    job = JobState.for_world(4, 2)
    job.reports.add(Report.STARTED, 1, [1])
    seen: list[bool] = []

    def on_wait(what: str, cond: Callable[[], bool]) -> None:
        if what == "spawn":
            seen.append(cond())
            del job.spawning[1]  # the agent's `spawned`
            job.pids[1] = 4242
            seen.append(cond())
            job.reports.add(Report.JOINED, 1, [0, 1, 2, 3])

    gens, _, _ = _generations(tmp_path, job, on_wait)
    gens.open(1, None, [1])
    gens.await_running(1, [1], 0, RestoreSource.NONE)
    assert seen == [False, True]

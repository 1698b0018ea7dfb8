"""A small builder for hand-written event streams, for metrics and report tests.

The builder keeps a controller clock `t` that only moves forward. Every method appends one event
at the current clock (after advancing it by `dt`) and returns that event, so a test can read the
timestamps it needs for its expectations back from the events themselves:

    b = StreamBuilder(start=1000.0)
    b.run_started(world_size=4, strategy="peer")
    b.steps(1, 25)                       # 25 steps of 0.5 s each, generation 0
    inj = b.fault_injected("f1", at_step=25, dt=0.25)
    ...
    metrics = compute("r1", b.events)

Times are multiples of powers of two by default, so sums of them are exact in binary floats.
"""
from __future__ import annotations

from typing import Any, Iterable

from runs.events import Event, EventKind

STEP_TIME_S = 0.5


def loss_at(step: int, gen: int = 0) -> float:
    """A deterministic, non-round loss for `step` as generation `gen` computes it.

    Different generations give different values so a test can tell which commit of a step the
    metrics kept.
    """
    return 10.0 / (step + 3) + gen / 7.0


class StreamBuilder:
    """Appends events to `events` on a monotonic controller clock."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.events: list[Event] = []

    # -- generic -----------------------------------------------------------------------------

    def wait(self, dt: float) -> float:
        """Advance the clock by `dt` seconds without an event; returns the new time."""
        if dt < 0:
            raise ValueError("the controller clock never goes back")
        self.t += dt
        return self.t

    def emit(self, event_kind: EventKind, dt: float = 0.0, /, **data: Any) -> Event:
        """Append an event `dt` seconds after the previous one (data may have its own `kind`)."""
        self.wait(dt)
        event = Event(kind=event_kind, t=self.t, data=data)
        self.events.append(event)
        return event

    # -- run lifecycle -----------------------------------------------------------------------

    def run_started(
        self,
        world_size: int = 4,
        strategy: str = "peer",
        nnodes: int = 2,
        steps: int = 100,
        seed: int = 0,
        dt: float = 0.0,
        **data: Any,
    ) -> Event:
        return self.emit(
            EventKind.RUN_STARTED,
            dt,
            world_size=world_size,
            strategy=strategy,
            nnodes=nnodes,
            nproc_per_node=max(1, world_size // max(1, nnodes)),
            steps=steps,
            seed=seed,
            **data,
        )

    def run_finished(self, status: Any = "completed", dt: float = 0.0, **data: Any) -> Event:
        return self.emit(EventKind.RUN_FINISHED, dt, status=status, **data)

    def spares_held(self, node: int, count: int, dt: float = 0.0) -> Event:
        return self.emit(EventKind.SPARES_HELD, dt, node=node, count=count)

    # -- training ----------------------------------------------------------------------------

    def step(
        self,
        step: int,
        gen: int = 0,
        loss: float | None = None,
        step_time_s: float = STEP_TIME_S,
        rank: int = 0,
    ) -> Event:
        """Commit `step`: the clock moves by the step's time, then the event is written."""
        return self.emit(
            EventKind.STEP,
            step_time_s,
            step=step,
            loss=loss_at(step, gen) if loss is None else loss,
            step_time_s=step_time_s,
            gen=gen,
            rank=rank,
        )

    def steps(
        self, first: int, last: int, gen: int = 0, step_time_s: float = STEP_TIME_S
    ) -> list[Event]:
        """Commit steps first..last (inclusive), each taking `step_time_s`."""
        return [self.step(s, gen=gen, step_time_s=step_time_s) for s in range(first, last + 1)]

    def snapshot(self, step: int, kind: str = "disk", ranks: Iterable[int] = (), dt: float = 0.0) -> Event:
        return self.emit(EventKind.SNAPSHOT_TAKEN, dt, step=step, kind=kind, ranks=list(ranks))

    # -- faults and recovery -----------------------------------------------------------------

    def fault_injected(
        self,
        fault_id: str,
        at_step: int,
        kind: Any = "kill-rank",
        target: str = "rank:1",
        ranks: Iterable[int] = (1,),
        nodes: Iterable[int] = (0,),
        emulated: bool = False,
        dt: float = 0.0,
        **extra: Any,
    ) -> Event:
        return self.emit(
            EventKind.FAULT_INJECTED,
            dt,
            fault_id=fault_id,
            kind=kind,
            target=target,
            ranks=list(ranks),
            nodes=list(nodes),
            at_step=at_step,
            emulated=emulated,
            **extra,
        )

    def fault_reverted(self, fault_id: str, dt: float = 0.0) -> Event:
        return self.emit(EventKind.FAULT_REVERTED, dt, fault_id=fault_id)

    def rank_exited(self, rank: int, gen: int, node: int = 0, exitcode: int = -9, dt: float = 0.0) -> Event:
        return self.emit(EventKind.RANK_EXITED, dt, node=node, rank=rank, pid=4242, exitcode=exitcode, gen=gen)

    def failure_detected(
        self,
        fault_ids: Iterable[str],
        gen: int,
        cause: str = "exit",
        ranks: Iterable[int] = (1,),
        nodes: Iterable[int] = (0,),
        dt: float = 0.0,
    ) -> Event:
        return self.emit(
            EventKind.FAILURE_DETECTED,
            dt,
            fault_ids=list(fault_ids),
            cause=cause,
            ranks=list(ranks),
            nodes=list(nodes),
            gen=gen,
        )

    def recovery_decided(
        self,
        fault_ids: Iterable[str],
        gen: int,
        restore_step: int,
        restore_source: Any = "peer-memory",
        strategy: str = "peer",
        dt: float = 0.0,
        **fields: Any,
    ) -> Event:
        return self.emit(
            EventKind.RECOVERY_DECIDED,
            dt,
            fault_ids=list(fault_ids),
            gen=gen,
            restore_step=restore_step,
            restore_source=restore_source,
            strategy=strategy,
            **fields,
        )

    def ranks_spawned(self, gen: int, ranks: Iterable[int] = (1,), dt: float = 0.0) -> Event:
        return self.emit(EventKind.RANKS_SPAWNED, dt, gen=gen, ranks=list(ranks))

    def rendezvous_done(self, gen: int, dt: float = 0.0) -> Event:
        return self.emit(EventKind.RENDEZVOUS_DONE, dt, gen=gen)

    def restore_done(self, gen: int, step: int, source: Any = "peer-memory", dt: float = 0.0) -> Event:
        return self.emit(EventKind.RESTORE_DONE, dt, gen=gen, step=step, source=source)

    def recovery_failed(self, fault_ids: Iterable[str], reason: str = "no state left", dt: float = 0.0) -> Event:
        return self.emit(EventKind.RECOVERY_FAILED, dt, fault_ids=list(fault_ids), reason=reason)

    def recovery(
        self,
        fault_ids: Iterable[str],
        gen: int,
        restore_step: int,
        restore_source: Any = "peer-memory",
        strategy: str = "peer",
        decide_s: float = 0.25,
        spawn_s: float = 1.0,
        rendezvous_s: float = 0.5,
        restore_s: float = 0.25,
    ) -> dict[str, Event]:
        """decided, spawned, rendezvous and restore events of generation `gen`, in that order."""
        ids = list(fault_ids)
        return {
            "decided": self.recovery_decided(ids, gen, restore_step, restore_source, strategy, dt=decide_s),
            "spawned": self.ranks_spawned(gen, dt=spawn_s),
            "rendezvous": self.rendezvous_done(gen, dt=rendezvous_s),
            "restored": self.restore_done(gen, restore_step, restore_source, dt=restore_s),
        }

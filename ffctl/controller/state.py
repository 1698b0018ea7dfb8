"""The job's state as the controller knows it: one object, owned by the controller, read and
updated by its message handlers, the recovery coordinator and the fault scheduler.

Which node each rank runs on and under which pid, each agent's health, the open generation and
what its ranks reported (started, joined, restored, aborted, done), the agents' snapshot
inventories, copies found corrupt, the newest complete disk checkpoint, the pending failure and
the controller's phase. Plain data: no store, no process, so a test can build one in a line.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable
from ffctl.backends.protocol import AgentProcess
from ffctl.controller.failures import Failure, RankFailure
from ffctl.controller.progress import Progress
from wire import messages
from runs.events import Label, RestoreHow, RestoreSource


class Phase(Label):
    """The controller's phase, shown live and in the final view.

    Transitions (`TRANSITIONS`): `starting` -> `running` once generation 0 is open;
    `running` -> `recovering` when a failure is pending; `recovering` -> `running` once the next
    generation runs (a failure during a recovery restarts it without leaving `recovering`);
    any phase -> `completed`, `failed` or `interrupted` (the run's status) when the run ends.
    """

    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


_ENDS = {Phase.COMPLETED, Phase.FAILED, Phase.INTERRUPTED}
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.RUNNING} | _ENDS),
    Phase.RUNNING: frozenset({Phase.RECOVERING} | _ENDS),
    Phase.RECOVERING: frozenset({Phase.RUNNING} | _ENDS),
    Phase.COMPLETED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.INTERRUPTED: frozenset(),
}


class Report(Label):
    """What a rank says about a generation, as the ledger files it (each a message kind of its
    own, `spawned` its agent's): the steps of a generation starting, ending or being given up."""

    SPAWNED = "spawned"  # its agent started the process (all a plain script ever says)
    STARTED = "started"  # the library is up, ready to join
    JOINED = "joined"
    RESTORED = "restored"
    ABORT_SEEN = "abort_seen"  # its abort watcher saw the flag
    ABORTED = "aborted"  # it has left the generation
    # ... and its failed step ran without its matrix products (`skipped` in its `aborted`)
    SKIPPED_PRODUCTS = "skipped_products"
    RESTORE_FAILED = "restore_failed"
    DONE = "done"


@dataclass
class Ledger:
    """Which ranks sent which report in which generation. Kinds are checked (`Report`): a
    misspelt one is a ValueError, never a set nobody ever fills."""

    _ranks: dict[tuple[Report, int], set[int]] = field(default_factory=dict)

    def add(self, kind: Report | str, gen: int, ranks: Iterable[int]) -> None:
        self._ranks.setdefault((Report(kind), gen), set()).update(ranks)

    def ranks(self, kind: Report | str, gen: int) -> set[int]:
        """The ranks that sent `kind` in `gen` (a copy: adding goes through `add`)."""
        return set(self._ranks.get((Report(kind), gen), ()))

    def ever(self, rank: int, kinds: Iterable[Report | str]) -> bool:
        """Whether `rank` sent any of `kinds` in any generation."""
        wanted = {Report(k) for k in kinds}
        return any(rank in ranks for (kind, _), ranks in self._ranks.items() if kind in wanted)


@dataclass
class NodeState:
    node: int
    proc: AgentProcess
    incarnation: int = 0  # how many times the node's agent was started before this one
    pid: int = 0
    peer: tuple[str, int] | None = None
    # A node's agent is starting (neither), up (said so), or lost (exited or went silent, or a
    # recovery counted it lost): starting -> up -> lost, or starting -> lost. A node started
    # again is a new NodeState, starting. A starting agent is not lost: a recovery waits for it
    # rather than starting it again (see `starting`).
    up: bool = False
    lost: bool = False
    started_at: float = field(default_factory=time.monotonic)  # when this incarnation was started
    hb_raw: bytes | None = None  # the heartbeat key's value as last read
    hb_read_at: float = 0.0  # when it was last read (monotonic)
    hb_seen: float = field(default_factory=time.monotonic)  # the last genuine, newer beat
    hb_first: bool = False  # its current agent has beaten at least once
    hb_late: bool = False  # silent past the limit while its process ran here (recorded at the next beat)
    up_at: float = 0.0  # when its current agent said it was up (monotonic)
    spares: int = -1  # warm (torch imported) spares
    spares_total: int = 0  # including those still warming up
    template: bool = False  # its worker template is warm: it starts a replacement in milliseconds
    failed: str = ""  # why the agent gave up starting (its own words)

    @property
    def starting(self) -> bool:
        """Started and not yet up, nor lost meanwhile."""
        return not self.up and not self.lost

    def declare_lost(self) -> None:
        self.up, self.lost = False, True


@dataclass
class JobState:
    members: dict[int, int]  # rank -> the node it runs on
    pids: dict[int, int | None]  # rank -> its live process, None while it has none
    # rank -> (gen, node): asked to start there, not yet said started (or dropped) by the agent.
    # An agent holds a spawn while its template warms up: a rank in here may start any time.
    spawning: dict[int, tuple[int, int]] = field(default_factory=dict)
    # rank -> (gen, node): a replacement started before generation `gen`'s plan was decided, on
    # the node its predecessor ran on (`coordinator.ahead_of_decision`); it waits for the plan.
    # Until the generation opens it is no survivor to wait for, and not started again.
    ahead: dict[int, tuple[int, int]] = field(default_factory=dict)
    nodes: dict[int, NodeState] = field(default_factory=dict)
    gen: int = 0
    phase: Phase = Phase.STARTING
    progress: Progress = field(default_factory=Progress)
    last_progress: float = field(default_factory=time.monotonic)  # when the open generation last moved
    reports: Ledger = field(default_factory=Ledger)  # what each generation's ranks reported
    restore_how: dict[int, dict[int, RestoreHow]] = field(default_factory=dict)  # gen -> rank -> kept | received | ...
    restore_loss: dict[int, float] = field(default_factory=dict)  # gen -> the restore step's loss, as a copy recorded it
    # (gen, rank) -> how its worker started (spare | template | cold) and the agent's seconds
    started_by: dict[tuple[int, int], tuple[str, float | None]] = field(default_factory=dict)
    ckpt_reports: dict[int, set[int]] = field(default_factory=dict)  # step -> ranks that wrote it
    disk_step: int | None = None  # the newest complete disk checkpoint
    # (rank, step, source kind, holder) copies found corrupt; the holder is a replica's snapshot
    # channel ("address:port"), "" for a local slot: another node's copy of that step stays usable.
    bad_sources: set[tuple[int, int, RestoreSource, str]] = field(default_factory=set)
    inventories: dict[tuple[int, int], messages.Inventory] = field(default_factory=dict)  # (node, req) -> answer
    pending: Failure | None = None  # detected, not yet taken by the coordinator
    rank_failed: dict[int, RankFailure] = field(default_factory=dict)  # rank -> its newest failure
    deferred_restarts: dict[int, float] = field(default_factory=dict)  # node -> when to restart its agent
    # node -> its agent's starts in a row that ended before it was up (with no rank waiting for
    # it): the next start waits twice as long as the last (`Watchdog.check_starting`)
    start_failures: dict[int, int] = field(default_factory=dict)
    # rank -> the node it was launched on: a rank moved elsewhere by a node fault goes back there
    # when it is started again (`coordinator.place`). Empty: every rank is at home.
    home: dict[int, int] = field(default_factory=dict)

    @classmethod
    def for_world(cls, world_size: int, nproc_per_node: int) -> JobState:
        members = {r: r // nproc_per_node for r in range(world_size)}
        return cls(members=members, pids={r: None for r in members}, home=dict(members))

    def stopped(self, rank: int) -> bool:
        """Whether `rank` has no process and none on its way (the next generation may open)."""
        return self.pids.get(rank) is None and rank not in self.spawning

    def forget_spawns(self, nodes: set[int]) -> None:
        """Spawns asked of the agents of `nodes`, which are gone: nothing of them will start."""
        for r, (_, node) in list(self.spawning.items()):
            if node in nodes:
                del self.spawning[r]

    def enter(self, phase: Phase) -> None:
        """Move to `phase`; a transition the table does not allow is a bug (ValueError)."""
        phase = Phase(phase)
        if phase is not self.phase and phase not in TRANSITIONS[self.phase]:
            raise ValueError(f"phase {self.phase.value} -> {phase.value} is not a transition")
        self.phase = phase

    def fail(self, failure: Failure) -> None:
        """Make `failure` pending, merged into the one already pending."""
        if self.pending is None:
            self.pending = failure
        else:
            self.pending.merge(failure)

    def take_pending(self) -> Failure | None:
        failure, self.pending = self.pending, None
        return failure

    def reported(self, kind: Report | str, gen: int) -> set[int]:
        """The ranks that sent report `kind` (`started`, `joined`, `aborted`, ...) in `gen`."""
        return self.reports.ranks(kind, gen)

    def away(self, ranks: Iterable[int]) -> dict[int, int]:
        """Those of `ranks` that run on another node than their home, and their home."""
        return {r: self.home[r] for r in ranks if self.home.get(r, self.members[r]) != self.members[r]}

    def live_nodes(self) -> list[int]:
        return sorted(n for n, st in self.nodes.items() if st.up)

    def placed(self) -> bool:
        """Every rank has a live process."""
        return all(self.pids.get(r) for r in self.members)

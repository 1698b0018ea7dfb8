"""The seam between the job's orchestration and the machinery that carries it out.

The recovery coordinator and the fault scheduler decide; the controller acts (the control plane,
the agents, the run record, the screen). They reach it only through these protocols, which the
controller implements and a unit test can fake, and read and update the job through the shared
`JobState`. Nothing here imports the controller.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from fault_injectors.plan import Topology
from ffctl.controller.decide import Decision
from wire import messages
from runs.events import EventKind, RestoreSource


class RecoveryAbandoned(Exception):
    """A new failure arrived while recovering: start the recovery over."""


class FatalRun(Exception):
    """The run cannot go on (recovery none, no usable state, infrastructure gone). `root_cause`:
    the failure that stopped it, as the run record gives it, where one is known."""

    def __init__(self, reason: str, root_cause: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.root_cause = root_cause


class Record(Protocol):
    """What the controller's pieces record through: an event appended to the run record (`sync`
    False for a line whose fsync the next event's covers)."""

    def __call__(self, kind: EventKind, /, t: float | None = None, **data: Any) -> object:
        ...


class Recorder(Protocol):
    def record(self, kind: EventKind, /, t: float | None = None, **data: Any) -> None:
        """Append an event to the run record."""
        ...


class FaultCluster(Recorder, Protocol):
    """What the fault scheduler needs: where everything runs now, and the record."""

    def topology(self) -> Topology:
        """Nodes and live ranks, addresses, namespaces and pids, as faults are planned against."""
        ...


class Cluster(Recorder, Protocol):
    """What the recovery coordinator needs. Every wait takes a timeout and pumps the control
    plane meanwhile, so the job state it reads moves while it waits."""

    def announce(self, line: str) -> None:
        """Say `line` on screen once."""
        ...

    def has_gpu(self) -> bool:
        """Whether the hosts have GPUs (a rank then needs a free device, not just a process)."""
        ...

    def spare_nodes(self) -> int:
        """How many idle hosts a lost node can come back on (the backend's spare nodes)."""
        ...

    def send(self, node: int, msg: messages.Message) -> None:
        """Send a command to node `node`'s agent."""
        ...

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str,
                 abandon_on_failure: bool = True) -> bool:
        """Pump messages until `cond()` holds (True) or `timeout` seconds pass (False). With
        `abandon_on_failure`, a failure becoming pending raises RecoveryAbandoned(`what`)."""
        ...

    def abort_generation(self, gen: int) -> None:
        """Tell every rank of `gen` to abandon it (they answer `aborted`)."""
        ...

    def wire_ring(self) -> None:
        """Tell each live agent where its ring neighbour's replica store is."""
        ...

    def start_agent(self, node: int) -> None:
        """(Re)start node `node`'s agent; it is up once it says so (`wait_agents`)."""
        ...

    def wait_agents(self, nodes: list[int]) -> None:
        """Wait until these agents are up; FatalRun when one fails or none comes in time."""
        ...

    def spawn_ahead(self, gen: int, ranks: list[int]) -> None:
        """Start `ranks` on the nodes they are placed on, into generation `gen` before its plan
        is published: each starts, says so and waits for the plan."""
        ...

    def open_generation(self, gen: int, decision: Decision | None, respawn: list[int],
                        ahead: frozenset[int] = frozenset()) -> None:
        """Publish generation `gen`'s plan and spawn `respawn` into it, but for those of `ahead`
        (already started into `gen`, see `spawn_ahead`)."""
        ...

    def await_generation(self, gen: int, respawn: list[int], restore_step: int, source: RestoreSource) -> None:
        """Wait until `gen` is spawned, joined and restored: RecoveryAbandoned when a failure
        interrupts it, FatalRun when ranks never start."""
        ...

    def attribute_faults(self, ranks: set[int], nodes: set[int]) -> list[str]:
        """The injected faults a failure of these ranks and nodes is blamed on (marked detected)."""
        ...

    def faults_on(self, nodes: set[int]) -> list[str]:
        """The injected faults that hit `nodes` (lost while a recovery was under way and handled
        by it), marked detected; none when no injected fault explains them."""
        ...

"""The agent's command handler: what the agent does with each command on its queue.

Every command must be sealed by the controller (the queue's receiver checks that) and decode as
one of `wire.messages`' commands. One that does not decode or has no handler is reported as
refused; one whose handler fails is reported as an `agent_error`: the controller hears of every
command it sent that was not carried out, and the agent goes on with the next.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Protocol

from ffctl.agent.reporter import Reporter
from wire import control, messages

log = logging.getLogger(__name__)


class Workers(Protocol):
    """What commands ask of the node's workers (`ffctl.agent.workers.WorkerSupervisor`)."""

    def request_spawn(self, gen: int, ranks: list[dict[str, Any]]) -> None: ...

    def drop_held(self, ranks: set[int]) -> None: ...

    def kill(self, ranks: list[int], grace: float, tail: bool = False) -> None: ...


class Snapshots(Protocol):
    """What commands ask of the node's snapshot store (`ffctl.agent.snapshots.NodeSnapshots`)."""

    def set_holders(self, holders: list[tuple[str, int]]) -> None: ...

    def inventory(self) -> dict[str, Any]: ...


class CommandHandler:
    """Carries out the commands of one agent's queue."""

    def __init__(self, queue: str, limits: control.Limits, reporter: Reporter, workers: Workers,
                 snapshots: Snapshots, stopping: threading.Event, term_grace: float) -> None:
        self.queue = queue  # named in what is reported of a refused command
        self.limits = limits
        self.reporter = reporter
        self.workers = workers
        self.snapshots = snapshots
        self.stopping = stopping
        self.term_grace = term_grace  # a kill's grace when the command gives none

    def handle(self, raw: dict[str, Any]) -> None:
        """Carry out one command read from the queue."""
        try:
            cmd = messages.decode(raw, self.limits, command=True)
        except messages.DecodeError as exc:
            self.reporter.rejected(self.queue, -1, exc.reason, json.dumps(raw)[:200].encode())
            return
        handler = self.HANDLERS.get(cmd.kind)  # type: ignore[call-overload]
        if handler is None:
            self.reporter.rejected(self.queue, -1, f"no handler for command {cmd.kind.value!r}",
                                   json.dumps(raw)[:200].encode())
            return
        try:
            handler(self, cmd)
        except Exception as exc:  # reported, and the agent goes on with the next
            error = f"{cmd.kind.value}: {type(exc).__name__}: {exc}"[:500]
            log.error("ffctl agent %d: command failed: %s", self.reporter.node, error)
            try:
                self.reporter.report(messages.AgentError, error=error)
            except Exception:  # the controller is gone; the log line stays
                pass

    def _on_spawn(self, cmd: messages.Spawn) -> None:
        self.workers.request_spawn(cmd.gen, cmd.ranks)

    def _on_kill(self, cmd: messages.Kill) -> None:
        self.workers.drop_held({int(r) for r in cmd.ranks})
        self.workers.kill(list(cmd.ranks), self.term_grace if cmd.grace is None else float(cmd.grace),
                          tail=bool(cmd.tail))

    def _on_neighbor(self, cmd: messages.Neighbor) -> None:
        self.snapshots.set_holders(list(cmd.holders))

    def _on_inventory(self, cmd: messages.InventoryRequest) -> None:
        self.reporter.report(messages.Inventory, req=cmd.req, **self.snapshots.inventory())

    def _on_stop(self, cmd: messages.Stop) -> None:
        self.stopping.set()

    # One handler per command kind (tests check that every kind has one).
    HANDLERS: dict[messages.CommandKind, Callable[[CommandHandler, Any], None]] = {
        messages.CommandKind.SPAWN: _on_spawn,
        messages.CommandKind.KILL: _on_kill,
        messages.CommandKind.NEIGHBOR: _on_neighbor,
        messages.CommandKind.INVENTORY: _on_inventory,
        messages.CommandKind.STOP: _on_stop,
    }

"""The agent's reporter: every message an agent sends to the controller goes through it.

Each report is sealed with the job token under the agent's own sender name and put on the
controller's queue, naming the agent's node and incarnation. A command or value the agent
refuses is logged and reported as a sealed `rejected` message. When the controller's queue cannot take a message
(its counter was tampered with and not repaired) nobody reads it: the agent's log is all that
is left to tell.
"""
from __future__ import annotations

import logging
from typing import Any

from wire import control, messages

log = logging.getLogger(__name__)


class Reporter:
    """Sends one node's reports to the controller over the control store."""

    def __init__(self, store: Any, sealer: control.Sealer, node: int, incarnation: int) -> None:
        self.store = store
        self.sealer = sealer
        self.node = node
        self.incarnation = incarnation

    def report(self, kind: type[messages.Message], **fields: Any) -> None:
        """Report a message of `kind` to the controller, naming our node and incarnation."""
        msg = messages.from_agent(kind, self.node, self.incarnation, **fields)
        blocked = control.send(self.store, control.CTL_QUEUE, msg, self.sealer)
        if blocked is not None:
            # The controller's queue counter was tampered with and not repaired: the controller
            # is not reading it, so there is nobody to tell but our log.
            log.error("ffctl agent %d: %s not sent: %s: %s", self.node, msg.kind.value, blocked.reason,
                      control.short_repr(blocked.raw))

    def report_kind(self, kind: str, **fields: Any) -> None:
        # The replicator names what it reports by its wire kind: it knows nothing of the agent.
        self.report(messages.report_type(kind), **fields)

    def rejected(self, where: str, index: int, reason: str, raw: bytes) -> None:
        """Something read from the store or a queue was refused: logged and reported."""
        log.warning("ffctl agent %d: rejected %s/%d: %s: %s", self.node, where, index, reason,
                    control.short_repr(raw))
        try:
            self.report(messages.Refusal, where=where, index=index, reason=reason, raw=control.short_repr(raw))
        except Exception:  # the controller is gone; the log line stays
            pass

    def peer_refused(self, why: str, unreported: int) -> None:
        # Called from the snapshot channel's connection threads; the store already logged it.
        self.report(messages.Refusal, where="snapshot channel", reason=why[:500],
                    **({"unreported": unreported} if unreported else {}))

"""A doorbell from a node's ranks to its agent: "one of my slots just became valid".

Without it the agent has to look at every slot header every few milliseconds to stream a fresh
snapshot at once, and on a host whose cores all run ranks that polling is CPU taken from the
step. A rank rings with one datagram on an abstract Unix socket named for the run and the node
(no file to leave behind; the name goes away with the agent). A ring is only a hint: the slot
headers stay the truth, and the agent still looks now and then in case a ring was lost.
"""
from __future__ import annotations

import hashlib
import hmac
import select
import socket


def address(run_id: str, node: int, token: str = "") -> bytes:
    # Abstract namespace (leading NUL): per network namespace, so a sandboxed node's ranks and
    # agent share it and other nodes' do not. Every user of the namespace shares it too: a name
    # made of the run id alone could be bound by a stranger before the agent (which would then
    # poll). With the job token the name is a keyed digest nobody else can compute in advance.
    if token:
        tag = hmac.new(token.encode(), f"doorbell {run_id} {node}".encode(), hashlib.sha256).hexdigest()[:32]
        return f"\0ffctl-{tag}".encode()
    return f"\0ffctl-{run_id}-n{node}-slots".encode()


class Doorbell:
    """The agent's side. `wait` returns when a rank rang or the timeout passed."""

    def __init__(self, run_id: str, node: int, token: str = "") -> None:
        self.sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(address(run_id, node, token))
        except OSError:
            # Taken (an earlier incarnation of this agent not gone yet): poll instead.
            self.sock.close()
            self.sock = None
        else:
            self.sock.setblocking(False)

    @property
    def listening(self) -> bool:
        return self.sock is not None

    def wait(self, timeout: float) -> bool:
        """True if at least one ring came (all pending rings are consumed)."""
        if self.sock is None:
            select.select([], [], [], timeout)
            return False
        ready, _, _ = select.select([self.sock], [], [], timeout)
        rang = False
        while ready:
            try:
                self.sock.recv(64)
                rang = True
            except (BlockingIOError, InterruptedError):
                break
        return rang

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Ringer:
    """A rank's side: one non-blocking datagram per ring, dropped silently if nobody listens."""

    def __init__(self, run_id: str, node: int, token: str = "") -> None:
        self._address = address(run_id, node, token)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def ring(self) -> None:
        try:
            self._sock.sendto(b"!", self._address)
        except OSError:  # no agent listening, or its queue is full: it will look anyway
            pass

    def close(self) -> None:
        self._sock.close()

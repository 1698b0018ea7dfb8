"""A doorbell from a node's ranks to its agent ("one of my slots just became valid"), and the
agent's answer ("a slot of yours is acknowledged").

Without it the agent has to look at every slot header every few milliseconds to stream a fresh
snapshot at once, and on a host whose cores all run ranks that polling is CPU taken from the
step. A rank rings with one datagram on an abstract Unix socket named for the run and the node
(no file to leave behind; the name goes away with the agent). The rank's own socket has an
address the kernel picks (autobind), so the agent knows where the ring came from: once it has
written acknowledgements into slot headers it answers every rank that rang, and a rank waiting
for its step to be held off-node wakes then, instead of looking at its header every millisecond.
Rings and answers are only hints: the slot headers stay the truth, the agent still looks now and
then in case a ring was lost, and a rank still looks at its header when no answer comes. A
stranger's datagram wakes a waiter to look at a header, nothing more.
"""
from __future__ import annotations

import select
import socket
import time

from wire import control

MAX_CALLERS = 256  # ranks' addresses an agent answers, the most recent (a rank's lives as long as it does)
CALLER_TTL_S = 60.0  # a caller not heard of for this long is not answered


def address(run_id: str, node: int, token: str = "") -> bytes:
    # Abstract namespace: per network namespace, so a sandboxed node's ranks and agent share it
    # and other nodes' do not. A name made of the run id alone could be bound by a stranger
    # before the agent (which would then poll); with the job token it cannot.
    if token:
        return control.abstract_socket_name(token, f"doorbell {run_id} {node}")
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
        self.callers: dict[str, float] = {}  # address that rang -> when, last

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
        now = time.monotonic()
        while ready:
            try:
                _, caller = self.sock.recvfrom(64)
            except (BlockingIOError, InterruptedError):
                break
            rang = True
            if isinstance(caller, (str, bytes)) and caller:  # an unbound sender has no address to answer
                key = caller.decode("latin-1") if isinstance(caller, bytes) else caller
                self.callers.pop(key, None)
                self.callers[key] = now
        while len(self.callers) > MAX_CALLERS:
            del self.callers[next(iter(self.callers))]
        return rang

    def answer(self) -> None:
        """Tell every rank that rang lately to look at its slot headers again: acknowledgements
        were written. A caller whose socket is gone is forgotten."""
        if self.sock is None:
            return
        now = time.monotonic()
        for key, seen in list(self.callers.items()):
            if now - seen > CALLER_TTL_S:
                del self.callers[key]
                continue
            try:
                self.sock.sendto(b"a", key.encode("latin-1"))
            except (BlockingIOError, InterruptedError):
                pass  # its queue is full: it has answers to read already
            except OSError:  # closed (the rank ended): nobody to answer there
                del self.callers[key]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Ringer:
    """A rank's side: one non-blocking datagram per ring, dropped silently if nobody listens;
    `wait` for the agent's answer."""

    def __init__(self, run_id: str, node: int, token: str = "") -> None:
        self._address = address(run_id, node, token)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        try:
            self._sock.bind("")  # an abstract address the kernel picks: where answers come
        except OSError:  # no autobind here: rings still go, answers never come, waits time out
            pass

    def ring(self) -> None:
        try:
            self._sock.sendto(b"!", self._address)
        except OSError:  # no agent listening, or its queue is full: it will look anyway
            pass

    def wait(self, timeout: float) -> bool:
        """True if an answer (or a `wake`) came within `timeout`; every pending one is taken."""
        ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        answered = False
        while ready:
            try:
                self._sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
            answered = True
        return answered

    def wake(self) -> None:
        """End a `wait` now, from another thread (the rank's abort watcher)."""
        try:
            self._sock.sendto(b"w", self._sock.getsockname())
        except OSError:  # unbound, or its own queue full: the wait ends at its timeout
            pass

    def close(self) -> None:
        self._sock.close()

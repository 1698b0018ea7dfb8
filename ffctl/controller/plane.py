"""The control plane as the controller holds it: torch's TCPStore, hosted by this process.

The store's server (bound to the controller's address only), the connection the controller
calls it through (opened again after a store error), the sealer and limits every message is
made and checked with, the controller's inbound queue, the keys the controller owns (the current
generation's pointer and plan, written again when someone changes them), each generation's
rendezvous store for an unchanged script, and the record of whatever is refused (rate-limited).
It knows nothing of nodes, ranks or generations beyond the keys it is asked to write.
"""
from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import torch.distributed as dist

from ffctl.controller.cluster import FatalRun, Record
from wire import control, messages
from wire.generation_plan import GenerationPlan
from recovery.throttle import Throttle
from runs.events import EventKind

# How often the keys the controller owns (the current generation and its plan) are checked, and
# written again if someone changed or deleted them.
GUARD_S = 0.1
# How long the control store may fail every call before the run is given up (a store error is
# recorded and the connection opened again; the server is this process, so it is not gone).
STORE_LOST_S = 60.0


class ControlPlane:
    # How many refused messages a second are recorded one by one; beyond that they are counted,
    # so a flood of garbage cannot turn into a flood of fsync'd record lines.
    REJECTS_PER_S = 20

    def __init__(self, address: str, token: str, world_size: int, nnodes: int, record: Record) -> None:
        self.address = address
        self.record = record
        # Everything the store carries is sealed with the job token, which never travels in it.
        self.token = token
        self.sealer = control.Sealer(token, "controller")
        self.limits = control.Limits(world_size, nnodes)
        self.world_size = world_size
        self.rejects = Throttle(self.REJECTS_PER_S)
        # Heartbeats are opened apart from the queue: each channel's sequence only goes up.
        self.hb_opener = control.Opener(token)
        # Every rank and agent may be mid-send at once: only a longer run of unwritten indices
        # is a counter pushed forward by a stranger.
        self.max_gap = max(256, 4 * (world_size + nnodes))
        self.store: dist.TCPStore | None = None  # what the controller calls the store through
        self.server: dist.TCPStore | None = None  # the store's server (this process hosts it)
        self.inbox: control.Receiver | None = None  # the controller's queue
        self.guarded: dict[str, bytes] = {}  # key -> the value the controller last wrote there
        self.guard_at = 0.0
        self.failing_since: float | None = None
        self.rdzv_stores: dict[int, dist.TCPStore] = {}  # gen -> an unchanged script's rendezvous store

    def start(self) -> None:
        """Host the store and open the controller's queue on it."""
        self.store = self.server = self.listen()
        self.inbox = control.Receiver(self.store, control.CTL_QUEUE, opener=control.Opener(self.token),
                                      on_reject=self.rejected, max_gap=self.max_gap)

    @property
    def port(self) -> int:
        assert self.store is not None
        return int(self.store.port)

    def listen(self) -> dist.TCPStore:
        """A TCPStore server on a free port of the controller's address (and nowhere else)."""
        # Bind the listening socket ourselves: torch's TCPStore would listen on every interface.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.address, 0))
        sock.listen(1024)
        try:
            store = dist.TCPStore(
                self.address, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=30), master_listen_fd=sock.fileno(),
            )
        except BaseException:
            sock.close()
            raise
        # The store's server owns the descriptor now and closes it when the store goes; closing
        # it here as well could close whatever file has reused the number by then.
        sock.detach()
        return store

    def rendezvous_port(self, gen: int) -> int:
        """The port of generation `gen`'s rendezvous store for an unchanged script (MASTER_PORT).

        torch's env:// rendezvous under an agent (TORCHELASTIC_USE_AGENT_STORE) keeps no prefix
        per restart, since torchrun's agent hosts a new store for every round: a group restarted
        on the old store would find the failed round's addresses and connect to dead peers. So
        each generation gets a store of its own, and the script's keys stay out of ffctl's
        control plane. Older generations' stores close once their ranks are gone (at the next
        generation's, the ranks of the one before have been stopped)."""
        store = self.rdzv_stores.get(gen)
        if store is None:
            for old in [g for g in self.rdzv_stores if g < gen - 1]:
                del self.rdzv_stores[old]  # its server closes with it
            store = self.rdzv_stores[gen] = self.listen()
        return int(store.port)

    def rejected(self, queue: str, index: int, reason: str, raw: bytes | str, **who: Any) -> None:
        """A message that failed authentication or decoding: recorded (rate-limited) and dropped."""
        dropped = self.rejects.admit()
        if dropped is None:
            return
        raw_text = raw if isinstance(raw, str) else control.short_repr(raw)
        self.record(EventKind.MESSAGE_REJECTED, queue=queue, index=index, reason=reason, raw=raw_text,
                    **({"dropped_before": dropped} if dropped else {}), **who)

    def send(self, queue: str, msg: messages.Message) -> None:
        assert self.store is not None
        blocked = control.send(self.store, queue, msg, self.sealer)
        if blocked is not None:
            # The agent's queue counter was tampered with and its agent did not repair it: the
            # command is lost, and the phase waiting on it times out and says so.
            self.rejected(blocked.queue, -1, f"{msg.kind.value} not sent: {blocked.reason}", blocked.raw)

    def abort(self, gen: int) -> None:
        assert self.store is not None
        # Sealed: ranks ignore (and report) an abort flag anyone else wrote.
        keys, values = control.abort_values(self.sealer, gen, self.world_size)
        control.store_multi_set(self.store, keys, values)

    def publish(self, gen: int, plan: GenerationPlan) -> None:
        """Make `gen` the current generation with `plan`, and guard both keys from now on."""
        assert self.store is not None
        self.guarded = control.publish_plan(self.store, gen, plan, self.sealer)

    def reply(self, key: str, reply: dict[str, Any]) -> None:
        """Write a sealed answer under `key` (an `ffctl inject` request's reply)."""
        assert self.store is not None
        control.store_set(self.store, key, self.sealer.seal(key, reply))

    def ok(self) -> None:
        """A pump went through without a store error."""
        self.failing_since = None

    def guard(self) -> None:
        """Write again what someone changed or deleted of the keys the controller owns (the
        current generation's pointer and plan): a rank joining later must find them."""
        now = time.monotonic()
        if now - self.guard_at < GUARD_S or self.store is None:
            return
        self.guard_at = now
        for key, value in self.guarded.items():
            raw = control.read(self.store, key)
            if raw != value:
                why = "deleted" if raw is None else "overwritten"
                self.rejected(key, -1, f"{key} {why} by someone else: written again", raw or b"")
                control.store_set(self.store, key, value)

    def failed(self, exc: RuntimeError) -> None:
        """A store call failed: recorded, then, after a short wait, a fresh connection to our own
        server. Only a store that fails every call for STORE_LOST_S ends the run (with a reason)."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        first = (str(exc).splitlines() or [""])[0][:200]
        self.rejected("store", -1, f"control store error: {type(exc).__name__}: {first}", b"")
        if now - self.failing_since > STORE_LOST_S:
            raise FatalRun(f"the control store failed every call for {STORE_LOST_S:g}s: {first}")
        time.sleep(0.05)
        assert self.server is not None and self.inbox is not None
        try:
            self.store = control.connect(self.address, int(self.server.port), timeout=30.0)
        except RuntimeError:
            return  # tried again on the next failure
        self.inbox.store = self.store

    def close(self) -> None:
        self.rdzv_stores.clear()
        self.store = self.server = None  # its server closes the listening socket

"""The reconfigurable process group: one torch process group per generation, abortable waits.

A generation's group is built on a PrefixStore (`pg/<gen>/`) of the controller's store, so a new
generation never collides with the keys of an old one. Waiting on a collective also watches the
controller's abort flag for the generation: a survivor blocked on a dead peer (gloo would wait
for its full timeout) gives up as soon as the controller opens the next generation. The old group
is destroyed once none of its collectives is blocked any more (see `Generation.close`).

Anyone who reaches the store can write an abort key, so with an `Opener` the flag's value must be
the controller's sealed abort of this generation and rank: any other value is reported through
`on_forged` and ignored, and the watcher waits for the value to change.
"""
from __future__ import annotations

import atexit
import datetime
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from wire import control
from recovery.errors import PeerFailure

# How often a watcher that found a forged flag looks whether the controller's own replaced it.
FORGED_POLL_S = 0.05
ForgedHook = Callable[[str, str, bytes], None]  # (key, reason, raw value)
SeenHook = Callable[[dist.Store], None]  # told the abort came, with the watcher's own connection

# A watcher's wait is renewed this often; an abort or a close ends it at once.
WATCH_TIMEOUT = datetime.timedelta(hours=1)
# How long a process about to exit waits for groups still being destroyed.
EXIT_REAP_TIMEOUT = 10.0


class AbortWatcher:
    """Waits for the controller's abort of one generation, on a connection of its own.

    The wait blocks in the store server until the key is set: the abort reaches a survivor
    blocked on a dead peer at once, and a healthy job pays nothing for it (a poll per rank every
    few milliseconds adds up to thousands of store requests a second at scale)."""

    def __init__(self, host: str, port: int, gen: int, rank: int, wake: threading.Event,
                 opener: control.Opener | None = None, on_forged: ForgedHook | None = None,
                 on_seen: SeenHook | None = None) -> None:
        self.gen = gen
        self._opener = opener
        self._on_forged = on_forged
        self._on_seen = on_seen
        self.aborted = threading.Event()
        self.key = control.gen_abort_key(gen, rank)
        self._wake = wake
        self._stop = threading.Event()
        self._host, self._port = host, port
        self._store = control.connect(host, port, timeout=10.0)
        self._thread = threading.Thread(target=self._run, name=f"ffctl-abort-{gen}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.wait([self.key], WATCH_TIMEOUT)
            except dist.DistStoreError:
                # Timed out: the connection may still owe the server's late answer, so reconnect.
                try:
                    self._store = control.connect(self._host, self._port, timeout=10.0)
                except Exception:  # the controller is gone, as below
                    pass
                else:
                    continue
            except Exception:  # the controller is gone: nothing can complete any more
                pass
            else:
                if self._stop.is_set():
                    return
                if not self._genuine():
                    continue  # forged and since replaced, or we are stopping: look again
            if not self._stop.is_set():
                self.aborted.set()
                self._wake.set()
                if self._on_seen is not None:
                    # Told from this thread, on this connection: the training thread may be deep
                    # in a step, and its own connection may be busy. That this answer comes is
                    # how the controller tells a busy rank from a stopped or wedged one.
                    try:
                        self._on_seen(self._store)
                    except Exception:  # the controller is gone: nobody to tell
                        pass
            return

    def _genuine(self) -> bool:
        """Whether the flag now set is the controller's. A forged one is reported, then watched
        until its value changes (the controller's abort written over it, or our own close)."""
        if self._opener is None:
            return True
        try:
            # Read without blocking: a stranger may delete the key as soon as it is set.
            raw = control.read(self._store, self.key)
            if raw is None:
                return False
            try:
                self._opener.open(raw, self.key, replay=False)
                return True
            except control.Rejected as exc:
                reason = exc.reason
            if self._on_forged is not None:
                try:
                    self._on_forged(self.key, reason, raw)
                except Exception:  # reporting is best effort
                    pass
            while not self._stop.wait(FORGED_POLL_S):
                try:
                    if control.read(self._store, self.key) != raw:
                        break
                except Exception:  # the controller is gone
                    return True
            return False
        except Exception:  # the controller is gone: nothing can complete any more
            return True

    def stop(self, store: dist.Store) -> None:
        """Let the watcher go: set its key through `store` (another connection) to end its wait."""
        self._stop.set()
        try:
            store.set(self.key, "closed")
        except Exception:  # the controller is gone: the wait has ended already
            pass
        self._thread.join(timeout=1.0)


class _Reaper:
    """Destroys dropped groups on threads of their own, and lets the process exit only once no
    destruction is half done: a gloo group torn down while the interpreter exits aborts the
    process ("terminate called without an active exception")."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._exiting = False

    def drop(self, box: list[Any], inflight: _Inflight, timeout: float, name: str) -> None:
        """Destroy the group in `box` once none of its collectives is blocked (within `timeout`)."""
        def reap() -> None:
            if not inflight.wait_idle(timeout):
                return
            with self._cond:
                if self._exiting:
                    return  # the process ends now: the group goes with it
                self._active += 1
            try:
                box.clear()
            finally:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

        threading.Thread(target=reap, name=name, daemon=True).start()

    def finish(self) -> None:
        with self._cond:
            self._exiting = True
            self._cond.wait_for(lambda: self._active == 0, EXIT_REAP_TIMEOUT)


_REAPER = _Reaper()
atexit.register(_REAPER.finish)


class _Inflight:
    """Collectives of one group started and not yet finished."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._n = 0

    def add(self, k: int) -> None:
        with self._cond:
            self._n += k
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout)


class Generation:
    """The process group of one generation and the waits that the controller can interrupt."""

    def __init__(self, store: dist.Store, host: str, port: int, gen: int, rank: int, world_size: int,
                 timeout: float, backend: str = "gloo", meanwhile: Callable[[], None] | None = None,
                 opener: control.Opener | None = None, on_forged: ForgedHook | None = None,
                 on_seen: SeenHook | None = None) -> None:
        """Build the group; `meanwhile` runs on this thread while it is being built (work that
        needs no group, done while waiting for the other ranks to arrive). With `opener`, only a
        sealed abort flag aborts (see the module's docstring)."""
        self.gen = gen
        self.rank = rank
        self.world_size = world_size
        self._wake = threading.Event()
        self._store = store
        self.watcher = AbortWatcher(host, port, gen, rank, self._wake, opener, on_forged, on_seen)
        self._backend, self._timeout = backend, timeout
        # Building the group blocks in C++ until every rank has arrived. A rank lost during the
        # rendezvous would hold the others there for the full timeout, so build on a thread and
        # leave it behind if the controller aborts this generation.
        built, failed = self._start_build(control.pg_prefix(gen), rank, world_size, f"ffctl-pg-{gen}")
        try:
            if meanwhile is not None:
                meanwhile()
            self._await_build(built, failed, "rendezvous")
        except BaseException:
            self.watcher.stop(store)  # no group to watch: end its wait rather than leave it blocked
            raise
        self.pg: Any = built[0]
        self._inflight = _Inflight()
        self._subgroups: dict[tuple[int, ...], Any] = {}

    def _start_build(self, key: str, rank: int, size: int, name: str) -> tuple[list[Any], list[BaseException]]:
        """Start building a gloo (or NCCL) group of `size` ranks over the store's keys under `key`
        on a thread; `built` or `failed` fills when it is done (see `_await_build`)."""
        prefix = dist.PrefixStore(key, self._store)
        built: list[Any] = []
        failed: list[BaseException] = []

        def build() -> None:
            try:
                if self._backend == "nccl":
                    built.append(dist.ProcessGroupNCCL(prefix, rank, size, dist.ProcessGroupNCCL.Options()))
                else:
                    built.append(dist.ProcessGroupGloo(prefix, rank, size, datetime.timedelta(seconds=self._timeout)))
            except BaseException as exc:  # a peer never arrived (timeout) or the store went away
                failed.append(exc)
            self._wake.set()

        threading.Thread(target=build, name=name, daemon=True).start()
        return built, failed

    def _await_build(self, built: list[Any], failed: list[BaseException], what: str) -> None:
        """Wait for a group being built on a thread (`built` or `failed` fills), giving up when
        the controller aborts this generation."""
        while not built and not failed:
            if self.watcher.aborted.is_set():
                raise PeerFailure(self.gen, f"{what} aborted: the controller opened a new generation")
            self._wake.wait(0.05)
            self._wake.clear()
        if failed:
            raise PeerFailure(self.gen, f"{what} failed: {str(failed[0]).splitlines()[0][:200]}")

    def subgroup(self, members: tuple[int, ...]) -> Any:
        """This generation's group of the ranks `members` (global ranks, this one among them):
        built the first time it is asked for, by every member as it reaches its first collective
        on it, over keys of its own under the generation's prefix. A subgroup of a device mesh
        (`recovery.process_group`) lives as long as the generation, like the whole group."""
        if members in self._subgroups:
            return self._subgroups[members]
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not in the group of ranks {list(members)}")
        key = "sub/" + "-".join(str(m) for m in members) + "/"
        built, failed = self._start_build(control.pg_prefix(self.gen) + key, members.index(self.rank), len(members),
                                          f"ffctl-pg-{self.gen}-{key}")
        self._await_build(built, failed, f"rendezvous of ranks {list(members)}")
        self._subgroups[members] = built[0]
        return built[0]

    def wait(self, work: Any, what: str) -> None:
        done = threading.Event()
        wake, inflight = self._wake, self._inflight
        errors: list[BaseException] = []

        # The callback runs on gloo's own thread and must not hold the group (through `self`):
        # were it the last holder, the group would be destroyed on that thread, which joins itself.
        def finished(*_: Any) -> None:
            inflight.add(-1)
            done.set()
            wake.set()

        inflight.add(1)

        try:
            work.get_future().add_done_callback(finished)
            blocked_on_thread = False
        except RuntimeError:
            # gloo's point-to-point work has no future: block on it on a thread of its own,
            # left behind like a dropped group if the generation is aborted.
            def block() -> None:
                try:
                    work.wait()
                except Exception as exc:  # handed to the waiting rank below
                    errors.append(exc)
                finished()

            threading.Thread(target=block, name=f"ffctl-{what}-{self.gen}", daemon=True).start()
            blocked_on_thread = True
        while not done.is_set():
            if self.watcher.aborted.is_set():
                raise PeerFailure(self.gen, f"{what} aborted: the controller opened a new generation")
            wake.wait(0.05)
            wake.clear()
        try:
            if errors:
                raise errors[0]
            if not blocked_on_thread:
                work.wait()
        except Exception as exc:  # gloo reports a dead peer as a RuntimeError
            raise PeerFailure(self.gen, f"{what} failed: {str(exc).splitlines()[0][:200]}") from None

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.wait(self.pg.allreduce([tensor]), "allreduce")
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        outs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.wait(self.pg.allgather([outs], [tensor]), "allgather")
        return outs

    def allgather_into(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` into row r of `rows` (world_size x numel): no concatenation after."""
        self.wait(self.pg.allgather([list(rows.unbind(0))], [tensor]), "allgather")
        return rows

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> None:
        """Point to point: send each (tensor, dst, tag) and receive each (tensor, src, tag), all
        posted before any is waited on, so transfers with several peers run side by side."""
        works = [(self.pg.send([t], dst, tag), "send") for t, dst, tag in sends]
        works += [(self.pg.recv([t], src, tag), "recv") for t, src, tag in recvs]
        for work, what in works:
            self.wait(work, what)

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1))

    def close(self) -> None:
        """Drop the group and destroy it on a thread of its own, once none of its collectives
        is blocked.

        Destroying a gloo group takes a tick of its event loop per peer (about 10 ms a peer,
        70 ms at 8 ranks), waiting rather than computing and with the GIL released: done here,
        it would hold up the next rendezvous. A group left alive for good slows every group
        built after it in this process (measured: a new group of 8 took 80 ms beside a live old
        one, 6 ms alone), so it is not left behind either. Destroying a group closes its
        connections, which ends the collectives that peers still have blocked on this rank: the
        ranks next to a dead one get an error first, and the rest follow in turn. A collective
        blocked on a hung peer keeps the group until gloo's own timeout."""
        self.watcher.stop(self._store)
        if not hasattr(self, "pg"):
            return  # the rendezvous never finished
        box = [self.pg, *self._subgroups.values()]
        del self.pg
        self._subgroups.clear()
        _REAPER.drop(box, self._inflight, self._timeout, f"ffctl-reap-{self.gen}")

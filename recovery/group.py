"""The reconfigurable process group: one torch process group per generation, abortable waits.

A generation's group is built on a PrefixStore (`pg/<gen>/`) of the controller's store, so a new
generation never collides with the keys of an old one. Waiting on a collective also watches the
controller's abort flag for the generation: a survivor blocked on a dead peer (gloo would wait
for its full timeout) gives up as soon as the controller opens the next generation. The old group
is then dropped, not destroyed, because its threads may still be blocked on the dead peer.
"""
from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from recovery import control
from recovery.errors import PeerFailure


class AbortWatcher:
    """Polls the controller's abort flag of one generation on a connection of its own."""

    def __init__(self, host: str, port: int, gen: int, wake: threading.Event, period: float = 0.01) -> None:
        self.gen = gen
        self.aborted = threading.Event()
        self._wake = wake
        self._stop = threading.Event()
        self._store = control.connect(host, port, timeout=10.0)
        self._period = period
        self._thread = threading.Thread(target=self._run, name=f"ffctl-abort-{gen}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        key = control.gen_abort_key(self.gen)
        while not self._stop.is_set():
            try:
                if self._store.check([key]):
                    self.aborted.set()
                    self._wake.set()
                    return
            except Exception:
                # The controller is gone: nothing can complete any more.
                self.aborted.set()
                self._wake.set()
                return
            self._stop.wait(self._period)

    def stop(self) -> None:
        self._stop.set()


class Generation:
    """The process group of one generation and the waits that the controller can interrupt."""

    def __init__(self, store: dist.Store, host: str, port: int, gen: int, rank: int, world_size: int,
                 timeout: float, backend: str = "gloo") -> None:
        self.gen = gen
        self.rank = rank
        self.world_size = world_size
        self._wake = threading.Event()
        self.watcher = AbortWatcher(host, port, gen, self._wake)
        prefix = dist.PrefixStore(control.pg_prefix(gen), store)
        td = datetime.timedelta(seconds=timeout)
        built: list[Any] = []
        failed: list[BaseException] = []

        def build() -> None:
            try:
                if backend == "nccl":
                    built.append(dist.ProcessGroupNCCL(prefix, rank, world_size, dist.ProcessGroupNCCL.Options()))
                else:
                    built.append(dist.ProcessGroupGloo(prefix, rank, world_size, td))
            except BaseException as exc:  # a peer never arrived (timeout) or the store went away
                failed.append(exc)
            self._wake.set()

        # Building the group blocks in C++ until every rank has arrived. A rank lost during the
        # rendezvous would hold the others there for the full timeout, so build on a thread and
        # leave it behind if the controller aborts this generation.
        threading.Thread(target=build, name=f"ffctl-pg-{gen}", daemon=True).start()
        while not built and not failed:
            if self.watcher.aborted.is_set():
                raise PeerFailure(gen, "rendezvous aborted: the controller opened a new generation")
            self._wake.wait(0.05)
            self._wake.clear()
        if failed:
            raise PeerFailure(gen, f"rendezvous failed: {str(failed[0]).splitlines()[0][:200]}")
        self.pg: Any = built[0]

    def wait(self, work: Any, what: str) -> None:
        done = threading.Event()
        wake = self._wake
        errors: list[BaseException] = []

        def finished(*_: Any) -> None:
            done.set()
            wake.set()

        try:
            work.get_future().add_done_callback(finished)
            blocked_on_thread = False
        except RuntimeError:
            # gloo's point-to-point work has no future: block on it on a thread of its own,
            # left behind like a dropped group if the generation is aborted.
            def block() -> None:
                try:
                    work.wait()
                except Exception as exc:  # noqa: BLE001 - handed to the waiting rank below
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

    def send(self, tensor: torch.Tensor, dsts: list[int], tag: int = 0) -> None:
        """Send `tensor` to each of `dsts`, all posted before any is waited on."""
        works = [self.pg.send([tensor], dst, tag) for dst in dsts]
        for work in works:
            self.wait(work, "send")

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.wait(self.pg.recv([tensor], src, tag), "recv")
        return tensor

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1))

    def close(self) -> None:
        self.watcher.stop()

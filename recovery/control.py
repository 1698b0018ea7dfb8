"""The control-plane conversation over torch's TCPStore: key names and message queues.

The controller hosts the store. Workers and agents send it JSON messages through one queue
(`ctl/q`); the controller sends each agent commands through `agent/<node>/q`. A queue is a
counter plus one key per message: the producer reserves an index with `add`, then `set`s the
message; the single consumer `get`s index after index (a `get` waits for a reserved index whose
message is still in flight). Generation plans are published under `gen/<g>/...`.
"""
from __future__ import annotations

import datetime
import json
import time
from typing import Any

import torch.distributed as dist

CTL_QUEUE = "ctl/q"
GEN_KEY = "gen/current"


def agent_queue(node: int, incarnation: int = 0) -> str:
    # One queue per agent incarnation: a restarted agent must not wait on messages its
    # predecessor already consumed.
    return f"agent/{node}/{incarnation}/q"


def gen_plan_key(gen: int) -> str:
    return f"gen/{gen}/plan"


def gen_abort_key(gen: int, rank: int) -> str:
    # One key per rank: each rank's watcher blocks on its own, so the rank can also set it to
    # wake its watcher when it drops the group (a TCPStore wait cannot be interrupted otherwise).
    return f"gen/{gen}/abort/{rank}"


def heartbeat_key(node: int) -> str:
    return f"hb/{node}"


def pg_prefix(gen: int) -> str:
    return f"pg/{gen}/"


def connect(host: str, port: int, timeout: float = 30.0) -> dist.TCPStore:
    """A client connection to the controller's store; every call on it times out after `timeout`."""
    return dist.TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )


def send(store: dist.Store, queue: str, msg: dict[str, Any]) -> None:
    idx = store.add(f"{queue}/n", 1)
    store.set(f"{queue}/{idx}", json.dumps(msg))


class Receiver:
    """The single consumer of a queue. Never blocks, and one slow or dead producer holds nobody
    up: an index reserved but not yet written is passed over and looked at again on every poll
    (first, before newer ones), then given up after `gap_timeout` seconds (its producer died
    between `add` and `set`, e.g. a rank SIGKILLed or SIGSTOPped mid-send).

    Passing over it keeps each producer's own order: a producer sends one message at a time,
    so every index after its unwritten one belongs to someone else."""

    def __init__(self, store: dist.Store, queue: str, gap_timeout: float = 2.0) -> None:
        self.store = store
        self.queue = queue
        self.seen = 0  # highest index looked at
        self.gap_timeout = gap_timeout
        self._missing: dict[int, float] = {}  # index -> when it was first found unwritten

    def _take(self, idx: int) -> dict[str, Any] | None:
        key = f"{self.queue}/{idx}"
        if not self.store.check([key]):
            return None
        msg: dict[str, Any] = json.loads(self.store.get(key))
        self.store.delete_key(key)
        return msg

    def poll(self, max_items: int = 1000) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        now = time.monotonic()
        for idx in sorted(self._missing):
            msg = self._take(idx)
            if msg is not None:
                out.append(msg)
                del self._missing[idx]
            elif now - self._missing[idx] >= self.gap_timeout:
                del self._missing[idx]  # its producer died between reserving and writing
        produced = self.store.add(f"{self.queue}/n", 0)
        while self.seen < produced and len(out) < max_items:
            self.seen += 1
            msg = self._take(self.seen)
            if msg is None:
                self._missing[self.seen] = now  # still in flight: look again next poll
            else:
                out.append(msg)
        return out


def publish_plan(store: dist.Store, gen: int, plan: dict[str, Any]) -> None:
    store.set(gen_plan_key(gen), json.dumps(plan))
    store.set(GEN_KEY, str(gen))


def current_gen(store: dist.Store) -> int:
    if not store.check([GEN_KEY]):
        return -1
    return int(store.get(GEN_KEY))


def wait_plan(store: dist.Store, gen: int, timeout: float) -> dict[str, Any]:
    """Block until the plan of `gen` is published (or raise TimeoutError)."""
    deadline = time.monotonic() + timeout
    key = gen_plan_key(gen)
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no plan for generation {gen} after {timeout:g}s")
        time.sleep(0.01)
    return json.loads(store.get(key))


def newest_plan(store: dist.Store, at_least: int, timeout: float) -> tuple[int, dict[str, Any]]:
    """The newest generation >= `at_least` and its plan, waiting up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        gen = current_gen(store)
        if gen >= at_least:
            return gen, wait_plan(store, gen, max(0.1, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            raise TimeoutError(f"no generation >= {at_least} after {timeout:g}s")
        time.sleep(0.01)

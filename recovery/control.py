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


def gen_abort_key(gen: int) -> str:
    return f"gen/{gen}/abort"


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
    """The single consumer of a queue. Never blocks: a message whose producer reserved an index
    and then died (SIGKILL between `add` and `set`) is skipped after `gap_timeout` seconds."""

    def __init__(self, store: dist.Store, queue: str, gap_timeout: float = 2.0) -> None:
        self.store = store
        self.queue = queue
        self.seen = 0
        self.gap_timeout = gap_timeout
        self._gap_since: float | None = None

    def poll(self, max_items: int = 1000) -> list[dict[str, Any]]:
        produced = self.store.add(f"{self.queue}/n", 0)
        out: list[dict[str, Any]] = []
        while self.seen < produced and len(out) < max_items:
            key = f"{self.queue}/{self.seen + 1}"
            if not self.store.check([key]):
                now = time.monotonic()
                if self._gap_since is None:
                    self._gap_since = now
                if now - self._gap_since < self.gap_timeout:
                    break  # still in flight; keep order and look again next poll
                self.seen += 1  # its producer died between reserving and writing
                self._gap_since = None
                continue
            self._gap_since = None
            out.append(json.loads(self.store.get(key)))
            self.store.delete_key(key)
            self.seen += 1
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

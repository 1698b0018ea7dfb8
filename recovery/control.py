"""The control-plane conversation over torch's TCPStore: key names and message queues.

The controller hosts the store. Workers and agents send it JSON messages through one queue
(`ctl/q`); the controller sends each agent commands through `agent/<node>/q`. A queue is a
counter plus one key per message: the producer reserves an index with `add`, then `set`s the
message; the single consumer `get`s index after index (a `get` waits for a reserved index whose
message is still in flight). Generation plans are published under `gen/<g>/...`.

torch's store has no authentication, so whoever reaches its port can read and write every key.
No secret is ever written to it, and every control value (queue messages, plans, the current
generation, abort flags, inject replies) is sealed with a key derived from the job token: an
HMAC-SHA256 over the exact bytes of an envelope that names the kind, the sender (its role and a
random per-process nonce), the sender's sequence number, a timestamp, the key it was written for
and the body. A receiver (`Opener`) refuses a bad MAC, a value written for another key, a
timestamp outside a window, and, per sender, any sequence number not above the last it accepted
(replay). Refusals are reported through a callback with a reason; nothing read from the store
raises out of a receiver. What a queue message may hold is typed in `recovery.messages`: `send`
takes one of its messages, and a consumer decodes what it receives (`messages.decode`) before
it uses a field.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import math
import secrets
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

# Limits is re-exported: a queue's consumer checks its messages against the job's shape.
from recovery.messages import Limits as Limits, Message

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


# -- sealing -------------------------------------------------------------------------------------
CONTROL_KEY_LABEL = b"ffctl control v1"
# Sealed values older or newer than this (by the receiver's clock) are refused. Wide, because
# hosts' clocks may differ; replays inside it are caught by the sequence numbers.
TIME_WINDOW_S = 600.0
_MAC_HEX = 64


class Rejected(Exception):
    """A value read from the store failed authentication or decoding; `reason` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def control_key(token: str) -> bytes:
    """The key control values are sealed with: derived, so it differs from the snapshot channel's."""
    return hmac.new(token.encode(), CONTROL_KEY_LABEL, hashlib.sha256).digest()


def short_repr(raw: bytes | str, limit: int = 120) -> str:
    text = repr(raw)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Sealer:
    """The sending side of one process: its identity and its strictly increasing sequence."""

    def __init__(self, token: str, role: str) -> None:
        self._key = control_key(token)
        self.sender = f"{role}/{secrets.token_hex(8)}"
        self._seq = 0
        # Held from numbering a message until it is in its queue, so one sender's messages take
        # queue indices in sequence order even when several of its threads send.
        self.lock = threading.RLock()

    def seal(self, to: str, msg: dict[str, Any]) -> str:
        """The sealed form of `msg` (its `type` is the kind), valid only under key `to`."""
        with self.lock:
            self._seq += 1
            seq = self._seq
        body = {k: v for k, v in msg.items() if k != "type"}
        payload = json.dumps({"kind": msg.get("type", ""), "sender": self.sender, "seq": seq,
                              "ts": time.time(), "to": to, "body": body}, separators=(",", ":"))
        mac = hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
        return mac + payload


class Opener:
    """The receiving side: checks a sealed value and returns its message, or raises Rejected."""

    def __init__(self, token: str, window: float = TIME_WINDOW_S) -> None:
        self._key = control_key(token)
        self.window = window
        self._last: dict[str, int] = {}  # sender -> highest sequence accepted

    def open(self, raw: bytes | str, to: str, replay: bool = True) -> dict[str, Any]:
        """The message sealed in `raw` for key `to`, as `{"type": kind, **body}`. `replay=False`
        for values that are read more than once (plans, flags): bound to their key, not counted."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if len(data) <= _MAC_HEX:
            raise Rejected("not a sealed message (too short)")
        mac, payload = data[:_MAC_HEX], data[_MAC_HEX:]
        want = hmac.new(self._key, payload, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(mac, want):
            raise Rejected("bad MAC (not sealed with this job's token, or altered)")
        try:
            env = json.loads(payload)
        except ValueError:
            raise Rejected("sealed payload is not JSON") from None
        if not isinstance(env, dict):
            raise Rejected("sealed payload is not an object")
        kind, sender, seq, ts = env.get("kind"), env.get("sender"), env.get("seq"), env.get("ts")
        body = env.get("body")
        if not (isinstance(kind, str) and isinstance(sender, str) and _is_int(seq)
                and isinstance(ts, (int, float)) and not isinstance(ts, bool) and isinstance(body, dict)):
            raise Rejected("sealed envelope lacks kind, sender, seq, ts or body")
        if env.get("to") != to:
            raise Rejected(f"sealed for {short_repr(str(env.get('to')), 60)}, read from {to}")
        if not math.isfinite(ts) or abs(time.time() - ts) > self.window:
            raise Rejected(f"timestamp {ts!r} outside the {self.window:g}s window")
        if replay:
            last = self._last.get(sender, 0)
            if seq <= last:
                raise Rejected(f"replayed or old sequence {seq} from {sender} (last accepted {last})")
            self._last[sender] = seq
        return {**body, "type": kind}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- queues -----------------------------------------------------------------------------------------
def send(store: dist.Store, queue: str, msg: Message, sealer: Sealer | None = None) -> None:
    """Append `msg` to `queue`, sealed by `sealer` (unsealed only where no job token exists)."""
    send_dict(store, queue, msg.to_dict(), sealer)


def send_dict(store: dist.Store, queue: str, msg: dict[str, Any], sealer: Sealer | None = None) -> None:
    """Append a value in wire form, unchecked: for what speaks the wire format directly (tests
    that forge a message, values that are not messages). Everything else sends a `Message`."""
    if sealer is None:
        idx = store.add(f"{queue}/n", 1)
        store.set(f"{queue}/{idx}", json.dumps(msg))
        return
    with sealer.lock:
        value = sealer.seal(queue, msg)
        idx = store.add(f"{queue}/n", 1)
        store.set(f"{queue}/{idx}", value)


RejectHook = Callable[[str, int, str, bytes], None]  # (queue, index, reason, raw value)


class Receiver:
    """The single consumer of a queue. Never blocks, and one slow or dead producer holds nobody
    up: an index reserved but not yet written is passed over and looked at again on every poll
    (first, before newer ones), then given up after `gap_timeout` seconds (its producer died
    between `add` and `set`, e.g. a rank SIGKILLed or SIGSTOPped mid-send).

    Passing over it keeps each producer's own order: a producer sends one message at a time,
    so every index after its unwritten one belongs to someone else.

    A value that does not open (with `opener`: sealing, sequence, window; without: JSON object)
    is handed to `on_reject` with the reason and dropped: what a queue holds never raises here."""

    def __init__(self, store: dist.Store, queue: str, gap_timeout: float = 2.0,
                 opener: Opener | None = None, on_reject: RejectHook | None = None) -> None:
        self.store = store
        self.queue = queue
        self.seen = 0  # highest index looked at
        self.gap_timeout = gap_timeout
        self.opener = opener
        self.on_reject = on_reject
        self._missing: dict[int, float] = {}  # index -> when it was first found unwritten

    def _take(self, idx: int) -> dict[str, Any] | None | bool:
        """The message at `idx`; None if not written yet; False if written but refused."""
        key = f"{self.queue}/{idx}"
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        self.store.delete_key(key)
        try:
            if self.opener is not None:
                return self.opener.open(raw, self.queue)
            msg = json.loads(raw)
            if not isinstance(msg, dict):
                raise Rejected("not a JSON object")
            return msg
        except Rejected as exc:
            reason = exc.reason
        except (ValueError, UnicodeDecodeError) as exc:
            reason = f"not JSON: {str(exc)[:80]}"
        if self.on_reject is not None:
            self.on_reject(self.queue, idx, reason, bytes(raw))
        return False

    def poll(self, max_items: int = 1000) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        now = time.monotonic()
        for idx in sorted(self._missing):
            msg = self._take(idx)
            if msg is not None:
                if msg is not False:
                    out.append(msg)  # type: ignore[arg-type]
                del self._missing[idx]
            elif now - self._missing[idx] >= self.gap_timeout:
                del self._missing[idx]  # its producer died between reserving and writing
        produced = self.store.add(f"{self.queue}/n", 0)
        while self.seen < produced and len(out) < max_items:
            self.seen += 1
            msg = self._take(self.seen)
            if msg is None:
                self._missing[self.seen] = now  # still in flight: look again next poll
            elif msg is not False:
                out.append(msg)  # type: ignore[arg-type]
        return out


def publish_plan(store: dist.Store, gen: int, plan: dict[str, Any], sealer: Sealer | None = None) -> None:
    if sealer is None:
        store.set(gen_plan_key(gen), json.dumps(plan))
        store.set(GEN_KEY, str(gen))
        return
    # One round trip: the plan and the pointer to it land together.
    store.multi_set([gen_plan_key(gen), GEN_KEY],
                    [sealer.seal(gen_plan_key(gen), {"type": "plan", **plan}),
                     sealer.seal(GEN_KEY, {"type": "gen", "gen": gen})])


def abort_values(sealer: Sealer, gen: int, world_size: int) -> tuple[list[str], list[str]]:
    """The abort flags of `gen` for every rank (keys, sealed values), for one `multi_set`."""
    keys = [gen_abort_key(gen, r) for r in range(world_size)]
    return keys, [sealer.seal(k, {"type": "abort", "gen": gen}) for k in keys]


class _Reader:
    """Reads values that are read more than once (plans, the current generation): a value that
    does not open is reported once (per distinct value) and treated as not there yet, so the
    genuine value, written over it, is still found."""

    def __init__(self, opener: Opener | None, on_reject: RejectHook | None) -> None:
        self.opener = opener
        self.on_reject = on_reject
        self._reported: set[tuple[str, bytes]] = set()

    def read(self, store: dist.Store, key: str, kind: str) -> dict[str, Any] | None:
        raw = store.get(key)
        if self.opener is None:
            return json.loads(raw) if kind == "plan" else {"gen": int(raw)}
        try:
            msg = self.opener.open(raw, key, replay=False)
            if msg.get("type") != kind:
                raise Rejected(f"a {short_repr(str(msg.get('type')), 30)} where a {kind} belongs")
            if kind == "gen" and not _is_int(msg.get("gen")):
                raise Rejected("gen is not an int")
            return msg
        except Rejected as exc:
            if (key, bytes(raw)) not in self._reported and self.on_reject is not None:
                self._reported.add((key, bytes(raw)))
                self.on_reject(key, -1, exc.reason, bytes(raw))
            return None


def current_gen(store: dist.Store, opener: Opener | None = None, on_reject: RejectHook | None = None,
                _reader: _Reader | None = None) -> int:
    if not store.check([GEN_KEY]):
        return -1
    msg = (_reader or _Reader(opener, on_reject)).read(store, GEN_KEY, "gen")
    return -1 if msg is None else int(msg["gen"])


def wait_plan(store: dist.Store, gen: int, timeout: float, opener: Opener | None = None,
              on_reject: RejectHook | None = None, _reader: _Reader | None = None) -> dict[str, Any]:
    """Block until a genuine plan of `gen` is published (or raise TimeoutError)."""
    deadline = time.monotonic() + timeout
    key = gen_plan_key(gen)
    reader = _reader or _Reader(opener, on_reject)
    while True:
        if store.check([key]):
            plan = reader.read(store, key, "plan")
            if plan is not None:
                if opener is not None and (plan.get("gen") != gen or not _is_int(plan.get("world_size"))
                                           or not isinstance(plan.get("sources"), dict)):
                    raise Rejected(f"sealed plan of generation {gen} is malformed")
                return plan
        if time.monotonic() > deadline:
            raise TimeoutError(f"no plan for generation {gen} after {timeout:g}s")
        time.sleep(0.01)


def newest_plan(store: dist.Store, at_least: int, timeout: float, opener: Opener | None = None,
                on_reject: RejectHook | None = None) -> tuple[int, dict[str, Any]]:
    """The newest generation >= `at_least` and its plan, waiting up to `timeout`."""
    deadline = time.monotonic() + timeout
    reader = _Reader(opener, on_reject)
    while True:
        gen = current_gen(store, _reader=reader)
        if gen >= at_least:
            return gen, wait_plan(store, gen, max(0.1, deadline - time.monotonic()), opener, _reader=reader)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no generation >= {at_least} after {timeout:g}s")
        time.sleep(0.01)

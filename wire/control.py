"""The control-plane conversation over torch's TCPStore: key names and message queues.

The controller hosts the store. Workers and agents send it JSON messages through one queue
(`ctl/q`); the controller sends each agent commands through `agent/<node>/<incarnation>/q`.
A queue is a counter plus one key per message: the producer reserves an index (a
compare-and-set on the counter), then `set`s the message; the single consumer reads index after
index without blocking (an index reserved whose message is still in flight is looked at again).
Generation plans (`wire.generation_plan.GenerationPlan`, typed and decoded like the queue messages) are
published under `gen/<g>/...`; each agent's heartbeat is `hb/<node>`.

torch's store has no authentication, so whoever reaches its port can read and write every key.
No secret is ever written to it, and every control value (queue messages, plans, the current
generation, abort flags, heartbeats, inject replies) is sealed with a key derived from the job
token: an HMAC-SHA256 over the exact bytes of an envelope that names the kind, the sender (its
role and a random per-process nonce), the sender's sequence number, a timestamp, the key it was
written for and the body. A receiver (`Opener`) refuses a bad MAC, a value written for another key, a
timestamp outside a window, and, per sender, any sequence number not above the last it accepted
(replay). Refusals are reported through a callback with a reason; nothing read from the store
raises out of a receiver. What a queue message may hold is typed in `wire.messages`: `send`
takes one of its messages, and a consumer decodes what it receives (`messages.decode`) before
it uses a field.

The store itself is hostile ground: anyone may overwrite or delete any key, including the ones
that carry no seal (a queue's counter). So nothing here parses a value the server would parse
for us (its `add` drops the connection of whoever asks it to count a value that is not a number:
a producer reserves an index with a compare-and-set instead), nothing blocks on a key that may
have been deleted (`read` answers at once), a queue's counter is only a hint (its consumer walks
a bounded stretch per poll, and repairs a counter that is garbage, missing or gone back), and
values read more than once only move forward (the current generation never goes back).
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import itertools
import json
import math
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, TypeGuard, Union

# Limits is re-exported: a queue's consumer checks its messages against the job's shape.
from wire.messages import DecodeError, Limits as Limits, Message
from wire.generation_plan import GenerationPlan, decode_plan

if TYPE_CHECKING:
    import torch.distributed as dist

    from wire.storeclient import StoreClient

    # What the calls here take: torch's store (the controller and the ranks, which have torch
    # anyway), or the plain-Python client of it (the agents and `ffctl inject`, which do not
    # import torch: `wire.storeclient`).
    Store = Union[dist.Store, StoreClient]

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
    """torch's client connection to the controller's store, for a process that has torch anyway
    (a process without it uses `wire.storeclient.connect`); every call times out after `timeout`."""
    import torch.distributed as dist

    return dist.TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )


# -- torch's Store, as its bindings behave --------------------------------------------------------
# torch's type stubs give a Store's values as str and leave `multi_set` out, while its bindings
# take bytes as well as str for every value (a C++ string either way) and do have `multi_set`.
# Sealed values are bytes: they are written through these, so that disagreement with the stubs
# is stated once.
def store_set(store: Store, key: str, value: bytes | str) -> None:
    store.set(key, value)  # type: ignore[arg-type]  # the stub says str; the binding takes bytes too


def store_compare_set(store: Store, key: str, expected: bytes, desired: bytes) -> bytes:
    """The value torch's `compare_set` answers (what it means: `read`, `_reserve`)."""
    return bytes(store.compare_set(key, expected, desired))  # type: ignore[arg-type]  # as store_set


def store_multi_set(store: Store, keys: list[str], values: list[bytes] | list[str]) -> None:
    store.multi_set(keys, values)  # type: ignore[union-attr]  # in the binding, not in the stub


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


def abstract_socket_name(token: str, label: str) -> bytes:
    """An abstract Unix socket name (leading NUL: no file, gone with its holder) for `label`.

    Abstract names are per network namespace and every user of the namespace shares them: a name
    anyone could compute could be bound by a stranger first. Keyed by the job token, it is a
    digest nobody outside the job can compute in advance."""
    tag = hmac.new(token.encode(), label.encode(), hashlib.sha256).hexdigest()[:32]
    return f"\0ffctl-{tag}".encode()


def short_repr(raw: object, limit: int = 120) -> str:
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


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


# -- reading hostile ground -------------------------------------------------------------------------
# What `read` gets back for a key that is not there: a compare-and-set whose expected value is
# not the key's answers the value, and for a missing key the expected one. Random per process,
# so nobody else can write it.
_ABSENT = b"\x00ffctl-absent\x00" + secrets.token_hex(8).encode()


def read(store: Store, key: str) -> bytes | None:
    """The value at `key`, or None when there is none: at once, whatever anyone did to the key.

    A `get` of a missing key blocks for the connection's whole timeout (a stranger deleting a
    key between our `check` and our `get` would freeze the reader), and a timed-out call leaves
    torch's client connection out of step. A compare-and-set that never matches does neither."""
    value = store_compare_set(store, key, _ABSENT, _ABSENT)
    return None if value == _ABSENT else value


# -- queue counters ---------------------------------------------------------------------------------
# A queue's counter holds the last index reserved, as "<index>:<tag>" (the tag names who reserved
# it, so a producer can tell its own compare-and-set succeeded) or as a plain number (what the
# server's `add` writes). Nothing else is a count, and nothing here asks the server to parse it.
_COUNTER = re.compile(rb"([0-9]{1,18})(?::[!-~]{1,80})?")
# The highest index a producer reserves: the counter's parser reads 18 digits, so a counter at
# the top of its range (a stranger's write) makes producers wait for the consumer's repair
# rather than write an index nobody could read back.
MAX_INDEX = 10**18 - 1
# How long a producer waits for a queue's consumer to repair a counter that is not a count.
SEND_WAIT_S = 5.0
# Compare-and-set attempts per reservation: each failure answers the newer value, so only
# producers reserving at the same instant make one try again.
_CAS_TRIES = 10_000
_BACKOFF_S = 20e-6
_BACKOFF_MAX_S = 2e-3
_TICKETS = itertools.count(1)  # numbers this process's reservations (next() is atomic in CPython)


def parse_counter(raw: bytes | None) -> int | None:
    """The index a counter value holds, or None for anything that is not one (missing too)."""
    if raw is None:
        return None
    m = _COUNTER.fullmatch(raw)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Blocked:
    """A message that was not queued: its queue's counter was not a count (someone wrote it)
    and its consumer did not repair it within `SEND_WAIT_S`. A value, never raised: the caller
    decides whether a lost message matters."""

    queue: str
    reason: str
    raw: bytes


def _reserve(store: Store, queue: str, tag: str, wait: float | None = None) -> int | Blocked:
    """The next index of `queue`, reserved for this producer alone (`wait`: SEND_WAIT_S)."""
    counter = f"{queue}/n"
    # What this reservation writes must be its own: two threads of one process, or two
    # processes of one sender name, reserving at the same instant must not both see success.
    # (Its end, the sender's random nonce, is kept whole: the value must stay a count.)
    tag = f"{tag[-60:]}.{next(_TICKETS)}"
    deadline = time.monotonic() + (SEND_WAIT_S if wait is None else wait)
    current = read(store, counter)
    for attempt in range(_CAS_TRIES):
        if current is None:
            # A queue nobody has used yet, or whose counter a stranger deleted: made here, at the
            # first index. A consumer already further on sees its counter go back and repairs it.
            want = f"1:{tag}".encode()
            got = store_compare_set(store, counter, b"", want)
            if got == want:
                return 1
            current = got
            continue
        n = parse_counter(current)
        if n is None or n >= MAX_INDEX:
            # Not a count (or one at the top of its range): only the consumer knows where the
            # queue stands, so it repairs it.
            if time.monotonic() > deadline:
                return Blocked(queue, "queue counter is not a count and was not repaired", current)
            time.sleep(0.01)
            current = read(store, counter)
            continue
        want = f"{n + 1}:{tag}".encode()
        got = store_compare_set(store, counter, current, want)
        if got == want:
            return n + 1
        # Another producer was first (its value comes back), or the counter is gone (the
        # expected value comes back: compare_set answers it for a missing key).
        current = None if got == current else got
        # Producers that keep colliding step apart, by a random wait that grows with each miss:
        # k producers at once then cost about k tries each rather than k^2 between them.
        time.sleep(random.uniform(0.0, min(_BACKOFF_S * (attempt + 1), _BACKOFF_MAX_S)))
    return Blocked(queue, f"no index reserved in {_CAS_TRIES} tries", current or b"")


# -- queues -----------------------------------------------------------------------------------------
_UNSEALED_TAG = f"unsealed/{secrets.token_hex(8)}"


def send(store: Store, queue: str, msg: Message, sealer: Sealer | None = None) -> Blocked | None:
    """Append `msg` to `queue`, sealed by `sealer` (unsealed only where no job token exists).
    None once it is queued; `Blocked` when the queue's counter was tampered with and stayed so."""
    return send_dict(store, queue, msg.to_dict(), sealer)


def send_dict(store: Store, queue: str, msg: dict[str, Any], sealer: Sealer | None = None) -> Blocked | None:
    """Append a value in wire form, unchecked: for what speaks the wire format directly (tests
    that forge a message, values that are not messages). Everything else sends a `Message`."""
    if sealer is None:
        idx = _reserve(store, queue, _UNSEALED_TAG)
        if isinstance(idx, Blocked):
            return idx
        store.set(f"{queue}/{idx}", json.dumps(msg))
        return None
    with sealer.lock:
        value = sealer.seal(queue, msg)
        idx = _reserve(store, queue, sealer.sender)
        if isinstance(idx, Blocked):
            return idx
        store_set(store, f"{queue}/{idx}", value)
    return None


RejectHook = Callable[[str, int, str, bytes], None]  # (queue, index, reason, raw value)

# Indices a consumer sets its counter past when it repairs it, and looks at again after it went
# back: those a producer may have reserved unseen meanwhile, so none is handed out twice.
REPAIR_MARGIN = 16
# Indices a consumer walks per poll at most, whatever the counter says.
MAX_WALK = 1024
# How often a consumer reports its counter tampered with, at most (a stranger writing it in a
# loop would otherwise turn each poll into a report).
COUNTER_REPORT_S = 1.0


class Receiver:
    """The single consumer of a queue. Never blocks, and one slow or dead producer holds nobody
    up: an index reserved but not yet written is passed over and looked at again on every poll
    (first, before newer ones), then given up after `gap_timeout` seconds (its producer died
    between reserving and writing, e.g. a rank SIGKILLed or SIGSTOPped mid-send).

    Passing over it keeps each producer's own order: a producer sends one message at a time,
    so every index after its unwritten one belongs to someone else.

    The consumer keeps its own place (`seen`) and takes the counter as a hint of how far to
    read, never as a bound on work: at most `MAX_WALK` indices per poll, and a run of more than
    `max_gap` unwritten indices is a counter pushed forward by someone who wrote nothing, skipped.
    A counter that is not a count, is missing or went back is reported and repaired (set past
    every index handed out so far), and the indices a producer may have reserved from the bad
    value are looked at again.

    A value that does not open (with `opener`: sealing, sequence, window; without: JSON object)
    is handed to `on_reject` with the reason and dropped: what a queue holds never raises here."""

    def __init__(self, store: Store, queue: str, gap_timeout: float = 2.0,
                 opener: Opener | None = None, on_reject: RejectHook | None = None,
                 max_gap: int = 256) -> None:
        self.store = store
        self.queue = queue
        self.seen = 0  # highest index looked at
        self.high = 0  # highest counter value accepted: counters only move forward
        self.gap_timeout = gap_timeout
        self.opener = opener
        self.on_reject = on_reject
        self.max_gap = max(max_gap, 2 * REPAIR_MARGIN)
        self._counter = f"{queue}/n"
        self._tag = f"consumer/{secrets.token_hex(8)}"
        self._missing: dict[int, float] = {}  # index -> when it was first found unwritten
        self._reported_at = float("-inf")
        self._unreported = 0
        # Opened here, before any producer is told of the queue (a producer would make it too).
        store_compare_set(store, self._counter, b"", f"0:{self._tag}".encode())

    def _report(self, index: int, reason: str, raw: bytes) -> None:
        if self.on_reject is not None:
            self.on_reject(self.queue, index, reason, raw)

    def _counter_refused(self, reason: str, raw: bytes) -> None:
        """Report a tampered counter, at most once per COUNTER_REPORT_S (the rest are counted)."""
        now = time.monotonic()
        if now - self._reported_at < COUNTER_REPORT_S:
            self._unreported += 1
            return
        if self._unreported:
            reason += f" ({self._unreported} more since the last report)"
        self._reported_at, self._unreported = now, 0
        self._report(-1, reason, raw)

    def _repair(self, raw: bytes | None) -> None:
        """Set the counter past every index handed out so far (and a margin a producer may have
        reserved unseen), unless someone changed it again meanwhile (the next poll looks)."""
        value = f"{max(self.high, self.seen) + REPAIR_MARGIN}:{self._tag}".encode()
        store_compare_set(self.store, self._counter, b"" if raw is None else raw, value)

    def _take(self, idx: int) -> dict[str, Any] | None | Literal[False]:
        """The message at `idx`; None if not written yet; False if written but refused."""
        key = f"{self.queue}/{idx}"
        raw = read(self.store, key)
        if raw is None:
            return None
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
        self._report(idx, reason, raw)
        return False

    def _produced(self, now: float) -> int:
        """How far to read this poll: the counter, checked. One that is not a count, is missing
        or went back is reported and repaired, and nothing new is read until it holds again."""
        raw = read(self.store, self._counter)
        n = parse_counter(raw)
        if n is None:
            why = "missing (deleted)" if raw is None else "not a count"
            self._counter_refused(f"queue counter {self._counter} is {why}", raw or b"")
            self._repair(raw)
            return self.seen
        if n < self.high:
            self._counter_refused(f"queue counter {self._counter} went back from {self.high} to {n}",
                                  raw or b"")
            # Producers that reserved from the bad value wrote where messages were read before,
            # up to the value seen now (and just above, until the repair lands): those indices
            # are looked at again (a message there now is a new one).
            for idx in range(max(1, n - REPAIR_MARGIN + 1), min(n + REPAIR_MARGIN, self.seen) + 1):
                self._watch(idx, now)
            self._repair(raw)
            return self.seen
        self.high = n
        return n

    def poll(self, max_items: int = 1000) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        now = time.monotonic()
        for idx in sorted(self._missing):
            msg = self._take(idx)
            if msg is not None:
                if msg is not False:
                    out.append(msg)
                del self._missing[idx]
            elif now - self._missing[idx] >= self.gap_timeout:
                del self._missing[idx]  # its producer died between reserving and writing
        produced = self._produced(now)
        walked = run = 0
        while self.seen < produced and len(out) < max_items and walked < MAX_WALK:
            self.seen += 1
            walked += 1
            msg = self._take(self.seen)
            if msg is None:
                self._watch(self.seen, now)  # still in flight: look again next poll
                run += 1
                if run > self.max_gap:
                    self._skip(produced, run, now)
                    break
                continue
            run = 0
            if msg is not False:
                out.append(msg)
        return out

    def _watch(self, idx: int, now: float) -> None:
        """Look at `idx` again on every poll until `gap_timeout`. At most twice `max_gap` indices
        are watched (each costs a read per poll; a run of `max_gap` fits, so `_skip` still finds
        the start of it): beyond that, the oldest are given up. Producers in flight are far
        fewer; only a counter tampered with again and again makes so many."""
        self._missing.setdefault(idx, now)
        while len(self._missing) > 2 * self.max_gap:
            del self._missing[min(self._missing)]

    def _skip(self, produced: int, run: int, now: float) -> None:
        """More indices in a row were reserved and left unwritten than producers can have in
        flight: the counter was pushed forward by someone who wrote nothing. A counter moves only
        as far as the messages that exist, so it is set back to where they are (this consumer's
        place and a margin), at any value it was pushed to, the top of its range included. The
        first few indices of the run stay watched (producers in flight when it happened), and so
        do the top few below the pushed value (producers that reserved from it before the
        repair): their messages are read, nothing else at the stranger's indices is."""
        start = self.seen - run + 1
        for idx in range(start + REPAIR_MARGIN, self.seen + 1):
            self._missing.pop(idx, None)
        # Read again now: the value set back is the one the top is watched below, so a producer
        # that reserved since the poll began is watched too (one that reserves after this read
        # makes the compare-and-set fail, and the next poll finds the jump again).
        raw = read(self.store, self._counter)
        top = max(produced, parse_counter(raw) or 0)
        for idx in range(max(start + REPAIR_MARGIN, top - REPAIR_MARGIN + 1), top + 1):
            self._watch(idx, now)
        self.seen = self.high = start - 1 + REPAIR_MARGIN
        self._counter_refused(f"queue counter {self._counter} jumped to {top} with nothing written "
                              f"after index {start - 1}: set back to {self.seen}", str(top).encode())
        if raw is not None:
            store_compare_set(self.store, self._counter, raw, f"{self.seen}:{self._tag}".encode())


def publish_plan(store: Store, gen: int, plan: GenerationPlan,
                 sealer: Sealer | None = None) -> dict[str, bytes]:
    """Publish generation `gen`'s plan and make it the current one. Returns what was written
    (key -> value), so the publisher can tell later whether someone changed it."""
    if plan.gen != gen:
        raise ValueError(f"the plan of generation {plan.gen} published as generation {gen}'s")
    wire = plan.to_dict()
    if sealer is None:
        values = {gen_plan_key(gen): json.dumps(wire).encode(), GEN_KEY: str(gen).encode()}
        for key, value in values.items():
            store_set(store, key, value)
        return values
    values = {gen_plan_key(gen): sealer.seal(gen_plan_key(gen), wire).encode(),
              GEN_KEY: sealer.seal(GEN_KEY, {"type": "gen", "gen": gen}).encode()}
    # One round trip: the plan and the pointer to it land together.
    store_multi_set(store, list(values), list(values.values()))
    return values


def abort_values(sealer: Sealer, gen: int, world_size: int) -> tuple[list[str], list[str]]:
    """The abort flags of `gen` for every rank (keys, sealed values), for one `multi_set`."""
    keys = [gen_abort_key(gen, r) for r in range(world_size)]
    return keys, [sealer.seal(k, {"type": "abort", "gen": gen}) for k in keys]


class Reader:
    """Reads values that are read more than once (plans, the current generation): a value that
    does not open is reported once (per distinct value) and treated as not there yet, so the
    genuine value, written over it, is still found. The current generation only moves forward:
    a genuine but older one (written back by someone who kept it) is refused like a forgery."""

    _MAX_REPORTED = 1024

    def __init__(self, opener: Opener | None, on_reject: RejectHook | None) -> None:
        self.opener = opener
        self.on_reject = on_reject
        self.newest_gen = -1  # the highest generation accepted from GEN_KEY
        self._reported: set[tuple[str, bytes]] = set()

    def _refuse(self, key: str, reason: str, raw: bytes) -> None:
        if (key, raw) in self._reported or self.on_reject is None:
            return
        if len(self._reported) >= self._MAX_REPORTED:
            self._reported.clear()  # bounded memory: at worst a value is reported again
        self._reported.add((key, raw))
        self.on_reject(key, -1, reason, raw)

    def read(self, store: Store, key: str, kind: str) -> dict[str, Any] | None:
        raw = read(store, key)
        if raw is None:
            return None
        try:
            if self.opener is None:
                msg = json.loads(raw) if kind == "plan" else {"type": "gen", "gen": int(raw)}
                if not isinstance(msg, dict):
                    raise Rejected("not a JSON object")
            else:
                msg = self.opener.open(raw, key, replay=False)
            if msg.get("type", kind) != kind:
                raise Rejected(f"a {short_repr(str(msg.get('type')), 30)} where a {kind} belongs")
            if kind == "gen":
                gen = msg.get("gen")
                if not _is_int(gen):
                    raise Rejected("gen is not an int")
                if gen < self.newest_gen:
                    raise Rejected(f"generation went back from {self.newest_gen} to {gen}")
                self.newest_gen = gen
            return msg
        except Rejected as exc:
            self._refuse(key, exc.reason, raw)
        except (ValueError, UnicodeDecodeError) as exc:
            self._refuse(key, f"not a {kind}: {str(exc)[:80]}", raw)
        return None

    def plan(self, store: Store, gen: int) -> GenerationPlan | None:
        """Generation `gen`'s genuine, well-formed plan, or None (not there, or refused). A plan
        that opens but does not decode (an unknown kind of source, a field missing or of the
        wrong type) is refused like a forged one: nothing of it is used."""
        key = gen_plan_key(gen)
        raw = self.read(store, key, "plan")
        if raw is None:
            return None
        try:
            plan = decode_plan({**raw, "type": "plan"})  # `read` checked its kind, or found none
            if plan.gen != gen:
                raise DecodeError(f"plan of generation {plan.gen} under generation {gen}'s key")
        except DecodeError as exc:
            self._refuse(key, f"malformed plan: {exc.reason}", short_repr(raw).encode())
            return None
        return plan


def current_gen(store: Store, opener: Opener | None = None, on_reject: RejectHook | None = None,
                _reader: Reader | None = None) -> int:
    """The current generation as GEN_KEY says, or -1 (missing, refused, or older than one seen)."""
    msg = (_reader or Reader(opener, on_reject)).read(store, GEN_KEY, "gen")
    return -1 if msg is None else int(msg["gen"])


def wait_plan(store: Store, gen: int, timeout: float, opener: Opener | None = None,
              on_reject: RejectHook | None = None, _reader: Reader | None = None) -> GenerationPlan:
    """Block until a genuine plan of `gen` is published (or raise TimeoutError)."""
    deadline = time.monotonic() + timeout
    reader = _reader or Reader(opener, on_reject)
    while True:
        plan = reader.plan(store, gen)
        if plan is not None:
            return plan
        if time.monotonic() > deadline:
            raise TimeoutError(f"no plan for generation {gen} after {timeout:g}s")
        time.sleep(0.01)


# Generations looked for above the newest one found, per look: more than any recovery opens
# while a rank waits (each takes a failure), and a bound on what a forged pointer can cost.
PLAN_PROBE = 64


def _newest_from(store: Store, start: int, reader: Reader) -> tuple[int, GenerationPlan] | None:
    """The newest generation from `start` on whose genuine plan is published, and that plan."""
    found = None
    for gen in range(start, start + PLAN_PROBE):
        plan = reader.plan(store, gen)
        if plan is None:
            break
        found = (gen, plan)
    return found


def newest_plan(store: Store, at_least: int, timeout: float, opener: Opener | None = None,
                on_reject: RejectHook | None = None, reader: Reader | None = None) -> tuple[int, GenerationPlan]:
    """The newest generation >= `at_least` and its plan, waiting up to `timeout`. A `reader`
    kept across calls (a rank keeps one for its life) refuses a generation pointer older than
    any it has read before, and reports each refused value once.

    GEN_KEY is only a hint of where to look: anyone may delete it, or write back an older
    genuine value, so the plans themselves (sealed, each bound to its generation) are looked for
    from the hint (or from `at_least`) upward."""
    deadline = time.monotonic() + timeout
    reader = reader or Reader(opener, on_reject)
    while True:
        hint = current_gen(store, _reader=reader)
        found = _newest_from(store, hint, reader) if hint > at_least else None
        found = found or _newest_from(store, at_least, reader)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"no generation >= {at_least} after {timeout:g}s")
        time.sleep(0.01)

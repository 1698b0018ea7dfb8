"""The control plane's readers on hostile ground, over a real TCPStore: a queue counter that is
garbage, missing, pushed back or pushed far forward, and a generation pointer written back or
deleted. Each is refused (reported) and repaired, nothing blocks or walks without bound, and no
connection is lost (the server drops the connection of a client whose `add` meets garbage)."""
from __future__ import annotations

import threading
import time

from wire import control
from wire.generation_plan import GenerationPlan
from tests.helpers.store import loopback_store

TOKEN = "d" * 64
Q = "ctl/q"


def _rx(store: control.Store, reports: list[str]) -> control.Receiver:
    return control.Receiver(store, Q, gap_timeout=0.3, on_reject=lambda q, i, reason, raw: reports.append(reason))


def _send(store: control.Store, i: int) -> control.Blocked | None:
    return control.send_dict(store, Q, {"i": i})


def _drain(rx: control.Receiver, want: int, timeout: float = 3.0) -> list[int]:
    got: list[int] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += [m["i"] for m in rx.poll()]
        time.sleep(0.01)
    return got


def test_read_answers_at_once_for_a_missing_key() -> None:
    store = loopback_store()  # its calls time out after 5 s: a `get` would block that long
    t0 = time.monotonic()
    assert control.read(store, "nobody/wrote/this") is None
    store.set("k", b"v")
    assert control.read(store, "k") == b"v"
    assert time.monotonic() - t0 < 1.0


def test_counter_values_parse_strictly() -> None:
    assert control.parse_counter(b"12") == 12
    assert control.parse_counter(b"12:rank/0/ab12") == 12
    for bad in (None, b"", b"garbage", b"-5", b" 7", b"12abc", b"1" * 30, b"12:", b"\xff"):
        assert control.parse_counter(bad) is None, bad


def test_a_garbage_counter_is_reported_repaired_and_drops_no_connection() -> None:
    store = loopback_store()
    reports: list[str] = []
    rx = _rx(store, reports)
    assert _send(store, 0) is None and _drain(rx, 1) == [0]
    store.set(f"{Q}/n", "garbage")
    # A producer waits for the consumer's repair instead of asking the server to count garbage.
    sender = threading.Thread(target=_send, args=(store, 1))
    sender.start()
    got = _drain(rx, 1)
    sender.join(timeout=5)
    assert got == [1]
    assert any("not a count" in r for r in reports), reports
    assert control.parse_counter(control.read(store, f"{Q}/n")) is not None
    assert store.check([f"{Q}/n"])  # the connection is still good


def test_a_producer_is_not_held_longer_than_its_wait() -> None:
    store = loopback_store()
    store.set(f"{Q}/n", "garbage")  # and no consumer to repair it
    t0 = time.monotonic()
    blocked = control._reserve(store, Q, "me", wait=0.2)
    assert isinstance(blocked, control.Blocked) and blocked.raw == b"garbage"
    assert time.monotonic() - t0 < 1.0


def test_a_counter_pushed_below_zero_is_repaired_and_nothing_is_lost() -> None:
    store = loopback_store()
    reports: list[str] = []
    rx = _rx(store, reports)
    for i in range(3):
        _send(store, i)
    assert _drain(rx, 3) == [0, 1, 2]
    store.add(f"{Q}/n", -1_000_000)
    sender = threading.Thread(target=lambda: [_send(store, i) for i in (3, 4)])
    sender.start()
    got = _drain(rx, 2)
    sender.join(timeout=5)
    assert got == [3, 4] and any("not a count" in r for r in reports), (got, reports)


def test_a_counter_pushed_far_forward_costs_a_bounded_walk() -> None:
    store = loopback_store()
    reports: list[str] = []
    rx = _rx(store, reports)
    _send(store, 0)
    assert _drain(rx, 1) == [0]
    store.add(f"{Q}/n", 10_000_000)
    _send(store, 1)  # reserved just above the pushed value
    t0 = time.monotonic()
    got = _drain(rx, 1)
    assert got == [1] and time.monotonic() - t0 < 2.0
    assert any("jumped" in r for r in reports), reports
    assert len(rx._missing) <= 2 * control.REPAIR_MARGIN  # not ten million indices to look at again
    _send(store, 2)
    assert _drain(rx, 1) == [2]


def test_a_counter_set_back_is_reported_and_messages_written_below_are_found() -> None:
    store = loopback_store()
    reports: list[str] = []
    rx = _rx(store, reports)
    for i in range(6):
        _send(store, i)
    assert _drain(rx, 6) == list(range(6))
    store.set(f"{Q}/n", "2")  # a producer now reserves index 3 again, read long ago
    _send(store, 6)
    assert _drain(rx, 1) == [6]
    assert any("went back from 6 to 3" in r for r in reports), reports  # 3: the producer's
    _send(store, 7)  # the counter stands past everything handed out: no index is reused
    assert _drain(rx, 1) == [7]


def test_a_deleted_counter_is_made_again_and_nothing_is_lost() -> None:
    store = loopback_store()
    reports: list[str] = []
    rx = _rx(store, reports)
    for i in range(4):
        _send(store, i)
    assert _drain(rx, 4) == [0, 1, 2, 3]
    store.delete_key(f"{Q}/n")
    assert rx.poll() == [] and any("missing" in r for r in reports), reports
    store.delete_key(f"{Q}/n")
    _send(store, 4)  # made again by the producer, at the first index
    assert _drain(rx, 1) == [4]
    _send(store, 5)
    assert _drain(rx, 1) == [5]


def test_the_generation_never_goes_back_and_its_pointer_is_only_a_hint() -> None:
    store = loopback_store()
    sealer, opener = control.Sealer(TOKEN, "controller"), control.Opener(TOKEN)
    reports: list[tuple[str, str]] = []
    hook = lambda key, i, reason, raw: reports.append((key, reason))  # noqa: E731
    old = control.publish_plan(store, 1, GenerationPlan.fresh(1, 2, "peer"), sealer)[control.GEN_KEY]
    control.publish_plan(store, 2, GenerationPlan.fresh(2, 2, "peer"), sealer)
    reader = control.Reader(opener, hook)
    assert control.current_gen(store, _reader=reader) == 2
    store.set(control.GEN_KEY, old)  # the genuine pointer of generation 1, written back
    assert control.current_gen(store, _reader=reader) == -1
    assert any("went back from 2 to 1" in reason for _, reason in reports), reports
    # A rank waiting for generation 2 finds it by its plan, whatever the pointer says...
    t0 = time.monotonic()
    assert control.newest_plan(store, 2, 1.0, opener, hook)[0] == 2
    store.delete_key(control.GEN_KEY)  # ...or when there is none
    assert control.newest_plan(store, 1, 1.0, opener, hook)[0] == 2
    assert time.monotonic() - t0 < 1.0
    # A reader kept across waits (a rank's) refuses the old pointer in a later wait too, and
    # reports that value no more than once.
    reports.clear()
    store.set(control.GEN_KEY, old)
    assert control.newest_plan(store, 2, 1.0, opener, hook, reader=reader)[0] == 2
    assert control.newest_plan(store, 2, 1.0, opener, hook, reader=reader)[0] == 2
    assert reports == [], reports  # reported once already, above
    assert control.current_gen(store, _reader=control.Reader(opener, hook)) == 1  # a fresh reader cannot tell


def test_a_counter_tampered_with_in_a_loop_keeps_the_work_per_poll_bounded() -> None:
    store = loopback_store()
    reports: list[str] = []
    rx = control.Receiver(store, Q, gap_timeout=5.0, on_reject=lambda q, i, reason, raw: reports.append(reason),
                          max_gap=64)
    for _ in range(200):  # garbage after every poll: each repair moves the counter on a margin
        store.set(f"{Q}/n", "garbage")
        rx.poll()
    assert len(rx._missing) <= 2 * 64
    assert len(reports) <= 2  # reported at most once a second, the rest counted
    _send(store, 1)
    assert _drain(rx, 1) == [1]


def test_threads_of_one_process_reserving_at_once_never_share_an_index() -> None:
    store = loopback_store()
    rx = control.Receiver(store, Q)
    threads = [threading.Thread(target=lambda t=t: [_send(store, 100 * t + i) for i in range(50)]) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    got = _drain(rx, 200, timeout=10)
    assert sorted(got) == sorted(100 * t + i for t in range(4) for i in range(50))


def test_a_counter_at_the_top_of_its_range_is_set_back_and_nothing_is_lost() -> None:
    # 18 nines: a count the parser accepts, one below the index no producer could write back.
    # Written once and then every 20 ms while three producers send 40 messages each: every
    # message arrives once, each producer's in its order, and the counter ends in range.
    store = loopback_store()
    reports: list[str] = []
    rx = _rx(store, reports)
    top = b"9" * 18
    store.set(f"{Q}/n", top)
    stop = threading.Event()

    def attack() -> None:
        while not stop.wait(0.02):
            store.set(f"{Q}/n", top)

    def produce(p: int) -> None:
        for i in range(40):
            assert control.send_dict(store, Q, {"i": p * 100 + i}) is None

    threads = [threading.Thread(target=attack)] + [threading.Thread(target=produce, args=(p,)) for p in range(3)]
    for t in threads:
        t.start()
    got = _drain(rx, 120, timeout=30.0)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert sorted(got) == sorted(p * 100 + i for p in range(3) for i in range(40)), len(got)
    for p in range(3):
        mine = [g for g in got if g // 100 == p]
        assert mine == sorted(mine)
    assert any("jumped to 999999999999999999" in r for r in reports), reports
    time.sleep(0.1)
    assert _drain(rx, 0) == [] and rx.poll() == []
    _send(store, 999)
    assert _drain(rx, 1) == [999]
    n = control.parse_counter(control.read(store, f"{Q}/n"))
    assert n is not None and n < 10_000  # back where the messages are


def test_a_producer_never_reserves_past_the_top_of_the_range() -> None:
    store = loopback_store()
    store.set(f"{Q}/n", b"9" * 18)  # and no consumer to set it back
    blocked = control._reserve(store, Q, "me", wait=0.2)
    assert isinstance(blocked, control.Blocked) and blocked.raw == b"9" * 18
    assert control.read(store, f"{Q}/n") == b"9" * 18  # nothing written at an index nobody reads

"""The control-plane queue over a real TCPStore: order, and a producer that died mid-send. The
queue carries any JSON object: these send plain ones (`send_dict`), typed messages are tested apart."""
from __future__ import annotations

import time


from wire import control
from tests.helpers.store import loopback_store


_store = loopback_store


def test_messages_arrive_in_order_once() -> None:
    store = _store()
    rx = control.Receiver(store, "q")
    for i in range(5):
        control.send_dict(store, "q", {"i": i})
    assert [m["i"] for m in rx.poll()] == [0, 1, 2, 3, 4]
    assert rx.poll() == []


def test_a_reserved_but_unwritten_message_holds_nobody_up() -> None:
    store = _store()
    rx = control.Receiver(store, "q", gap_timeout=0.3)
    control.send_dict(store, "q", {"i": 0})
    store.add("q/n", 1)  # a producer reserved index 2 and stopped (or died) before writing it
    control.send_dict(store, "q", {"i": 2})
    t0 = time.monotonic()
    assert [m["i"] for m in rx.poll()] == [0, 2]  # others' messages are not held behind the gap
    assert time.monotonic() - t0 < 0.2
    store.set("q/2", '{"i": 1}')  # the stopped producer resumes within the grace: delivered
    assert [m["i"] for m in rx.poll()] == [1]
    store.add("q/n", 1)  # index 4 is reserved by a producer that never comes back
    assert rx.poll() == []
    time.sleep(0.35)
    assert rx.poll() == [] and rx._missing == {}  # given up, not waited on forever

"""The allowance that keeps a flood of refused messages out of the record, one by one."""
from __future__ import annotations

import threading

import pytest

from recovery import throttle
from recovery.throttle import Throttle


def test_a_few_a_second_pass_and_the_rest_are_counted_into_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    t = Throttle(3)
    assert [t.admit() for _ in range(5)] == [0, 0, 0, None, None]
    now[0] += 0.99  # the same window
    assert t.admit() is None
    now[0] += 0.02  # a new one: the three held back travel with the first admitted
    assert [t.admit() for _ in range(4)] == [3, 0, 0, None]
    now[0] += 5.0
    assert t.admit() == 1


def test_threads_sharing_one_allowance_admit_exactly_its_size() -> None:
    t = Throttle(50)
    results: list[int | None] = []
    lock = threading.Lock()

    def hammer() -> None:
        for _ in range(100):
            r = t.admit()
            with lock:
                results.append(r)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    admitted = [r for r in results if r is not None]
    # 800 tries within a second or two: 50 per window, the held ones counted exactly once.
    assert len(results) == 800 and 50 <= len(admitted) <= 150
    assert len(admitted) + sum(admitted) + t._held == 800  # none lost, none counted twice

"""The stacks a lingering rank writes (`faulthandler`) are found at the end of its stderr log,
whatever it printed before, for the exit barrier's root cause."""
from __future__ import annotations

from ffctl.agent.workers import python_stacks

DUMP = [
    "Thread 0x00007f1 (most recent call first):",
    '  File "/usr/lib/python3.11/threading.py", line 320 in wait',
    "",
    "Current thread 0x00007f2 (most recent call first):",
    '  File "/job/train.py", line 63 in main',
    '  File "/job/train.py", line 66 in <module>',
]


def test_the_whole_last_dump_and_nothing_before_it() -> None:
    before = ["OUT rank=1 done", "Thread 0x00007f0 (most recent call first):", '  File "old.py", line 1 in f',
              "a line the script printed after an older dump"]
    assert python_stacks(before + DUMP) == DUMP
    assert python_stacks(DUMP) == DUMP


def test_no_dump_is_nothing() -> None:
    assert python_stacks(["OUT rank=1 done", "Traceback (most recent call last):"]) == []
    assert python_stacks([]) == []

"""The typed reader of a run record's fields: every field `runs.metrics` reads from an event goes
through one of these functions, which returns it as the type the report computes with or raises
`BadField` naming the event, the field and the value.

A record line can be valid JSON and still hold what no controller writes (`"step": "abc"`, a
list where a count belongs, `"NaN"` as a string, a negative count). Read with `int()` or
`float()` such a value raises a bare ValueError or TypeError deep inside the metrics, which the
CLI cannot tell from a bug; read here it is one error that says where it is. A field that is
absent (or JSON null) takes its default: older records lack fields newer ones carry, and that is
no corruption. A value of the wrong type is never coerced: `"3"` is not step 3.

Events carry no line numbers (`runs.events.Event`), so `BadField` holds the event itself and the
reader of the file finds its line with `line_of` once, on the error path only.
"""
from __future__ import annotations

import json
import math
import os
import stat
from enum import Enum
from pathlib import Path
from typing import Any, Final

from runs.events import Event, EventKind

# The sentinel default of a field a record must carry: absent or null is then bad too.
REQUIRED: Final[Any] = object()
_SHOWN_MAX = 60  # characters of a bad value shown: enough to recognise it, never a whole page


class BadField(ValueError):
    """A record field that holds a value of the wrong type or range. A ValueError, so every
    caller that already treats a bad record as unusable (`ffctl project`, the listing of
    `ffctl report`) goes on treating it so. `line` is the line of events.jsonl that holds the
    event, once `at_line` has set it (None: not known, or the event is not from that file)."""

    def __init__(self, event: Event, field: str, value: Any, expected: str, line: int | None = None) -> None:
        self.event = event
        self.kind = event.kind.value
        self.field = field
        self.value = value
        self.expected = expected
        self.line = line
        super().__init__(str(self))

    def at_line(self, line: int | None) -> BadField:
        """This error with the event's line in events.jsonl."""
        return BadField(self.event, self.field, self.value, self.expected, line)

    def __str__(self) -> str:
        where = f"events.jsonl line {self.line}" if self.line is not None else "events.jsonl"
        return (f"{where} ({self.kind} event): field {self.field!r} is {shown(self.value)}, "
                f"not {self.expected}")


def shown(value: Any) -> str:
    """A bad value as one short line: its repr (which escapes line breaks), cut if long."""
    text = "missing" if value is _ABSENT else repr(value)
    return text if len(text) <= _SHOWN_MAX else text[:_SHOWN_MAX - 3] + "..."


_ABSENT: Final[Any] = object()  # what `_raw` returns for a field the event does not carry


def _raw(event: Event, name: str) -> Any:
    value = event.data.get(name, _ABSENT)
    return _ABSENT if value is None else value


def _is_int(value: Any) -> bool:
    # bool is an int subclass in Python; `true` is never a step or a count. A whole float (3.0)
    # is the same number as written by a writer that went through a float: it counts.
    if isinstance(value, float):
        return math.isfinite(value) and value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def count(event: Event, name: str, default: Any = 0) -> int:
    """A whole number >= 0 (a step, a generation, a count, a world size)."""
    value = _raw(event, name)
    if value is _ABSENT:
        if default is REQUIRED:
            raise BadField(event, name, value, "a whole number >= 0")
        return int(default)
    if not _is_int(value) or value < 0:
        raise BadField(event, name, value, "a whole number >= 0")
    return int(value)


def opt_count(event: Event, name: str) -> int | None:
    """A whole number >= 0, or None when the record has none."""
    return None if _raw(event, name) is _ABSENT else count(event, name)


def step(event: Event, name: str = "step") -> int:
    """The step a `step` event (or another that must name one) commits: required."""
    return count(event, name, REQUIRED)


def gen(event: Event) -> int:
    """The generation an event belongs to (0 in a record that predates generations)."""
    return count(event, "gen", 0)


def number(event: Event, name: str, default: float | None = 0.0, finite: bool = True,
           minimum: float | None = None) -> float | None:
    """A real number (JSON int or float; never a string, even "NaN"). `finite=False` lets a
    NaN or infinity the writer produced through (a loss that diverged is recorded as NaN)."""
    value = _raw(event, name)
    if value is _ABSENT:
        return default
    expected = "a finite number" if finite else "a number"
    if minimum is not None:
        expected += f" >= {minimum:g}"
    if not _is_real(value) or (finite and not math.isfinite(value)) \
            or (minimum is not None and not value >= minimum):
        raise BadField(event, name, value, expected)
    return float(value)


def duration(event: Event, name: str, default: float = 0.0) -> float:
    """Seconds that passed: a finite number >= 0."""
    value = number(event, name, default, minimum=0.0)
    return default if value is None else value


def text(event: Event, name: str, default: str = "") -> str:
    """A string field (a `str` enum, as a test's hand-made event may hold, reads as its value)."""
    value = _raw(event, name)
    if value is _ABSENT:
        return default
    if isinstance(value, Enum) and isinstance(value.value, str):
        return value.value
    if not isinstance(value, str):
        raise BadField(event, name, value, "a string")
    return value


def opt_text(event: Event, name: str) -> str | None:
    """A string field, or None when the record has none."""
    return None if _raw(event, name) is _ABSENT else text(event, name)


def ident(event: Event, name: str) -> str:
    """An id (fault_id, failure_id) as text: ids are written as strings; a number reads as its
    text, since ids are only compared as text. Anything else (a list, a dict) is bad."""
    value = _raw(event, name)
    if value is _ABSENT:
        return "None"  # what str() gave an absent id before, so records without ids read as before
    if _is_int(value):
        return str(value)
    return text(event, name)


def key(event: Event, name: str) -> Any:
    """A value used to tell things apart (a node): a string, a whole number or none. A list or
    a dict cannot be compared as one and is bad."""
    value = event.data.get(name)
    if value is None or isinstance(value, str) or _is_int(value):
        return value
    raise BadField(event, name, value, "a string or a whole number")


def counts(event: Event, name: str) -> list[int]:
    """A list of whole numbers >= 0 (ranks); none when the record has none."""
    value = _raw(event, name)
    if value is _ABSENT:
        return []
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise BadField(event, name, value, "a list of whole numbers >= 0")
    return [int(v) for v in value]


def nested_counts(event: Event, name: str, inner: str) -> list[int]:
    """`inner` of the object field `name` (a restore's `transfer.healed`) as a list of whole
    numbers >= 0; none when either is absent. Named `name.inner` when bad."""
    outer = _raw(event, name)
    if outer is _ABSENT:
        return []
    if not isinstance(outer, dict):
        raise BadField(event, name, outer, "an object")
    value = outer.get(inner)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise BadField(event, f"{name}.{inner}", value, "a list of whole numbers >= 0")
    return [int(v) for v in value]


def time_of(event: Event) -> float:
    """The event's controller-clock time: the store reads `t` with float(), which takes the
    strings "NaN" and "inf" too; no clock says either."""
    if not math.isfinite(event.t):
        raise BadField(event, "t", event.t, "a finite time")
    return event.t


def line_of(path: Path, event: Event) -> int | None:
    """The line of `path` (an events.jsonl) that holds `event`, or None (not in the file: a dead
    man's switch's revert merged in from its own log, or the file changed since it was read).
    Read again only to name a bad line: the first line that decodes to the same event."""
    want = event.to_json()
    try:
        # Without blocking: the file was a regular one when it was read, but need not be now.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return None
        for n, raw in enumerate(fh, 1):
            try:
                obj = json.loads(raw)
                found = Event(kind=EventKind(obj.pop("event")), t=float(obj.pop("t")), data=obj)
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                continue  # a line the store skipped (torn, unknown kind) or refused
            if found.to_json() == want:
                return n
    return None

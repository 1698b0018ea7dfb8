"""Seeded chaos schedules: `--chaos mtbf=120s,seed=7[,kinds=kill-rank|kill-node][,until=600][,duration=5]`.

Faults arrive with exponential inter-arrival times of mean `mtbf` (a Poisson process, the usual
model of independent failures). Each fault's kind is drawn from `kinds`, its target is mode `one`
with a seed derived from the schedule seed and the fault's index, and its trigger is `t=` seconds
after the start. The same text always gives the same schedule.
"""
from __future__ import annotations

import hashlib
import random
import secrets
import re
from dataclasses import dataclass
from typing import Iterator

from wire.fault_spec import (
    MAX_DURATION_S, MAX_SEED, MAX_T_S, REQUIRED_OPTIONS, REVERTIBLE, FaultKind, FaultSpec, FaultSpecError, Target, TargetMode, Trigger,
    parse_kind,
)

DEFAULT_KINDS = (FaultKind.KILL_RANK,)
# ASCII digits only (`\d` takes any script's), a bounded count of them.
_NUMBER = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,9})?)(ms|s|m|h)?", re.ASCII)
_SEED = re.compile(r"[0-9]{1,19}", re.ASCII)
# Below a second between faults the schedule is a flood (and its list grows without bound).
MIN_MTBF_S = 1.0
_SCALE = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_KEYS = ("mtbf", "seed", "kinds", "until", "duration")


def _q(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _seconds(key: str, text: str, *, minimum: float = 0.0, maximum: float = MAX_T_S) -> float:
    match = _NUMBER.fullmatch(text.strip())
    if not match:
        raise FaultSpecError(f"{key}={_q(text)} is not a time like 120s, 2m or 90")
    value = float(match.group(1)) * _SCALE[match.group(2)]
    if value <= 0:
        raise FaultSpecError(f"{key}={_q(text)} must be more than zero")
    if value < minimum:
        raise FaultSpecError(f"{key}={_q(text)} is too short (at least {minimum:g}s)")
    if value > maximum:
        raise FaultSpecError(f"{key}={_q(text)} is too long (at most {maximum:g}s)")
    return value


@dataclass(frozen=True)
class ChaosSpec:
    mtbf: float  # mean seconds between faults
    seed: int = 0
    kinds: tuple[FaultKind, ...] = DEFAULT_KINDS
    until: float | None = None  # no fault after this many seconds from the start
    duration: float | None = None  # how long each revertible fault lasts

    def schedule(self, until: float | None = None) -> list[tuple[float, FaultSpec]]:
        end = until if until is not None else self.until
        if end is None:
            raise FaultSpecError("a chaos schedule needs an end: until=SECONDS")
        return mtbf_schedule(self.mtbf, self.seed, self.kinds, until=end, duration=self.duration)

    def __str__(self) -> str:
        parts = [f"mtbf={self.mtbf:g}s", f"seed={self.seed}", "kinds=" + "|".join(k.value for k in self.kinds)]
        if self.until is not None:
            parts.append(f"until={self.until:g}")
        if self.duration is not None:
            parts.append(f"duration={self.duration:g}")
        return ",".join(parts)


def with_seed(text: str) -> tuple[str, int | None]:
    """`text` with a `seed=` of its own: as given, or with one drawn now appended (and the seed
    drawn, to be said and recorded: a schedule that found a bug must be one a user can repeat)."""
    if any(part.partition("=")[0].strip() == "seed" for part in text.split(",")):
        return text, None
    seed = secrets.randbelow(1 << 31)
    return f"{text.rstrip(', ')},seed={seed}", seed


def parse_chaos(text: str) -> ChaosSpec:
    """Parse `mtbf=120s,seed=7[,kinds=kill-rank|kill-node][,until=SECONDS][,duration=SECONDS]`."""
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise FaultSpecError(f"bad field {_q(part)} in chaos spec {_q(text)} (expected key=value)")
        if key not in _KEYS:
            raise FaultSpecError(f"unknown key {_q(key)} in chaos spec {_q(text)} (known: {', '.join(_KEYS)})")
        if key in fields:
            raise FaultSpecError(f"{key}= given twice in chaos spec {_q(text)}")
        fields[key] = value.strip()
    if "mtbf" not in fields:
        raise FaultSpecError(f"chaos spec {_q(text)} needs mtbf=SECONDS")
    seed_text = fields.get("seed", "0")
    if not _SEED.fullmatch(seed_text) or int(seed_text) > MAX_SEED:
        raise FaultSpecError(f"seed={_q(seed_text)} is not a non-negative integer (at most {MAX_SEED})")
    kinds: tuple[FaultKind, ...] = DEFAULT_KINDS
    if "kinds" in fields:
        names = [k.strip() for k in fields["kinds"].split("|")]
        if not all(names):
            raise FaultSpecError(f"kinds={_q(fields['kinds'])} has an empty kind")
        kinds = tuple(dict.fromkeys(parse_kind(name) for name in names))
    for kind in kinds:
        if REQUIRED_OPTIONS.get(kind):
            need = ", ".join(f"{key}=" for key in REQUIRED_OPTIONS[kind])
            raise FaultSpecError(f"kinds={_q(fields['kinds'])}: a {kind.value} needs {need}, which a chaos schedule "
                                 "cannot give (schedule it with --inject)")
    if "duration" in fields and not any(k in REVERTIBLE for k in kinds):
        # Otherwise ignored: none of these kinds is ever reverted.
        raise FaultSpecError(f"duration={_q(fields['duration'])}: none of the kinds "
                             f"{', '.join(k.value for k in kinds)} is reverted, so a duration does not apply")
    return ChaosSpec(
        mtbf=_seconds("mtbf", fields["mtbf"], minimum=MIN_MTBF_S),
        seed=int(seed_text),
        kinds=kinds,
        until=_seconds("until", fields["until"]) if "until" in fields else None,
        duration=_seconds("duration", fields["duration"], maximum=MAX_DURATION_S) if "duration" in fields else None,
    )


def fault_seed(seed: int, index: int) -> int:
    """Seed of the index-th fault's target pick: stable across Python versions and processes."""
    digest = hashlib.sha256(f"ffctl-chaos:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def iter_mtbf(
    mtbf: float, seed: int, kinds: tuple[FaultKind, ...] = DEFAULT_KINDS, duration: float | None = None
) -> Iterator[tuple[float, FaultSpec]]:
    """The endless schedule: (seconds after start, spec), in time order."""
    if mtbf <= 0:
        raise FaultSpecError(f"mtbf={mtbf!r} must be more than zero")
    if not kinds:
        raise FaultSpecError("a chaos schedule needs at least one fault kind")
    rng = random.Random(seed)
    t = 0.0
    index = 0
    while True:
        t += rng.expovariate(1.0 / mtbf)
        kind = kinds[rng.randrange(len(kinds))]
        at = round(t, 3)  # milliseconds: what a scenario file or the record can say exactly
        yield at, FaultSpec(
            kind=kind,
            target=Target(TargetMode.ONE),
            trigger=Trigger(t=at),
            duration=duration,
            seed=fault_seed(seed, index),
        )
        index += 1


def mtbf_schedule(
    mtbf: float,
    seed: int,
    kinds: tuple[FaultKind, ...] = DEFAULT_KINDS,
    *,
    until: float,
    duration: float | None = None,
) -> list[tuple[float, FaultSpec]]:
    """Every fault of the schedule that arrives before `until` seconds."""
    if until <= 0:
        raise FaultSpecError(f"until={until!r} must be more than zero")
    out: list[tuple[float, FaultSpec]] = []
    for t, spec in iter_mtbf(mtbf, seed, kinds, duration):
        if t >= until:
            break
        out.append((t, spec))
    return out

"""A generation's plan: what the controller tells every rank of generation g (DESIGN.md,
"One-step restoration", steps 3 and 4).

    GenerationPlan(gen, world_size, strategy, restore_step, sources={rank: source, ...})

The controller decides it (`ffctl.controller.decide`), publishes it sealed under `gen/<g>/plan`
(`wire.control.publish_plan`), and each rank reads it back (`control.newest_plan`) and
restores its state from its own source (`recovery.job.Job._join`). A source is one of a small
union of frozen dataclasses, each a kind of copy of a rank's state:

- `Fresh`: none, the rank starts from step 0 (a new job, or a restart with nothing to restore);
- `LocalSlot`: its own shared-memory slot on node `node` (the rank's agent's);
- `PeerReplica`: the snapshot store at `address:port` (the ring neighbour's agent), `where`
  saying which of its copies (the replicas it holds, or its own ranks' slots);
- `Disk`: the newest complete disk checkpoint of the job.

On the wire a plan is a message like every other of the control plane (`wire.messages`):
`{"type": "plan", "gen": g, ..., "sources": {"<rank>": {"type": "<kind>", ...}}}`, and it is
decoded the same way, field by field, by one decoder (`GenerationPlan.from_dict`) that raises
`DecodeError` with one line for anything wrong: an unknown kind of source, a field missing or of
the wrong type, a source for a rank outside the generation, a restore step some rank has no copy
of. A reader refuses such a plan and reports it like any forged value; a rank never falls back
to something the plan did not say. A new kind of source (the shards of a sharded state, next) is
one more `@_source` dataclass and one more case where a rank fetches its copy.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, Union

from wire.jobenv import Strategy

# The plan is decoded by the very machinery of the control plane's messages (their field checks,
# their descriptions of what a field wants, their table-driven decoder), not by a copy of it.
from wire.messages import (
    _WANT,
    DecodeError,
    Limits,
    M,
    Message,
    _addr,
    _decode_fields,
    _enum,
    _field,
    _is_int,
    _nat,
    _node,
    _port,
    _rank_key,
    _register,
    _Spec,
    dataclass_transform,
    short_repr,
)
from runs.events import Label, RestoreSource

# The kinds of source are the restore sources a run reports (`runs.events.RestoreSource`); only
# those registered here may appear in a plan ("replica" and "script" are words of the record).
SOURCES: dict[str, _Spec] = {}


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(_field,))
def _source(kind: RestoreSource) -> Callable[[type[M]], type[M]]:
    return _register(SOURCES, kind)


class _Source(Message):
    """What every kind of source is: a message of the plan whose kind is a `RestoreSource`."""

    __slots__ = ()
    kind: ClassVar[RestoreSource]


class Where(Label):
    """Which copies a snapshot store looks in for a `PeerReplica`."""

    REPLICA = "replica"  # the replicas it holds of its ring neighbour's ranks
    LOCAL = "local"  # its own node's ranks' slots


def _where(v: Any, _: Limits | None) -> bool:
    return isinstance(v, str) and v in Where._value2member_map_


def _strategy(v: Any, _: Limits | None) -> bool:
    return isinstance(v, str) and v in Strategy._value2member_map_


def _world(v: Any, lim: Limits | None) -> bool:
    return _is_int(v) and 0 < v <= (lim.world_size if lim is not None else 1 << 20)


def _mapping(v: Any, _: Limits | None) -> bool:
    return isinstance(v, dict)


_WANT.update({_where: " or ".join(w.value for w in Where), _strategy: " or ".join(Strategy.ALL),
              _world: "a world size of the job", _mapping: '{rank: {"type": kind, ...}}'})


@_source(RestoreSource.NONE)
class Fresh(_Source):
    """No copy: the rank starts from step 0 (its initial state is the fault-free run's)."""


@_source(RestoreSource.LOCAL_MEMORY)
class LocalSlot(_Source):
    """The rank's own shared-memory slot on `node` (written by the rank itself before the
    failure, read straight from the node's shared memory)."""

    node: int = _field(_node)


@_source(RestoreSource.PEER_MEMORY)
class PeerReplica(_Source):
    """A copy held by the snapshot store at `address:port` (an agent), fetched over the job's
    authenticated channel; `where` says which of its copies."""

    address: str = _field(_addr)
    port: int = _field(_port)
    where: Where = _field(_where, _enum(Where))

    @property
    def holder(self) -> str:
        """"address:port": the name the copy goes by when a rank refuses it (`restore_failed`)."""
        return f"{self.address}:{self.port}"


@_source(RestoreSource.DISK)
class Disk(_Source):
    """The job's disk checkpoint of the restore step."""


Source = Union[Fresh, LocalSlot, PeerReplica, Disk]
FRESH = Fresh()


def decode_source(raw: Any, limits: Limits | None = None) -> Source:
    """One rank's source from its wire form (DecodeError for anything else)."""
    if not isinstance(raw, dict):
        raise DecodeError(f"not a source: {short_repr(raw)}")
    kind = raw.get("type")
    spec = SOURCES.get(kind) if isinstance(kind, str) else None
    if spec is None or not isinstance(kind, str):
        raise DecodeError(f"unknown source kind {short_repr(kind)}")
    return _decode_fields(spec, kind, raw, limits)  # type: ignore[return-value]  # SOURCES holds sources only


def _sources(value: dict[Any, Any], limits: Limits | None) -> dict[int, Source]:
    out: dict[int, Source] = {}
    for key, raw in value.items():
        if not _rank_key(key, limits):
            raise DecodeError(f"bad rank {short_repr(key)}")
        try:
            out[int(key)] = decode_source(raw, limits)
        except DecodeError as exc:
            raise DecodeError(f"rank {key}: {exc.reason}") from None
    return out


PLANS: dict[str, _Spec] = {}


class PlanKind(Label):
    PLAN = "plan"


@_register(PLANS, PlanKind.PLAN)
class GenerationPlan(Message):
    """Generation `gen`: `world_size` ranks, recovering with `strategy`, start after
    `restore_step` (0: from scratch), each rank's state of that step from `sources[rank]`."""

    gen: int = _field(_nat)
    world_size: int = _field(_world)
    strategy: Strategy = _field(_strategy, _enum(Strategy))
    restore_step: int = _field(_nat)
    sources: Mapping[int, Source] = _field(_mapping, _sources)

    def __post_init__(self) -> None:
        # What no single field shows: every source names a rank of the generation, and a
        # restore step is one every rank has a copy of. Checked when a plan is made too, so
        # the controller can never publish one a rank would refuse.
        outside = [r for r in self.sources if not 0 <= r < self.world_size]
        if outside:
            raise DecodeError(f"plan: source for rank {outside[0]}, outside a world of {self.world_size}")
        if self.restore_step > 0 or self.restores:
            missing = [r for r in range(self.world_size) if isinstance(self.sources.get(r, FRESH), Fresh)]
            if missing:
                raise DecodeError(f"plan: restore step {self.restore_step} but rank {missing[0]} has no copy of it")

    @classmethod
    def fresh(cls, gen: int, world_size: int, strategy: str) -> GenerationPlan:
        """A generation that starts from step 0 (the job's first, or a restart from scratch)."""
        return cls(gen=gen, world_size=world_size, strategy=Strategy(strategy), restore_step=0, sources={})

    @property
    def restores(self) -> bool:
        """Whether the ranks restore the restore step from copies, rather than start fresh. Step 0
        too: the initial state is a step (a rank lost in step 1 is restored from it), and a
        survivor that has trained past it must go back to it from its copy, which a fresh start
        would never do (it keeps the state it has: the same weights after DDP's broadcast, but
        the optimizer's moments of a later step)."""
        return any(not isinstance(s, Fresh) for s in self.sources.values())

    def source(self, rank: int) -> Source:
        """Where `rank` gets the restore step's state (`Fresh` when the generation starts fresh)."""
        return self.sources.get(rank, FRESH) if self.restores else FRESH

    def to_dict(self) -> dict[str, Any]:
        """The wire form; sources keyed by the rank's decimal digits, as JSON keys are."""
        out = Message.to_dict(self)
        out["sources"] = {str(r): s.to_dict() for r, s in sorted(self.sources.items())}
        return out


def decode_plan(raw: Any, limits: Limits | None = None) -> GenerationPlan:
    """A plan from its wire form (DecodeError, and only that, for anything that is not one)."""
    if not isinstance(raw, dict):
        raise DecodeError(f"not a plan: {short_repr(raw)}")
    if raw.get("type") != PlanKind.PLAN.value:
        raise DecodeError(f"a {short_repr(raw.get('type'))} where a plan belongs")
    # PLANS holds GenerationPlan alone.
    return _decode_fields(PLANS[PlanKind.PLAN.value], PlanKind.PLAN.value, raw, limits)  # type: ignore[return-value]

"""Snapshot format: a rank's training state as (meta, shard bytes).

Replicated state (the same on every data-parallel rank: parameters, a replicated optimizer) is
laid out as one byte string of all its tensors, and each rank keeps only its 1/W slice, so a
replica group holds the replicated state once in total. Sharded state (registered `sharded=True`:
an FSDP model's and optimizer's local shards, each rank's own and large) is kept whole by its
rank, its tensors' bytes after the replicated slice, copied into the slot like the slice and never
pickled. Unique state (RNG, counters, anything small registered `replicated=False`) is kept whole
by its rank inside the meta. Restoring gathers the slices back (`assemble`). Every tensor is
copied byte for byte: a restored run is bit-exact.

A `DTensor` (torch's distributed tensor, what FSDP2's state dicts hold) is snapshotted as its
local tensor with its placements and global shape, and handed back as a `LocalShard`: the caller
that knows the device mesh makes it a `DTensor` again (`recovery.fsdp`). Nothing here issues a
collective.
"""
from __future__ import annotations

import ctypes
import io
import pickle
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class StateEntry:
    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    replicated: bool
    sharded: bool = False  # the rank's own, large: its tensors kept as bytes beside the slice
    # Sharded only: the global ranks that hold the same shards (HSDP: this rank's column of the
    # mesh, itself included); () when they are this rank's alone. A lost rank's shards are then
    # healed from a live one of them rather than read from its copy.
    replicas: tuple[int, ...] = ()


def state_entry(name: str, state_dict: Callable[[], Any] | None, load_state_dict: Callable[[Any], None] | None,
                replicated: bool, aliases: dict[str, Callable[..., Any]], sharded: bool = False,
                replicas: tuple[int, ...] = ()) -> StateEntry:
    """The entry `register` makes, in torch's words (`state_dict`, `load_state_dict`) or in the
    older ones (`get=`, `set=`, kept as aliases), whichever the caller used, never both."""
    unknown = sorted(set(aliases) - {"get", "set"})
    if unknown:
        raise TypeError(f"register() got an unexpected keyword argument {unknown[0]!r}")
    if "get" in aliases and state_dict is not None or "set" in aliases and load_state_dict is not None:
        raise TypeError("register(): give state_dict/load_state_dict or get/set, not both")
    save, load = state_dict or aliases.get("get"), load_state_dict or aliases.get("set")
    if not callable(save) or not callable(load):
        raise TypeError(f"register({name!r}): state_dict and load_state_dict must be callables")
    if replicated and sharded:
        raise ValueError(f"register({name!r}): state is replicated or sharded, not both")
    if replicas and not sharded:
        raise ValueError(f"register({name!r}): replicas= names the holders of sharded state")
    return StateEntry(name, save, load, replicated, sharded, tuple(int(r) for r in replicas))


class _TensorRef:
    """Placeholder left in a state's structure where tensor number `index` was."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_TensorRef, (self.index,))


@dataclass(frozen=True)
class LocalShard:
    """A `DTensor` as a snapshot holds it: this rank's local tensor, how it is placed on the
    mesh, and the global shape and stride (`DTensor.from_local` takes them back)."""

    local: torch.Tensor
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _ShardRef:
    """Placeholder left where a `DTensor` was: its local tensor is tensor number `index`."""

    __slots__ = ("index", "placements", "shape", "stride")

    def __init__(self, index: int, placements: tuple[Any, ...], shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.index, self.placements, self.shape, self.stride = index, placements, shape, stride

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_ShardRef, (self.index, self.placements, self.shape, self.stride))


_DTENSOR: type[DTensor] | None = None


def _dtensor_type() -> type[DTensor] | None:
    """torch's DTensor class, if anything in this process has loaded distributed tensors. Not
    imported here: `torch.distributed.tensor` costs half a second of CPU (it brings sympy), in
    every process that imports this module (the CLI, each agent and worker template), and
    until some code has imported it no tensor can be a DTensor. Kept once found: this is asked
    for every tensor of every snapshot."""
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(module, "DTensor", None) if module is not None else None
    return _DTENSOR


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (any other tensor as it is), from its field where torch has one:
    `to_local()` is an autograd function, a tenth of a millisecond per tensor, and the snapshot
    asks for every tensor of the state every step; only its bytes are read (detached)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return t.to_local() if hasattr(t, "to_local") else t


def _flatten(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(obj, dtensor):
            # Its local tensor only: anything that looks at the DTensor as a whole (a reshape,
            # a view as bytes) would be a collective.
            out.append(local_tensor(obj))
            return _ShardRef(len(out) - 1, tuple(obj.placements), tuple(obj.shape), tuple(obj.stride()))
        out.append(obj)
        return _TensorRef(len(out) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, out) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_flatten(v, out) for v in obj)
    return obj


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorRef):
        return tensors[obj.index]
    if isinstance(obj, _ShardRef):
        return LocalShard(tensors[obj.index], obj.placements, obj.shape, obj.stride)
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unflatten(v, tensors) for v in obj)
    return obj


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's storage (no copy for contiguous tensors)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor's bytes, without a copy.

    torch offers the buffer protocol only through numpy, which ffctl does not depend on (a
    user's environment may not have it); a ctypes array over the tensor's memory gives the same
    view. The array keeps the tensor alive for as long as the view exists."""
    if t.dtype != torch.uint8 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"byte_view needs a contiguous CPU uint8 tensor, not {t.dtype} on {t.device}")
    if t.numel() == 0:
        return memoryview(bytearray())
    arr = (ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())
    arr._owner = t  # type: ignore[attr-defined]  # a ctypes array takes new attributes; the stub has none
    return memoryview(arr).cast("B")


Spec = tuple[str, tuple[int, ...], int]  # (dtype, shape, nbytes)


@dataclass(frozen=True)
class Layout:
    """Where each replicated tensor lies in the replicated byte string, and this rank's slice;
    then the rank's own sharded tensors, which follow its slice in its shard bytes."""

    specs: tuple[Spec, ...]
    total: int
    chunk: int
    own: tuple[Spec, ...] = ()
    own_total: int = 0

    def shard(self, rank: int) -> tuple[int, int]:
        start = min(self.total, rank * self.chunk)
        return start, min(self.total, start + self.chunk)

    def slice_len(self, rank: int) -> int:
        lo, hi = self.shard(rank)
        return hi - lo


def _specs(tensors: list[torch.Tensor]) -> tuple[Spec, ...]:
    return tuple((str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()) for t in tensors)


def slice_pieces(layout: Layout, tensors: tuple[torch.Tensor, ...], index: int) -> list[tuple[int, torch.Tensor]]:
    """(offset within the slice, uint8 source) for every tensor byte range in slice `index` of
    the replicated byte string (rank `index`'s share)."""
    lo, hi = layout.shard(index)
    pieces, pos = [], 0
    for t, (_, _, nbytes) in zip(tensors, layout.specs):
        a, b = max(lo, pos), min(hi, pos + nbytes)
        if a < b:
            pieces.append((a - lo, as_bytes(t)[a - pos : b - pos]))
        pos += nbytes
    return pieces


@dataclass(frozen=True)
class Replicated:
    """The replicated and sharded entries of the live state, by reference: their structure and
    tensors (the replicated ones first, in layout order, then the rank's own sharded ones)."""

    skeletons: dict[str, Any]
    layout: Layout
    tensors: tuple[torch.Tensor, ...]

    @property
    def own(self) -> tuple[torch.Tensor, ...]:
        """The sharded entries' tensors, in layout order."""
        return self.tensors[len(self.layout.specs):]


def replicated(entries: list[StateEntry], world_size: int) -> Replicated:
    tensors: list[torch.Tensor] = []
    skeletons = {e.name: _flatten(e.get(), tensors) for e in entries if e.replicated}
    specs = _specs(tensors)
    # The sharded entries go on in the same list: their placeholders count on from the replicated.
    skeletons.update({e.name: _flatten(e.get(), tensors) for e in entries if e.sharded})
    own_specs = _specs(tensors[len(specs):])
    total = sum(s[2] for s in specs)
    layout = Layout(specs=specs, total=total, chunk=-(-total // world_size) if world_size else total,
                    own=own_specs, own_total=sum(s[2] for s in own_specs))
    return Replicated(skeletons, layout, tuple(tensors))


def own_pieces(layout: Layout, tensors: tuple[torch.Tensor, ...]) -> list[tuple[int, torch.Tensor]]:
    """(offset within the own part, uint8 source) for each sharded tensor; `tensors` are the
    replicated ones then the own ones, as `Replicated.tensors` holds them."""
    pieces, pos = [], 0
    for t, (_, _, nbytes) in zip(tensors[len(layout.specs):], layout.own):
        if nbytes:
            pieces.append((pos, as_bytes(t)))
        pos += nbytes
    return pieces


@dataclass(frozen=True)
class Capture:
    """One step's state, captured by reference (tensors still live) until copied into a slot."""

    step: int
    rank: int
    world_size: int
    layout: Layout
    tensors: tuple[torch.Tensor, ...]
    meta: bytes  # pickled: step, rank, world size, layout, skeletons, unique state

    def shard_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """(offset within the shard, uint8 source) for every tensor byte range this rank keeps:
        its slice of the replicated state, then its own sharded tensors."""
        base = self.layout.slice_len(self.rank)
        own = [(base + off, src) for off, src in own_pieces(self.layout, self.tensors)]
        return slice_pieces(self.layout, self.tensors, self.rank) + own

    @property
    def shard_len(self) -> int:
        return self.layout.slice_len(self.rank) + self.layout.own_total


def capture(entries: list[StateEntry], step: int, rank: int, world_size: int,
            loss: float | None = None) -> Capture:
    """Step `step`'s state by reference, and the loss the run records for it: a restore of this
    copy tells the controller that loss, which no report may have brought (see `Restored`)."""
    rep = replicated(entries, world_size)
    unique = {e.name: e.get() for e in entries if not e.replicated and not e.sharded}
    buf = io.BytesIO()
    # Unique state is small (RNG, counters, a data position); torch.save clones it now,
    # so later in-place updates cannot tear it.
    torch.save(unique, buf)
    meta = pickle.dumps(
        {"step": step, "rank": rank, "world_size": world_size, "layout": rep.layout,
         "skeletons": rep.skeletons, "unique": buf.getvalue(), "loss": loss},
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    return Capture(step, rank, world_size, rep.layout, rep.tensors, meta)


def read_meta(meta: bytes) -> dict[str, Any]:
    return pickle.loads(meta)


def unique_states(meta: dict[str, Any]) -> dict[str, Any]:
    """The entries kept whole by their rank (RNG, a sharded optimizer's shard, ...)."""
    states: dict[str, Any] = torch.load(io.BytesIO(meta["unique"]), weights_only=False)
    return states


def tensors_from(specs: tuple[Spec, ...], raw: torch.Tensor, copy: bool) -> list[torch.Tensor]:
    """The tensors `specs` lays out in the byte buffer `raw`: views of it, or copies."""
    tensors, pos = [], 0
    for dtype, shape, nbytes in specs:
        piece = raw[pos : pos + nbytes]
        piece = piece.clone() if copy else piece
        tensors.append(piece.view(getattr(torch, dtype)).reshape(shape))
        pos += nbytes
    return tensors


def _as_tensor(raw: bytes | memoryview | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)


def own_bytes(meta: dict[str, Any], shard: bytes | memoryview) -> memoryview:
    """The sharded entries' part of a rank's shard bytes (after its replicated slice)."""
    layout: Layout = meta["layout"]
    base = layout.slice_len(meta["rank"])
    return memoryview(shard)[base : base + layout.own_total]


def assemble(meta: dict[str, Any], replicated: bytes | torch.Tensor, copy: bool = True,
             own: bytes | memoryview | torch.Tensor = b"") -> dict[str, Any]:
    """Every entry's state from the meta of a rank, the whole replicated byte string and that
    rank's own sharded bytes (`own_bytes`). `copy=False` when `replicated` is a fresh buffer the
    caller gives away: the tensors are then views of it rather than copies (an optimizer adopts
    loaded tensors as they are)."""
    layout: Layout = meta["layout"]
    tensors = tensors_from(layout.specs, _as_tensor(replicated), copy)
    tensors += tensors_from(layout.own, _as_tensor(own), copy=False)  # a fresh buffer already
    return rebuild(meta, tuple(tensors))


def rebuild(meta: dict[str, Any], tensors: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Every entry's state: the snapshot's structure and non-tensor values (learning rates,
    counters) around `tensors`, which must hold the snapshot's replicated tensors in layout
    order, then its own sharded ones."""
    states = {name: _unflatten(sk, list(tensors)) for name, sk in meta["skeletons"].items()}
    states.update(unique_states(meta))
    return states

"""Snapshot format: a rank's training state as (meta, shard bytes).

Replicated state (the same on every data-parallel rank: parameters, a replicated optimizer) is
laid out as one byte string of all its tensors, and each rank keeps only its 1/W slice, so a
replica group holds the replicated state once in total. Unique state (RNG, a sharded optimizer's
own shard, anything registered `replicated=False`) is kept whole by its rank. Restoring gathers
the slices back (`assemble`). Every tensor is copied byte for byte: a restored run is bit-exact.
"""
from __future__ import annotations

import ctypes
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class StateEntry:
    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    replicated: bool


def state_entry(name: str, state_dict: Callable[[], Any] | None, load_state_dict: Callable[[Any], None] | None,
                replicated: bool, aliases: dict[str, Callable[..., Any]]) -> StateEntry:
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
    return StateEntry(name, save, load, replicated)


class _TensorRef:
    """Placeholder left in a state's structure where tensor number `index` was."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_TensorRef, (self.index,))


def _flatten(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
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
    arr._owner = t  # type: ignore[attr-defined]
    return memoryview(arr).cast("B")


@dataclass(frozen=True)
class Layout:
    """Where each replicated tensor lies in the replicated byte string, and this rank's slice."""

    specs: tuple[tuple[str, tuple[int, ...], int], ...]  # (dtype, shape, nbytes)
    total: int
    chunk: int

    def shard(self, rank: int) -> tuple[int, int]:
        start = min(self.total, rank * self.chunk)
        return start, min(self.total, start + self.chunk)


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
    """The replicated entries of the live state, by reference: their structure and tensors."""

    skeletons: dict[str, Any]
    layout: Layout
    tensors: tuple[torch.Tensor, ...]


def replicated(entries: list[StateEntry], world_size: int) -> Replicated:
    tensors: list[torch.Tensor] = []
    skeletons = {e.name: _flatten(e.get(), tensors) for e in entries if e.replicated}
    specs = tuple((str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()) for t in tensors)
    total = sum(s[2] for s in specs)
    layout = Layout(specs=specs, total=total, chunk=-(-total // world_size) if world_size else total)
    return Replicated(skeletons, layout, tuple(tensors))


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
        """(offset within the shard, uint8 source) for every tensor byte range in this rank's slice."""
        return slice_pieces(self.layout, self.tensors, self.rank)

    @property
    def shard_len(self) -> int:
        lo, hi = self.layout.shard(self.rank)
        return hi - lo


def capture(entries: list[StateEntry], step: int, rank: int, world_size: int) -> Capture:
    rep = replicated(entries, world_size)
    unique = {e.name: e.get() for e in entries if not e.replicated}
    buf = io.BytesIO()
    # Unique state is small (RNG, counters, a sharded optimizer's part); torch.save clones it now,
    # so later in-place updates cannot tear it.
    torch.save(unique, buf)
    meta = pickle.dumps(
        {"step": step, "rank": rank, "world_size": world_size, "layout": rep.layout,
         "skeletons": rep.skeletons, "unique": buf.getvalue()},
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    return Capture(step, rank, world_size, rep.layout, rep.tensors, meta)


def read_meta(meta: bytes) -> dict[str, Any]:
    return pickle.loads(meta)


def unique_states(meta: dict[str, Any]) -> dict[str, Any]:
    """The entries kept whole by their rank (RNG, a sharded optimizer's shard, ...)."""
    states: dict[str, Any] = torch.load(io.BytesIO(meta["unique"]), weights_only=False)
    return states


def assemble(meta: dict[str, Any], replicated: bytes | torch.Tensor, copy: bool = True) -> dict[str, Any]:
    """Every entry's state from the meta of any rank and the whole replicated byte string.
    `copy=False` when `replicated` is a fresh buffer the caller gives away: the tensors are then
    views of it rather than copies (an optimizer adopts loaded tensors as they are)."""
    layout: Layout = meta["layout"]
    raw = replicated if isinstance(replicated, torch.Tensor) else torch.frombuffer(bytearray(replicated), dtype=torch.uint8)
    tensors, pos = [], 0
    for dtype, shape, nbytes in layout.specs:
        piece = raw[pos : pos + nbytes]
        piece = piece.clone() if copy else piece
        tensors.append(piece.view(getattr(torch, dtype)).reshape(shape))
        pos += nbytes
    return rebuild(meta, tuple(tensors))


def rebuild(meta: dict[str, Any], tensors: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Every entry's state: the snapshot's structure and non-tensor values (learning rates,
    counters) around `tensors`, which must hold the snapshot's replicated bytes in layout order."""
    states = {name: _unflatten(sk, list(tensors)) for name, sk in meta["skeletons"].items()}
    states.update(unique_states(meta))
    return states

"""A torch process group ffctl owns: what torch's own sharded modules run on under ffctl.

`FSDP2` (`fully_shard`), `DeviceMesh` and `DTensor` issue their collectives on torch process
groups, in C++ and in Python, and block in them until every peer answers: a lost peer leaves every
survivor in a collective until gloo's or NCCL's timeout. Under ffctl they run instead on
`ResilientGroup`s, torch `ProcessGroup`s registered as the "ffctl" backend (so `init_device_mesh`
and `new_group` make them as they make any group):

- A group keeps its rank and size for the whole job (ffctl replaces a lost rank under the same
  number), so torch's modules and their sharding never change. What changes is the generation:
  every collective goes to the gloo (or NCCL) group of the generation the rank is in now, the
  whole world's (`Generation.pg`) or a mesh dimension's (`Generation.subgroup`, built when it is
  first used in a generation). A rank that joins generation g+1 (`bind`) has every group it made
  rebuilt in place: same process, same objects, no re-import.
- Each collective's wait is the generation's abortable wait: a survivor blocked on a dead peer
  gives up as soon as the controller aborts the generation, within the detection bound.
- A failed collective never raises into torch's modules: it completes with its output left as
  it was, and the failure is recorded (`failure`) and raised before any parameter moves, by the
  optimizer's step pre-hook (`recovery.fsdp`) and by the job after the step function. Every
  later collective of the failed generation completes at once, issuing nothing, so the rest of
  the step runs through quickly on garbage that is never committed, without its matrix products
  (`recovery.failed_step`). Raising instead would leave
  FSDP2's state machine half way: an exception in a forward's all-gather leaves a module's
  unshard pending, and its next forward skips the all-gather that a replacement rank issues,
  which pairs different collectives across the ranks of the next generation (measured: gloo
  aborted the survivor on a size mismatch); inside `backward()` it would leave torch's
  post-backward state half-finalized. A completed step, however wrong its numbers, leaves every
  module resharded and ready.

The default group is made with a `HashStore` of this process: nothing of torch's own rendezvous
goes over the control store, whose clients authenticate nobody; each generation's groups meet
under keys of that generation, as the rest of ffctl's groups do.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from recovery import failed_step
from recovery.errors import PeerFailure

if TYPE_CHECKING:
    from recovery.group import Generation

BACKEND = "ffctl"


class _Binding:
    """The generation this process's groups run on, and its failure if one was seen. One per
    process, as torch's process groups are (the default group is process-wide)."""

    def __init__(self) -> None:
        self.gen: Generation | None = None
        self.failed: PeerFailure | None = None  # the failure seen in `gen`, if any
        self.waited = 0.0  # seconds spent blocked in collectives since `take_waited`
        self.lock = threading.Lock()
        self.on_issue: Callable[[], None] | None = None  # called as each collective is issued

    def fail(self, exc: PeerFailure) -> None:
        with self.lock:
            if self.gen is not None and exc.gen == self.gen.gen and self.failed is None:
                self.failed = exc


_BINDING = _Binding()


def bind(gen: Generation | None) -> None:
    """Run every resilient group on generation `gen` from now on (None: none, the job is over).
    The groups of the previous generation are the `Generation`'s to destroy."""
    with _BINDING.lock:
        _BINDING.gen, _BINDING.failed = gen, None
    failed_step.leave()  # whatever step failed in the previous generation is over
    if gen is not None:
        failed_step.trains_here()


def on_collective(hook: Callable[[], None] | None) -> None:
    """Call `hook` as each collective of torch's modules is issued (where a kill-rank with
    phase=collective lands in an FSDP step)."""
    _BINDING.on_issue = hook


def failure() -> PeerFailure | None:
    """The failure a collective of the current generation met, if any (see the module's docstring)."""
    return _BINDING.failed


def take_waited() -> float:
    """Seconds this process's collectives have blocked since the last call (a rank's busy time
    is its step time less this: what the straggler detector reads)."""
    with _BINDING.lock:
        waited, _BINDING.waited = _BINDING.waited, 0.0
    return waited


def _absorb(exc: PeerFailure) -> bool:
    """Record the failure for the step's end; the collective counts as done (see the module),
    and the rest of the step runs without its matrix products (`recovery.failed_step`)."""
    _BINDING.fail(exc)
    failed_step.enter()
    return True


class _GenerationWork(dist._Work):
    """A collective of one generation; waiting on it is the generation's abortable wait."""

    def __init__(self, gen: Generation, work: Any, what: str) -> None:
        super().__init__()
        self._gen, self._work, self._what = gen, work, what
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if self._done:
            return True
        begun = time.perf_counter()
        try:
            self._gen.wait(self._work, self._what)
        except PeerFailure as exc:
            return _absorb(exc)
        finally:
            with _BINDING.lock:
                _BINDING.waited += time.perf_counter() - begun
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())

    def get_future(self) -> torch.futures.Future[Any]:
        return self._work.get_future()


class _FailedWork(dist._Work):
    """A collective of a generation that has failed already: issued to nobody."""

    def __init__(self, exc: PeerFailure) -> None:
        super().__init__()
        self._exc = exc

    def wait(self, timeout: Any = None) -> bool:
        return _absorb(self._exc)

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(None)
        return fut


def _as_process_group(backend: Any, rank: int, size: int) -> dist.ProcessGroup:
    """A torch `ProcessGroup` over one generation's backend (gloo or NCCL), so every method of
    torch's group API is there to delegate to. Gloo serves CPU tensors (and CUDA ones where no
    NCCL is used); NCCL serves CUDA tensors."""
    group = dist.ProcessGroup(dist.HashStore(), rank, size)
    if isinstance(backend, dist.ProcessGroupGloo):
        kind = dist.ProcessGroup.BackendType.GLOO
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    else:
        kind = dist.ProcessGroup.BackendType.NCCL
        devices = ["cuda"]
    group._set_default_backend(kind)
    for device in devices:
        group._register_backend(torch.device(device), kind, backend)
    return group


def _collective(name: str) -> Callable[..., Any]:
    def call(self: ResilientGroup, *args: Any) -> Any:
        return self._issue(name, lambda pg: getattr(pg, name)(*args))

    call.__name__ = name
    call.__doc__ = f"torch's `ProcessGroup.{name}`, on the current generation's group."
    return call


class ResilientGroup(dist.ProcessGroup):
    """A process group of fixed ranks whose collectives run on the current generation's group
    (see the module's docstring). `members` are the global ranks, in group-rank order."""

    def __init__(self, rank: int, size: int, members: tuple[int, ...]) -> None:
        # torch's stub lists only the (store, rank, size) overload; the binding has (rank, size).
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.members = members
        self._name = ""
        self._inner: tuple[int, dist.ProcessGroup] | None = None  # (generation, its group)

    def getBackendName(self) -> str:  # torch's name
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]  # torch types it as GroupName, a NewType of str
        return self._name

    def _group_of(self, gen: Generation) -> dist.ProcessGroup:
        if self._inner is None or self._inner[0] != gen.gen:
            whole = self.members == tuple(range(gen.world_size))
            backend = gen.pg if whole else gen.subgroup(self.members)
            self._inner = (gen.gen, _as_process_group(backend, self.rank(), self.size()))
        return self._inner[1]

    def _issue(self, what: str, call: Callable[[dist.ProcessGroup], Any]) -> dist._Work:
        hook = _BINDING.on_issue
        if hook is not None:
            hook()
        with _BINDING.lock:
            gen, failed = _BINDING.gen, _BINDING.failed
        if gen is None:
            raise RuntimeError(f"ffctl: a collective ({what}) outside job.run(): under ffctl the process "
                               "group exists only while the job trains")
        if failed is not None:
            failed_step.enter()
            return _FailedWork(failed)
        try:
            inner = self._group_of(gen)
        except PeerFailure as exc:  # its rendezvous in this generation was aborted
            _absorb(exc)
            return _FailedWork(exc)
        return _GenerationWork(gen, call(inner), what)

    allreduce = _collective("allreduce")
    allreduce_coalesced = _collective("allreduce_coalesced")
    allgather = _collective("allgather")
    allgather_coalesced = _collective("allgather_coalesced")
    _allgather_base = _collective("_allgather_base")
    all_gather_single = _collective("all_gather_single")
    allgather_into_tensor_coalesced = _collective("allgather_into_tensor_coalesced")
    all_gather_single_coalesced = _collective("all_gather_single_coalesced")
    reduce_scatter = _collective("reduce_scatter")
    _reduce_scatter_base = _collective("_reduce_scatter_base")
    reduce_scatter_single = _collective("reduce_scatter_single")
    reduce_scatter_tensor_coalesced = _collective("reduce_scatter_tensor_coalesced")
    reduce_scatter_single_coalesced = _collective("reduce_scatter_single_coalesced")
    broadcast = _collective("broadcast")
    reduce = _collective("reduce")
    gather = _collective("gather")
    scatter = _collective("scatter")
    alltoall = _collective("alltoall")
    alltoall_base = _collective("alltoall_base")
    all_to_all_single = _collective("all_to_all_single")
    send = _collective("send")
    recv = _collective("recv")

    def barrier(self, opts: Any = None) -> dist._Work:
        # gloo's barrier ignores an abort; an allreduce of one element is a barrier that does not.
        return self._issue("barrier", lambda pg: pg.allreduce([torch.zeros(1)]))


def _create(opts: Any, _backend_options: Any) -> ResilientGroup:
    """torch's constructor hook for the "ffctl" backend (`Backend.register_backend`): the
    default group (no ranks listed: all of them) and every group `new_group` makes of it."""
    members = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    return ResilientGroup(opts.group_rank, opts.group_size, members)


def init_default_group(rank: int, world_size: int) -> None:
    """Make torch's default process group a resilient one (once per process): what
    `init_device_mesh`, `new_group` and `fully_shard` then build on."""
    if dist.is_initialized():
        if dist.get_backend() != BACKEND:
            raise RuntimeError("torch's default process group exists already; under ffctl let the job "
                               "make it (job.device_mesh), not init_process_group")
        return
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)

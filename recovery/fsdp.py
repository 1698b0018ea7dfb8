"""One-step recovery for a model sharded with torch's `fully_shard` (FSDP2), HSDP included.

    job = Job.from_env()
    mesh = job.device_mesh("cpu", (world,))              # was: init_device_mesh("cpu", (world,))
    for block in model.blocks: fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), ...)
    batches = job.register_fsdp(model=model, optimizer=opt, scheduler=sched, loader=loader)
    job.run(train_step, steps)                           # train_step(ctx): forward, backward, opt.step()

torch's FSDP2 does its work as it always does (sharded parameters, all-gathers before each
block's forward and backward, reduce-scatters of the gradients); only the process groups under
the mesh change: they are ffctl's `ResilientGroup`s (`recovery.process_group`), rebuilt under each
generation and abortable, so a lost peer never leaves a survivor waiting in a collective.

The state is registered as torch's distributed checkpointing sees it
(`torch.distributed.checkpoint.state_dict`: `get_model_state_dict`, `get_optimizer_state_dict`,
and their `set_` twins), sharded: each rank's snapshot holds its local shards of the parameters
and of the optimizer's state, whole, byte for byte, and is replicated to the ring neighbour's
agent like every slot. After a failure a survivor whose live shards are its snapshot's keeps them
(they are checksummed against its copy); a replacement loads its own shards, from its agent after
a process fault or from the neighbour after a node fault. Under HSDP (a 2D mesh, replicated over
its first dimension) a replacement's shards are healed from a live rank that holds the same ones
(its column of the mesh) and checked against its copy's checksum; its copy supplies the rest. The
scheduler is replicated, the data position (`recovery.ddp.Batches`) the rank's own, as on the DDP path.

A step whose collective failed is unwound before any parameter moves: the optimizer's step
pre-hook raises the failure (and fences the previous step's snapshot, which the update must not
race), and so does a check after the step function. The step's loss that the run reports is the
mean over the ranks, one small allreduce after the step function.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from recovery import process_group
from recovery.ddp import Batches, Host, mean_over_ranks, register_schedule_and_data
from recovery.snapshot import LocalShard, local_tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _dtensor() -> type[DTensor]:
    from torch.distributed.tensor import DTensor

    return DTensor


def mesh_of(model: torch.nn.Module) -> Any:
    """The device mesh `model`'s sharded parameters live on (FSDP2 puts all of them on one)."""
    dtensor = _dtensor()
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, dtensor)}
    if not meshes:
        raise TypeError(f"register_fsdp: {type(model).__name__} has no sharded parameter; "
                        "apply torch's fully_shard to it (with mesh=job.device_mesh(...)) first")
    if len(meshes) > 1:
        raise ValueError(f"register_fsdp: the model's parameters live on {len(meshes)} device meshes; one is supported")
    return next(iter(meshes.values()))


def replica_group(mesh: Any) -> tuple[int, ...]:
    """The global ranks that hold this rank's shards: HSDP's replicate dimension (the first of a
    2D mesh) through this rank's place on the shard dimension; () for a 1D mesh (FSDP: the
    shards are this rank's alone)."""
    if mesh.ndim != 2:
        return ()
    ranks = mesh.mesh  # global ranks laid out as the mesh
    _, col = (int(i) for i in (ranks == mesh.get_rank()).nonzero()[0])
    return tuple(int(r) for r in ranks[:, col].tolist())


def _to_dtensors(state: Any, mesh: Any) -> Any:
    """A snapshot's state with each `LocalShard` made a `DTensor` on `mesh` again (no collective:
    the placements and global shape are the snapshot's)."""
    if isinstance(state, LocalShard):
        return _dtensor().from_local(state.local, mesh, state.placements, run_check=False,
                                     shape=torch.Size(state.shape), stride=state.stride)
    if isinstance(state, dict):
        return {k: _to_dtensors(v, mesh) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_dtensors(v, mesh) for v in state]
    if isinstance(state, tuple):
        return tuple(_to_dtensors(v, mesh) for v in state)
    return state


def model_identity(model: torch.nn.Module) -> tuple[Any, ...]:
    """What a model's state dict refers to: each parameter and buffer object and the memory of
    its (local) tensor. Equal between two calls when every tensor torch's state dict would hand
    out is still the one it handed out before (updated in place, as optimizers do)."""
    return tuple((id(t), local_tensor(t).data_ptr()) for t in (*model.parameters(), *model.buffers()))


def optimizer_identity(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What an optimizer's state dict refers to: its parameters, each one's state dict and the
    objects in it, and every value of that state that is not a tensor (a count kept as a Python
    number changes the dict without touching any tensor)."""
    params = tuple(id(p) for g in optimizer.param_groups for p in g["params"])
    state = tuple((id(p), id(st), tuple((k, id(v), local_tensor(v).data_ptr()) if isinstance(v, torch.Tensor) else (k, repr(v))
                                         for k, v in st.items()))
                  for p, st in optimizer.state.items())
    return params, state


def with_live_groups(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state dict with its param groups' settings (the learning rate a scheduler
    moves each step) read again from the live optimizer; their parameter names kept."""
    groups = [{**{k: v for k, v in live.items() if k != "params"}, "params": kept["params"]}
              for kept, live in zip(state["param_groups"], optimizer.param_groups)]
    return {**state, "param_groups": groups}


class LiveStateDict:
    """torch's distributed state dict of a model or optimizer (`get_model_state_dict`,
    `get_optimizer_state_dict`), taken once and handed out again while it still refers to the
    live tensors.

    Taking it costs milliseconds of Python on every call (it walks the module tree, maps
    parameters to names, wraps each shard again), and the snapshot asks for it after every step;
    what it returns refers to the tensors themselves, which the optimizer updates in place. So
    it is taken again only when `identity` (which objects, which memory, which non-tensor values
    it would hand out) changed: a parameter replaced, an optimizer state created or loaded.
    `refresh` reads again what changes beside the tensors (an optimizer's learning rate)."""

    def __init__(self, take: Callable[[], Any], identity: Callable[[], Any],
                 refresh: Callable[[Any], Any] = lambda state: state) -> None:
        self.take, self.identity, self.refresh = take, identity, refresh
        self.state: Any = None
        self.key: Any = None
        self.taken = 0  # how many times it was taken afresh

    def __call__(self) -> Any:
        if self.state is None or self.identity() != self.key:
            self.state = self.take()
            self.key = self.identity()  # after the take: the first one creates an optimizer's state
            self.taken += 1
            return self.state
        return self.refresh(self.state)


def live_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[LiveStateDict, LiveStateDict]:
    """The model's and the optimizer's state dicts as the snapshot takes them, each step."""
    from torch.distributed.checkpoint import state_dict as dcp

    return (LiveStateDict(lambda: dcp.get_model_state_dict(model), lambda: model_identity(model)),
            LiveStateDict(lambda: dcp.get_optimizer_state_dict(model, optimizer), lambda: optimizer_identity(optimizer),
                          lambda sd: with_live_groups(sd, optimizer)))


class Guard:
    """Unwinds a step whose collective failed, before the optimizer moves any parameter."""

    def __init__(self, job: Host, optimizer: torch.optim.Optimizer) -> None:
        self.job = job
        self.optimizer = optimizer

    def raise_failure(self) -> None:
        exc = process_group.failure()
        if exc is not None:
            self.optimizer.zero_grad(set_to_none=True)  # gradients of a failed reduce-scatter
            raise exc

    def before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.raise_failure()
        self.job.fence()

    def after_step(self, loss: float) -> float:
        self.raise_failure()
        return mean_over_ranks(self.job, loss)


def attach(job: Host, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None,
           loader: Iterable | None) -> Batches | None:
    """`Job.register_fsdp`: see the module's docstring."""
    from torch.distributed.checkpoint import state_dict as dcp

    mesh = mesh_of(model)
    guard = Guard(job, optimizer)
    optimizer.register_step_pre_hook(guard.before_update)
    job.on_after_step(guard.after_step)

    def load_model(state: Any) -> None:
        dcp.set_model_state_dict(model, _to_dtensors(state, mesh))

    def load_optimizer(state: Any) -> None:
        dcp.set_optimizer_state_dict(model, optimizer, _to_dtensors(state, mesh))

    get_model, get_optimizer = live_state_dicts(model, optimizer)
    replicas = replica_group(mesh)
    job.register("model", get_model, load_model, sharded=True, replicas=replicas)
    job.register("optimizer", get_optimizer, load_optimizer, sharded=True, replicas=replicas)
    return register_schedule_and_data(job, scheduler, loader)

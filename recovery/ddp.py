"""One-step recovery for torch's own `DistributedDataParallel` (DDP).

    job = Job.from_env()
    model = DDP(net, process_group=job.ddp_group())
    batches = job.register_ddp(model=model, optimizer=opt, scheduler=sched, loader=loader)
    def train_step(ctx):
        x, y = next(batches); opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward()
        opt.step(); sched.step(); return loss.item()
    job.run(train_step, steps)

DDP keeps doing what it does (buckets, autograd hooks, `no_sync`, buffer handling); only where
its gradients travel changes:

- DDP's own process group is private to the rank, of size 1 (`private_group`). DDP's collectives
  (the parameter shape check and broadcast at construction, bucket-order agreement, buffer
  broadcasts) are then local no-ops, so a replacement rank that builds DDP issues no collective
  the survivors never join, and DDP never blocks in C++ on a peer that died. What DDP's init
  broadcast would have done, the library does over the job's generation group when the job
  starts fresh (`_broadcast_from_rank0`).
- Gradients go through a communication hook (`Reduction.hook`) into the library's abortable
  allreduce over the current generation, divided by its world size as DDP's default hook does.
  The hook gathers every bucket of the iteration and reduces all gradients at the last one, in
  one flat buffer in parameter order: DDP rebuilds its buckets after the first iteration (in
  gradient-ready order), so a replacement rank's first iteration has other buckets than the
  survivors'; a reduction in parameter order matches element for element on every rank and
  sums each element in the same order as the fault-free run, so losses stay bit-identical.
- The reduction is the step's first collective, so a survivor caught in it by a peer's failure
  recovers in place (`Job._collective`): it joins the next generation inside the hook and, its
  state being the last committed step's, repeats only the allreduce with the replacements, which
  restore that step and compute the step afresh ("continued": no survivor computes it twice).
- Any other failure inside the hook is not raised through autograd (that would leave DDP's
  reducer half-finalized and unusable). The hook completes every bucket's future with the local
  gradients, remembers the failure and lets `backward()` finish, so the reducer is ready for
  the next iteration. The optimizer's step pre-hook then raises it before any parameter moves
  (and a check after the step function catches a step that had no optimizer step): the step
  unwinds to `Job.run`, which (once the next generation is joined and the last committed step
  restored, if the hook has not done so) trains the interrupted step again.
- Model, optimizer, scheduler and data position are registered as the job's state: the model's
  parameters and the optimizer replicated (each rank snapshots a 1/W slice), the scheduler's
  counters with them; the model's buffers (DDP's per-forward broadcast of rank 0's is local on
  the private group) and the data position (`Batches`: epoch and batches taken) per rank, so a
  loop over a `DistributedSampler`'s `DataLoader` resumes at the same sample after a restore.
- The step's loss that the run reports is the mean over the ranks: reduced with the gradients
  when the step function hands it over before `backward()` (`StepContext.reduce_loss`), else by
  a one-element allreduce after the step function.
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from recovery.errors import PeerFailure

if TYPE_CHECKING:
    from recovery.group import Generation

PRIVATE_GROUP_TIMEOUT = datetime.timedelta(seconds=60)


class Host(Protocol):
    """What this module needs of the `Job` it serves (`recovery.job` imports this module): its
    public surface only, so the DDP path is one more user of what any script may call."""

    @property
    def world_size(self) -> int: ...

    def register(self, name: str, state_dict: Callable[[], Any] | None = None,
                 load_state_dict: Callable[[Any], None] | None = None, *, replicated: bool = False,
                 sharded: bool = False, replicas: tuple[int, ...] = ()) -> None: ...

    def on_after_step(self, hook: Callable[[float], float]) -> None: ...

    def on_fresh_start(self, hook: Callable[[Generation], None]) -> None: ...

    def use_reduction(self, reduction: Reduction) -> None: ...

    def fence(self) -> None: ...

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


def private_group() -> dist.ProcessGroup:
    """A gloo process group of this rank alone, for DDP's `process_group=`.

    Built as torch builds its own groups (a ProcessGroup with a gloo backend registered for the
    CPU), over a store in this process: no rendezvous, no peer, nothing a failure can block.
    DDP needs a `ProcessGroup` (a bare backend object is refused by its C++ checks) and calls
    only collectives of a size-1 group on it, which complete at once."""
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    gloo = dist.ProcessGroupGloo(store, 0, 1, PRIVATE_GROUP_TIMEOUT)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    if torch.cuda.is_available():
        # Gloo also moves CUDA tensors; DDP's init checks and buffer broadcasts stay local anyway.
        group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return group


class Batches:
    """An endless iterator over a `DataLoader`'s batches, epoch after epoch, whose position is
    part of the job's state.

    At each epoch's start it calls `set_epoch(epoch)` on the loader's sampler (or its batch
    sampler) when it has one, as a `DistributedSampler` loop does. Its state is (epoch, batches
    taken in the epoch, the RNG state the epoch's iterator was made with). After a restore the
    next batch comes from a new iterator of the restored epoch, made from the same RNG state
    (a `DataLoader` draws its workers' seed, a `RandomSampler` its shuffle seed, from torch's
    generator) and advanced past the batches already taken, then the RNG is put back: the
    batches are the ones the fault-free run saw and the training RNG is untouched. The world
    size and rank never change under ffctl, so a `DistributedSampler` keeps its shard. Skipping
    loads the skipped batches (a `DataLoader` has no cheaper way to seek); it happens only on
    ranks that restore, once per recovery."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.epoch = 0
        self.taken = 0  # batches taken from the current epoch
        self._epoch_rng: torch.Tensor | None = None
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._open()
        assert self._it is not None
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.taken, self._epoch_rng = self.epoch + 1, 0, None
            self._open()
            try:
                batch = next(self._it)
            except StopIteration:
                raise RuntimeError(f"the data loader yields no batch in epoch {self.epoch}") from None
        self.taken += 1
        return batch

    def _generator(self) -> torch.Generator | None:
        return getattr(self.loader, "generator", None)

    def _get_rng(self) -> torch.Tensor:
        gen = self._generator()
        return gen.get_state() if gen is not None else torch.get_rng_state()

    def _set_rng(self, state: torch.Tensor) -> None:
        gen = self._generator()
        if gen is not None:
            gen.set_state(state)
        else:
            torch.set_rng_state(state)

    def _set_epoch(self) -> None:
        for owner in (getattr(self.loader, "sampler", None), getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            if owner is not None and hasattr(owner, "set_epoch"):
                owner.set_epoch(self.epoch)
                return

    def _open(self) -> None:
        self._set_epoch()
        if self.taken == 0 or self._epoch_rng is None:
            self._epoch_rng = self._get_rng().clone()
            self._it = iter(self.loader)
            self.taken = 0
            return
        # Mid-epoch after a restore: replay the epoch's draws from its starting RNG state.
        now = self._get_rng().clone()
        self._set_rng(self._epoch_rng)
        try:
            self._it = iter(self.loader)
            for _ in range(self.taken):
                next(self._it)
        finally:
            self._set_rng(now)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "taken": self.taken, "epoch_rng": self._epoch_rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.taken = int(state["epoch"]), int(state["taken"])
        rng = state["epoch_rng"]
        self._epoch_rng = rng.clone() if rng is not None else None
        self._it = None  # the next batch comes from an iterator of the restored position


class Reduction:
    """The communication hook and the unwinding of a step whose gradient reduction failed."""

    def __init__(self, job: Host, model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        self.job = job
        self.model = model
        self.optimizer = optimizer
        self.order = {id(p): i for i, p in enumerate(model.module.parameters())}
        self.failure: PeerFailure | None = None
        self._pending: list[tuple[Any, torch.futures.Future[torch.Tensor]]] = []
        self._flat: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None  # the step's loss, given by `StepContext.reduce_loss`
        self._mean_loss: float | None = None  # ...and its mean over the ranks, from the reduction
        self.reductions = 0  # completed reductions (for tests and logs)

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's comm hook: hold each bucket until the iteration's last, then reduce them all."""
        if bucket.index() == 0:
            self._pending.clear()  # a new backward (an earlier one may have been cut short)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._pending.append((bucket, fut))
        if bucket.is_last():
            pending, self._pending = self._pending, []
            try:
                self._reduce([b for b, _ in pending])
            finally:
                # Every future completes whatever happened, with the reduced gradients or the
                # local ones: DDP's reducer then finalizes normally and is ready for the next
                # iteration. A step with a failure never reaches the optimizer (`before_update`).
                for b, f in pending:
                    f.set_result(b.buffer())
        return fut

    def _reduce(self, buckets: list[Any]) -> None:
        views: list[tuple[int, torch.Tensor]] = []
        for b in buckets:
            views += [(self.order[id(p)], g) for p, g in zip(b.parameters(), b.gradients())]
        views.sort(key=lambda v: v[0])
        grads = [g for _, g in views]
        parts = [g.reshape(-1) for g in grads]
        if self._loss is not None:  # the loss travels as one more element: no collective of its own
            parts.append(self._loss.to(grads[0].dtype))
        total = sum(p.numel() for p in parts)
        flat = self._flat
        if flat is None or flat.numel() != total or flat.dtype != grads[0].dtype or flat.device != grads[0].device:
            flat = self._flat = torch.empty(total, dtype=grads[0].dtype, device=grads[0].device)
        torch.cat(parts, out=flat)
        flat.div_(self.job.world_size)  # DDP's default hook divides before it sums
        try:
            # The job's allreduce: it fences the previous step's snapshot first (the optimizer
            # update that follows must not race its copy), and as the step's first collective,
            # a survivor caught in it by a peer's failure joins the next generation right here
            # and, its state being the last committed step's, repeats only this allreduce with
            # the replacements (`Job._collective`): its backward is not computed again.
            self.job.allreduce(flat)
        except PeerFailure as exc:
            # Any other case (StepRestart: the next generation is joined and the last committed
            # step restored; or a failure with no recovery here) is not raised through autograd:
            # remembered, and raised before the optimizer step, so the step runs again.
            self.failure = exc
            self._flat = None  # an aborted collective may still write into its buffer
            return
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        if self._loss is not None:
            self._mean_loss = float(flat[-1])
        self.reductions += 1

    def take_loss(self, loss: torch.Tensor) -> None:
        """`StepContext.reduce_loss`: reduce this step's loss with its gradients."""
        if loss.numel() != 1:
            raise ValueError(f"reduce_loss takes the step's scalar loss, not a tensor of shape {tuple(loss.shape)}")
        self._loss, self._mean_loss = loss.detach().reshape(1), None

    def raise_failure(self) -> None:
        """Unwind the step if its reduction failed: the gradients are local ones, dropped."""
        exc, self.failure = self.failure, None
        if exc is not None:
            self._loss = self._mean_loss = None
            self.optimizer.zero_grad(set_to_none=True)
            raise exc

    def after_step(self, loss: float) -> float:
        """After the step function: unwind a step whose reduction failed (one with no optimizer
        step would otherwise commit it), and make the step's loss the mean over the ranks, as the
        loss of a data-parallel step is (each rank returns the loss of its own batch)."""
        self.raise_failure()
        mean, self._mean_loss, self._loss = self._mean_loss, None, None
        if mean is not None:
            return mean  # reduced with the gradients
        return mean_over_ranks(self.job, loss)

    def before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: no parameter moves after a failed reduction, nor before the
        previous step's snapshot is copied (a step with no reduction, under `no_sync`)."""
        self.raise_failure()
        self.job.fence()


# DDP checks a comm hook's annotations by identity; this module's are strings (postponed
# evaluation), so the hook carries the objects themselves.
Reduction.hook.__annotations__.update(bucket=dist.GradBucket, state=object,
                                      **{"return": torch.futures.Future[torch.Tensor]})


def mean_over_ranks(job: Host, loss: float) -> float:
    """The mean of each rank's `loss` (one small allreduce over the job's generation)."""
    total = torch.tensor([loss], dtype=torch.float64)
    job.allreduce(total)
    return float(total.item()) / job.world_size


def _broadcast_from_rank0(group: Generation, module: torch.nn.Module) -> None:
    """What DDP's constructor does over its group: every rank starts from rank 0's parameters
    and buffers. One flat broadcast per dtype."""
    tensors = [t.detach() for t in (*module.parameters(), *module.buffers())]
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        group.wait(group.pg.broadcast(flat, 0), "broadcast")
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _load(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load part of `module`'s state (its parameters, or its buffers)."""
    unexpected = module.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise RuntimeError(f"snapshot holds state the model does not have: {sorted(unexpected)[:5]}")


def attach(job: Host, model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
           scheduler: Any | None, loader: Iterable | None) -> Batches | None:
    """`Job.register_ddp`: see the module's docstring."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register_ddp: model must be torch's DistributedDataParallel, not {type(model).__name__}")
    size = model.process_group.size()
    if size != 1:
        raise ValueError(f"register_ddp: the DDP model's process group has {size} ranks; "
                         "build it with DistributedDataParallel(..., process_group=job.ddp_group())")
    reduction = Reduction(job, model, optimizer)
    job.use_reduction(reduction)
    model.register_comm_hook(state=None, hook=reduction.hook)
    optimizer.register_step_pre_hook(reduction.before_update)
    job.on_after_step(reduction.after_step)
    job.on_fresh_start(lambda group: _broadcast_from_rank0(group, model.module))
    module = model.module
    # Parameters are the same on every rank (the reduction sees to it): replicated. Buffers are
    # each rank's own: DDP broadcasts rank 0's before every forward over its group, which is
    # this rank alone here, so a buffer that training changes (BatchNorm's running statistics)
    # stays the rank's and is snapshotted whole by it.
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    job.register("model", lambda: {k: v for k, v in module.state_dict().items() if k in names},
                 lambda state: _load(module, state), replicated=True)
    if any(k not in names for k in module.state_dict()):
        job.register("buffers", lambda: {k: v for k, v in module.state_dict().items() if k not in names},
                     lambda state: _load(module, state), replicated=False)
    return register_rest(job, optimizer, scheduler, loader)


def register_rest(job: Any, optimizer: torch.optim.Optimizer, scheduler: Any | None,
                  loader: Iterable | None) -> Batches | None:
    """The optimizer and scheduler (replicated) and the data position (the rank's own) as the
    job's state; the batches iterator when there is a loader. Shared with the job outside ffctl
    (`recovery.standalone`), so the two draw the same batches."""
    job.register("optimizer", optimizer.state_dict, optimizer.load_state_dict, replicated=True)
    return register_schedule_and_data(job, scheduler, loader)


def register_schedule_and_data(job: Any, scheduler: Any | None, loader: Iterable | None) -> Batches | None:
    """The scheduler (replicated) and the data position (the rank's own) as the job's state; the
    batches iterator when there is a loader. The DDP and FSDP paths, in ffctl and outside it."""
    if scheduler is not None:
        job.register("scheduler", scheduler.state_dict, scheduler.load_state_dict, replicated=True)
    if loader is None:
        return None
    batches = Batches(loader)
    job.register("data", batches.state_dict, batches.load_state_dict, replicated=False)
    return batches

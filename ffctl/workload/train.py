"""Entry point of the built-in workload: `python -m ffctl.workload.train --model tiny --steps N`.

With AdamW (the default) the GPT trains on the recovery library's public DDP path, as a user's
script does (docs/guides/ddp.md): torch's `DistributedDataParallel` over `job.ddp_group()`, its
gradients reduced by the library's communication hook, the model and optimizer handed over with
`job.register_ddp`, the loss reduced with the gradients (`ctx.reduce_loss`). The sharded
optimizer (ZeRO-1) keeps the step-function path: each rank's optimizer state is its own
(`register_ddp` takes a replicated optimizer), and the gradients and the loss travel in one flat
buffer through `ctx.allreduce`. Either way the gradients are averaged over the ranks in one flat
buffer in parameter order, so with the same seed the losses are bit-identical run to run, with
faults or without. `--parallel fsdp|hsdp` shards the GPT with torch's `fully_shard` instead
(docs/guides/fsdp.md): FSDP2's own collectives on ffctl's process group, each rank's shards snapshotted.

A scheduler's preemption notice (SIGUSR1/SIGUSR2, which `ffctl launch` passes on to the ranks)
is written to the rank's log and training goes on: its disk checkpoints (--ckpt-every) are what
a requeued job resumes from.
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from ffctl.workload.data import batch
from ffctl.workload.gpt import GPT
from ffctl.workload.sizes import MODELS, OPTIMIZERS, PARALLELISMS, SIZES
from recovery import Job, StepContext

if TYPE_CHECKING:
    from recovery.standalone import PlainJob


LR = 3e-3


class ShardedAdamW:
    """A ZeRO-1 style optimizer: rank r keeps AdamW state for its 1/W slice of the flattened
    parameters only, updates that slice and all-gathers the slices back. Its state is unique
    to the rank (registered `replicated=False`), unlike a replicated optimizer's."""

    def __init__(self, params: list[torch.nn.Parameter], rank: int, world_size: int) -> None:
        self.params = params
        total = sum(p.numel() for p in params)
        self.chunk = -(-total // world_size)
        self.lo, self.hi = min(total, rank * self.chunk), min(total, (rank + 1) * self.chunk)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        self.shard = torch.nn.Parameter(flat[self.lo : self.hi].clone())
        self.opt = torch.optim.AdamW([self.shard], lr=LR, weight_decay=0.0, foreach=False)

    def step(self, flat_grad: torch.Tensor, ctx: StepContext) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard.data.copy_(flat[self.lo : self.hi])
        self.shard.grad = flat_grad[self.lo : self.hi].clone()
        self.opt.step()
        mine = torch.zeros(self.chunk)
        mine[: self.hi - self.lo] = self.shard.detach()
        whole = torch.cat(ctx.allgather(mine))[: flat.numel()]
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(whole[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def state_dict(self) -> dict[str, object]:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.opt.load_state_dict(state)


def build(model_size: str, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(SIZES[model_size])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ffctl-gpt")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                        help="adamw (replicated) or sharded (ZeRO-1: each rank owns a slice of the state)")
    parser.add_argument("--parallel", default="ddp", choices=list(PARALLELISMS),
                        help="ddp, fsdp (fully_shard over every rank) or hsdp (replicated across nodes, sharded within one)")
    parser.add_argument("--shard-ranks", type=int, default=0,
                        help="hsdp: ranks that shard one replica (0: the job's ranks per node)")
    parser.add_argument("--batch", type=int, default=0, help="sequences per rank per step (0: the size's default)")
    args = parser.parse_args(argv)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        # The default action would end the rank: a notice is not a failure.
        signal.signal(sig, lambda signum, _: print(f"ffctl-gpt: {signal.Signals(signum).name}: preemption notice",
                                                   file=sys.stderr, flush=True))

    torch.set_num_threads(1)  # same kernels, same reduction order: bit-identical runs
    job = Job.from_env()
    model = build(args.model, args.seed)
    params = [p for p in model.parameters()]
    cfg = model.cfg
    if args.parallel != "ddp":
        _train_sharded(job, model, args)
        return
    if args.optimizer != "sharded":
        ddp = DistributedDataParallel(model, process_group=job.ddp_group())
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=False)
        job.register_ddp(model=ddp, optimizer=opt)

        def ddp_step(ctx: StepContext) -> float:
            x, y = batch(ctx.step, ctx.rank, args.seed, args.batch or cfg.batch, cfg.block)
            opt.zero_grad()
            loss = ddp(x, y)
            ctx.reduce_loss(loss)  # the mean over the ranks, reduced with the gradients
            loss.backward()
            opt.step()
            return loss.item()  # this rank's; the run reports the mean, reduced with the gradients

        job.run(ddp_step, args.steps)
        return

    job.register("model", model.state_dict, model.load_state_dict, replicated=True)
    sharded = ShardedAdamW(params, job.env.rank, job.env.world_size)
    job.register("optim", sharded.state_dict, sharded.load_state_dict, replicated=False)

    def step_fn(ctx: StepContext) -> float:
        x, y = batch(ctx.step, ctx.rank, args.seed, args.batch or cfg.batch, cfg.block)
        model.zero_grad(set_to_none=False)
        loss = model(x, y)
        loss.backward()
        # A parameter the loss did not reach has no gradient: zero, in its place of the flat vector.
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        flat = torch.cat(grads + [loss.detach().reshape(1)])
        ctx.allreduce(flat)
        flat /= ctx.world_size
        sharded.step(flat[:-1], ctx)
        return float(flat[-1])

    job.run(step_fn, args.steps)


def _train_sharded(job: Job | PlainJob, model: GPT, args: argparse.Namespace) -> None:
    """The GPT sharded with torch's `fully_shard` (docs/guides/fsdp.md): each block and the root, on a
    mesh of every rank (fsdp) or of nodes x ranks per node (hsdp: a replica per node, its ranks
    sharding it). The loss reported is the mean over the ranks."""
    from torch.distributed.fsdp import fully_shard

    # The mesh must be the same in every generation: a replacement rank may run on a node with
    # more ranks than the job started with, so the shard size comes from the job, not the node.
    world, per_replica = job.env.world_size, args.shard_ranks or job.env.local_world_size
    if world % per_replica:
        raise SystemExit(f"ffctl-gpt: --shard-ranks {per_replica} does not divide the world size {world}")
    shape = (world,) if args.parallel == "fsdp" else (world // per_replica, per_replica)
    mesh = job.device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    job.register_fsdp(model=model, optimizer=opt)
    cfg = model.cfg

    def fsdp_step(ctx: StepContext) -> float:
        x, y = batch(ctx.step, ctx.rank, args.seed, args.batch or cfg.batch, cfg.block)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        return loss.item()

    job.run(fsdp_step, args.steps)


if __name__ == "__main__":
    main()

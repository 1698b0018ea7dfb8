"""A small DDP training: a regression network on data it generates, a DistributedSampler, AdamW
and a one-cycle LR schedule; rank 0 prints its loss at every step.

`plain.py` is an ordinary torchrun script (`torchrun --nproc-per-node 2 examples/ddp/plain.py`);
`with_ffctl.py` is the same with one-step recovery (`ffctl launch --nnodes 2 --nproc-per-node 2
--spares 2 examples/ddp/with_ffctl.py`). docs/guides/ddp.md explains the difference line by line.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from recovery import Job, StepContext


def make_data(samples: int = 2048, features: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, features, generator=g)
    y = torch.sin(x @ torch.randn(features, 1, generator=g)) + 0.05 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def make_model(features: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    job = Job.from_env()
    rank, world = job.env.rank, job.env.world_size
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    model = DDP(make_model(), process_group=job.ddp_group())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=args.steps)
    batches = job.register_ddp(model=model, optimizer=opt, scheduler=sched, loader=loader)

    def train_step(ctx: StepContext) -> float:
        step = ctx.step
        x, y = next(batches)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
        return loss.item()

    job.run(train_step, args.steps)


if __name__ == "__main__":
    main()

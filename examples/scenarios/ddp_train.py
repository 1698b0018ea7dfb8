"""A plain torchrun training script (nothing of ffctl in it): `torchrun --nproc-per-node 2 ddp_train.py`.

Data parallel with torch's DistributedDataParallel over gloo, a checkpoint every few steps
written by rank 0 and read back by every rank when the group (re)starts, and a line per step
(`step N loss X`) that `ffctl run` reads the steps off (`step_regex` in the scenario beside it).
Same data and seed on every run, so a restarted group ends with the weights of one never stopped.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds per step, as a bigger model would take")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # One checkpoint per job: torchrun (and ffctl) give every worker of a job the same run id.
    ckpt = os.path.join(tempfile.gettempdir(), f"ddp-train-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}.pt")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"resumed from step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_time)
        if step % args.ckpt_every == 0:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            dist.barrier()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.barrier()
    if rank == 0 and os.path.exists(ckpt):
        os.remove(ckpt)
    del model  # before the group goes: DDP's reducer still holds it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Entry point of the built-in workload: `python -m ffctl.workload.train --model tiny --steps N`.

Data parallel over the recovery library's process group: gradients and the loss travel in one
flat buffer through `ctx.allreduce`, which the controller can abort when a peer dies (a DDP
reducer blocks inside C++ and cannot be interrupted on gloo). The arithmetic is DDP's: the sum
divided by the world size, so losses are bit-identical run to run with the same seed.
"""
from __future__ import annotations

import argparse

import torch

from ffctl.workload.data import batch
from ffctl.workload.gpt import GPT, SIZES
from recovery import Job, StepContext


def build(model_size: str, seed: int, optimizer: str, world_size: int) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(SIZES[model_size])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, foreach=False)
    return model, opt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ffctl-gpt")
    parser.add_argument("--model", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw"])
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # same kernels, same reduction order: bit-identical runs
    job = Job.from_env()
    model, opt = build(args.model, args.seed, args.optimizer, job.env.world_size)
    params = [p for p in model.parameters()]
    sizes = [p.numel() for p in params]
    cfg = model.cfg
    job.register("model", model.state_dict, model.load_state_dict, replicated=True)
    job.register("optim", opt.state_dict, opt.load_state_dict, replicated=True)

    def step_fn(ctx: StepContext) -> float:
        x, y = batch(ctx.step, ctx.rank, args.seed, cfg.batch, cfg.block)
        opt.zero_grad(set_to_none=False)
        loss = model(x, y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
        ctx.allreduce(flat)
        flat /= ctx.world_size
        for p, g in zip(params, flat[:-1].split(sizes)):
            p.grad.copy_(g.view_as(p))
        opt.step()
        return float(flat[-1])

    job.run(step_fn, args.steps)


if __name__ == "__main__":
    main()

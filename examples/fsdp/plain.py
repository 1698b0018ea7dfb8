"""A small transformer sharded with torch's `fully_shard` (FSDP2): a character-level language
model on text it generates, a DistributedSampler, AdamW and a cosine LR schedule; rank 0 prints
its loss at every step.

`plain.py` is an ordinary torchrun script (`torchrun --nproc-per-node 2 examples/fsdp/plain.py`);
`with_ffctl.py` is the same with one-step recovery (`ffctl launch --nnodes 2 --nproc-per-node 2
--spares 2 examples/fsdp/with_ffctl.py`). docs/guides/fsdp.md explains the difference line by line.
`--mesh R,S` trains HSDP instead: replicated over R groups, sharded over S ranks in each.
"""
from __future__ import annotations

import argparse
from itertools import count
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, CONTEXT, WIDTH = 32, 16, 32


def make_data(samples: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (samples, 1), generator=g)
    stride = torch.randint(1, 4, (samples, 1), generator=g)
    seq = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB  # sequences a model can learn
    return TensorDataset(seq[:, :-1], seq[:, 1:])


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.attn = torch.nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(CONTEXT, WIDTH))
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def epochs(loader: DataLoader, sampler: DistributedSampler) -> Iterator[list[torch.Tensor]]:
    """Batches forever, reshuffled each epoch."""
    for epoch in count():
        sampler.set_epoch(epoch)
        yield from loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mesh", default="", help="R,S: HSDP over R replicas of S shards (default: FSDP)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = tuple(int(n) for n in args.mesh.split(",")) if args.mesh else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    model = Model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    batches = epochs(loader, sampler)

    for step in range(1, args.steps + 1):
        x, y = next(batches)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

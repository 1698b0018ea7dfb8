"""The built-in workload's tables: model sizes and optimizer names, without torch.

Read by the GPT itself and by `LaunchSpec.validate`, so a launch is refused before anything
starts with exactly the names the workload accepts (and a spec is checked without importing torch).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    block: int = 64
    layers: int = 2
    heads: int = 2
    dim: int = 64
    batch: int = 8  # sequences per rank per step


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block=32, layers=2, heads=2, dim=32, batch=4),
    "small": GPTConfig(block=64, layers=4, heads=4, dim=128, batch=8),
    "medium": GPTConfig(block=64, layers=4, heads=4, dim=192, batch=8),
    "base": GPTConfig(block=128, layers=6, heads=8, dim=256, batch=8),
}
MODELS: tuple[str, ...] = tuple(SIZES)

# adamw: every rank holds the whole optimizer state (replicated); sharded: ZeRO-1, each rank owns a slice.
OPTIMIZERS: tuple[str, ...] = ("adamw", "sharded")

# ddp: torch's DistributedDataParallel; fsdp: torch's fully_shard over every rank; hsdp: fully_shard
# on a 2D mesh, replicated across nodes and sharded over each node's ranks.
PARALLELISMS: tuple[str, ...] = ("ddp", "fsdp", "hsdp")

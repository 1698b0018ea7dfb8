"""What `register_ddp` hands the job: a DDP model over the rank's private group, its parameters
(tied ones included) as replicated state, its buffers as the rank's own, and a clear refusal of a
model that is not torch's DDP on a private group."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from recovery.ddp import attach, private_group


class _Job:
    """What `attach` uses of a `Job` when it registers (no group: nothing is reduced here)."""

    def __init__(self) -> None:
        self.api = "step-function"
        self.reduction: Any = None
        self.after_step: list[Callable[[float], float]] = []
        self.fresh_start: list[Any] = []
        self.entries: dict[str, tuple[Callable[[], Any], Callable[[Any], None], bool]] = {}

    def register(self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None], *,
                 replicated: bool = False) -> None:
        self.entries[name] = (state_dict, load_state_dict, replicated)

    def use_reduction(self, reduction: Any) -> None:
        self.reduction, self.api = reduction, "ddp"

    def on_after_step(self, hook: Callable[[float], float]) -> None:
        self.after_step.append(hook)

    def on_fresh_start(self, hook: Any) -> None:
        self.fresh_start.append(hook)


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: one tensor under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)))


def test_parameters_are_replicated_and_buffers_the_ranks_own() -> None:
    torch.manual_seed(0)
    model = DDP(_Tied(), process_group=private_group())
    job = _Job()
    opt = torch.optim.AdamW(model.parameters())
    assert attach(job, model, opt, None, None) is None  # type: ignore[arg-type]
    assert job.api == "ddp" and job.reduction is not None and len(job.after_step) == len(job.fresh_start) == 1
    assert {n: r for n, (_, _, r) in job.entries.items()} == {"model": True, "buffers": False, "optimizer": True}
    params, buffers = job.entries["model"][0](), job.entries["buffers"][0]()
    assert set(params) == {"emb.weight", "head.weight", "norm.weight", "norm.bias"}
    assert set(buffers) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    saved = {k: v.clone() for k, v in {**params, **buffers}.items()}
    model(torch.tensor([1, 2, 3]))  # a training forward moves the running statistics
    with torch.no_grad():
        model.module.emb.weight.add_(1.0)
    job.entries["model"][1]({k: saved[k] for k in params})
    job.entries["buffers"][1]({k: saved[k] for k in buffers})
    now = model.module.state_dict()
    assert all(torch.equal(now[k], saved[k]) for k in saved)
    assert model.module.head.weight is model.module.emb.weight  # still tied after the restore


def test_a_model_that_is_not_ddp_on_a_private_group_is_refused() -> None:
    net = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="DistributedDataParallel, not Linear"):
        attach(_Job(), net, torch.optim.SGD(net.parameters(), lr=0.1), None, None)  # type: ignore[arg-type]

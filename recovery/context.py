"""`StepContext`: what a step function gets, under ffctl (`recovery.job.Job`) and without it
(`recovery.standalone.PlainJob`): the step number and the job's collectives."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class StepJob(Protocol):
    """What a step context needs of its job; `Job` and `PlainJob` both have it."""

    # Read-only: a step context never sets them (`Job.reduction` is a property).
    @property
    def env(self) -> Any: ...

    @property
    def reduction(self) -> Any: ...

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass
class StepContext:
    """What a step function gets: the step number and the collectives of this generation."""

    step: int
    job: StepJob

    @property
    def rank(self) -> int:
        return self.job.env.rank

    @property
    def world_size(self) -> int:
        return self.job.env.world_size

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.job.allreduce(tensor)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all ranks), in rank order."""
        return self.job.allgather(tensor)

    def reduce_loss(self, loss: torch.Tensor) -> None:
        """On the DDP path, before `backward()`: the step's loss travels with the gradients, so
        the mean over the ranks that the run reports costs no collective of its own."""
        reduction = self.job.reduction
        if reduction is None:
            raise RuntimeError("reduce_loss is for a job with register_ddp")
        reduction.take_loss(loss)

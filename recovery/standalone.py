"""`Job` outside ffctl: the same script runs under plain torchrun (or `python SCRIPT` alone).

A script adapted to the recovery library (`Job.from_env()`, `job.ddp_group()`,
`job.register_ddp(...)`, `job.run(step_fn, steps)`) must still run where ffctl is not: under
torchrun, on a laptop. There is no agent, no snapshot store and no controller, so nothing is
recovered; the job trains as the unadapted script would. `Job.from_env()` returns a `PlainJob`
when the environment has no ffctl run (no FFCTL_RUN_ID): it joins torch's default process group
from torchrun's variables (`init_process_group()` with the env:// rendezvous, gloo on CPU, NCCL
where a GPU is), builds DDP over that group as DDP's default hook would reduce, draws batches
from the same `Batches` iterator (so the data order is the one the script sees under ffctl), and
runs the step function for the given steps. Registered state is kept only to be consistent
with the ffctl path: nothing snapshots it.

A group `PlainJob` created is also closed by it, at interpreter exit: every rank meets at a
barrier (bounded, so a rank whose peer died still exits) and then destroys the group. Left to
the interpreter's own teardown, gloo aborts a rank now and then after its last output
("terminate called without an active exception", SIGABRT, about one run in four of a two-rank
job on a loaded host), and torchrun reports that as a failed job.
"""
from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from recovery.ddp import Batches, register_rest, register_schedule_and_data
from recovery.context import StepContext
from wire.jobenv import JobEnv, Strategy
from recovery.snapshot import StateEntry, state_entry


# How long a rank waits at exit for the others before closing its group anyway: long enough for
# a slow rank's last step on a loaded host, short enough that a rank whose peer died exits.
EXIT_BARRIER_S = 30.0


def _close_world() -> None:
    """Close the default group this module created: a barrier first, so no rank tears gloo down
    while another still talks to it, then `destroy_process_group`."""
    if not dist.is_initialized():
        return  # the script closed it itself
    try:
        if dist.get_world_size() > 1:
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=EXIT_BARRIER_S))
    except Exception:  # a peer gone or the wait over: close this rank's side all the same
        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def under_ffctl(environ: dict[str, str] | None = None) -> bool:
    """Whether this process was started by an ffctl agent (it sets FFCTL_RUN_ID)."""
    return bool((os.environ if environ is None else environ).get("FFCTL_RUN_ID"))


class _LossAfterStep:
    """`StepContext.reduce_loss` outside ffctl: DDP reduces its own gradients, and the step's
    mean loss is taken after the step function when `until` asks for it."""

    def take_loss(self, loss: torch.Tensor) -> None:
        pass


class PlainJob:
    """The recovery library's surface over torch's default process group, recovering nothing."""

    api = "plain"

    def __init__(self, env: JobEnv) -> None:
        self.env = env
        self.entries: list[StateEntry] = []
        self.last_committed = 0
        self._ddp = False
        self.reduction: _LossAfterStep | None = None  # set by register_ddp (StepContext.reduce_loss)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> PlainJob:
        env = os.environ if environ is None else environ
        world = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        return cls(JobEnv(rank=int(env.get("RANK", "0")), world_size=world,
                          local_rank=int(env.get("LOCAL_RANK", "0")), local_world_size=local_world,
                          node=int(env.get("GROUP_RANK", "0")), run_id=env.get("TORCHELASTIC_RUN_ID", "plain"),
                          store_host=env.get("MASTER_ADDR", "127.0.0.1"), store_port=int(env.get("MASTER_PORT", "0") or 0),
                          gen=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), strategy=Strategy.NONE))

    def register(self, name: str, state_dict: Callable[[], Any] | None = None,
                 load_state_dict: Callable[[Any], None] | None = None, *, replicated: bool = False,
                 sharded: bool = False, **aliases: Callable[..., Any]) -> None:
        """`Job.register`: kept, never snapshotted here."""
        if any(e.name == name for e in self.entries):
            raise ValueError(f"state {name!r} registered twice")
        self.entries.append(state_entry(name, state_dict, load_state_dict, replicated, aliases, sharded))

    def register_stateful(self, name: str, obj: Any, *, replicated: bool = False) -> None:
        """`Job.register_stateful`: an object with `state_dict()` and `load_state_dict(state)`."""
        self.register(name, obj.state_dict, obj.load_state_dict, replicated=replicated)

    @property
    def world_size(self) -> int:
        """`Job.world_size`: torch's world size (it never changes here)."""
        return self.env.world_size

    def _world(self) -> Any:
        if not dist.is_initialized():
            if self.env.world_size > 1 or "MASTER_ADDR" in os.environ:
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            else:  # `python SCRIPT` alone: a group of one, so DDP and the collectives still work
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            atexit.register(_close_world)
        return dist.group.WORLD

    def ddp_group(self) -> Any:
        """torch's default group: DDP reduces its gradients as it always does."""
        return self._world()

    def register_ddp(self, *, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any | None = None,
                     loader: Iterable | None = None) -> Batches | None:
        self._ddp = True
        self.reduction = _LossAfterStep()
        self.register("model", model.module.state_dict, model.module.load_state_dict, replicated=True)
        return register_rest(self, optimizer, scheduler, loader)

    def device_mesh(self, device_type: str, mesh_shape: tuple[int, ...], *,
                    mesh_dim_names: tuple[str, ...] | None = None) -> Any:
        """`Job.device_mesh`: torch's `init_device_mesh` over the default group."""
        from torch.distributed.device_mesh import init_device_mesh

        self._world()
        return init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names)

    def register_fsdp(self, *, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any | None = None,
                      loader: Iterable | None = None) -> Batches | None:
        """`Job.register_fsdp`: the same batches, nothing snapshotted."""
        self._ddp = True  # the step's loss is the mean over the ranks, as under ffctl
        self.register("model", model.state_dict, model.load_state_dict, sharded=True)
        self.register("optimizer", optimizer.state_dict, optimizer.load_state_dict, sharded=True)
        return register_schedule_and_data(self, scheduler, loader)

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._world()
        dist.all_reduce(tensor)
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._world()
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(out, tensor)
        return out

    def run(self, step_fn: Callable[[Any], float], steps: int,
            until: Callable[[int, float], bool] | None = None) -> None:
        """Train steps 1..`steps`; `until(step, loss)` (the step's loss, the mean over the ranks
        on the DDP path as under ffctl) ends the job after that step when true."""
        for step in range(1, steps + 1):
            loss = float(step_fn(StepContext(step, self)))
            self.last_committed = step
            if until is not None:
                if self._ddp:
                    total = torch.tensor([loss], dtype=torch.float64)
                    self.allreduce(total)
                    loss = float(total.item()) / self.env.world_size
                flag = torch.tensor([1.0 if until(step, loss) else 0.0])
                if self.env.world_size > 1:
                    self.allreduce(flag)  # one rank's "stop" stops every rank at the same step
                if flag.item() > 0:
                    return

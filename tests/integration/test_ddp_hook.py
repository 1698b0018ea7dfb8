"""torch's DistributedDataParallel over the recovery library's communication hook, across real
processes and gloo: a peer lost inside `backward()` leaves the reducer usable.

Three ranks build generation 0 and DDP (over each rank's private group, with small buckets, so an
iteration has several) and train one iteration. In the second, rank 2 never reaches the gradient
reduction; the test, acting as the controller, kills it and aborts the generation. The
survivors' hook swallows the failure, `backward()` returns, and the optimizer step refuses to
run (no parameter moves). With a replacement rank 2 (a fresh DDP, whose buckets are still the
initial ones while the survivors' were rebuilt after their first iteration) they build
generation 1 and train iterations 2 and 3 again: every rank ends with the same parameters, equal
to a single-process computation of the same data-parallel steps.
"""
from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from wire import control
from recovery.ddp import _broadcast_from_rank0, attach, private_group
from recovery.errors import PeerFailure
from recovery.group import Generation

WORLD = 3
VICTIM = 2
LR = 0.05


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def _batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * it + rank)
    x = torch.randn(8, 6, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


class _Holder:
    """What `attach` needs of a `Job`: the current generation, the snapshot fence (nothing to
    fence here) and a place for the state it registers. The controller is the test itself."""

    def __init__(self) -> None:
        self.group: Generation | None = None
        self.api = "step-function"
        self.reduction: Any = None
        self.after_step: list[Callable[[float], float]] = []
        self.fresh_start: list[Callable[[Generation], None]] = []
        self.registered: list[str] = []

    def register(self, name: str, state_dict: Any, load_state_dict: Any, *, replicated: bool = False) -> None:
        self.registered.append(name)

    def use_reduction(self, reduction: Any) -> None:
        self.reduction, self.api = reduction, "ddp"

    def on_after_step(self, hook: Callable[[float], float]) -> None:
        self.after_step.append(hook)

    def on_fresh_start(self, hook: Callable[[Generation], None]) -> None:
        self.fresh_start.append(hook)

    @property
    def world_size(self) -> int:
        assert self.group is not None
        return self.group.world_size

    def fence(self) -> None:
        pass

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        return self.group.allreduce(tensor)


def _params(model: DDP) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]).tolist()


def _iteration(model: DDP, opt: torch.optim.Optimizer, rank: int, it: int) -> None:
    x, y = _batch(rank, it)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _rank_main(rank: int, port: int, replacement: bool) -> None:
    torch.set_num_threads(1)
    store = control.connect("127.0.0.1", port, timeout=120.0)
    model = DDP(_net(), process_group=private_group(), bucket_cap_mb=0.001)  # ~1 KB buckets
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    holder = _Holder()
    attach(holder, model, opt, None, None)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    if not replacement:
        holder.group = Generation(store, "127.0.0.1", port, 0, rank, WORLD, timeout=120.0)
        _iteration(model, opt, rank, 1)
        store.add("ready/0", 1)
        if rank == VICTIM:
            time.sleep(3600)  # never reaches iteration 2's reduction: killed there
        before = _params(model)
        x, y = _batch(rank, 2)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # the hook's allreduce is aborted inside
        try:
            opt.step()
            out["step"] = "ran"
        except PeerFailure:
            out["step"] = "refused"
        out["unchanged"] = _params(model) == before
        out["grads_dropped"] = all(p.grad is None for p in model.module.parameters())
        holder.group.close()
    holder.group = Generation(store, "127.0.0.1", port, 1, rank, WORLD, timeout=120.0)
    _broadcast_from_rank0(holder.group, model.module)  # the restore: rank 0's (unchanged) state
    _iteration(model, opt, rank, 2)
    out["after2"] = _params(model)
    _iteration(model, opt, rank, 3)
    out["after3"] = _params(model)
    out["registered"] = holder.registered
    holder.group.close()
    print(json.dumps(out), flush=True)


def _spawn(rank: int, port: int, replacement: bool) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen([sys.executable, "-m", "tests.integration.test_ddp_hook", str(rank), str(port),
                             "1" if replacement else "0"],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _reference() -> tuple[list[float], list[float]]:
    """Iterations 1 to 3 in one process: the gradient of the mean of the ranks' losses."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seen: list[list[float]] = []
    for it in (1, 2, 3):
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in (_batch(r, it) for r in range(WORLD))]
        (sum(losses) / WORLD).backward()
        opt.step()
        seen.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
    return seen[1], seen[2]


@pytest.mark.slow
@pytest.mark.timeout(300)  # real ranks in processes over gloo, a peer lost and a generation rebuilt
def test_a_peer_lost_inside_backward_leaves_ddp_usable() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=120))
    procs = [_spawn(r, master.port, replacement=False) for r in range(WORLD)]
    try:
        master.wait(["ready/0"], datetime.timedelta(seconds=120))
        while int(master.add("ready/0", 0)) < WORLD:
            time.sleep(0.01)
        time.sleep(0.5)  # the survivors are inside backward, in the hook's allreduce
        procs[VICTIM].send_signal(signal.SIGKILL)
        procs[VICTIM].wait(timeout=30)
        master.multi_set([control.gen_abort_key(0, r) for r in range(WORLD)], ["1"] * WORLD)
        procs[VICTIM] = _spawn(VICTIM, master.port, replacement=True)
        outputs = [p.communicate(timeout=180) for p in procs]
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r}: " + outputs[r][1][-3000:]
        got = {r: json.loads(out.strip().splitlines()[-1]) for r, (out, _) in enumerate(outputs)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in (0, 1):
        assert got[r]["step"] == "refused" and got[r]["unchanged"] and got[r]["grads_dropped"], got[r]
    assert got[0]["registered"] == ["model", "optimizer"]
    after2, after3 = _reference()
    for r in range(WORLD):
        # Bucket by bucket a survivor's layout differs from the replacement's; the reduction in
        # parameter order makes every rank's update the same, bit for bit...
        assert got[r]["after2"] == got[0]["after2"] and got[r]["after3"] == got[0]["after3"]
    # ...and the one a single process computes for the same data-parallel steps.
    assert torch.allclose(torch.tensor(got[0]["after2"]), torch.tensor(after2), rtol=1e-5, atol=1e-6)
    assert torch.allclose(torch.tensor(got[0]["after3"]), torch.tensor(after3), rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")

"""torch's FSDP2 on ffctl's process group, across real processes: a peer lost mid-collective.

Two ranks shard a small model with `fully_shard` on a mesh of `ResilientGroup`s bound to
generation 0 and train a step. In the second step rank 1 is lost just as it would issue its
gradient reduce-scatter, so rank 0 is blocked in its own: rank 1 is either killed (gloo sees the
connection close) or stopped (nothing closes; the test, playing the controller, aborts the
generation as its detector would). Rank 0 must come out of `backward()` with the failure
absorbed and recorded (`process_group.failure()`, which the job raises before the optimizer
moves anything), well within a bound (the test fails on a 30 s wait), and with every later
collective of the failed generation returning at once. Lost instead as it would issue the
forward's first all-gather, rank 1 leaves rank 0 to run the rest of its step (forward and
backward) without the matrix products (`recovery.failed_step`); lost in the backward, the
products there run (the mode is never entered inside the autograd engine). Then a fresh
rank 1 joins generation 1 and both train a step on the same torch objects, rebuilt in place:
the same loss on both shows that the survivor's products run again.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from wire import control

WORLD = 2
BOUND_S = 30.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


# Where rank 1 is lost in its second step: the collective it never issues.
LOST_IN = {"reduce-scatter": ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"),
           "all-gather": ("_allgather_base", "allgather_into_tensor_coalesced", "all_gather_single")}


def _rank_main(rank: int, port: int, mode: str, replacement: bool, phase: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from recovery import failed_step, process_group
    from recovery.group import Generation

    torch.set_num_threads(1)
    store = control.connect("127.0.0.1", port, timeout=120.0)
    process_group.init_default_group(rank, WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = {id(g) for g in mesh.get_all_groups()}
    out: dict[str, object] = {}
    if not replacement:
        gen0 = Generation(store, "127.0.0.1", port, 0, rank, WORLD, timeout=120.0)
        process_group.bind(gen0)
        out["step1"] = _step(model, opt, 1)
        store.add("ready/1", 1)
        if rank == 1:
            def lost(self: process_group.ResilientGroup, *args: object) -> object:
                os.kill(os.getpid(), signal.SIGKILL if mode == "killed" else signal.SIGSTOP)
                raise AssertionError("not reached")

            for name in LOST_IN[phase]:
                setattr(process_group.ResilientGroup, name, lost)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
        model(x).pow(2).mean().backward()  # rank 0 blocks in its collective: rank 1 never joins
        print(json.dumps({"unblocked": time.time()}), flush=True)
        failed = process_group.failure()
        out["failure"] = None if failed is None else failed.reason
        t0 = time.monotonic()
        # A later collective of the failed generation issues nothing and returns at once.
        dist.all_reduce(torch.ones(1))
        out["later_s"] = time.monotonic() - t0
        opt.zero_grad(set_to_none=True)  # the failed step's gradients are dropped, as the job does
        out["skipped"] = failed_step.leave()  # as the job does after the step function
        gen0.close()
    gen1 = Generation(store, "127.0.0.1", port, 1, rank, WORLD, timeout=120.0)
    process_group.bind(gen1)
    out["step2"] = _step(model, opt, 2)
    out["same_groups"] = groups == {id(g) for g in mesh.get_all_groups()}
    process_group.bind(None)
    gen1.close()
    print(json.dumps(out), flush=True)


def _spawn(rank: int, port: int, mode: str, replacement: bool, phase: str) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen([sys.executable, "-m", "tests.integration.test_process_group", str(rank), str(port),
                             mode, "1" if replacement else "0", phase],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lost(proc: subprocess.Popen[str], mode: str, timeout: float = 120.0) -> None:
    """Wait until rank 1 is dead (killed) or stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mode == "killed" and proc.poll() is not None:
            return
        if mode == "stopped" and Path(f"/proc/{proc.pid}/stat").read_text().split(")")[1].split()[0] == "T":
            return
        time.sleep(0.01)
    raise AssertionError(f"rank 1 was never {mode}")


@pytest.mark.slow
@pytest.mark.timeout(300)  # real ranks in processes over gloo, a peer lost and a generation rebuilt
@pytest.mark.parametrize(("mode", "phase"), [("killed", "reduce-scatter"), ("stopped", "reduce-scatter"),
                                             ("killed", "all-gather")])
def test_a_survivor_blocked_in_an_fsdp_collective_unblocks_when_its_peer_is_lost(mode: str, phase: str) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [_spawn(r, server.port, mode, False, phase) for r in range(WORLD)]
    replacement: subprocess.Popen[str] | None = None
    try:
        server.wait(["ready/1"])
        while int(server.add("ready/1", 0)) < WORLD:
            time.sleep(0.01)
        _lost(procs[1], mode)
        lost_at = time.time()
        if mode == "stopped":
            # The controller's detector found rank 1 silent: it aborts the generation.
            server.set(control.gen_abort_key(0, 0), "abort")
        # Waited for with a deadline of its own: a survivor that stays blocked fails the test
        # here rather than holding it until the suite's timeout.
        ready, _, _ = select.select([procs[0].stdout], [], [], 2 * BOUND_S)
        assert ready, f"rank 0 still blocked {2 * BOUND_S:.0f} s after its peer was {mode}"
        first = procs[0].stdout.readline()  # type: ignore[union-attr]
        assert first, procs[0].stderr.read()[-3000:]  # type: ignore[union-attr]
        waited = json.loads(first)["unblocked"] - lost_at
        assert waited < BOUND_S, f"rank 0 stayed blocked {waited:.1f} s after its peer was {mode}"
        if mode == "stopped":
            procs[1].kill()
        procs[1].wait(timeout=60)
        replacement = _spawn(1, server.port, mode, True, phase)
        out0, err0 = procs[0].communicate(timeout=240)
        out1, err1 = replacement.communicate(timeout=240)
        assert procs[0].returncode == 0 and replacement.returncode == 0, err0[-3000:] + err1[-3000:]
        survivor, fresh = json.loads(out0.splitlines()[-1]), json.loads(out1.splitlines()[-1])
        assert survivor["failure"], survivor  # absorbed inside backward, recorded for the optimizer hook
        assert survivor["later_s"] < 5.0, survivor
        if phase == "all-gather":
            # The forward's remaining Linear, and the backward's products of both: none computed.
            assert survivor["skipped"] >= 3, survivor
        else:
            assert survivor["skipped"] == 0, survivor  # lost inside backward(): its products ran
        # Generation 1 on the same torch objects: both ranks computed the same loss on it.
        assert survivor["same_groups"] and fresh["same_groups"]
        assert survivor["step2"] == fresh["step2"], (survivor, fresh)  # the same all-gathered parameters
    finally:
        for p in [*procs, replacement]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", sys.argv[5])

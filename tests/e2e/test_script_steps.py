"""An unchanged torchrun script that checkpoints and resumes, under `ffctl launch` with faults.

The script restores itself from its own checkpoint after ffctl restarts its group (torchrun's
semantics); it ends with the same weights as a fault-free run. ffctl knows its steps when the
script calls `recovery.report_step` or prints them for `--step-regex`, so a fault lands at a step
and the record has the lost steps; without either, a fault lands at a time, the step is unknown
and recovery_s ends when every restarted worker is up again, and the record says so.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import assert_nothing_left, launch, rid, shm_left

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 40
CKPT_EVERY = 5

# A data-parallel job by hand (allreduce of the gradients), a checkpoint every 5 steps written
# by rank 0 and read back by every rank at start, a loss line per step. Deterministic: same
# data, same reduction order, same weights whoever launches it and however often it restarts.
SCRIPT = f'''
import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--report", action="store_true")
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
if os.path.exists(args.ckpt):
    state = torch.load(args.ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"]
    print(f"resumed from step {{start}}", flush=True)
report = None
if args.report:
    from recovery import report_step as report
for step in range(start + 1, {STEPS} + 1):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 4, generator=g)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    time.sleep(0.15)
    if step % {CKPT_EVERY} == 0:
        if rank == 0:
            torch.save({{"model": model.state_dict(), "opt": opt.state_dict(), "step": step}}, args.ckpt + ".tmp")
            os.replace(args.ckpt + ".tmp", args.ckpt)
        dist.barrier()
    print(f"step {{step}} loss {{loss.item():.6f}} at {{time.time():.3f}}", flush=True)
    if report is not None:
        report(step, loss.item())
weights = [p.detach().double().sum().item() for p in model.parameters()]
os.write(1, f"RESULT rank={{rank}} weights={{weights!r}}\\n".encode())
dist.barrier()
dist.destroy_process_group()
'''

COMMON = ("--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "2")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("script-steps")
    (d / "train.py").write_text(SCRIPT)
    return d


def _results(res_dir: Path, run_id: str) -> list[str]:
    logs = sorted((res_dir / run_id / "logs").glob("*/[0-9]*.log"))
    text = "\n".join(p.read_text() for p in logs)
    return sorted(line[line.index("RESULT"):] for line in text.splitlines() if "RESULT " in line)


@pytest.fixture(scope="module")
def fault_free(workdir: Path) -> tuple[list[str], float]:
    """The fault-free run's RESULT lines, and the time after its ranks started that lies halfway
    between its first checkpoint and its last step."""
    res = launch(workdir, rid("plain"), *COMMON, "train.py", "--ckpt", str(workdir / "free.pt"))
    assert res.returncode == 0, res.stdout + res.stderr
    results = _results(res.runs_dir, res.run_id or "")
    assert len(results) == 2, results
    # t= of a plain script counts from its ranks' start, not the launch.
    started = next(e for e in res.events if e.kind is EventKind.RANKS_SPAWNED)
    log = (res.runs_dir / (res.run_id or "") / "logs" / "0" / "1.log").read_text()
    def done(step: int) -> float:
        return float(re.search(rf"^step {step} loss \S+ at (\S+)$", log, re.M).group(1))  # type: ignore[union-attr]

    return results, (done(CKPT_EVERY) + done(STEPS)) / 2 - started.t


@pytest.fixture(scope="module")
def expected(fault_free: tuple[list[str], float]) -> list[str]:
    return fault_free[0]


def _one_fault(res) -> dict:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (fault,) = res.report["faults"]
    assert fault["recovered"] and fault["restore_source"] == "script", fault
    return fault


@pytest.mark.parametrize("how", ["report_step", "step_regex"])
def test_a_script_that_reports_its_steps_takes_a_fault_at_a_step(workdir: Path, expected: list[str], how: str) -> None:
    ckpt = workdir / f"{how}.pt"
    argv = ["train.py", "--ckpt", str(ckpt)]
    if how == "report_step":
        argv.append("--report")
    else:
        argv = ["--step-regex", r"^step (?P<step>\d+) loss (?P<loss>\S+) at ", *argv]
    res = launch(workdir, rid(how.replace("_", "-")), *COMMON, "--inject", "kill-rank:rank=1,step=12", *argv)
    fault = _one_fault(res)
    # Killed once both ranks had reported step 12; the script went back to its checkpoint of
    # step 10 and trained 11 and 12 again.
    assert fault["at_step"] >= 12 and fault["restore_step"] == 10, fault
    assert fault["lost_steps"] == fault["at_step"] - 10, fault
    assert fault["step_known"] and fault["recovery_until"] == "step", fault
    assert fault["recovery_s"] is not None and fault["recovery_s"] >= fault["detection_s"], fault
    assert _results(res.runs_dir, res.run_id or "") == expected
    rep = res.report
    assert rep["steps_completed"] == STEPS
    # The losses the script reported (or printed) are the record's loss curve.
    assert all(isinstance(loss, float) for _, loss in rep["loss_by_step"])
    restarted = [e for e in res.events if e.kind is EventKind.RANKS_SPAWNED and e.get("gen") == 1]
    assert restarted and restarted[0].get("ranks") == [0, 1]  # torchrun's restart: the whole group
    assert_nothing_left(workdir)
    assert not shm_left(res.run_id or "")


def test_a_script_that_reports_nothing_takes_a_fault_at_a_time(workdir: Path, fault_free: tuple[list[str], float]) -> None:
    expected, midway = fault_free
    # Past its first checkpoint (step 5) and before its end, reckoned from the fault-free run:
    # halfway between the two, so that a start a few seconds slower or faster than that run's
    # (a loaded host) still lands the kill inside the window.
    at = round(midway, 1)
    res = launch(workdir, rid("by-time"), *COMMON, "--inject", f"kill-rank:rank=1,t={at}",
                 "train.py", "--ckpt", str(workdir / "by-time.pt"))
    fault = _one_fault(res)
    assert fault["step_known"] is False and fault["recovery_until"] == "workers-up", fault
    assert fault["recovery_s"] is not None and fault["recovery_s"] >= fault["detection_s"], fault
    assert fault["restore_step"] is None
    assert _results(res.runs_dir, res.run_id or "") == expected
    assert "resumed from step" in "\n".join(p.read_text() for p in (res.runs_dir / (res.run_id or "") / "logs").glob("*/1.log"))
    assert_nothing_left(workdir)

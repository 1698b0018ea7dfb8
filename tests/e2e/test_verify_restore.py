"""`--verify-restore` end to end: a recovery from memory restores one snapshot further back and
trains the steps between again, and every rank's loss of each must equal its own from before the
fault. A DDP script in nanoGPT's pattern (the next batch fetched at the end of each step, held
in a variable the script never registers) restores its model, optimizer and data position
exactly, yet trains the replayed step on another batch: the check catches it at the replayed step
and the job stops naming the rank. The same script registering its prefetched batch recovers
and is recorded as verified."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import Result, assert_nothing_left, launch, rid, shm_left

# Whole jobs launched with a fault and a recovery: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PREFETCH = """
import sys
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from recovery import Job

register_prefetch = sys.argv[1] == "register"
torch.manual_seed(0)
torch.set_num_threads(1)
job = Job.from_env()
g = torch.Generator().manual_seed(1234)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randn(1024, 1, generator=g))
sampler = DistributedSampler(data, num_replicas=job.env.world_size, rank=job.env.rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
model = DDP(torch.nn.Linear(8, 1), process_group=job.ddp_group())
opt = torch.optim.SGD(model.parameters(), lr=0.05)
batches = job.register_ddp(model=model, optimizer=opt, loader=loader)
batch = next(batches)  # nanoGPT: the first batch fetched before the loop...


def load(state):
    global batch
    batch = (state["x"], state["y"])


if register_prefetch:
    job.register("prefetch", lambda: {"x": batch[0], "y": batch[1]}, load)


def step(ctx):
    global batch
    x, y = batch
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    batch = next(batches)  # ...and the next one at the end of each step
    return loss.item()


job.run(step, int(sys.argv[2]))
"""


# This model's steps take about 5 ms, and a kill "at step 10" is sent from outside once every rank
# has committed step 10: on a loaded host the ranks commit more meanwhile (a 24-step job once ended
# before the kill landed). Steps enough that it lands with a recovery and steps to verify after it.
STEPS = 60


def _run(workdir: Path, how: str) -> tuple[Result, str]:
    script = workdir / "prefetch.py"
    script.write_text(PREFETCH)
    run_id = rid(f"verify-{how}")
    res = launch(workdir, run_id, "--nnodes", "1", "--nproc-per-node", "2", "--spares", "1", "--verify-restore",
                 "--inject", "kill-rank:rank=1,step=10", str(script), how, str(STEPS))
    return res, run_id


def test_an_unregistered_prefetched_batch_is_caught_at_the_replayed_step(tmp_path: Path) -> None:
    res, run_id = _run(tmp_path, "unregistered")
    assert res.returncode != 0, res.stdout[-3000:]
    [decided] = [e for e in res.events if e.kind is EventKind.RECOVERY_DECIDED]
    until, restored = decided.get("verify_until"), decided.get("restore_step")
    assert until and restored in (until - 1, until - 2), decided  # one or two snapshots further back
    [diverged] = [e for e in res.events if e.kind is EventKind.RESTORE_DIVERGED]
    # Neither rank trains the replayed step on its batch: the survivor's variable holds the batch
    # of a later step, the replacement's its start-up one. The first to report is named.
    assert diverged.get("rank") in (0, 1) and diverged.get("step") == restored + 1, diverged
    assert diverged.get("loss_before") != diverged.get("loss_after")
    finished = [e for e in res.events if e.kind is EventKind.RUN_FINISHED][0]
    assert finished.get("status") == "failed" and finished.get("root_cause")["cause"] == "restore-diverged"
    assert f"restore check FAILED: rank {diverged.get('rank')}" in res.stdout + res.stderr
    assert [f["restore_check"] for f in res.report["faults"]] == ["diverged"]
    # Stopped there, not trained to the end: the ranks go on only for the moment the controller
    # takes to read the replayed step's loss and stop them (a few of this model's 5 ms steps).
    assert finished.get("steps_completed") < STEPS, finished
    assert_nothing_left(tmp_path)
    assert not shm_left(run_id)


def test_a_registered_prefetched_batch_recovers_and_is_verified(tmp_path: Path) -> None:
    res, run_id = _run(tmp_path, "register")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    [verified] = [e for e in res.events if e.kind is EventKind.RESTORE_VERIFIED]
    assert verified.get("verified") is True and verified.get("unchecked") == [], verified
    # Up to the newest step any rank reported before the fault, one to three steps.
    assert 1 <= verified.get("until") - verified.get("restore_step") <= 3, verified
    assert not [e for e in res.events if e.kind is EventKind.RESTORE_DIVERGED]
    rep = json.loads((tmp_path / "runs" / run_id / "report.json").read_text())
    assert rep["status"] == "completed" and rep["steps_completed"] == STEPS
    assert "restore verified" in res.stdout + res.stderr
    assert [f["restore_check"] for f in rep["faults"]] == ["verified"]
    assert_nothing_left(tmp_path)
    assert not shm_left(run_id)

"""Unchanged torchrun scripts under `ffctl launch`: the same argv prints the same RESULT lines as
under `python -m torch.distributed.run`, workers see torchrun's environment, and a failing script
gets torchrun's restart semantics (every worker restarted, up to --max-restarts, then the root
cause: the failed rank and the error its `@record` error file holds)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import (
    TIMEOUT, assert_nothing_left, ffctl_launch_script, launch, launcher_env, rid, shm_left, torchrun_script,
)

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# env:// rendezvous, one allreduce, and the torchrun variables a script may read.
ALLREDUCE = '''
import os
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
         "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS")


@record
def main():
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    seen = " ".join(f"{n}={os.environ.get(n)}" for n in NAMES)
    flags = (f"elastic={dist.is_torchelastic_launched()} run_id={bool(os.environ.get('TORCHELASTIC_RUN_ID'))} "
             f"error_file={bool(os.environ.get('TORCHELASTIC_ERROR_FILE'))} "
             f"master={bool(os.environ.get('MASTER_ADDR'))}:{bool(os.environ.get('MASTER_PORT'))}")
    # One write: the ranks share torchrun's stdout, and a line must not be split by another's.
    os.write(1, f"RESULT sum={t.item()} {seen} {flags}\\n".encode())
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

# A small DDP job: same seed, same data, same result whoever launches it.
DDP = '''
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + rank)
for step in range(5):
    x = torch.randn(4, 8, generator=g)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
weights = sum(p.detach().double().sum().item() for p in model.parameters())
os.write(1, f"RESULT rank={rank} world={world} loss={loss.item()!r} weights={weights!r}\\n".encode())
# DDP's reducer goes before its group: torch aborts the process now and then ("terminate called
# without an active exception") when the group is destroyed under a live DDP module.
del model, opt
dist.barrier()  # no rank tears gloo down while another still talks to it
dist.destroy_process_group()
'''

# Rank 1 fails at every attempt; rank 0 waits to be stopped. @record writes the error file.
FAILING = '''
import os
import time
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    if os.environ["RANK"] == "1":
        time.sleep(0.3)
        raise ValueError("rank 1 cannot go on")
    time.sleep(120)


if __name__ == "__main__":
    main()
'''

ARGVS = {
    "nnodes": ["--nnodes", "1", "--nproc-per-node", "2"],
    "standalone": ["--standalone", "--nproc_per_node=2"],
    "c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--nproc-per-node", "2"],
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("torchrun")
    (d / "allreduce.py").write_text(ALLREDUCE)
    (d / "ddp.py").write_text(DDP)
    (d / "failing.py").write_text(FAILING)
    return d


def _results(text: str) -> list[str]:
    return sorted(line[line.index("RESULT"):] for line in text.splitlines() if "RESULT " in line)


def _torchrun(workdir: Path, argv: list[str]) -> list[str]:
    proc = torchrun_script(workdir, argv, lambda out: len(_results(out)) == 2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _results(proc.stdout)


def _ffctl(workdir: Path, argv: list[str]) -> list[str]:
    proc, run_id = ffctl_launch_script(workdir, "torchrun", argv, lambda out: len(_results(out)) == 2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = workdir / "runs" / run_id / "logs"
    text = "\n".join(p.read_text() for p in sorted(logs.glob("*/[0-9]*.log")))
    assert_nothing_left(workdir)
    assert not shm_left(run_id)
    # On the console too, as it came, each line under its rank.
    shown = sorted(line for line in proc.stdout.splitlines() if line.startswith("[rank ") and "RESULT " in line)
    assert sorted(line[line.index("RESULT"):] for line in shown) == _results(text), proc.stdout
    assert all(line.startswith(("[rank 0]: RESULT", "[rank 1]: RESULT")) for line in shown), shown
    return _results(text)


@pytest.mark.parametrize("layout", sorted(ARGVS))
def test_allreduce_prints_what_torchrun_prints(workdir: Path, layout: str) -> None:
    argv = [*ARGVS[layout], "allreduce.py"]
    expected = _torchrun(workdir, argv)
    assert len(expected) == 2 and all("sum=3.0" in line and "elastic=True" in line for line in expected), expected
    assert all("error_file=True" in line and "OMP_NUM_THREADS=1" in line for line in expected), expected
    assert _ffctl(workdir, argv) == expected


def test_ddp_job_prints_what_torchrun_prints(workdir: Path) -> None:
    # One layout: what the layout changes (the environment each rank gets) is what the allreduce
    # script prints under all three; this one checks a DDP model trains as under torchrun.
    argv = [*ARGVS["nnodes"], "ddp.py"]
    expected = _torchrun(workdir, argv)
    assert len(expected) == 2, expected
    assert _ffctl(workdir, argv) == expected


def test_rank_failing_every_attempt_stops_after_the_restarts(workdir: Path) -> None:
    res = launch(workdir, rid("fails"), "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "2",
                 "failing.py")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    events = res.events
    # Three attempts: the first and two restarts, each of the whole group.
    spawned = [e for e in events if e.kind is EventKind.RANKS_SPAWNED]
    assert [(e.get("gen"), e.get("ranks")) for e in spawned] == [(0, [0, 1]), (1, [0, 1]), (2, [0, 1])], out
    assert "restart budget spent: 2 of --max-restarts 2 used" in res.stderr, out
    assert "rank      : 1 (node 0)" in res.stderr, out
    assert "ValueError: rank 1 cannot go on" in res.stderr, out
    (finished,) = [e for e in events if e.kind is EventKind.RUN_FINISHED]
    cause = finished.get("root_cause")
    assert cause["rank"] == 1 and cause["error"] == "ValueError: rank 1 cannot go on", cause
    # The message came from the rank's error file, as torchrun reads it.
    exits = [e for e in events if e.kind is EventKind.RANK_EXITED and e.get("rank") == 1]
    assert [e.get("error_file") for e in exits] == ["ValueError: rank 1 cannot go on"] * 3, [e.data for e in exits]
    assert_nothing_left(workdir)
    assert not shm_left(res.run_id or "")


def test_no_python_from_the_environment_runs_a_program(workdir: Path) -> None:
    script = workdir / "job.sh"
    script.write_text('#!/bin/sh\necho "RESULT rank=$RANK of $WORLD_SIZE role=$ROLE_NAME args=$*"\n')
    script.chmod(0o755)
    run_id = rid("nopython")
    proc = subprocess.run([sys.executable, "-m", "ffctl", "launch", "--run-id", run_id, "--runs-dir",
                           str(workdir / "runs"), "--nproc-per-node", "2", "--role", "trainer", "./job.sh", "a", "b"],
                          cwd=workdir, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**launcher_env(), "PET_NO_PYTHON": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = "\n".join(p.read_text() for p in sorted((workdir / "runs" / run_id / "logs").glob("*/[0-9]*.log")))
    assert _results(text) == [f"RESULT rank={r} of 2 role=trainer args=a b" for r in (0, 1)]
    assert_nothing_left(workdir)

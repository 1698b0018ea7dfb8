"""A finished script always ends: the patterns of public torchrun scripts that once printed their
last line under `ffctl launch` and never exited, each run 10 times (a hang of 3 in 10 is
caught with 97% odds; tests/integration/test_worker_exit.py repeats the worker alone 30 times),
every run ending on its own as under torchrun; and a script that truly never ends, stopped within
`--silence-timeout` with every rank named, its last line, how long it was silent and its Python
stacks in the record.

- DDP over 2 nodes x 1, an epoch loop printing every epoch, `destroy_process_group()` and the
  model freed as `main()` returns (pytorch/examples' `multigpu_torchrun.py`): 3 runs in 10 hung
  in gloo's process-group destructor (ffctl/agent/teardown.py).
- The same shape with rank 1 SIGKILLed right after it was forked, under `--max-restarts 1`
  (rasbt/LLMs-from-scratch's DDP script): the restarted job's rank 0 never exited.
"""
from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import TORCH_EXIT_ABORT, Result, assert_nothing_left, launch, rid, shm_left

# Ten whole jobs a test, two at a time: about two minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUNS = 10
AT_ONCE = 2  # launches side by side: the host loaded as a shared CI machine's is
# A run that has not ended after this long hung (each takes about 10 s alone, 20 s beside another).
RUN_TIMEOUT_S = 240.0

EPOCHS = textwrap.dedent("""
    import os, sys, torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed import init_process_group, destroy_process_group

    def main(epochs):
        init_process_group(backend="gloo")
        rank = int(os.environ["RANK"])
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.rand(64, 20, generator=g), torch.rand(64, 1, generator=g))
        loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
        model = DDP(torch.nn.Linear(20, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            print(f"[GPU{rank}] Epoch {epoch} | Batchsize: 8 | Steps: {len(loader)}")
            for x, y in loader:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        destroy_process_group()

    if __name__ == "__main__":
        main(int(sys.argv[1]))
""")

# Rank 1 of the first attempt dies the moment it starts; the restarted job trains to its end.
KILLED_AT_FORK = EPOCHS.replace('if __name__ == "__main__":\n', textwrap.dedent("""\
    if __name__ == "__main__":
        if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
"""))


def _runs(tmp_path: Path, script: str, *args: str) -> list[Result]:
    (tmp_path / "train.py").write_text(script)
    ids = [rid("end") for _ in range(RUNS)]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(lambda run_id: launch(tmp_path, run_id, "--nnodes", "2", "--nproc-per-node", "1",
                                                      *args, "train.py", "3", timeout=RUN_TIMEOUT_S), ids))
    assert_nothing_left(tmp_path)
    for run_id in ids:
        assert not shm_left(run_id)
    return results


def _ended_on_its_own(res: Result) -> None:
    """The run ended with every rank's own exit: completed, or (as torchrun sees it now and then,
    tests/helpers/launch.py) a rank aborted by torch's teardown after its last line. Never
    stopped by ffctl for lingering or silence."""
    [end] = [e for e in res.events if e.kind is EventKind.RUN_FINISHED]
    assert (end.get("root_cause") or {}).get("cause") not in ("exit-barrier", "silence"), res.stderr[-2000:]
    if res.returncode != 0:
        assert TORCH_EXIT_ABORT in res.stderr, (res.returncode, res.stderr[-2000:])
    exits = [e for e in res.events if e.kind is EventKind.RANK_EXITED and e.get("exitcode") == 0]
    assert {e.get("rank") for e in exits} == {0, 1} or res.returncode != 0


def test_ddp_over_two_nodes_ends_every_time(tmp_path: Path) -> None:
    results = _runs(tmp_path, EPOCHS)
    for res in results:
        _ended_on_its_own(res)
    assert sum(r.returncode == 0 for r in results) >= RUNS - 5  # torch's own teardown abort aside


def test_a_rank_killed_as_it_was_forked_then_a_restart_ends_every_time(tmp_path: Path) -> None:
    results = _runs(tmp_path, KILLED_AT_FORK, "--max-restarts", "1")
    for res in results:
        _ended_on_its_own(res)
        assert res.report["faults"], res.stderr[-2000:]  # the kill was seen and restarted from
    assert sum(r.returncode == 0 for r in results) >= RUNS - 5


SLEEPS_FOREVER = textwrap.dedent("""
    import os, time
    import torch.distributed as dist

    def wait_forever():
        while True:
            time.sleep(3600)

    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} done", flush=True)
    wait_forever()
""")


def test_a_script_whose_every_rank_never_ends_is_stopped_within_the_bound_with_its_stacks(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SLEEPS_FOREVER)
    bound = 15.0
    run_id = rid("silent")
    res = launch(tmp_path, run_id, "--nnodes", "2", "--nproc-per-node", "2", "--silence-timeout", f"{bound:g}",
                 "train.py", timeout=RUN_TIMEOUT_S)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "hang: no output and no step from any rank" in res.stderr
    [said] = [e for e in res.events if e.kind is EventKind.RANKS_SILENT]
    assert [r["rank"] for r in said.get("ranks")] == [0, 1, 2, 3]
    [end] = [e for e in res.events if e.kind is EventKind.RUN_FINISHED]
    cause = end.get("root_cause")
    assert end.get("status") == "failed" and cause["cause"] == "silence"
    assert [e["rank"] for e in cause["lingering"]] == [0, 1, 2, 3]
    for each in cause["lingering"]:
        assert each["last_line"] == f"rank {each['rank']} done"
        assert bound <= each["lingered_s"] < bound + 60  # stopped once the bound was reached
        stacks = Path(each["stacks_file"]).read_text()
        assert Path(each["stacks_file"]).parent == tmp_path / "runs" / run_id / "logs" / str(each["rank"] // 2)
        assert "in wait_forever" in stacks and "Current thread" in stacks, stacks
    stopped = [e for e in res.events if e.kind is EventKind.RANK_EXITED]
    assert sorted(e.get("rank") for e in stopped) == [0, 1, 2, 3] and all(e.get("stacks_file") for e in stopped)
    assert "stacks in :" in res.stderr  # the root cause on the console points at them
    assert_nothing_left(tmp_path)
    assert not shm_left(run_id)

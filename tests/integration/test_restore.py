"""Restoring a generation's state across real processes and a real gloo group.

Four ranks train the same small model to step 3 and snapshot it (each rank's copy: its 1/W
slice of the replicated state and its own RNG). Then, per scenario, some ranks lose or move past
that state, and `restore` must bring every rank back to step 3 bit for bit, by the cheapest way:
ranks still at step 3 keep their state, the others receive the slices they lack from them, and
when no rank is at step 3 all of them gather the slices.
"""
from __future__ import annotations

import copy
import datetime
import json
import subprocess
import sys
from pathlib import Path
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from recovery.group import Generation
from recovery.restore import GATHERED, KEPT, RECEIVED, agree, prepare, restore
from recovery.slots import SlotContent
from recovery.snapshot import StateEntry, byte_view, capture

WORLD = 4
SNAP_STEP = 3
# name -> (ranks that lose their state (a fresh replacement), ranks that trained one step more,
#          ranks whose learning rate a scheduler moved before the aborted step's first collective)
SCENARIOS: dict[str, tuple[set[int], set[int], set[int]]] = {
    "kill-rank": ({1}, set(), set()),
    "kill-node": ({2, 3}, set(), set()),
    "survivor-ahead": ({1}, {3}, set()),
    "lr-moved": ({1}, set(), {0, 2, 3}),
    "all-new": ({0, 1, 2, 3}, set(), set()),
    "all-ahead": ({1}, {0, 2, 3}, set()),
}
EXPECTED = {
    "kill-rank": {0: KEPT, 1: RECEIVED, 2: KEPT, 3: KEPT},
    "kill-node": {0: KEPT, 1: KEPT, 2: RECEIVED, 3: RECEIVED},
    "survivor-ahead": {0: KEPT, 1: RECEIVED, 2: KEPT, 3: RECEIVED},
    "lr-moved": {0: KEPT, 1: RECEIVED, 2: KEPT, 3: KEPT},
    "all-new": {r: GATHERED for r in range(WORLD)},
    "all-ahead": {r: GATHERED for r in range(WORLD)},
}


class Trainer:
    """A model, its optimizer and this rank's RNG, trained identically on every rank."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.entries = [
            StateEntry("model", self.model.state_dict, self.model.load_state_dict, True),
            StateEntry("optim", self.opt.state_dict, self.opt.load_state_dict, True),
            StateEntry("rng", torch.get_rng_state, torch.set_rng_state, False),
        ]

    def step(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)  # the same batch on every rank: replicas agree
        x = torch.randn(16, 24, generator=g)
        self.opt.zero_grad()
        self.model(x).pow(2).mean().backward()
        self.opt.step()
        torch.rand(3)  # this rank's RNG moves on too


def _content(trainer: Trainer, rank: int) -> SlotContent:
    cap = capture(trainer.entries, SNAP_STEP, rank, WORLD)
    shard = torch.zeros(cap.shard_len, dtype=torch.uint8)
    for off, src in cap.shard_pieces():
        shard[off : off + src.numel()] = src
    raw = bytes(byte_view(shard))
    return SlotContent(SNAP_STEP, cap.meta, raw, zlib.crc32(raw, zlib.crc32(cap.meta)))


def _state(trainer: Trainer) -> dict[str, Any]:
    opt = trainer.opt.state_dict()["state"]
    return {"model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optim": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.items()},
            "rng": torch.get_rng_state(),
            "lr": torch.tensor([g["lr"] for g in trainer.opt.param_groups])}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if not _same(x, y):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _rank_main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(100 + rank)  # each rank's own RNG stream
    trainer = Trainer(seed=0)
    for step in range(1, SNAP_STEP + 1):
        trainer.step(step)
    content, reference = _content(trainer, rank), _state(trainer)
    results: dict[str, tuple[str, bool]] = {}
    for gen, (name, (fresh, ahead, lr_moved)) in enumerate(SCENARIOS.items()):
        local = Trainer(seed=0)
        if rank in fresh:  # a replacement: a new process that built the model and nothing more
            local = Trainer(seed=1000 + rank)
        else:
            local.model.load_state_dict(reference["model"])
            local.opt.load_state_dict(copy.deepcopy(trainer.opt.state_dict()))
            torch.rand(5)  # the aborted step used this rank's RNG
            if rank in ahead:
                local.step(SNAP_STEP + 1)
            if rank in lr_moved:
                local.opt.param_groups[0]["lr"] = 0.5
        group = Generation(store, "127.0.0.1", port, gen, rank, WORLD, timeout=120.0)
        try:
            prepared = prepare(local.entries, content, SNAP_STEP, WORLD)
            how = restore(group, local.entries, prepared, agree(group, prepared))
        finally:
            group.close()
        results[name] = (how, _same(_state(local), reference))
    print(json.dumps(results), flush=True)


@pytest.mark.slow
@pytest.mark.timeout(300)  # real ranks in processes over gloo, a peer lost and a generation rebuilt
def test_restore_keeps_sends_or_gathers_and_is_bit_exact() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=120))
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.test_restore", str(r), str(master.port)],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    got: dict[int, dict[str, list[Any]]] = {}
    try:
        for r, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-2000:]
            got[r] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, expected in EXPECTED.items():
        assert {r: got[r][name][0] for r in range(WORLD)} == expected, name
        assert all(got[r][name][1] for r in range(WORLD)), f"{name}: state differs from step {SNAP_STEP}"


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]))

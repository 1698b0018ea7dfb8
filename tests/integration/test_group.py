"""A generation's process group across real processes: abort, close, and the next generation.

Four ranks build generation 0; three start an allreduce and rank 2 is killed before it takes
part. The test, acting as the controller, sets the generation's abort keys at once: the ranks
next to the dead one have an error by then, rank 0 (not next to it in gloo's ring) is normally
still blocked and is aborted. The survivors close the old group and, with a replacement rank 2,
build generation 1 and allreduce through it. Closing must destroy the old group also on a rank
whose collective was still blocked when it closed: its gloo threads end once the other
survivors' closed connections end that collective.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from wire import control
from recovery.errors import PeerFailure
from recovery.group import Generation

WORLD = 4
VICTIM = 2  # rank 0 is not next to it in gloo's ring: its allreduce stays blocked until aborted


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_threads(at_most: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while _threads() > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return _threads()


def _rank_main(rank: int, port: int, replacement: bool) -> None:
    torch.set_num_threads(1)
    store = control.connect("127.0.0.1", port, timeout=120.0)
    out: dict[str, object] = {}
    if not replacement:
        baseline = _threads()
        group = Generation(store, "127.0.0.1", port, 0, rank, WORLD, timeout=120.0)
        out["built_threads"] = _threads() - baseline
        store.add("ready/0", 1)
        if rank == VICTIM:
            time.sleep(3600)  # never takes part: killed while the others wait for it
        try:
            group.allreduce(torch.ones(4))  # rank 2 is killed before it takes part
            out["gen0"] = "completed"
        except PeerFailure as exc:
            out["gen0"] = "error" if "failed" in str(exc) else "aborted"
        group.close()
        # The old group's gloo threads and the abort watcher are gone (generous: CI is shared).
        out["left_threads"] = _wait_threads(baseline, timeout=60.0) - baseline
        out["watchers"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("ffctl-abort"))
    group = Generation(store, "127.0.0.1", port, 1, rank, WORLD, timeout=120.0)
    out["gen1_sum"] = group.allreduce(torch.full((4,), float(rank + 1))).tolist()
    group.close()
    print(json.dumps(out), flush=True)


def _spawn(rank: int, port: int, replacement: bool) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen([sys.executable, "-m", "tests.integration.test_group", str(rank), str(port),
                             "1" if replacement else "0"],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.timeout(300)  # real ranks in processes over gloo, a peer lost and a generation rebuilt
def test_abort_close_and_the_next_generation() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=120))
    procs = [_spawn(r, master.port, replacement=False) for r in range(WORLD)]
    try:
        master.wait(["ready/0"], datetime.timedelta(seconds=120))
        while int(master.add("ready/0", 0)) < WORLD:
            time.sleep(0.01)
        time.sleep(0.5)  # ranks 0 and 1 are inside the allreduce, waiting for rank 2
        procs[VICTIM].send_signal(signal.SIGKILL)
        procs[VICTIM].wait(timeout=30)
        keys = [control.gen_abort_key(0, r) for r in range(WORLD)]
        master.multi_set(keys, ["1"] * WORLD)
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
    survivors = [r for r in range(WORLD) if r != VICTIM]
    assert {got[r]["gen0"] for r in survivors} <= {"error", "aborted"}
    for r in survivors:
        assert got[r]["built_threads"] > 0  # building a group starts gloo threads...
        assert got[r]["left_threads"] <= 0, got[r]  # ...and closing it ends them all
        assert got[r]["watchers"] == []
    for r in range(WORLD):
        assert got[r]["gen1_sum"] == [float(sum(range(1, WORLD + 1)))] * 4


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")

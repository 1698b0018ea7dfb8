"""What a torchrun user meets at the edges of a run under `ffctl launch`: a rank that lingers
after the others finished is stopped by the exit barrier and named; the error file is an
absolute path, found after the script changed directory; an elastic `--nnodes MIN:MAX` on one
host starts what one torchrun there starts; torchrun's worker environment (GROUP_WORLD_SIZE)."""
from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import assert_nothing_left, launch, rid

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LINGER = textwrap.dedent("""
    import os, time
    rank = int(os.environ["RANK"])
    print(f"rank {rank} trained")
    def wait_for_peer():
        time.sleep(600)
    if rank == 1:
        print("waiting for a peer that already left")
        wait_for_peer()
""")

CHDIR_THEN_FAIL = textwrap.dedent("""
    import os, sys
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        os.chdir(sys.argv[1])
        raise ValueError("bad batch after chdir")

    main()
""")

ENV = textwrap.dedent("""
    import os
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
    print("ENV " + " ".join(f"{n}={os.environ.get(n)}" for n in names))
""")


def test_a_rank_lingering_after_the_others_finished_is_stopped_and_named(tmp_path: Path) -> None:
    script = tmp_path / "linger.py"
    script.write_text(LINGER)
    run_id = rid("linger")
    t0 = time.monotonic()
    res = launch(tmp_path, run_id, "--nnodes", "1", "--nproc-per-node", "2", "--exit-barrier-timeout", "6",
                 str(script))
    assert time.monotonic() - t0 < 120  # never the 600 s its sleep would take
    assert res.returncode == 1, res.stdout[-3000:]
    out = res.stdout + res.stderr
    assert "exit barrier" in out and "rank      : 1" in out
    assert "waiting for a peer that already left" in out  # what it was doing
    # Said on screen before it was stopped, and recorded.
    assert "rank 1 still running" in out and "after rank 0 finished" in out
    events = res.events
    [barrier] = [e for e in events if e.kind is EventKind.EXIT_BARRIER]
    assert barrier.get("ranks") == [1] and barrier.get("finished") == [0]
    [end] = [e for e in events if e.kind is EventKind.RUN_FINISHED]
    cause = end.get("root_cause")
    assert end.get("status") == "failed" and cause["rank"] == 1 and cause["cause"] == "exit-barrier"
    assert cause["last_line"] == "waiting for a peer that already left"
    assert 6 <= cause["lingered_s"] < 60
    # Where it was stuck: its Python stacks, written when it was stopped, in the root cause.
    stacks = cause["stacks"]
    assert any("linger.py" in line and "in wait_for_peer" in line for line in stacks), stacks
    assert "its Python stacks when it was stopped:" in res.stderr and "in wait_for_peer" in res.stderr, res.stderr
    assert_nothing_left(tmp_path)


def test_the_error_file_is_absolute_and_read_after_the_script_changed_directory(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(CHDIR_THEN_FAIL)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_id = rid("chdir")
    res = launch(tmp_path, run_id, str(script), str(elsewhere))
    assert res.returncode == 1
    [end] = [e for e in res.events if e.kind is EventKind.RUN_FINISHED]
    assert "bad batch after chdir" in end.get("root_cause")["error"]
    assert list(elsewhere.iterdir()) == []  # nothing written where the script went
    assert list((res.runs_dir / run_id / "logs" / "0").glob("0.gen0.error.json"))


def test_an_elastic_range_starts_its_minimum_on_one_host_with_torchruns_environment(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text(ENV)
    run_id = rid("range")
    res = launch(tmp_path, run_id, "--nnodes=1:2", "--nproc-per-node=2", str(script))
    assert res.returncode == 0, res.stdout[-3000:]
    lines = sorted(line.split("]: ", 1)[1] for line in res.stdout.splitlines() if "]: ENV " in line)
    assert lines == [
        f"ENV RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 GROUP_WORLD_SIZE=1" for r in (0, 1)]
    [started] = [e for e in res.events if e.kind is EventKind.RUN_STARTED]
    assert started.get("nnodes") == 1 and started.get("torchrun", {}).get("nnodes") == "1:2"

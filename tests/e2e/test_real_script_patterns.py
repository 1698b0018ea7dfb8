"""Patterns of real public torchrun scripts, each run under `torchrun` and under `ffctl launch`
on this machine with the same command line: the same exit code, the same files and the same
printed lines (less ffctl's `[rank N]: ` prefix). The patterns: a script that saves and resumes
its own snapshot across restarts (pytorch/examples' DDP tutorial series), one that reads
LOCAL_RANK through argparse defaults, one run with `-m package.module`, one whose DataLoader
forks its own workers, one that calls `sys.exit(3)` on one rank; and a rank SIGKILLed mid-run
under `--max-restarts 1`, whose last printed line reaches the console and the record."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from runs.events import EventKind
from runs.store import iter_events
from tests.helpers.launch import assert_nothing_left, ffctl_launch_script, torchrun_script

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The DDP tutorial series' trainer: a snapshot file written by rank 0 every epoch, loaded at
# start when present; KILL_EPOCH makes rank 1 SIGKILL itself after that epoch, first attempt only.
SNAPSHOT = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def say(line):  # one write: the ranks share torchrun's stdout
        os.write(1, (line + "\\n").encode())

    def main(path, epochs, kill_epoch):
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        first = 0
        if os.path.exists(path):
            snap = torch.load(path)
            model.load_state_dict(snap["model"])
            first = snap["epochs_run"]
            say(f"OUT rank={rank} resuming from epoch {first}")
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for epoch in range(first, epochs):
            g = torch.Generator().manual_seed(1000 * epoch + rank)
            x = torch.randn(8, 4, generator=g)
            loss = (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            if rank == 0:
                torch.save({"model": model.state_dict(), "epochs_run": epoch + 1}, path)
            dist.barrier()  # the snapshot is written before anyone may die
            say(f"OUT rank={rank} epoch={epoch} loss={loss.item():.6f}")
            if epoch == kill_epoch and rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                print(f"OUT rank={rank} dying after epoch {epoch}")  # a plain print: kept only if unbuffered
                os.kill(os.getpid(), signal.SIGKILL)
        w = sum(p.detach().double().sum().item() for p in model.parameters())
        say(f"OUT rank={rank} done weights={w!r}")
        dist.destroy_process_group()

    if __name__ == "__main__":
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
""")

ARGPARSE = textwrap.dedent("""
    import argparse, os
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ["LOCAL_RANK"]))
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    os.write(1, f"OUT local_rank={args.local_rank} rank={os.environ['RANK']} lr={args.lr}\\n".encode())
    import logging
    logging.basicConfig(format="%(message)s", level=logging.INFO)  # logging writes to stderr
    logging.info("LOG rank=%s", os.environ["RANK"])
""")

PACKAGE_MODULE = textwrap.dedent("""
    import os, sys
    from . import helper
    os.write(1, (f"OUT name={__name__} package={__package__} rank={os.environ['RANK']} argv={sys.argv[1:]} "
                 f"helper={helper.VALUE} file={os.path.basename(__file__)}\\n").encode())
""")

LOADER = textwrap.dedent("""
    import os
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Squares(Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            return torch.tensor([float(i * i)]), os.getpid()

    rank = int(os.environ["RANK"])
    total, pids = 0.0, set()
    for x, pid in DataLoader(Squares(), batch_size=4, num_workers=2):
        total += x.sum().item()
        pids.update(pid.tolist())
    os.write(1, f"OUT rank={rank} total={total} loader_processes={len(pids)} own_pid_among_them={os.getpid() in pids}\\n".encode())
""")

EXIT3 = textwrap.dedent("""
    import os, sys, time
    rank = int(os.environ["RANK"])
    os.write(1, f"OUT rank={rank} starting\\n".encode())
    if rank == 1:
        sys.exit(3)
    time.sleep(60)
""")


def _out(text: str, prefixed: bool) -> list[str]:
    """The script's own lines, sorted (ranks interleave), without ffctl's `[rank N]: ` prefix."""
    lines = []
    for line in text.splitlines():
        if prefixed:
            if not line.startswith("[rank ") or "]: " not in line:
                continue
            line = line.split("]: ", 1)[1]
        if line.startswith("OUT "):
            lines.append(line)
    return sorted(lines)


def _both(tmp_path: Path, argv: list[str],
          whole_lines: int) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str], str]:
    """Run `argv` under torchrun in one copy of the work dir and under ffctl in another."""
    src = tmp_path / "src"
    runs = {}
    for who in ("torchrun", "ffctl"):
        work = tmp_path / who
        shutil.copytree(src, work)
        runs[who] = work
    tr = torchrun_script(runs["torchrun"], argv, lambda out: len(_out(out, False)) >= whole_lines)
    ff, run_id = ffctl_launch_script(runs["ffctl"], "pattern", argv, lambda out: len(_out(out, True)) >= whole_lines)
    assert_nothing_left(runs["ffctl"])
    return tr, ff, run_id


def _write(tmp_path: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _digest(path: Path) -> str:
    import torch

    snap = torch.load(path)
    return hashlib.sha256(repr(sorted((k, v.tolist()) for k, v in snap["model"].items())).encode()).hexdigest()


def test_a_script_that_saves_and_resumes_its_snapshot_runs_as_under_torchrun(tmp_path: Path) -> None:
    _write(tmp_path, {"train.py": SNAPSHOT})
    argv = ["--nnodes", "1", "--nproc-per-node", "2", "train.py", "snapshot.pt", "4", "-1"]
    tr, ff, _ = _both(tmp_path, argv, whole_lines=10)
    assert tr.returncode == ff.returncode == 0, ff.stdout[-2000:] + ff.stderr[-2000:]
    assert _out(ff.stdout, True) == _out(tr.stdout, False) and len(_out(tr.stdout, False)) == 10
    assert _digest(tmp_path / "ffctl" / "snapshot.pt") == _digest(tmp_path / "torchrun" / "snapshot.pt")


def test_a_rank_killed_mid_run_resumes_from_the_scripts_snapshot_and_its_last_line_is_kept(tmp_path: Path) -> None:
    _write(tmp_path, {"train.py": SNAPSHOT})
    # The fault-free run's result under torchrun is the reference (torchrun's own restart after a
    # SIGKILL is itself unreliable on this torch, so the faulted run is compared to it).
    clean = ["--nnodes", "1", "--nproc-per-node", "2", "train.py", "snapshot.pt", "5", "-1"]
    tr, _, _ = _both(tmp_path, clean, whole_lines=12)
    assert tr.returncode == 0, tr.stderr[-2000:]
    reference = [line for line in _out(tr.stdout, False) if " done " in line]
    shutil.rmtree(tmp_path / "ffctl")
    work = tmp_path / "ffctl"
    shutil.copytree(tmp_path / "src", work)
    argv = ["--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "train.py", "snapshot.pt", "5", "2"]
    ff, run_id = ffctl_launch_script(work, "resume", argv, lambda out: " done " in out)
    assert ff.returncode == 0, ff.stdout[-3000:] + ff.stderr[-2000:]
    lines = _out(ff.stdout, True)
    assert [line for line in lines if " done " in line] == reference  # the same final weights
    assert "OUT rank=0 resuming from epoch 3" in lines and "OUT rank=1 resuming from epoch 3" in lines
    # The killed rank's last line reached the console before it died, and the record keeps it.
    assert "[rank 1]: OUT rank=1 dying after epoch 2" in ff.stdout
    events = list(iter_events(work / "runs" / run_id / "events.jsonl"))
    [killed] = [e for e in events if e.kind is EventKind.RANK_EXITED and e.get("exitcode") == -9
                and not e.get("expected")]
    assert killed.get("log_tail")[-1] == "OUT rank=1 dying after epoch 2"
    assert _digest(work / "snapshot.pt") == _digest(tmp_path / "torchrun" / "snapshot.pt")
    assert_nothing_left(work)


def test_local_rank_from_argparse_defaults(tmp_path: Path) -> None:
    _write(tmp_path, {"train.py": ARGPARSE})
    tr, ff, run_id = _both(tmp_path, ["--nproc-per-node", "2", "train.py", "--lr", "0.5"], whole_lines=2)
    assert tr.returncode == ff.returncode == 0, ff.stderr[-2000:]
    assert _out(ff.stdout, True) == _out(tr.stdout, False) == [
        "OUT local_rank=0 rank=0 lr=0.5", "OUT local_rank=1 rank=1 lr=0.5"]
    # A rank's stderr is its stderr, as under torchrun: on the console's stderr, in its own log.
    for rank in (0, 1):
        assert f"LOG rank={rank}" in tr.stderr and f"LOG rank={rank}" not in tr.stdout
        assert f"[rank {rank}]: LOG rank={rank}" in ff.stderr and f"LOG rank={rank}" not in ff.stdout
        logs = tmp_path / "ffctl" / "runs" / run_id / "logs" / "0"
        assert (logs / f"{rank}.err").read_text() == f"LOG rank={rank}\n"
        assert "LOG" not in (logs / f"{rank}.log").read_text()


def test_with_torchruns_tee_the_lines_carry_torchruns_prefix(tmp_path: Path) -> None:
    _write(tmp_path, {"train.py": ARGPARSE})
    tee = lambda text: sorted(line for line in text.splitlines() if line.startswith("[default"))  # noqa: E731
    src = tmp_path / "src"
    tr = torchrun_script(src, ["--nproc-per-node", "2", "--tee", "3", "train.py"], lambda out: len(tee(out)) == 2)
    ff, _ = ffctl_launch_script(src, "tee", ["--nproc-per-node", "2", "--tee", "3", "train.py"],
                                lambda out: len(tee(out)) == 2)
    assert tr.returncode == ff.returncode == 0, ff.stderr[-2000:]
    assert tee(ff.stdout) == tee(tr.stdout) == [
        "[default0]:OUT local_rank=0 rank=0 lr=0.1", "[default1]:OUT local_rank=1 rank=1 lr=0.1"]
    assert tee(ff.stderr) == tee(tr.stderr) == ["[default0]:LOG rank=0", "[default1]:LOG rank=1"]
    assert_nothing_left(src)


def test_a_module_of_a_package_run_with_dash_m(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/helper.py": "VALUE = 42\n", "pkg/train.py": PACKAGE_MODULE})
    tr, ff, _ = _both(tmp_path, ["--nproc-per-node", "2", "-m", "pkg.train", "x", "--y"], whole_lines=2)
    assert tr.returncode == ff.returncode == 0, ff.stderr[-2000:]
    assert _out(ff.stdout, True) == _out(tr.stdout, False) == [
        f"OUT name=__main__ package=pkg rank={r} argv=['x', '--y'] helper=42 file=train.py" for r in (0, 1)]


def test_a_dataloader_that_forks_its_own_workers(tmp_path: Path) -> None:
    _write(tmp_path, {"train.py": LOADER})
    tr, ff, _ = _both(tmp_path, ["--nproc-per-node", "2", "train.py"], whole_lines=2)
    assert tr.returncode == ff.returncode == 0, ff.stderr[-2000:]
    assert _out(ff.stdout, True) == _out(tr.stdout, False) == [
        f"OUT rank={r} total=1240.0 loader_processes=2 own_pid_among_them=False" for r in (0, 1)]


def test_a_rank_that_exits_3_fails_the_job_as_under_torchrun(tmp_path: Path) -> None:
    _write(tmp_path, {"train.py": EXIT3})
    tr, ff, run_id = _both(tmp_path, ["--nproc-per-node", "2", "train.py"], whole_lines=2)
    assert tr.returncode == ff.returncode == 1, ff.stdout[-2000:] + ff.stderr[-2000:]
    assert _out(ff.stdout, True) == _out(tr.stdout, False) == ["OUT rank=0 starting", "OUT rank=1 starting"]
    assert "exitcode  : 3" in ff.stderr and "rank      : 1" in ff.stderr
    assert "exitcode  : 3" in tr.stderr  # torchrun's root cause names the same exit

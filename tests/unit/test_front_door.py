"""The command line a newcomer meets: every command's help and `ffctl doctor` read whole at 80
columns (nothing cut with "…", no line wider), torchrun's options apart with one spelling shown,
`ffctl faults` listing exactly the kinds and keys the spec parser accepts, and mistakes answered
in one line with exit 2 (a mistyped launch option is not taken for the script)."""
from __future__ import annotations

import json
import re
import os
import subprocess
from pathlib import Path

import pytest

from fault_injectors.catalogue import COMMON_KEYS, catalogue
from fault_injectors.schedule import with_seed
from ffctl.cli.app import app
from tests.helpers.cli import ffctl_in_process
from wire.fault_spec import REQUIRED_OPTIONS, FaultKind, allowed_keys, parse_injection, parse_seconds
from tests.helpers.launch import ffctl_argv

COMMANDS = sorted(info.name or "" for info in app.registered_commands if not info.hidden)


def run_cli(argv: list[str], columns: int = 80) -> tuple[int, str, str]:
    """`ffctl ARGV` in this process at `columns` wide: (exit code, stdout, stderr)."""
    return ffctl_in_process(argv, {"COLUMNS": str(columns)})

def _readable(text: str, width: int = 80) -> None:
    assert "…" not in text, [line for line in text.splitlines() if "…" in line]
    assert all(len(line) <= width for line in text.splitlines()), [ln for ln in text.splitlines() if len(ln) > width]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_help_reads_whole_at_80_columns(command: str) -> None:
    code, out, _ = run_cli([command, "--help"] if command else ["--help"])
    assert code == 0 and "Usage: " in out
    _readable(out)
    assert "<str>" not in out and "<bool>" not in out and "\\[" not in out


def test_the_command_list_shows_every_command_with_its_whole_summary() -> None:
    _, out, _ = run_cli(["--help"])
    listed = [line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.startswith("  ") and
              not line.startswith("   ")]
    assert listed == [name for name in (i.name for i in app.registered_commands if not i.hidden)]
    assert "record it." in out and not out.rstrip().endswith("...")  # summaries whole, not cut at 45 columns


def test_torchrun_options_are_apart_with_one_spelling_shown() -> None:
    _, out, _ = run_cli(["launch", "--help"])
    ours, torchrun = out.split("torchrun options:")
    assert "--nproc-per-node" in ours and "--nproc_per_node" not in out and "--max_restarts" not in out
    assert "--rdzv-backend" in torchrun and "--rdzv-backend" not in ours and "--rdzv_backend" not in out
    assert "-m, --module" in torchrun


def test_doctor_reads_whole_at_80_columns() -> None:
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    proc = subprocess.run(ffctl_argv("doctor"), capture_output=True, text=True, env=env, timeout=300)
    assert "localhost" in proc.stdout, proc.stdout + proc.stderr
    _readable(proc.stdout)
    for field in ("python:", "torch:", "/dev/shm free:", "can run job:"):  # field: value, whole
        assert field in proc.stdout, proc.stdout


def test_faults_lists_every_kind_the_parser_accepts_with_its_keys() -> None:
    code, out, _ = run_cli(["faults", "--json"])
    assert code == 0
    listed = json.loads(out)
    assert listed["common_keys"] == list(COMMON_KEYS)
    assert [k["kind"] for k in listed["kinds"]] == [k.value for k in FaultKind]
    for entry in listed["kinds"]:
        kind = FaultKind(entry["kind"])
        assert set(COMMON_KEYS) <= set(allowed_keys(kind))
        assert entry["keys"] == [k for k in allowed_keys(kind) if k not in COMMON_KEYS]
        assert entry["required"] == list(REQUIRED_OPTIONS.get(kind, ()))
        # What the catalogue shows is what --inject takes: the kind with its required keys parses.
        needed = {"rate": "1mbit", "factor": "2"}
        fields = ["rank=0" if kind.targets_rank else "node=0", "step=1"] + [f"{k}={needed[k]}" for k in entry["required"]]
        parse_injection(f"{kind.value}:{','.join(fields)}", scheduled=True)
    code, text, _ = run_cli(["faults"])
    assert code == 0
    _readable(text)
    for info in catalogue():
        assert f"\n{info.kind.value}: " in text
        assert all(f"{key}=" in text for key in info.keys)


def test_a_mistyped_launch_option_is_not_taken_for_the_script(tmp_path: Path) -> None:
    proc = subprocess.run(ffctl_argv("launch", "--spare", "2", "--runs-dir", str(tmp_path / "runs")),
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert "No such option: --spare" in line and "--spares" in line
    assert not (tmp_path / "runs").exists()
    # After the script, an unknown option is the script's own.
    code, out, err = run_cli(["launch", "--dry-run", "--nnodes", "1", str(tmp_path / "t.py"), "--spare", "2"])
    assert "No such option" not in err


@pytest.mark.parametrize(("argv", "says"), [
    (["inject", "revert"], "name the fault"),
    (["inject", "revert", "f1"], "--run ID is required"),
    (["inject", "revert", "x1", "--run", "r"], "not a fault id"),
    (["inject", "revert", "f1", "--all"], "name one fault or say --all"),
    (["inject", "kill-rank", "f1", "--run", "r"], "unexpected argument 'f1'"),
    (["inject", "slow-rank", "--run", "r", "--rank", "0", "-o", "factor=2", "--duration", "5x"], "--duration '5x'"),
])
def test_inject_mistakes_are_one_line_and_exit_2(argv: list[str], says: str, tmp_path: Path) -> None:
    code, out, err = run_cli([*argv, "--runs-dir", str(tmp_path)])
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_one_duration_syntax_on_every_command_line() -> None:
    assert [parse_seconds(t) for t in ("5", "2.5s", "500ms", "2m", "3h", "1d", "90min")] == [
        5.0, 2.5, 0.5, 120.0, 10800.0, 86400.0, 5400.0]
    assert parse_seconds("3x") is None and parse_seconds("-1s") is None
    code, out, _ = run_cli(["launch", "--dry-run", "--hang-timeout", "30s", "--silence-timeout", "2m"])
    assert code == 0, out
    code, _, err = run_cli(["launch", "--dry-run", "--hang-timeout", "3x"])
    assert code == 2 and "--hang-timeout '3x': not a positive duration" in err and err.count("\n") == 1
    code, _, err = run_cli(["project", "some-run", "--mtbf", "3x@8", "--gpus", "8"])
    assert code == 2 and "--mtbf '3x': not a positive duration" in err


def test_a_chaos_schedule_without_a_seed_gets_one_drawn_and_shown() -> None:
    assert with_seed("mtbf=5,seed=7") == ("mtbf=5,seed=7", None)
    text, seed = with_seed("mtbf=5")
    assert seed is not None and text == f"mtbf=5,seed={seed}"
    shown = []
    for _ in range(2):
        code, out, _ = run_cli(["launch", "--dry-run", "--chaos", "mtbf=5"])
        assert code == 0, out
        shown.append(re.search(r"chaos mtbf=5s,seed=(\d+)", out).group(1))  # type: ignore[union-attr]
    assert shown[0] != shown[1]  # drawn per run (a 2**-31 chance of the same)

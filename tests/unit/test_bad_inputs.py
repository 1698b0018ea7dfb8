"""Bad input at every door of the command line: exit 2, one line naming the bad value, nothing left.

Each case runs the real entry point (`ffctl.cli.app.main`, which turns refusals into exit codes)
inside typer's CliRunner isolation, with a fresh runs dir. A case passes when the command exits 2,
prints exactly one non-empty line that names the bad value, shows no traceback, and creates no
run directory (nor anything else under the runs dir). A few run as real subprocesses too, where
the interpreter's own exit path is what a user sees.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ffctl.cli.app import main
from runs.store import RunStore

ROOT = Path(__file__).resolve().parents[2]
RUN = "r1"  # a recorded run of 2 nodes x 2 ranks, for `ffctl inject` to aim at


def launch(*args: str) -> list[str]:
    # No --dry-run: the refusal must come before anything starts, on the path a user takes.
    return ["launch", *args]


def inject(*args: str) -> list[str]:
    return ["inject", *args]


CASES: list[tuple[str, list[str], str]] = [
    # --- launch: a fault or a check that could test nothing in this job ---
    ("kill-only-node", launch("--nnodes", "1", "--inject", "kill-node:node=0,step=5"), "the job's only node"),
    ("corrupt-unread", launch("--recovery", "restart-disk", "--ckpt-every", "5", "--inject",
                              "corrupt-snapshot:rank=1,step=5"), "--recovery restart-disk never reads them"),
    ("corrupt-replica-one-node", launch("--nnodes", "1", "--inject", "corrupt-snapshot:rank=1,step=5,copy=replica"),
     "this job has one node"),
    ("backward-sharded", launch("--optimizer", "sharded", "--inject", "kill-rank:rank=1,step=5,phase=backward"),
     "no DDP backward"),
    ("backward-fsdp", launch("--parallel", "fsdp", "--inject", "kill-rank:rank=1,step=5,phase=backward"),
     "--parallel fsdp has no DDP backward"),
    ("verify-nothing", launch("--recovery", "none", "--verify-restore"), "--recovery none makes none"),
    ("master-addr-any", launch("--master-addr", "0.0.0.0"), "--master-addr 0.0.0.0: give the address"),
    ("heartbeat-exponent", launch("--heartbeat-timeout", "1e-300"), "--heartbeat-timeout '1e-300'"),
    ("signals-kill", launch("--signals-to-handle", "SIGKILL"), "SIGKILL cannot be handled"),
    ("rdzv-conf-negative", launch("--rdzv-conf", "timeout=-1,join_timeout=nan"), "timeout='-1'"),
    ("project-spares", ["project", RUN, "--mtbf", "3h@8", "--spares-per-1000", "2000"], "--spares-per-1000 2000"),
    ("project-rate", ["project", RUN, "--failures-per-1000-node-days", "1e300"],
     "--failures-per-1000-node-days '1e300'"),
    # --- launch: numbers finite and in range ---
    ("heartbeat-nan", launch("--heartbeat-timeout", "nan"), "--heartbeat-timeout 'nan'"),
    ("heartbeat-zero", launch("--heartbeat-timeout", "0"), "--heartbeat-timeout '0'"),
    ("heartbeat-inf", launch("--heartbeat-timeout", "inf"), "--heartbeat-timeout 'inf'"),
    ("hang-nan", launch("--hang-timeout", "nan"), "--hang-timeout 'nan'"),
    ("hang-negative", launch("--hang-timeout", "-1"), "--hang-timeout '-1'"),
    ("nnodes-zero", launch("--nnodes", "0"), "--nnodes 0"),
    ("nproc-huge", launch("--nproc-per-node", "2000"), "--nproc-per-node 2000"),
    ("spares-huge", launch("--spares", "5000"), "--spares 5000"),
    ("steps-zero", launch("--steps", "0"), "--steps 0"),
    ("seed-negative", launch("--seed", "-1"), "--seed -1"),
    ("ckpt-negative", launch("--ckpt-every", "-1"), "--ckpt-every -1"),
    ("batch-negative", launch("--batch", "-1"), "--batch -1"),
    ("model-unknown", launch("--model", "gigantic"), "'gigantic'"),
    ("parallel-unknown", launch("--parallel", "tensor"), "'tensor'"),
    ("parallel-hsdp-one-node", launch("--parallel", "hsdp", "--nnodes", "1"), "1 x 2"),
    ("parallel-fsdp-zero1", launch("--parallel", "fsdp", "--optimizer", "sharded"), "--parallel fsdp"),
    ("steps-not-a-number", launch("--steps", "abc"), "abc"),
    # --- launch: run ids ---
    ("run-id-traversal", launch("--run-id", "../../etc"), "'../../etc'"),
    ("run-id-dotdot", launch("--run-id", "a..b"), "'a..b'"),
    ("run-id-slash", launch("--run-id", "a/b"), "'a/b'"),
    # --- launch --inject: triggers, durations ---
    ("t-nan", launch("--inject", "kill-rank:rank=1,t=nan"), "t='nan'"),
    ("t-inf", launch("--inject", "kill-rank:rank=1,t=inf"), "t='inf'"),
    ("duration-nan", launch("--inject", "hang-rank:rank=1,step=3,duration=nan"), "duration='nan'"),
    ("duration-inf", launch("--inject", "net-partition:node=1,step=3,duration=inf"), "duration='inf'"),
    ("duration-over-a-day", launch("--inject", "hang-rank:rank=1,step=3,duration=100000"), "duration='100000'"),
    ("duration-zero", launch("--inject", "hang-rank:rank=1,step=3,duration=0"), "duration='0'"),
    ("step-past-the-run", launch("--steps", "10", "--inject", "kill-rank:rank=1,step=99"), "step 99"),
    # --- launch --inject: keys checked against the kind ---
    ("rate-on-kill-rank", launch("--inject", "kill-rank:rank=1,step=3,rate=1mbit"), "rate='1mbit' does not apply to kill-rank"),
    ("port-on-kill-node", launch("--inject", "kill-node:node=1,step=3,port=80"), "port='80' does not apply to kill-node"),
    ("duration-on-kill-rank", launch("--inject", "kill-rank:rank=1,step=3,duration=5"), "duration='5' does not apply to kill-rank"),
    ("seed-beside-a-rank", launch("--inject", "kill-rank:rank=1,seed=3,step=3"), "seed='3'"),
    ("duplicate-key", launch("--inject", "kill-rank:rank=1,rank=0,step=3"), "rank= given twice"),
    ("unknown-key", launch("--inject", "kill-rank:rnak=1,step=3"), "'rnak'"),
    # --- launch --inject: what must be said ---
    ("empty-spec", launch("--inject", "kill-rank:"), "'kill-rank:' names no target"),
    ("no-trigger", launch("--inject", "kill-rank:rank=1"), "'kill-rank:rank=1' names no trigger"),
    ("no-target", launch("--inject", "kill-rank:step=3"), "'kill-rank:step=3' names no target"),
    ("fixed-zero", launch("--inject", "kill-rank:mode=fixed:0,step=3"), "fixed:0"),
    ("bandwidth-without-rate", launch("--inject", "net-bandwidth:node=1,step=3"), "needs rate="),
    # --- launch --inject: ASCII digits, values in range, targets inside the job ---
    ("arabic-indic-rank", launch("--inject", "kill-rank:rank=١,step=3"), "rank='١'"),
    ("fullwidth-step", launch("--inject", "kill-rank:rank=1,step=５"), "step='５'"),
    ("exponent-step", launch("--inject", "kill-rank:rank=1,step=1e3"), "step='1e3'"),
    ("rank-outside-job", launch("--inject", "kill-rank:rank=9,step=3"), "rank 9"),
    ("node-outside-job", launch("--inject", "kill-node:node=2,step=3"), "node 2"),
    ("fixed-beyond-pool", launch("--inject", "kill-node:mode=fixed:3,step=3"), "fixed:3"),
    ("port-out-of-range", launch("--inject", "net-port-block:node=1,step=3,port=70000"), "port '70000'"),
    ("loss-over-100", launch("--inject", "net-loss:node=1,step=3,loss=150%"), "loss='150%'"),
    ("delay-too-long", launch("--inject", "net-delay:node=1,step=3,delay=99999s"), "delay='99999s'"),
    ("rate-not-a-rate", launch("--inject", "net-bandwidth:node=1,step=3,rate=fast"), "rate='fast'"),
    # --- launch --chaos ---
    ("chaos-mtbf-nan", launch("--chaos", "mtbf=nan,seed=1"), "mtbf='nan'"),
    ("chaos-mtbf-flood", launch("--chaos", "mtbf=0.001,seed=1"), "mtbf='0.001'"),
    ("chaos-seed-digits", launch("--chaos", "mtbf=60,seed=٣"), "seed='٣'"),
    ("chaos-duration-unused", launch("--chaos", "mtbf=60,kinds=kill-rank,duration=5"), "duration='5'"),
    # --- inject ---
    ("revert-traversal", inject("revert", "--all", "--run", "../../etc"), "'../../etc'"),
    ("inject-run-traversal", inject("kill-rank", "--run", "../x", "--rank", "1"), "'../x'"),
    ("inject-no-target", inject("kill-rank", "--run", RUN), "names no target"),
    ("inject-rate-on-kill-rank", inject("kill-rank", "--run", RUN, "--rank", "1", "-o", "rate=1mbit"), "rate='1mbit'"),
    ("inject-bandwidth-without-rate", inject("net-bandwidth", "--run", RUN, "--node", "1"), "needs rate="),
    ("inject-duration-nan", inject("hang-rank", "--run", RUN, "--rank", "1", "--duration", "nan"), "--duration 'nan'"),
    ("inject-duration-inf", inject("net-delay", "--run", RUN, "--node", "1", "--duration", "inf"), "--duration 'inf'"),
    ("inject-trigger", inject("kill-rank", "--run", RUN, "--rank", "1", "-o", "step=5"), "step='5'"),
    ("inject-rank-outside-job", inject("kill-rank", "--run", RUN, "--rank", "9"), "rank 9"),
    ("inject-node-outside-job", inject("kill-node", "--run", RUN, "--node", "5"), "node 5"),
    ("inject-two-targets", inject("kill-rank", "--run", RUN, "--rank", "1", "-o", "mode=one"), "more than one target"),
    ("inject-negative-rank", inject("kill-rank", "--run", RUN, "--rank", "-1"), "rank='-1'"),
    # --- report ---
    ("report-traversal", ["report", "../../etc"], "'../../etc'"),
    ("report-slash", ["report", "a/b"], "'a/b'"),
]

SCENARIOS: list[tuple[str, str, str]] = [
    ("model-unknown", '[launch]\nmodel = "gigantic"\n', "[launch].model: 'gigantic'"),
    ("nnodes-bool", "[launch]\nnnodes = true\n", "[launch].nnodes: true is not an integer"),
    ("heartbeat-text", '[launch]\nheartbeat_timeout = "fast"\n', "[launch].heartbeat_timeout: 'fast' is not a number"),
    ("heartbeat-nan", "[launch]\nheartbeat_timeout = nan\n", "[launch].heartbeat_timeout: nan"),
    ("heartbeat-zero", "[launch]\nheartbeat_timeout = 0\n", "[launch].heartbeat_timeout: 0"),
    ("inject-number", "[launch]\ninject = [5]\n", "[launch].inject[0]: 5"),
    ("inject-empty-spec", '[launch]\ninject = ["kill-rank:"]\n', "[launch].inject[0]"),
    ("inject-not-a-list", '[launch]\ninject = "kill-rank:rank=1,step=3"\n', "[launch].inject: 'kill-rank:rank=1,step=3'"),
    ("nnodes-text", '[launch]\nnnodes = "two"\n', "[launch].nnodes: 'two' is not an integer"),
    ("steps-text", '[launch]\nsteps = "many"\n', "[launch].steps: 'many' is not an integer"),
    ("nproc-huge", "[launch]\nnproc_per_node = 100000\n", "[launch].nproc_per_node: 100000"),
    ("rank-outside-job", '[launch]\ninject = ["kill-rank:rank=7,step=3"]\n', "rank 7"),
    ("chaos-bad", '[launch]\nchaos = "mtbf=0"\n', "[launch].chaos: mtbf='0'"),
    ("launch-not-a-table", "launch = 5\n", "launch: 5 is not a table"),
    ("expect-negative", "[expect]\nmax_lost_steps = -1\n", "[expect].max_lost_steps: -1"),
    ("expect-source", '[expect]\nrestore_source = ["moon"]\n', "[expect].restore_source: 'moon'"),
    ("expect-status", '[expect]\nstatus = "done"\n', "[expect].status: 'done'"),
    ("not-toml", "[launch\n", "not valid TOML"),
]


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    """A runs dir holding one recorded run, r1 (2 nodes x 2 ranks), and nothing else."""
    runs_dir = tmp_path / "runs"
    RunStore.create(runs_dir, RUN, {"run_id": RUN, "spec": {"nnodes": 2, "nproc_per_node": 2}}).close()
    return runs_dir


def snapshot(runs_dir: Path) -> set[str]:
    return {str(p.relative_to(runs_dir)) for p in runs_dir.rglob("*")}


def run_cli(argv: list[str], runs_dir: Path, cwd: Path) -> tuple[int, str]:
    """`ffctl ARGV` through its real entry point; (exit code, everything it printed)."""
    runner = CliRunner()
    old = os.getcwd()
    os.chdir(cwd)  # a default ./ffctl-runs would land here, where the test can see it
    try:
        with runner.isolation(env={"FFCTL_RUNS_DIR": str(runs_dir), "COLUMNS": "200"}) as (out, err, _):
            try:
                main(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            printed = out.getvalue().decode() + err.getvalue().decode()
    finally:
        os.chdir(old)
    return code, printed


def assert_refused(code: int, printed: str, needle: str) -> None:
    lines = [line for line in printed.splitlines() if line.strip()]
    assert code == 2, printed
    assert "Traceback" not in printed, printed
    assert len(lines) == 1, printed
    assert needle in lines[0], printed
    assert lines[0].startswith("ffctl: error: "), printed


def test_there_are_at_least_forty_cases() -> None:
    assert len(CASES) + len(SCENARIOS) >= 40
    assert len({name for name, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize(("argv", "needle"), [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_is_refused_with_one_line(argv: list[str], needle: str, runs: Path, tmp_path: Path) -> None:
    before = snapshot(runs)
    code, printed = run_cli(argv, runs, tmp_path)
    assert_refused(code, printed, needle)
    assert snapshot(runs) == before  # no run dir, no file in the existing one
    assert not (tmp_path / "ffctl-runs").exists()


@pytest.mark.parametrize(("text", "needle"), [pytest.param(t, n, id=i) for i, t, n in SCENARIOS])
def test_bad_scenario_is_refused_with_one_line(text: str, needle: str, runs: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    before = snapshot(runs)
    code, printed = run_cli(["run", str(path)], runs, tmp_path)
    assert_refused(code, printed, needle)
    assert str(path) in printed or "bad.toml" in printed
    assert snapshot(runs) == before


def test_scenario_run_id_is_checked(runs: Path, tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text("[launch]\nsteps = 5\n")
    code, printed = run_cli(["run", str(path), "--run-id", "../x"], runs, tmp_path)
    assert_refused(code, printed, "'../x'")
    assert not (tmp_path / "x").exists()


def test_valid_input_next_to_the_bad_is_accepted(runs: Path, tmp_path: Path) -> None:
    """The checks refuse the bad value, not the kind of input: the same options, well formed, plan."""
    code, printed = run_cli(launch("--dry-run", "--heartbeat-timeout", "0.5", "--hang-timeout", "3",
                                   "--inject", "hang-rank:rank=3,t=2.5,duration=5",
                                   "--inject", "gpu-oom:mode=fixed:2,seed=5,step=3,mb=64",
                                   "--chaos", "mtbf=60,seed=3"), runs, tmp_path)
    assert code == 0, printed
    assert "hang-rank rank:3 @t=2.5" in printed and "gpu-oom fixed:2 @step=3" in printed
    path = tmp_path / "ok.toml"
    path.write_text('[launch]\nnnodes = 2\nsteps = 9\nheartbeat_timeout = 2\ninject = ["kill-rank:rank=1,step=3"]\n'
                    '[expect]\nrestore_source = "peer-memory"\nmin_goodput = 0.5\n')
    code, printed = run_cli(["run", str(path), "--dry-run"], runs, tmp_path)
    assert code == 0, printed
    assert snapshot(runs) == {".gitignore", RUN, f"{RUN}/logs", f"{RUN}/token", f"{RUN}/run.json"}


@pytest.mark.parametrize(("argv", "needle"), [
    (["launch", "--inject", "kill-rank:rank=1,t=nan"], "t='nan'"),
    (["launch", "--inject", "hang-rank:rank=1,step=2,duration=nan"], "duration='nan'"),
    (["inject", "revert", "--all", "--run", "../../etc"], "'../../etc'"),
])
def test_refused_by_the_installed_command(argv: list[str], needle: str, tmp_path: Path) -> None:
    """The same refusals from a fresh interpreter: exit status 2, one line on stderr, no output."""
    env = {**os.environ, "FFCTL_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ffctl", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert proc.stdout.strip() == ""
    assert not (tmp_path / "runs").exists()

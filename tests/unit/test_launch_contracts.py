"""One owner per naming contract and table: shared-memory names, the workload's model and
optimizer names, the fault planners, and the launch checks that read them."""
from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fault_injectors.planner import PLANNERS
from wire.fault_spec import FaultFamily
from fault_injectors.transport import CommandResult
from ffctl.agent.config import AgentConfig
from ffctl.backends import BACKENDS
from ffctl.exits import BadInput
from ffctl.launch.launch_plan import plan_launch
from ffctl.launch_spec import LaunchSpec, SpecError
from ffctl.workload import gpt, sizes
from recovery.faults import InStepFaults
from recovery.slots import claim_node, release_node
from runs import shm


def test_slot_names_round_trip_and_ignore_a_longer_run_id(tmp_path: Path) -> None:
    d = str(tmp_path)
    mine = [shm.slot_path(d, "run", 0, r, s) for r in (0, 3) for s in (0, 1)]
    # Another run whose id extends this one: a glob on "ffctl-run-n0-r*-s*" would take its slots.
    other = shm.slot_path(d, "run-n0-r5", 1, 2, 0)
    for p in [*mine, other]:
        p.write_bytes(b"x")
    fd = claim_node(d, "run", 0)  # the lock file is no slot
    assert shm.node_slots(d, "run", 0) == sorted(mine)
    assert [shm.slot_rank(p, "run", 0) for p in sorted(mine)] == [0, 0, 3, 3]
    with pytest.raises(ValueError):
        shm.slot_rank(other, "run", 0)
    assert shm.sweep_node(d, "run", 0) == 4
    assert other.exists() and shm.node_slots(d, "run", 0) == []
    release_node(d, "run", 0, fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]


def test_fault_file_is_where_the_rank_reads_it(tmp_path: Path) -> None:
    rank = InStepFaults(str(tmp_path), "run", 3)
    assert rank.path is not None and str(rank.path) == shm.fault_path(str(tmp_path), "run", 3)
    dropped = [Path(f"{rank.path}.{tail}") for tail in ("Ab3dEf9h", "00000000")]
    for path in dropped:
        path.write_text("crash-rank:exception")
    # Not faults of this run's ranks: another name, the mailbox's bare name, a longer tail, rank 30's.
    for name in ("ffctl-run-fault-rx.Ab3dEf9h", "ffctl-run-fault-r3", "ffctl-run-fault-r3.Ab3dEf9hX"):
        (tmp_path / name).write_text("not ours")
    (tmp_path / "ffctl-run-fault-r30.Ab3dEf9h").write_text("rank 30's")
    assert shm.mailbox(rank.path) == sorted(dropped, key=lambda p: (p.stat().st_mtime_ns, p.name))
    assert shm.fault_files(str(tmp_path), "run") == sorted([*dropped, tmp_path / "ffctl-run-fault-r30.Ab3dEf9h"])
    assert shm.sweep_faults(str(tmp_path), "run") == 3 and shm.mailbox(rank.path) == []
    assert (tmp_path / "ffctl-run-fault-r3").exists()


def test_workload_tables_are_torch_free_and_the_gpts_own() -> None:
    assert gpt.SIZES is sizes.SIZES and sizes.MODELS == tuple(gpt.SIZES)
    code = "import sys, ffctl.workload.sizes; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("field, value, needle", [
    ("model", "gigantic", "--model 'gigantic'"), ("optimizer", "sgd", "--optimizer 'sgd'"),
    ("sandbox", "docker", "--sandbox 'docker'"), ("max_restarts", True, "--max-restarts True"),
])
def test_every_launch_check_is_in_validate(field: str, value: object, needle: str, tmp_path: Path) -> None:
    spec = LaunchSpec(runs_dir=tmp_path / "runs", **{field: value})  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=f"^{needle}"):
        spec.validate()
    with pytest.raises(BadInput, match=f"^{needle}"):
        plan_launch(spec)
    assert not (tmp_path / "runs").exists()


def test_sandbox_and_hosts_together_refused(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a\n")
    with pytest.raises(SpecError, match="^--sandbox netns and --hosts"):
        LaunchSpec(sandbox="netns", hostfile=hostfile).validate()


def test_every_family_has_a_planner_and_every_way_a_backend() -> None:
    assert set(PLANNERS) == set(FaultFamily)
    assert set(BACKENDS) == {"local", "netns", "ssh", "slurm"}


class _Started(Exception):
    """Raised by a stand-in process start once it has the argv: nothing runs."""


def _shown(lines: tuple[str, ...], node: int) -> list[str]:
    """The agent argv the dry run prints for `node` (between backquotes)."""
    line = next(x for x in lines if x.startswith(f"node {node}: agent `"))
    return shlex.split(line.split("`")[1])


def _cfg(run_id: str, node: int, tmp_path: Path) -> AgentConfig:
    return AgentConfig(run_id=run_id, node=node, nnodes=2, store_host="127.0.0.1", store_port=1, address="127.0.0.1",
                       token="t", log_dir=str(tmp_path / "logs" / str(node)), worker_argv=("-m", "x"))


def _started_locally(monkeypatch: pytest.MonkeyPatch, backend: Any, started: list[list[str]]) -> None:
    """Capture at the process start of the local backends: `subprocess.Popen`. Agents forked
    from the host template are the dry run's note (test_the_local_dry_run_names_the_host_template);
    what is printed per node is the start of each agent it does not fork."""
    from ffctl.backends import local

    monkeypatch.setenv(local.HOST_TEMPLATE_ENV, "0")

    def popen(argv: list[str], **kwargs: object) -> None:
        started.append(list(argv))
        raise _Started

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    monkeypatch.setattr(backend, "_hold_shm", lambda shm_dir: None)


@pytest.mark.parametrize("name", ["local", "netns", "ssh", "slurm"])
def test_the_dry_run_prints_the_argv_each_backend_starts_its_agents_with(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What `--dry-run` prints for each node's agent is what the backend hands its process start
    # (Popen, a step's srun, the SSH transport's start), captured there, not derived again.
    spec = LaunchSpec(nnodes=2, nproc_per_node=1, runs_dir=tmp_path / "runs")
    if name == "netns":
        from ffctl.backends import netns

        monkeypatch.setattr(netns, "require_root", lambda: None)
        monkeypatch.setattr(netns, "_networks_in_use", lambda: [])
        spec = replace(spec, sandbox="netns")
    elif name == "ssh":
        (tmp_path / "hosts").write_text("h0\nh1\n")
        spec = replace(spec, hostfile=tmp_path / "hosts", remote_python="python3.11")
    elif name == "slurm":
        monkeypatch.setenv("SLURM_JOB_ID", "7")
        monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
        spec = replace(spec, backend="slurm")
    plan = plan_launch(spec)
    backend = BACKENDS[name](plan.spec, plan.run_id)
    backend.log_dir = tmp_path / "logs"  # what attach() gives it
    started: list[list[str]] = []
    if name in ("local", "netns"):
        _started_locally(monkeypatch, backend, started)
    elif name == "ssh":
        from ffctl.hosts.hostfile import HostEntry
        from ffctl.hosts.ssh.preflight import HostSetup

        class Transport:
            def __init__(self, host: str) -> None:
                self.host = host

            def run(self, argv: Any, *, timeout: float, input: str | None = None) -> CommandResult:
                return CommandResult(tuple(argv), 0, "", "")

            def start(self, argv: Any, env: Any = None, **kwargs: object) -> None:
                started.append(list(argv))
                raise _Started

        # As `prepare` leaves it: each host checked, its python found at a path of its own.
        backend._use([(Transport(h), HostSetup(n, HostEntry(h), "/opt/py/bin/python3.11", "0", f"10.0.0.{n}",
                                               "eth0", "10.0.0.9", None, None)) for n, h in enumerate(("h0", "h1"))])
    else:
        def popen(argv: list[str], **kwargs: object) -> None:
            started.append(list(argv))
            raise _Started

        backend._popen = popen
    for node in (0, 1):
        with pytest.raises(_Started):
            backend.start(_cfg(plan.run_id, node, tmp_path))
        assert started[-1] == _shown(plan.lines, node), (plan.lines, started)
    # Each backend's own argv, not a shared default: the namespace, the node's step, the
    # interpreter as --remote-python names it.
    where = {"local": [sys.executable, "-m", "ffctl.agent"], "netns": ["ip", "netns", "exec"],
             "ssh": ["python3.11", "-m", "ffctl.agent"], "slurm": ["srun", "--jobid=7"]}[name]
    assert started[1][:len(where)] == where and started[1][-2:] == ["-m", "ffctl.agent"]
    assert name != "slurm" or "--nodelist=n2" in started[1]


def test_the_local_dry_run_names_the_host_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The host template is the one process the local backend starts itself for forked agents:
    # the dry run names its very argv (the one `HostTemplate.start` hands Popen), and not where
    # no template serves (restart-disk's fresh interpreters, or the switch set to 0).
    from ffctl.backends import host_template, local

    monkeypatch.delenv(local.HOST_TEMPLATE_ENV, raising=False)
    spec = LaunchSpec(nnodes=2, nproc_per_node=1, runs_dir=tmp_path / "runs")
    argv = shlex.join(host_template.host_template_argv(sys.executable))
    assert any(f"`{argv}`" in line for line in plan_launch(spec).lines)
    assert not any(argv in line for line in plan_launch(replace(spec, recovery="restart-disk", ckpt_every=5)).lines)
    monkeypatch.setenv(local.HOST_TEMPLATE_ENV, "0")
    assert not any(argv in line for line in plan_launch(spec).lines)

    started: list[list[str]] = []

    def popen(cmd: list[str], **kwargs: object) -> None:
        started.append(list(cmd))
        raise _Started

    monkeypatch.setattr(host_template.subprocess, "Popen", popen)
    with pytest.raises(_Started):
        host_template.HostTemplate(sys.executable, {}, None, tmp_path / "log").start()
    assert shlex.join(started[0]) == argv

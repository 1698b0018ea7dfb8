"""One owner per naming contract and table: shared-memory names, the workload's model and
optimizer names, the fault planners, and the launch checks that read them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fault_injectors.planner import PLANNERS
from fault_injectors.spec import FaultFamily
from ffctl.errors import BadInput
from ffctl.launch.plan import BACKENDS, plan_launch
from ffctl.spec import LaunchSpec, SpecError
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
    assert str(rank.path) == shm.fault_path(str(tmp_path), "run", 3)
    rank.path.write_text("crash-rank:exception")
    (tmp_path / "ffctl-run-fault-rx").write_text("not ours")
    assert shm.fault_files(str(tmp_path), "run") == [rank.path]
    assert shm.sweep_faults(str(tmp_path), "run") == 1 and not rank.path.exists()


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


def test_the_dry_run_prints_the_argv_each_local_agent_is_started_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shlex

    from ffctl.agent.config import AgentConfig
    from ffctl.launch import nodes as local

    started: list[list[str]] = []

    class Started(Exception):
        pass

    def popen(argv: list[str], **kwargs: object) -> None:
        started.append(list(argv))
        raise Started

    plan = plan_launch(LaunchSpec(nnodes=2, nproc_per_node=1, runs_dir=tmp_path / "runs"))
    backend = local.LocalNodes(plan.spec, plan.run_id)
    backend.log_dir = tmp_path / "logs"
    monkeypatch.setattr(local.subprocess, "Popen", popen)
    monkeypatch.setattr(backend, "_hold_shm", lambda shm_dir: None)
    with pytest.raises(Started):
        backend.start(AgentConfig(run_id=plan.run_id, node=0, nnodes=2, store_host="127.0.0.1", store_port=1,
                                  address="127.0.0.1", token="t", log_dir=str(tmp_path), worker_argv=("-m", "x")))
    [argv] = started
    shown = [line for line in plan.lines if line.startswith("node 0: agent ")]
    assert shown and f"`{shlex.join(argv)}` on localhost" in shown[0], (shown, argv)

"""`ffctl inject revert --all` plans, then executes: the plan names every place and command, and
the dry run prints exactly that plan."""
from __future__ import annotations

from pathlib import Path

import pytest

from fault_injectors.revert import FIRE_DEADMEN, SHM_SWEEP
from ffctl.exits import BadInput
from ffctl.launch.cleanup import LOCAL, plan_revert, revert_everything


def _hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hosts"
    path.write_text("gpu-a slots=2\nops@gpu-b:2222\n")
    return path


def test_the_plan_covers_this_machine_and_every_host(tmp_path: Path) -> None:
    plan = plan_revert(_hostfile(tmp_path))
    names = [p.name for p in plan.places]
    assert names[0] == LOCAL and names[-2:] == ["gpu-a", "gpu-b"]
    for place in plan.places:
        assert place.commands and all(c.host == place.host for c in place.commands)
    assert plan.removes_sandbox  # unscoped: any sandbox ffctl left goes too
    assert revert_everything(_hostfile(tmp_path), dry_run=True) == plan.describe()


def test_a_plan_scoped_to_one_run_only_fires_that_runs_switches(tmp_path: Path) -> None:
    plan = plan_revert(_hostfile(tmp_path), run_id="run-7")
    for place in plan.places:
        if place.netns is None:
            # Its switches fired, and its shared memory removed if no live process holds it.
            assert [c.argv[2] for c in place.commands] == [FIRE_DEADMEN, SHM_SWEEP]
            assert all("run-7" in " ".join(c.argv) for c in place.commands)
    assert all("run-7" in line or "ffctl-deadman" in line for line in plan.describe())


@pytest.mark.parametrize("run_id", ["../../etc", "a/b", "", "x" * 200])
def test_a_bad_run_id_is_refused_before_planning(run_id: str) -> None:
    with pytest.raises(BadInput):
        plan_revert(None, run_id=run_id)

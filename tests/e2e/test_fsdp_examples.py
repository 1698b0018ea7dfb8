"""The FSDP2 example pair end to end: `examples/fsdp/with_ffctl.py` trains exactly as
`examples/fsdp/plain.py` under torchrun; under `ffctl launch` it survives a killed rank and a
killed node, with spares (the scenario `examples/scenarios/fsdp-matches-fault-free.toml`, which
runs its fault-free twin) and without (the lost node's ranks come back on the surviving node),
every step's loss bit for bit the fault-free run's, no survivor restarted, and the survivors'
shards kept where they were."""
from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import (
    assert_nothing_left, crashes, launch, rid, run_ffctl, shm_left, torchrun_script,
)

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "fsdp"
SCENARIO = ROOT / "examples" / "scenarios" / "fsdp-matches-fault-free.toml"
STEPS = 16  # the scenario's


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


def _loss_lines(text: str) -> list[str]:
    return [line[line.index("step "):] for line in text.splitlines() if " loss " in line and "step " in line]


def test_the_two_examples_differ_by_at_most_15_changed_lines() -> None:
    plain = (EXAMPLES / "plain.py").read_text().splitlines()
    adapted = (EXAMPLES / "with_ffctl.py").read_text().splitlines()
    added = [line for line in difflib.ndiff(plain, adapted) if line.startswith("+ ") and line[2:].strip()]
    assert 0 < len(added) <= 15, "\n".join(added)


def test_with_ffctl_trains_as_the_plain_script_under_torchrun(workdir: Path) -> None:
    whole = lambda out: len(_loss_lines(out)) == 12  # noqa: E731
    layout = ["--nnodes", "1", "--nproc-per-node", "2"]
    plain = torchrun_script(workdir, [*layout, str(EXAMPLES / "plain.py"), "--steps", "12"], whole)
    adapted = torchrun_script(workdir, [*layout, str(EXAMPLES / "with_ffctl.py"), "--steps", "12"], whole)
    assert plain.returncode == 0 and adapted.returncode == 0, adapted.stdout[-2000:] + adapted.stderr[-3000:]
    assert len(_loss_lines(plain.stdout)) == 12
    assert _loss_lines(adapted.stdout) == _loss_lines(plain.stdout)


def _events(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_rank_and_a_node_lost_with_spares_match_the_fault_free_run(workdir: Path) -> None:
    runs = workdir / "runs"
    proc = run_ffctl(workdir, "run", str(SCENARIO), "--runs-dir", str(runs), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert re.search(r"matches_fault_free\W+identical over 16\b", proc.stdout), proc.stdout[-3000:]
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.endswith("-twin")
                  and (d / "report.json").exists() and "fsdp" not in d.name]
    events = _events(run_dir)
    # No survivor restarted: generation 0 spawned every rank, later ones only the lost ranks.
    spawned = {e.get("gen"): e.get("ranks") for e in events if e["event"] == EventKind.RANKS_SPAWNED.value}
    assert spawned == {0: [0, 1, 2, 3], 1: [1], 2: [2, 3]}, spawned
    # The lost node's ranks got their shards from the neighbour's copy; a survivor kept its live
    # shards when they were the restored step's (it may have finished one step more before the
    # kill landed: then it loaded its own copy, and the step was trained again).
    restores = [e for e in events if e["event"] == EventKind.RESTORE_DONE.value]
    assert restores[-1]["source"] == "peer-memory", restores
    transfer = restores[-1]["transfer"]
    assert set(transfer.get("kept", [])) <= {0, 1} and sorted(r for rs in transfer.values() for r in rs) == [0, 1, 2, 3]
    (finished,) = [e for e in events if e["event"] == EventKind.RUN_FINISHED.value]
    assert finished.get("path") == "fsdp" and finished.get("api") == "fsdp"  # as its ranks said
    assert_nothing_left(workdir)
    assert not shm_left(run_dir.name)


def _fault_free_losses(workdir: Path, script: list[str], layout: list[str]) -> list[list[float]]:
    """The fault-free losses of the scenario's job: its twin's, when the scenario test ran in this
    module (same script, steps and layout; spares change no loss), else a run of its own."""
    twins = sorted((workdir / "runs").glob("*-twin/report.json")) if (workdir / "runs").is_dir() else []
    if twins:
        return json.loads(twins[0].read_text())["loss_by_step"]
    base = launch(workdir, rid("fsdp-base"), *layout, *script)
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]
    return base.report["loss_by_step"]


def test_a_node_lost_without_a_spare_matches_the_fault_free_run(workdir: Path) -> None:
    script = [str(EXAMPLES / "with_ffctl.py"), "--steps", str(STEPS)]
    layout = ["--nnodes", "2", "--nproc-per-node", "2"]
    base = _fault_free_losses(workdir, script, layout)
    run_id = rid("fsdp-nospare")
    res = launch(workdir, run_id, *layout, "--inject", "kill-node:node=1,step=6", *script)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(base) == STEPS
    assert res.report["loss_by_step"] == base  # every step, bit for bit
    (fault,) = res.report["faults"]
    assert fault["kind"] == "kill-node" and fault["restore_source"] == "peer-memory" and fault["lost_steps"] <= 1
    # The lost node's ranks came back on node 0, the only one left.
    (decided,) = [e for e in res.events if e.kind is EventKind.RECOVERY_DECIDED]
    assert decided.get("placement") == {"2": 0, "3": 0}, decided
    assert crashes(res.events) == []
    assert_nothing_left(workdir)
    assert not shm_left(run_id)


def test_survivors_leave_a_step_failed_in_its_forward_without_its_products(workdir: Path) -> None:
    # Rank 1 killed as its step 6 begins: the three others fail in the forward's first
    # all-gather and run the rest of the step without its matrix products (recovery.failed_step),
    # which their `aborted` says and the decision records; what they restore is still exact.
    script = [str(EXAMPLES / "with_ffctl.py"), "--steps", str(STEPS)]
    layout = ["--nnodes", "2", "--nproc-per-node", "2"]
    base = _fault_free_losses(workdir, script, layout)
    run_id = rid("fsdp-forward")
    res = launch(workdir, run_id, *layout, "--spares", "1", "--inject", "kill-rank:rank=1,step=6,phase=forward",
                 *script)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.report["loss_by_step"] == base  # every step, bit for bit
    (fault,) = res.report["faults"]
    assert fault["recovered"] and fault["survivors_without_products"] == 3, fault
    (decided,) = [e for e in res.events if e.kind is EventKind.RECOVERY_DECIDED]
    assert decided.get("ranks") == [1] and decided.get("survivors_without_products") == 3, decided
    assert crashes(res.events) == []
    assert_nothing_left(workdir)
    assert not shm_left(run_id)


def test_hsdp_survives_a_lost_replica_node_bit_for_bit(workdir: Path) -> None:
    # A 2 x 2 mesh: node 0's ranks are one replica of the model, node 1's the other, each
    # sharding it over its two ranks. Losing node 1 loses a whole replica: its ranks' shards are
    # healed from node 0's live ranks holding the same shards (checked against the copies from the
    # neighbour, which also give the ranks' own small state), the survivors keep theirs.
    script = [str(EXAMPLES / "with_ffctl.py"), "--steps", "12", "--mesh", "2,2"]
    layout = ["--nnodes", "2", "--nproc-per-node", "2"]
    base = launch(workdir, rid("hsdp-base"), *layout, *script)
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]
    run_id = rid("hsdp-node")
    res = launch(workdir, run_id, *layout, "--spares", "2", "--inject", "kill-node:node=1,step=6", *script)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(base.report["loss_by_step"]) == 12
    assert res.report["loss_by_step"] == base.report["loss_by_step"]
    (fault,) = res.report["faults"]
    assert fault["restore_source"] == "replica-group" and fault["recovered"], fault
    (done,) = [e for e in res.events if e.kind is EventKind.RESTORE_DONE]
    transfer = done.get("transfer")
    # The survivors keep their live shards, or load their own agent's copy when they had
    # finished one step more before the kill landed.
    assert transfer.get("healed") == [2, 3] and sorted(transfer.get("kept", []) + transfer.get("loaded", [])) == [0, 1], done
    assert crashes(res.events) == []
    assert_nothing_left(workdir)
    assert not shm_left(run_id)


def test_the_built_in_gpt_as_hsdp_survives_a_rank_and_a_node_bit_for_bit(workdir: Path) -> None:
    # `--parallel hsdp`: the GPT sharded with fully_shard on a 2 x 2 mesh. The lost node's ranks
    # come back on node 0, which then runs four ranks: the mesh stays the job's 2 x 2.
    args = ["--parallel", "hsdp", "--steps", "12"]
    base = launch(workdir, rid("gpt-hsdp-base"), *args)
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]
    run_id = rid("gpt-hsdp")
    res = launch(workdir, run_id, *args, "--spares", "1", "--inject", "kill-rank:rank=1,step=3",
                 "--inject", "kill-node:node=1,step=7")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(base.report["loss_by_step"]) == 12
    assert res.report["loss_by_step"] == base.report["loss_by_step"]
    # The killed rank reads its copy from its own agent; the lost node's ranks are healed from
    # node 0's ranks holding the same shards (the same columns of the mesh).
    assert [f["restore_source"] for f in res.report["faults"]] == ["local-memory", "replica-group"]
    (finished,) = [e for e in res.events if e.kind is EventKind.RUN_FINISHED]
    assert finished.get("path") == "built-in" and finished.get("api") == "fsdp"
    assert crashes(res.events) == []
    assert_nothing_left(workdir)
    assert not shm_left(run_id)

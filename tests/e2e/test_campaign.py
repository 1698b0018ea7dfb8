"""A seeded campaign of production faults in one scenario, as `ffctl run` runs it in CI: kills
inside a collective, stragglers, snapshots corrupted in a rank's own memory and in the replicas
other nodes hold (each followed by the failure that makes a recovery read them), and two nodes
lost in one step, on three nodes keeping two copies of every snapshot (`--snapshot-copies 2`).

The job must complete with every step's loss equal, bit for bit, to its fault-free twin's; every
corrupted copy a recovery reaches is refused before training resumes on it (none restored
silently); no crash loop and no restart budget spent on the faults.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.launch import assert_nothing_left, run_ffctl, shm_left

# Two whole jobs (the campaign and its twin): a few minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.exclusive]

SEED = 1
MIN_FAULTS = 50
FIRST_STEP = 12
WINDOW = 7  # steps between one group of faults and the next
# Steps trained after the last group's. A fault waits while an earlier one is in force (a 3x slow
# rank for its 2 s, until it is reverted or named a straggler), so the schedule falls behind by
# as many steps as the job trains meanwhile. Since one host's nodes stream their copies over a
# Unix socket, a step of this job takes 0.01-0.04 s instead of about 0.1 s: a run that ended 7
# steps after its last group had dealt 37 of its 50 faults, 13 still waiting behind a slow rank.
TAIL = 600


def campaign(seed: int, nranks: int = 3) -> tuple[list[str], int]:
    """The campaign's faults, drawn from `seed` in groups a window of steps apart, and the
    steps the job trains. Groups: a kill-rank inside the step's collective; a 3x slow rank for
    2 s; a rank stopped, its own slots corrupted and the rank killed (its copy refused, the
    other node's restored); a rank stopped, every replica of it corrupted and its node killed
    (each copy refused, then disk); two nodes killed at once."""
    rng = random.Random(seed)
    groups = ["collective", "slow", "corrupt-local", "corrupt-replica", "two-nodes"]
    faults: list[str] = []
    step = FIRST_STEP
    while len(faults) < MIN_FAULTS:
        group = groups[len(faults) % len(groups)] if len(faults) < len(groups) else rng.choice(groups)
        r = rng.randrange(nranks)
        at = f"step={step}"
        if group == "collective":
            faults.append(f"kill-rank:rank={r},{at},phase=collective")
        elif group == "slow":
            faults.append(f"slow-rank:rank={r},{at},factor=3,duration=2")
        elif group == "corrupt-local":
            faults += [f"hang-rank:rank={r},{at},duration=60", f"corrupt-snapshot:rank={r},{at}", f"kill-rank:rank={r},{at}"]
        elif group == "corrupt-replica":
            faults += [f"hang-rank:rank={r},{at},duration=60", f"corrupt-snapshot:rank={r},{at},copy=replica",
                       f"kill-node:rank={r},{at}"]
        else:
            faults.append(f"kill-node:mode=fixed:2,seed={rng.randrange(1000)},{at}")
        step += WINDOW
    return faults, step + TAIL


def _scenario(faults: list[str], steps: int) -> str:
    injects = ",\n".join(f'  "{f}"' for f in faults)
    return f'''name = "production faults, seed {SEED}"

[launch]
nnodes = 3
nproc_per_node = 1
steps = {steps}
seed = 5
spares = 1
ckpt_every = 10
snapshot_copies = 2

[faults]
inject = [
{injects},
]

[expect]
completes = true
matches_fault_free = true
'''


def test_a_seeded_campaign_of_production_faults_matches_the_fault_free_run(tmp_path: Path) -> None:
    faults, steps = campaign(SEED)
    assert len(faults) >= MIN_FAULTS
    scenario = tmp_path / "campaign.toml"
    scenario.write_text(_scenario(faults, steps))
    junit = tmp_path / "campaign.xml"
    proc = run_ffctl(tmp_path, "run", str(scenario), "--run-id", "campaign", "--junit", str(junit), timeout=800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "campaign" / "report.json").read_text())
    assert report["status"] == "completed" and report["steps_completed"] == steps
    got = report["faults"]
    assert len([f for f in got if f["kind"] != "detected"]) == len(faults), [f["kind"] for f in got]
    # Every fault that breaks the job was recovered; nothing else failed on its own.
    assert all(f["recovered"] for f in got if f["kind"] in ("kill-rank", "kill-node")), got
    assert not [f for f in got if f["kind"] == "detected"], [f for f in got if f["kind"] == "detected"]
    events = [json.loads(line) for line in (tmp_path / "runs" / "campaign" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "recovery_failed"]
    # No corrupted copy restored silently: each kill behind a corruption that hit a copy refused
    # a copy first. A replica corruption that found none held (the rank's holders were still
    # coming back from an earlier node fault) left its rank no copy in memory: disk.
    kinds = [f["kind"] for f in got]
    pairs = [(got[i], got[i + 1]) for i, k in enumerate(kinds) if k == "corrupt-snapshot"]
    assert pairs and all(k["kind"] in ("kill-rank", "kill-node") for _, k in pairs), kinds
    hit = [(c, k) for c, k in pairs if c["landed"] is None or any(c["landed"]["replicas"].values())]
    assert len(hit) >= len(pairs) // 2, [c["landed"] for c, _ in pairs]
    injected = {e["fault_id"]: e for e in events if e["event"] == "fault_injected"}
    decided = {fid: e for e in events if e["event"] == "recovery_decided" for fid in e["fault_ids"]}

    def went_home(c: dict[str, Any], k: dict[str, Any]) -> bool:
        # A rank a node fault moved away goes home when it is next started, restored from the
        # replica held there: the corrupted slots on the node it left are never read.
        corrupted, decision = injected[c["fault_id"]], decided.get(k["fault_id"])
        return (c["landed"] is None and decision is not None and k["restore_source"] == "peer-memory"
                and all(decision["placement"].get(str(r)) not in corrupted["nodes"] for r in corrupted["ranks"]))

    assert all(k["rejected_copies"] or went_home(c, k) for c, k in hit), [
        (c["fault_id"], c["landed"], k["fault_id"], k["restore_source"]) for c, k in hit if not k["rejected_copies"]]
    assert sum(bool(k["rejected_copies"]) for _, k in hit) >= len(hit) // 2, [k["fault_id"] for _, k in hit]
    assert all(k["restore_source"] == "disk" for c, k in pairs if (c, k) not in hit), pairs
    # The collective kills landed in their collective.
    landed = [f["landed"] for f in got if f["kind"] == "kill-rank" and f.get("landed")]
    assert landed and all(x["phase"] == "collective" for x in landed), landed
    assert_nothing_left(tmp_path)
    assert not shm_left("campaign")

"""Scenario files: loading, bad files refused naming the field, expectations against hand-made
reports, the bit-for-bit loss comparison, worst cases over repeats, JUnit and Markdown output."""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from ffctl.cli.app import main
from ffctl.launch.scenario import (
    Check, Outcome, ScenarioError, compare_losses, evaluate, load, loads, twin_spec, worst_case,
)
from ffctl.launch.scenario_runs import plan_scenarios, scenario_files
from ffctl.render.verdicts import junit, markdown

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "scenarios"

REPORT: dict[str, Any] = {
    "run_id": "r1", "status": "completed", "reason": "", "steps_completed": 60, "lost_gpu_hours_total": 0.002,
    "goodput": 0.5, "loss_by_step": [[1, 2.5], [2, 2.25], [3, 2.0]],
    "faults": [
        {"fault_id": "f1", "kind": "kill-rank", "target": "rank:1", "recovery_s": 0.4, "detection_s": 0.05,
         "lost_steps": 0, "lost_s": 0.3, "restore_source": "local-memory"},
        {"fault_id": "f2", "kind": "kill-node", "target": "node:1", "recovery_s": 6.0, "detection_s": 1.1,
         "lost_steps": 1, "lost_s": 5.5, "restore_source": "peer-memory"},
    ],
}


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


# --- loading ----------------------------------------------------------------------------------


def test_load_and_spec(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('name = "k"\n[launch]\nnnodes = 2\nsteps = 9\nhang_timeout = 3\n'
                    '[faults]\ninject = ["kill-rank:rank=1,step=3"]\n[expect]\ncompletes = true\n')
    sc = load(path).require_expectations()
    spec = sc.spec(tmp_path, "r1")
    assert sc.name == "k" and spec.nnodes == 2 and spec.steps == 9 and spec.hang_min_s == 3
    assert spec.injects[0].trigger.step == 3 and spec.run_id == "r1"
    assert sc.spec(tmp_path, None, seed=5).seed == 5
    twin = twin_spec(spec, "r1-twin")
    assert twin.injects == () and twin.chaos is None and twin.seed == spec.seed and twin.run_id == "r1-twin"


def test_old_keys_still_load(tmp_path: Path) -> None:
    sc = loads('[launch]\nsteps = 9\ninject = ["kill-rank:rank=1,step=3"]\nchaos = "mtbf=5,seed=1,until=9"\n'
               '[expect]\nstatus = "completed"\nmax_lost_gpu_hours_total = 0.5\n', tmp_path / "old.toml")
    spec = sc.spec(tmp_path, None)
    assert len(spec.injects) == 1 and spec.chaos == "mtbf=5,seed=1,until=9"
    assert sc.expect == {"status": "completed", "max_lost_gpu_hours": 0.5}


def test_a_script_is_found_beside_the_scenario_and_takes_torchrun_options(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    sc = loads('[launch]\nscript = ["train.py", "--lr", "0.1"]\nmax_restarts = 1\n'
               '[launch.torchrun]\nrole = "trainer"\nstart_method = "fork"\n[expect]\ncompletes = true\n',
               tmp_path / "s.toml")
    old = os.getcwd()
    os.chdir("/")  # the script is named relative to the file, not to where ffctl runs
    try:
        spec = sc.spec(tmp_path / "runs", None)
    finally:
        os.chdir(old)
    assert spec.script == (str(tmp_path / "train.py"), "--lr", "0.1")
    assert (spec.nnodes, spec.nproc_per_node, spec.max_restarts) == (1, 1, 1)  # torchrun's layout for a script
    assert spec.role == "trainer" and ("start_method", "fork") in spec.torchrun


@pytest.mark.parametrize("text, needle", [
    ("[launch]\nnodes = 2\n", "unknown key(s) ['nodes'] in [launch]"),
    ("[expect]\nmax_recovery = 1\n", "unknown key(s) ['max_recovery'] in [expect]"),
    ("[lunch]\n", "['lunch']"),
    ("[launch\n", "not valid TOML"),
    ('[launch]\nsteps = "many"\n', "[launch].steps: 'many' is not an integer"),
    ("[launch]\nsteps = 0\n", "[launch].steps: 0 is out of range"),
    ("[launch]\nhang_timeout = 0\n", "[launch].hang_timeout: 0 is out of range"),
    ('[launch]\nscript = []\n', "[launch].script: [] is not a non-empty string"),
    ('[launch]\ntorchrun = 3\n', "[launch].torchrun: 3 is not a table"),
    ('[launch.torchrun]\nrdzv_id = true\n', "[launch].torchrun.rdzv_id: true is not a string or an integer"),
    ('[launch.torchrun]\nmax_restarts = 1\n', "unknown key 'max_restarts' (a key of [launch] itself)"),
    ('[launch.torchrun]\nstandalone = "yes"\n', "[launch].torchrun.standalone: 'yes' is not true or false"),
    ('[faults]\ninject = ["kill-rank:rank=1"]\n', "[faults].inject[0]"),
    ('[faults]\ninject = "kill-rank:rank=1,step=2"\n', "[faults].inject: 'kill-rank:rank=1,step=2' is not a list"),
    ('[faults]\nchaos = "mtbf=0"\n', "[faults].chaos: mtbf='0'"),
    ('[faults]\nshake = 1\n', "unknown key(s) ['shake'] in [faults]"),
    ('[launch]\nchaos = "mtbf=5"\n[faults]\nchaos = "mtbf=6"\n', "[faults].chaos and [launch].chaos"),
    ("[expect]\ncompletes = 1\n", "[expect].completes: 1 is not true or false"),
    ("[expect]\nmatches_fault_free = \"yes\"\n", "[expect].matches_fault_free: 'yes' is not true or false"),
    ("[expect]\nmax_lost_s = -1\n", "[expect].max_lost_s: -1 is out of range"),
    ("[expect]\nmin_goodput = 2\n", "[expect].min_goodput: 2 is out of range"),
    ("[expect]\nmax_lost_gpu_hours = nan\n", "[expect].max_lost_gpu_hours: nan is not a finite number"),
    ('[expect]\nrestore_source = "moon"\n', "[expect].restore_source: 'moon' is not one of"),
    ("[expect]\nmax_lost_gpu_hours = 1\nmax_lost_gpu_hours_total = 1\n", "give one"),
    ("name = 3\n", "name: 3 is not a string"),
])
def test_bad_scenarios_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as err:
        load(path)
    assert needle in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("text, needle", [
    ('[launch]\nsteps = "many"\n[expect]\ncompletes = true\n', "[launch].steps: 'many' is not an integer"),
    ('[launch]\nsteps = 5\n[faults]\ninject = ["kill-rank:rank=1,step=9"]\n[expect]\ncompletes = true\n', "step 9"),
    ("[launch]\nsteps = 5\n", "[expect] holds no expectation"),
    ("[launch]\nsteps = 5\n[expect]\nmatches_fault_free = false\n", "[expect] holds no expectation"),
    ("[launch]\nsteps = 5\n[expect]\nmatches_fault_free = true\n", "matches_fault_free = true without a fault"),
    ('[launch]\nscript = "missing.py"\n[expect]\ncompletes = true\n', "script"),
    ('[launch]\nrecovery = "restart-disk"\n[expect]\ncompletes = true\n', "--ckpt-every"),
    ('[launch]\nscript = "x.py"\n[launch.torchrun]\nstandalone = true\nmodule = true\nno_python = true\n'
     '[expect]\ncompletes = true\n', "[launch.torchrun]"),
    ('[launch]\nnnodes = 2\n[launch.torchrun]\nstandalone = true\n[expect]\ncompletes = true\n',
     "standalone is one node"),
])
def test_ffctl_run_refuses_a_bad_file_with_exit_2_and_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as ex:
        main(["run", str(path), "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert ex.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and needle in err and "bad.toml" in err, err
    assert not (tmp_path / "runs").exists()  # nothing started, nothing recorded


def test_one_bad_file_among_good_ones_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.toml").write_text("[launch]\nsteps = 5\n[expect]\ncompletes = true\n")
    (tmp_path / "b.toml").write_text("[launch]\nsteps = 5\n[expect]\nmax_recovery_s = \"fast\"\n")
    with pytest.raises(SystemExit) as ex:
        main(["run", str(tmp_path), "--runs-dir", str(tmp_path / "runs")])
    assert ex.value.code == 2
    assert "[expect].max_recovery_s: 'fast' is not a number" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_every_example_scenario_is_valid_and_a_folder_is_its_toml_files(tmp_path: Path) -> None:
    files = scenario_files([EXAMPLES])
    assert len(files) >= 6 and all(f.suffix == ".toml" for f in files)
    for f in files:
        sc = load(f).require_expectations()
        if sc.launch.get("sandbox") is None:  # a sandbox is planned only as root
            sc.spec(tmp_path, None)
    assert any(load(f).wants_twin for f in files)
    assert any(load(f).launch.get("script") for f in files)


def test_plans_give_each_run_and_twin_an_id_and_dry_run_starts_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[launch]\nsteps = 9\nseed = 4\n[faults]\ninject = ["kill-rank:rank=1,step=3"]\n'
                    '[expect]\nmatches_fault_free = true\n')
    (planned,) = plan_scenarios([path], tmp_path / "runs", "ci", repeat=2)
    assert [(r.seed, r.plan.run_id, r.twin.run_id if r.twin else None) for r in planned.runs] == [
        (4, "ci-c-4", "ci-c-4-twin"), (5, "ci-c-5", "ci-c-5-twin")]
    assert planned.runs[1].plan.spec.seed == 5 and planned.runs[1].twin.spec.injects == ()  # type: ignore[union-attr]
    with pytest.raises(SystemExit) as ex:
        main(["run", str(path), "--dry-run", "--repeat", "2", "--runs-dir", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert ex.value.code == 0
    assert "matches_fault_free = true" in out and "kill-rank rank:1 @step=3" in out and "fault-free twin" in out
    assert not (tmp_path / "runs").exists()
    with pytest.raises(SystemExit) as ex:
        main(["run", str(path), "--repeat", "0", "--runs-dir", str(tmp_path / "runs")])
    assert ex.value.code == 2 and "--repeat 0" in capsys.readouterr().err


# --- expectations -----------------------------------------------------------------------------


def test_expectations_met() -> None:
    checks = evaluate({"completes": True, "faults": 2, "max_lost_steps": 1, "max_detection_s": 2.0,
                       "max_recovery_s": 6.0, "max_lost_s": 6, "max_lost_gpu_hours": 0.01,
                       "restore_source": ["local-memory", "peer-memory"], "min_goodput": 0.4,
                       "steps_completed": 60}, REPORT)
    assert [c.name for c in checks] == ["completes", "faults", "max_lost_steps", "max_detection_s", "max_recovery_s",
                                        "max_lost_s", "max_lost_gpu_hours", "restore_source", "min_goodput",
                                        "steps_completed"]
    assert all(c.passed for c in checks), [c.detail for c in checks if not c.passed]
    assert all(c.run_id == "r1" for c in checks)


def test_expectations_missed_name_the_measured_value_and_the_fault() -> None:
    checks = by_name(evaluate({"completes": False, "faults": 1, "max_recovery_s": 1.0, "max_detection_s": 1.0,
                               "max_lost_s": 5.0, "max_lost_steps": 0, "max_lost_gpu_hours": 0.001,
                               "min_goodput": 0.9, "restore_source": "peer-memory"}, REPORT))
    assert not any(c.passed for c in checks.values())
    rec = checks["max_recovery_s"]  # the worst fault decides
    assert rec.measured == "6.000 s" and rec.value == 6.0 and "f2 kill-node node:1" in rec.detail
    assert checks["max_detection_s"].measured == "1.100 s"
    assert checks["max_lost_s"].value == 5.5 and checks["max_lost_steps"].value == 1
    assert checks["max_lost_gpu_hours"].measured == "0.002000"
    assert "goodput 0.500" in checks["min_goodput"].detail
    assert "f1 restored from local-memory" in checks["restore_source"].detail
    assert "1" in checks["faults"].bound and checks["faults"].measured == "2"


def test_a_fault_never_recovered_misses_and_no_fault_is_no_pass() -> None:
    failed = {**REPORT, "status": "failed", "reason": "recovery failed",
              "faults": [{**REPORT["faults"][0], "recovery_s": None, "restore_source": None}]}
    checks = by_name(evaluate({"completes": True, "max_recovery_s": 100.0, "restore_source": "local-memory"}, failed))
    assert not checks["completes"].passed and "recovery failed" in checks["completes"].detail
    assert not checks["max_recovery_s"].passed and checks["max_recovery_s"].measured == "never recovered"
    assert not checks["restore_source"].passed
    empty = by_name(evaluate({"max_recovery_s": 100.0, "faults": 0}, {**REPORT, "faults": []}))
    assert not empty["max_recovery_s"].passed and empty["faults"].passed


def test_a_fault_that_never_took_effect_fails_the_scenario_whatever_it_expects() -> None:
    missed = {"fault_id": "f2", "kind": "kill-rank", "target": "rank:1", "trigger": "@step=50",
              "reason": "the job ended at step 40, before step 50"}
    checks = by_name(evaluate({"completes": True, "faults": 2}, {**REPORT, "missed_faults": [missed]}))
    assert checks["completes"].passed and checks["faults"].passed  # the two that landed are as expected ...
    landed = checks["faults_landed"]  # ... but a third never did
    assert not landed.passed and landed.measured == "1 missed"
    assert "f2" in landed.detail and "before step 50" in landed.detail
    assert "faults_landed" not in by_name(evaluate({"completes": True}, {**REPORT, "missed_faults": []}))


def test_compare_losses_bit_for_bit() -> None:
    a = [[1, 2.5], [2, 2.25], [3, 2.0]]
    assert compare_losses(a, [list(x) for x in a]) is None
    diff = compare_losses(a, [[1, 2.5], [2, 2.2500000000000004], [3, 2.0]])
    assert diff is not None and (diff.step, diff.loss, diff.twin_loss) == (2, 2.25, 2.2500000000000004)
    # Equal as numbers, not as bits: -0.0 is not the twin's 0.0.
    assert compare_losses([[1, -0.0]], [[1, 0.0]]) is not None
    missing = compare_losses(a[:2], a)
    assert missing is not None and (missing.step, missing.loss, missing.twin_loss) == (3, None, 2.0)
    assert compare_losses([[2, 1.0]], [[1, 1.0], [2, 1.0]]).step == 1  # type: ignore[union-attr]


def test_matches_fault_free_names_the_first_differing_step() -> None:
    twin = {"run_id": "r1-twin", "loss_by_step": [[1, 2.5], [2, 2.25], [3, 2.0]]}
    same = by_name(evaluate({"matches_fault_free": True}, REPORT, twin))["matches_fault_free"]
    assert same.passed and same.measured == "identical over 3 steps"
    other = {**twin, "loss_by_step": [[1, 2.5], [2, 2.25], [3, 1.9999999999999998]]}
    diff = by_name(evaluate({"matches_fault_free": True}, REPORT, other))["matches_fault_free"]
    assert not diff.passed and diff.measured == "differs at step 3" and diff.value == 3.0
    assert "first differing step 3: loss 2.0, fault-free twin (r1-twin) 1.9999999999999998" in diff.detail
    assert not by_name(evaluate({"matches_fault_free": True}, REPORT, None))["matches_fault_free"].passed
    assert evaluate({"matches_fault_free": False, "faults": 2}, REPORT, None)[0].name == "faults"


# --- repeats ----------------------------------------------------------------------------------


def test_worst_case_over_repeats() -> None:
    def run(rid: str, seed: int, recovery: float, goodput: float, status: str) -> list[Check]:
        report = {**REPORT, "run_id": rid, "status": status, "goodput": goodput,
                  "faults": [{**REPORT["faults"][0], "recovery_s": recovery}]}
        return [Check(c.name, c.passed, c.measured, c.bound, c.detail, c.value, c.run_id, seed)
                for c in evaluate({"completes": True, "max_recovery_s": 5.0, "min_goodput": 0.3}, report)]

    worst = by_name(worst_case([run("a", 0, 0.5, 0.6, "completed"), run("b", 1, 2.5, 0.35, "completed"),
                                run("c", 2, 1.0, 0.5, "completed")]))
    assert all(c.passed for c in worst.values())
    assert worst["max_recovery_s"].value == 2.5 and worst["max_recovery_s"].run_id == "b"
    assert worst["min_goodput"].value == 0.35 and "worst of 3 runs (0 missed), run b seed 1" in worst["min_goodput"].detail
    # A missed run is worse than any met one, and the furthest miss is shown.
    worst = by_name(worst_case([run("a", 0, 7.0, 0.6, "completed"), run("b", 1, 9.0, 0.1, "failed"),
                                run("c", 2, 1.0, 0.5, "completed")]))
    assert not worst["max_recovery_s"].passed and worst["max_recovery_s"].run_id == "b"
    assert "(2 missed)" in worst["max_recovery_s"].detail
    assert not worst["completes"].passed and worst["completes"].run_id == "b"
    assert not worst["min_goodput"].passed and worst["min_goodput"].value == 0.1
    single = run("a", 0, 0.5, 0.6, "completed")
    assert worst_case([single]) == single and worst_case([]) == []


# --- JUnit and Markdown -----------------------------------------------------------------------


def outcomes() -> list[dict[str, Any]]:
    checks = evaluate({"completes": True, "max_recovery_s": 1.0}, REPORT)
    run = {"run_id": "r1", "record": "/runs/r1", "seed": 0, "status": "completed",
           "twin": {"run_id": "r1-twin", "record": "/runs/r1-twin", "status": "completed"}}
    missed = Outcome("kill & <node>", "s/kill.toml", checks, [run], seconds=12.5)
    broken = Outcome("sandbox", "s/net.toml", [], [], error="ip: RTNETLINK answers: Operation not permitted")
    return [missed.to_dict(), broken.to_dict()]


def test_junit_is_a_suite_per_scenario_and_a_case_per_expectation() -> None:
    root = ET.fromstring(junit(outcomes()))
    assert root.tag == "testsuites" and root.get("tests") == "3" and root.get("failures") == "1"
    assert root.get("errors") == "1"
    first, second = root.findall("testsuite")
    assert first.get("name") == "kill & <node>" and first.get("failures") == "1" and first.get("tests") == "2"
    failed = [c for c in first.iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["max_recovery_s"]
    message = failed[0].find("failure").get("message")  # type: ignore[union-attr]
    assert "measured 6.000 s" in message and "<= 1.000 s" in message and "f2 kill-node" in message
    out = first.find("system-out").text or ""  # type: ignore[union-attr]
    assert "run r1 (seed 0): completed, record /runs/r1" in out and "r1-twin" in out
    (error,) = second.iter("error")
    assert "Operation not permitted" in (error.get("message") or "") and second.get("errors") == "1"


def test_markdown_summary() -> None:
    text = markdown(outcomes())
    assert text.startswith("## ffctl chaos checks")
    assert "| kill & <node> | ❌ failed | 1 | 12.5 |" in text and "| sandbox | ⚠️ error | 0 | 0.0 |" in text
    assert "| `max_recovery_s` | 6.000 s | <= 1.000 s | **missed** |" in text
    assert "Operation not permitted" in text and "record /runs/r1" in text


def test_a_launch_that_cannot_run_is_exit_3_and_a_junit_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch's execute path fails as it does when a tool or host is unusable (InfraError):
    the scenario is an error, not a miss, and the other scenarios still run."""
    from ffctl.exits import InfraError
    from ffctl.launch import scenario_runs

    started: list[str] = []

    def unusable(plan: Any, view: Any) -> Any:
        started.append(plan.run_id)
        raise InfraError(f"run {plan.run_id}: iptables is not usable on localhost")

    monkeypatch.setattr(scenario_runs, "execute", unusable)
    for name in ("a", "b"):
        (tmp_path / f"{name}.toml").write_text("[launch]\nsteps = 5\n[expect]\ncompletes = true\n")
    xml = tmp_path / "out.xml"
    with pytest.raises(SystemExit) as ex:
        main(["run", str(tmp_path), "--run-id", "inf", "--junit", str(xml), "--runs-dir", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert ex.value.code == 3, out
    assert started == ["inf-a-0", "inf-b-0"] and "2 error" in out
    root = ET.parse(xml).getroot()
    assert root.get("errors") == "2" and root.get("failures") == "0"
    errors = [e.get("message") for e in root.iter("error")]
    assert errors == ["run inf-a-0: iptables is not usable on localhost", "run inf-b-0: iptables is not usable on localhost"]

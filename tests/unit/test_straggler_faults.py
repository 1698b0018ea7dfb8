"""slow-rank and slow-node: the spec, the pure plan (a sleep written to the ranks' in-step fault
files, and its revert) and the rank side that sleeps (`recovery.faults.InStepFaults`), on a fake
clock."""
from __future__ import annotations

from pathlib import Path

import pytest

from fault_injectors import deadman, make_plan, parse_spec
from fault_injectors.deadman import with_fault_id
from fault_injectors.plan import FaultPlan, NodePlace, RankPlace, Topology
from fault_injectors.process import in_step_fault_path
from wire.fault_spec import FaultFamily, FaultKind, FaultSpecError, parse_injection
from fault_injectors.targets import check_in_job
from recovery import faults as rank_faults
from recovery.faults import BASE_STEPS, InStepFaults


def topo() -> Topology:
    nodes = tuple(NodePlace(n, "localhost", "127.0.0.1", 100 + n) for n in range(2))
    ranks = tuple(RankPlace(n * 2 + i, n, 1000 + n * 2 + i) for n in range(2) for i in range(2))
    return Topology("run1", nodes, ranks, fault_dir="/dev/shm/ffctl-run1-k")


def plan_of(text: str) -> FaultPlan:
    return make_plan(with_fault_id(parse_injection(text, scheduled=True), "f1"), topo())


def test_slow_rank_spec() -> None:
    spec = parse_injection("slow-rank:rank=1,step=10,factor=3,duration=10", scheduled=True)
    assert spec.kind is FaultKind.SLOW_RANK and spec.kind.family is FaultFamily.STRAGGLER
    assert spec.duration == 10.0 and spec.option("factor") == "3" and not spec.kind.breaks_job
    assert parse_injection("slow-node:node=1,factor=1.5", scheduled=False).kind is FaultKind.SLOW_NODE


@pytest.mark.parametrize("text, word", [
    ("slow-rank:rank=1,step=10", "factor="),
    ("slow-rank:rank=1,step=10,factor=1", "factor='1'"),
    ("slow-rank:rank=1,step=10,factor=0.5", "factor='0.5'"),
    ("slow-rank:rank=1,step=10,factor=1000", "factor='1000'"),
    ("slow-rank:rank=1,step=10,factor=nan", "factor='nan'"),
    ("slow-rank:rank=1,step=10,factor=٣", "factor="),
    ("slow-rank:rank=1,step=10,factor=3,rate=1mbit", "rate="),
    ("slow-node:node=1,step=10,factor=3,factor=4", "factor= given twice"),
])
def test_bad_slow_specs_are_one_line_naming_the_value(text: str, word: str) -> None:
    with pytest.raises(FaultSpecError) as exc:
        parse_injection(text, scheduled=True)
    assert word in str(exc.value) and len(str(exc.value).splitlines()) == 1


def test_targets_are_checked_against_the_job() -> None:
    with pytest.raises(FaultSpecError, match="rank 4 does not exist"):
        check_in_job(parse_spec("slow-rank:rank=4,factor=2"), 4, 2)
    with pytest.raises(FaultSpecError, match="node 2 does not exist"):
        check_in_job(parse_spec("slow-node:node=2,factor=2"), 4, 2)


def test_slow_rank_plan_writes_the_sleep_to_the_rank_and_reverts_it() -> None:
    plan = plan_of("slow-rank:rank=1,step=10,factor=3,duration=10")
    assert plan.ranks == (1,) and plan.nodes == (0,) and plan.revertible
    (apply,) = plan.apply
    assert apply.argv[-3:] == ("slow:3:10", in_step_fault_path(topo(), 1), "1001")
    (revert,) = plan.revert
    assert revert.argv[-3:] == ("slow:off", in_step_fault_path(topo(), 1), "1001") and revert.allow_fail
    # Revertible, so guarded by a dead man's switch like every fault with a duration.
    guarded = deadman.guard(plan, "run1")
    assert guarded.deadman


def test_slow_node_slows_every_rank_of_the_node() -> None:
    plan = plan_of("slow-node:node=1,step=5,factor=2.5")
    assert plan.ranks == (2, 3) and plan.nodes == (1,)
    assert [c.argv[-3] for c in plan.apply] == [f"slow:2.5:{deadman.DEFAULT_DURATION_S:g}"] * 2
    assert [c.argv[-1] for c in plan.revert] == ["1002", "1003"]


class Clock:
    """time.monotonic and time.sleep of recovery.faults: a sleep moves the clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(rank_faults.time, "monotonic", c.monotonic)
    monkeypatch.setattr(rank_faults.time, "sleep", c.sleep)
    return c


def steps(f: InStepFaults, clock: Clock, n: int, step_s: float) -> None:
    for _ in range(n):
        f.check()
        clock.now += step_s  # the step's own work


def test_a_slowed_rank_sleeps_factor_minus_one_times_its_step_until_the_duration_ends(clock: Clock) -> None:
    f = InStepFaults("", "run1", 1)
    steps(f, clock, BASE_STEPS, 0.2)
    f.fire("slow:3:3")
    steps(f, clock, 4, 0.2)
    # Two extra step times per step, the base measured before the slowdown; the sleeps
    # themselves never count into the base (which would make it grow).
    assert clock.slept == pytest.approx([0.4] * 4)
    clock.slept.clear()
    steps(f, clock, 3, 0.2)  # 3 s after the onset (five slowed steps) the duration is over
    assert clock.slept == pytest.approx([0.4]) and f.slow_factor is None


def test_revert_ends_the_slowdown_at_once(clock: Clock) -> None:
    f = InStepFaults("", "run1", 1)
    steps(f, clock, 3, 0.1)
    f.fire("slow:4:60")
    steps(f, clock, 2, 0.1)
    assert clock.slept == pytest.approx([0.3, 0.3])
    f.fire("slow:off")
    steps(f, clock, 3, 0.1)
    assert len(clock.slept) == 2


def test_a_slowdown_from_the_first_step_measures_one_step_first(clock: Clock) -> None:
    f = InStepFaults("", "run1", 1)
    f.fire("slow:2:60")
    steps(f, clock, 3, 0.5)
    assert clock.slept == pytest.approx([0.5, 0.5])  # the first step unslowed (nothing measured yet)


def test_a_bad_slow_text_is_an_error(clock: Clock) -> None:
    with pytest.raises(RuntimeError, match="slow:fast"):
        InStepFaults("", "run1", 1).fire("slow:fast")


def test_a_scenario_schedules_stragglers_and_sets_the_policy(tmp_path: Path) -> None:
    from ffctl.launch.scenario import ScenarioError, loads

    text = ('[launch]\nnnodes = 2\nnproc_per_node = 1\nsteps = 40\nstraggler = "replace:factor=3"\n'
            '[faults]\ninject = ["slow-node:node=1,step=10,factor=3,duration=10"]\n[expect]\ncompletes = true\n')
    spec = loads(text, tmp_path / "s.toml").spec(tmp_path, "r1")
    assert spec.straggler_policy.replaces and spec.straggler_policy.factor == 3.0
    assert [s.kind for s in spec.injects] == [FaultKind.SLOW_NODE]
    with pytest.raises(ScenarioError, match=r"\[launch\]: --straggler 'later'"):
        loads(text.replace("replace:factor=3", "later"), tmp_path / "s.toml").spec(tmp_path, "r1")

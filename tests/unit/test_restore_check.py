"""`--verify-restore` as pure pieces: the decision restores one snapshot further back, and the
progress ledger compares each rank's loss of every step trained again with its own from before
the fault, bit for bit."""
from __future__ import annotations

import math

from ffctl.controller.decide import Inventory, decide
from ffctl.controller.progress import Progress, StepReport, same_loss
from ffctl.launch_spec import LaunchSpec

MEMBERS = {0: 0, 1: 0, 2: 1, 3: 1}


def _inv(node: int, local: dict[int, set[int]], replica: dict[int, set[int]]) -> Inventory:
    return Inventory(node, "10.0.0.1", 4000, {r: frozenset(s) for r, s in local.items()},
                     {r: frozenset(s) for r, s in replica.items()})


def test_a_verifying_decision_restores_the_oldest_common_step() -> None:
    # Three slots: the survivors went one step further (8, 9, 10) than the lost rank (7, 8, 9).
    invs = {0: _inv(0, {0: {8, 9, 10}, 1: {7, 8, 9}}, {2: {8, 9, 10}, 3: {8, 9, 10}}),
            1: _inv(1, {2: {8, 9, 10}, 3: {8, 9, 10}}, {0: {8, 9, 10}, 1: {7, 8, 9}})}
    plain = decide("peer", MEMBERS, {1}, set(), invs, [0, 1], None, gen=1)
    assert plain is not None and plain.restore_step == 9 and plain.verify_until == 0
    checked = decide("peer", MEMBERS, {1}, set(), invs, [0, 1], None, gen=1, replay=True)
    assert checked is not None and checked.restore_step == 8 and checked.verify_until == 9
    # Nobody went further: two steps back, so a rank killed before reporting its newest still
    # has an earlier step to compare.
    level = {0: _inv(0, {0: {7, 8, 9}, 1: {7, 8, 9}}, {2: {7, 8, 9}, 3: {7, 8, 9}}),
             1: _inv(1, {2: {7, 8, 9}, 3: {7, 8, 9}}, {0: {7, 8, 9}, 1: {7, 8, 9}})}
    both = decide("peer", MEMBERS, {1}, set(), level, [0, 1], None, gen=1, replay=True)
    assert both is not None and both.restore_step == 7 and both.verify_until == 9
    # Only one step held everywhere: nothing further back to restore, the newest it is.
    one = {0: _inv(0, {0: {9}, 1: {9}}, {2: {9}, 3: {9}}), 1: _inv(1, {2: {9}, 3: {9}}, {0: {9}, 1: {9}})}
    alone = decide("peer", MEMBERS, {1}, set(), one, [0, 1], None, gen=1, replay=True)
    assert alone is not None and alone.restore_step == 9 and alone.verify_until == 0


def test_verifying_keeps_a_third_slot() -> None:
    assert LaunchSpec().snapshot_slots == 2
    assert LaunchSpec(verify_restore=True).snapshot_slots == 3


def _report(p: Progress, gen: int, step: int, rank: int, loss: float | None) -> object:
    rep = StepReport(gen, step, rank, loss, 0.01)
    found = p.check_replay(rep)
    p.report(rep)
    return found


def test_replayed_steps_are_compared_per_rank_and_a_difference_is_found() -> None:
    p = Progress()
    p.verify = True
    for step in range(1, 11):
        for rank in (0, 1):
            assert _report(p, 0, step, rank, step + rank / 10) is None  # nothing replayed yet
    _report(p, 0, 11, 0, 11.0)  # rank 0 got one step further before the fault
    p.open(1, 9, verify_until=10)
    assert p.verify_until == 11  # up to the newest step any rank reported
    same = _report(p, 1, 10, 0, 10.0)
    assert same is not None and same.compared and same.matched  # type: ignore[attr-defined]
    assert p.replay_verified({0, 1}) is None  # not every rank is through the replay yet
    differs = _report(p, 1, 10, 1, 10.25)
    assert differs is not None and differs.compared and not differs.matched  # type: ignore[attr-defined]
    assert differs.before == 10.1 and differs.after == 10.25  # type: ignore[attr-defined]
    _report(p, 1, 11, 0, 11.0)
    late = _report(p, 1, 11, 1, 99.0)  # rank 1 never reported step 11 before: nothing to compare
    assert late is not None and not late.compared  # type: ignore[attr-defined]
    assert p.replay_verified({0, 1}) is False
    assert _report(p, 1, 12, 0, 12.0) is None  # past the replay: not checked


def test_a_replay_equal_for_every_rank_is_verified() -> None:
    p = Progress()
    p.verify = True
    for step in (1, 2, 3):
        for rank in (0, 1):
            _report(p, 0, step, rank, float("nan") if step == 3 else step * 1.5)
    p.open(1, 2, verify_until=3)
    _report(p, 1, 3, 0, float("nan"))
    assert p.replay_verified({0, 1}) is None
    _report(p, 1, 3, 1, float("nan"))  # a NaN equals a NaN: both runs diverged alike
    assert p.replay_verified({0, 1}) is True
    assert p.replay_compared(0) and p.replay_compared(1)


def test_without_verify_nothing_is_kept_or_compared() -> None:
    p = Progress()
    _report(p, 0, 1, 0, 1.0)
    p.open(1, 0, verify_until=1)
    assert p.verify_until == 1 and _report(p, 1, 1, 0, 2.0) is None


def test_losses_are_equal_only_bit_for_bit() -> None:
    assert same_loss(0.1 + 0.2, 0.1 + 0.2) and not same_loss(0.1 + 0.2, 0.3)
    assert same_loss(math.nan, math.nan) and not same_loss(0.0, -0.0)
    assert same_loss(None, None) and not same_loss(None, 1.0)

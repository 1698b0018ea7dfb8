"""The controller's progress ledger: which step reports become STEP events, and when a step is
complete everywhere."""
from __future__ import annotations

from ffctl.controller.progress import Progress, StepReport


def _rep(gen: int, step: int, rank: int = 0, loss: float | None = None) -> StepReport:
    return StepReport(gen, step, rank, loss if loss is not None else 10.0 - step, 0.1)


def test_one_event_per_step_from_the_first_report() -> None:
    p = Progress()
    assert p.report(_rep(0, 1, rank=1))
    assert not p.report(_rep(0, 1, rank=0))
    assert p.report(_rep(0, 2, rank=0))
    assert (p.committed_step, p.last_loss) == (2, 8.0)


def test_a_step_is_everywhere_once_every_rank_reported_it() -> None:
    p = Progress()
    for rank in (0, 1, 2):
        p.report(_rep(0, 5, rank=rank))
    p.report(_rep(0, 6, rank=0))
    assert p.everywhere([0, 1, 2]) == 5
    assert p.everywhere([0, 1, 2, 3]) == 0  # rank 3 has said nothing yet
    p.open(1, restore_step=5)
    assert p.everywhere([0, 1, 2]) == 0  # the new generation starts counting afresh


def test_a_late_report_of_the_restored_step_is_kept() -> None:
    # Step 13's slots were complete on every rank, but its reports were still on their way when
    # the recovery restored it: the new generation will not train it again.
    p = Progress()
    p.report(_rep(0, 12))
    p.open(1, restore_step=13)
    assert p.report(_rep(0, 13, rank=1))
    assert not p.report(_rep(0, 13, rank=3))  # once
    assert p.committed_step == 12  # the live view follows the current generation only


def test_a_late_report_past_the_restored_step_is_dropped() -> None:
    p = Progress()
    p.report(_rep(0, 12))
    p.open(1, restore_step=12)
    assert not p.report(_rep(0, 13))  # recomputed by generation 1 and reported afresh
    assert p.report(_rep(1, 13, loss=4.0))
    assert (p.committed_step, p.last_loss) == (13, 4.0)


def test_started_and_hang_limit() -> None:
    p = Progress()
    assert not p.started()
    assert p.hang_limit(5.0) == 5.0  # no step yet: the floor
    for step, dt in enumerate([0.2, 0.9, 0.8], start=1):
        p.report(StepReport(0, step, 0, 1.0, dt))
    assert p.started() and p.started(0) and not p.started(1)
    assert p.hang_limit(5.0) == 8.0  # 10 x the median step time


def test_a_step_every_rank_wrote_to_disk_is_recorded_once_and_held_by_no_rank() -> None:
    # Step 40's disk checkpoint is complete while its reports still wait for the snapshot's copy
    # on the ring neighbour; a node fault then restores from step 40, whose loss the record must
    # have although no rank's report of it will come.
    p = Progress()
    for rank in (0, 1):
        p.report(_rep(0, 39, rank=rank))
    assert p.checkpointed(_rep(0, 40, rank=1, loss=2.5))
    assert (p.committed_step, p.last_loss) == (40, 2.5)
    assert not p.report(_rep(0, 40, rank=0))  # its report, come after all: not a second event
    assert not p.checkpointed(_rep(0, 40, rank=0))
    assert p.everywhere([0, 1]) == 39  # rank 1 has not said its snapshot of step 40 is durable
    p.open(1, restore_step=20)
    assert not p.checkpointed(_rep(0, 60))  # an older generation's checkpoint: its own reports decide

"""The straggler detector, fed step reports as the ranks of a synchronous job send them: every
rank takes the same wall time per step, and the fast ranks spend the difference waiting."""
from __future__ import annotations

import pytest

from ffctl.controller.stragglers import (
    END_STEPS,
    ONSET_S,
    ONSET_STEPS,
    Recovered,
    Replace,
    WARMUP_STEPS,
    StragglerDetector,
    Straggling,
)
from ffctl.launch_spec import SpecError, StragglerPolicy, parse_straggler

BUSY = 0.4  # a healthy rank's compute per step (seconds)
COMM = 0.01  # what a collective costs every rank even when nobody is late


def feed(det: StragglerDetector, steps: range, slow: dict[int, float], world: int = 4, gen: int = 0,
         t0: float = 1000.0, order: list[int] | None = None, busy_s: float = BUSY) -> tuple[list[object], float]:
    """Report `steps` from every rank; ranks in `slow` compute `factor` times longer, the others
    wait for them. Returns the findings and the time after the last step."""
    out: list[object] = []
    t = t0
    for step in steps:
        busy = {r: busy_s * slow.get(r, 1.0) for r in range(world)}
        dt = max(busy.values()) + COMM
        t += dt
        for r in order or range(world):
            out += det.report(gen, step, r, dt, dt - busy[r], t)
    return out, t


def test_names_the_slow_rank_within_the_onset_steps_with_its_factor_and_onset() -> None:
    det = StragglerDetector(4)
    found, t = feed(det, range(1, 11), {})
    assert found == []
    found, _ = feed(det, range(11, 21), {2: 3.0}, t0=t)
    named = [f for f in found if isinstance(f, Straggling)]
    assert len(named) == 1 and not [f for f in found if not isinstance(f, Straggling)]
    s = named[0]
    assert s.rank == 2 and s.onset_step == 11 and s.step == 11 + ONSET_STEPS - 1
    assert s.step - s.onset_step < 5
    # The step took 1.21 s; with rank 2 as fast as the others it would have taken 0.41 s.
    assert s.factor == pytest.approx((3 * BUSY + COMM) / (BUSY + COMM))
    assert s.onset_t == pytest.approx(t)  # when its first slow step began


def test_back_at_pace_ends_it_with_the_time_the_others_waited() -> None:
    det = StragglerDetector(4)
    _, t = feed(det, range(1, 6), {})
    _, t = feed(det, range(6, 16), {1: 2.0}, t0=t)
    found, _ = feed(det, range(16, 16 + END_STEPS + 1), {}, t0=t)
    ended = [f for f in found if isinstance(f, Recovered)]
    assert len(ended) == 1
    e = ended[0]
    assert (e.rank, e.onset_step, e.last_step, e.steps) == (1, 6, 15, 10)
    assert e.lost_s == pytest.approx(10 * BUSY)  # ten steps, each 0.4 s longer for everyone
    assert e.end_t == pytest.approx(t)


def test_noise_is_not_a_straggler() -> None:
    det = StragglerDetector(4)
    found: list[object] = []
    t = 0.0
    for start in range(1, 60, ONSET_STEPS + 1):
        # Slow for one step short of the onset, then normal: a page fault, a descheduled rank.
        got, t = feed(det, range(start, start + ONSET_STEPS - 1), {3: 4.0}, t0=t)
        found += got
        got, t = feed(det, range(start + ONSET_STEPS - 1, start + ONSET_STEPS + 1), {}, t0=t)
        found += got
    # Slower by a few milliseconds: a big factor of a tiny step is still noise.
    det2 = StragglerDetector(2)
    for step in range(1, 20):
        found += det2.report(0, step, 0, 0.004, 0.003, float(step))
        found += det2.report(0, step, 1, 0.004, 0.0, float(step))
    assert found == []


def test_short_steps_are_named_once_the_slowdown_lasted_long_enough() -> None:
    # Steps of 0.05 s, twice as slow: named when the slow steps have lasted ONSET_S, not after
    # ONSET_STEPS of them (half a second of a descheduled rank on a loaded host is noise).
    det = StragglerDetector(2)
    found, _ = feed(det, range(1, 40), {1: 2.0}, world=2, busy_s=0.05)
    (named,) = [f for f in found if isinstance(f, Straggling)]
    slow_step = 2 * 0.05 + COMM
    assert named.step - named.onset_step + 1 == pytest.approx(ONSET_S / slow_step, abs=1)
    found, _ = feed(StragglerDetector(2), range(1, 1 + int(ONSET_S / slow_step) - 1), {1: 2.0}, world=2, busy_s=0.05)
    assert found == []


def test_every_rank_of_a_slow_node_is_named() -> None:
    det = StragglerDetector(4)
    found, _ = feed(det, range(1, 10), {2: 3.0, 3: 3.0})
    assert sorted(f.rank for f in found if isinstance(f, Straggling)) == [2, 3]


def test_reports_out_of_order_and_steps_not_yet_complete() -> None:
    det = StragglerDetector(3)
    found: list[object] = []
    # Rank 0's reports run two steps ahead of the others': each step is judged once complete.
    reports = []
    for step in range(1, 9):
        busy = {0: BUSY, 1: BUSY * 4, 2: BUSY}
        dt = max(busy.values()) + COMM
        reports += [(step, r, dt, dt - busy[r], 10.0 + step) for r in range(3)]
    reports.sort(key=lambda x: (x[0] - (2 if x[1] == 0 else 0), x[1]))
    for step, r, dt, wait, t in reports:
        found += det.report(0, step, r, dt, wait, t)
    named = [f for f in found if isinstance(f, Straggling)]
    assert [(f.rank, f.onset_step) for f in named] == [(1, 1)]


def test_a_new_generation_closes_what_was_open_and_starts_over() -> None:
    det = StragglerDetector(2)
    _, t = feed(det, range(1, 8), {1: 3.0}, world=2)
    found, _ = feed(det, range(5, 9), {}, world=2, gen=1, t0=t)  # replayed from step 4, at pace
    assert [type(f) for f in found] == [Recovered]
    assert det.report(0, 9, 0, 1.0, 0.0, t) == []  # the old generation is not heard any more


def test_a_replacement_warming_up_after_a_recovery_is_not_a_straggler_but_one_slow_beyond_it_is() -> None:
    det = StragglerDetector(4)
    _, t = feed(det, range(1, 21), {})
    # Generation 1 replays from step 16: rank 1 was started again and is three times slower for
    # its first steps (well over ONSET_S), as on a loaded host. The recovery's cost, not a straggler.
    found, t = feed(det, range(17, 17 + WARMUP_STEPS), {1: 3.0}, gen=1, t0=t)
    assert found == []
    found, t = feed(det, range(17 + WARMUP_STEPS, 40), {}, gen=1, t0=t)
    assert found == []
    # Slow past its warm-up: named, from the first step judged.
    det = StragglerDetector(4)
    _, t = feed(det, range(1, 21), {})
    found, _ = feed(det, range(17, 40), {1: 3.0}, gen=1, t0=t)
    named = [f for f in found if isinstance(f, Straggling)]
    assert [(f.rank, f.onset_step, f.gen) for f in named] == [(1, 17 + WARMUP_STEPS, 1)]


def test_a_script_without_wait_times_is_left_alone() -> None:
    det = StragglerDetector(2)
    found = []
    for step in range(1, 10):
        found += det.report(0, step, 0, 0.1, None, float(step))
        found += det.report(0, step, 1, 0.5, None, float(step))
    assert found == []
    assert det.close() == []


def test_close_ends_a_slowdown_under_way() -> None:
    det = StragglerDetector(2)
    feed(det, range(1, 8), {0: 3.0}, world=2)
    ended = det.close()
    assert [(type(e), e.rank) for e in ended] == [(Recovered, 0)]  # type: ignore[attr-defined]


def test_replace_policy_names_a_rank_over_its_factor_for_its_steps_once() -> None:
    det = StragglerDetector(4, StragglerPolicy("replace", factor=2.0, steps=3))
    found, _ = feed(det, range(1, 12), {1: 4.0})
    replace = [f for f in found if isinstance(f, Replace)]
    assert len(replace) == 1 and replace[0].rank == 1 and replace[0].step == 3
    assert replace[0].factor >= 2.0
    # Slower than the detector's threshold but under the policy's factor: waited for.
    det = StragglerDetector(4, StragglerPolicy("replace", factor=3.0, steps=3))
    found, _ = feed(det, range(1, 12), {1: 2.0})
    assert [f for f in found if isinstance(f, Straggling)] and not [f for f in found if isinstance(f, Replace)]
    # A burst over the factor too short to name a straggler (short steps, under ONSET_S) is noise.
    det = StragglerDetector(2, StragglerPolicy("replace", factor=2.0, steps=3))
    found, _ = feed(det, range(1, 5), {1: 4.0}, world=2, busy_s=0.05)  # 4 steps, 0.84 s
    assert found == []
    # The default policy waits.
    found, _ = feed(StragglerDetector(4), range(1, 12), {1: 4.0})
    assert not [f for f in found if isinstance(f, Replace)]


def test_straggler_policy_parsing() -> None:
    assert parse_straggler("wait") == StragglerPolicy()
    assert parse_straggler("replace") == StragglerPolicy("replace", 2.0, 3)
    assert parse_straggler("replace:factor=2.5") == StragglerPolicy("replace", 2.5, 3)
    assert parse_straggler("replace:factor=3,steps=5") == StragglerPolicy("replace", 3.0, 5)
    assert str(parse_straggler("replace:factor=2")) == "replace:factor=2,steps=3"


@pytest.mark.parametrize("text", ["", "kill", "wait:factor=2", "replace:factor=1", "replace:factor=nan",
                                  "replace:factor=inf", "replace:factor=٣", "replace:steps=0", "replace:steps=1.5",
                                  "replace:factor=2,factor=3", "replace:speed=2", "replace:factor"])
def test_bad_straggler_policy_is_one_line_naming_it(text: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_straggler(text)
    message = str(exc.value)
    assert message.startswith(f"--straggler {text!r}") and len(message.splitlines()) == 1

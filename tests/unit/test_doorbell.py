"""The ranks' doorbell to their agent: a ring wakes the agent, a missing agent costs nothing."""
from __future__ import annotations

import threading
import time
import uuid

from recovery.doorbell import Doorbell, Ringer


def _run_id() -> str:
    return f"bell-{uuid.uuid4().hex[:6]}"


def test_a_ring_wakes_the_waiter_before_its_timeout() -> None:
    run = _run_id()
    bell, ringer = Doorbell(run, 0), Ringer(run, 0)
    try:
        assert bell.listening
        timer = threading.Timer(0.2, ringer.ring)
        timer.start()
        t0 = time.monotonic()
        assert bell.wait(30.0)
        assert time.monotonic() - t0 < 10.0
        timer.join()
    finally:
        bell.close()
        ringer.close()


def test_pending_rings_are_consumed_and_silence_times_out() -> None:
    run = _run_id()
    bell, ringer = Doorbell(run, 3), Ringer(run, 3)
    try:
        for _ in range(5):
            ringer.ring()
        assert bell.wait(5.0)
        assert not bell.wait(0.05)  # all five were taken by one wait
    finally:
        bell.close()
        ringer.close()


def test_rings_go_to_their_own_node_only() -> None:
    run = _run_id()
    bell0, ringer1 = Doorbell(run, 0), Ringer(run, 1)
    try:
        ringer1.ring()
        assert not bell0.wait(0.1)
    finally:
        bell0.close()
        ringer1.close()


def test_ringing_with_no_agent_is_silent_and_a_taken_name_falls_back_to_polling() -> None:
    run = _run_id()
    ringer = Ringer(run, 0)
    ringer.ring()  # nobody listens: no error
    first, second = Doorbell(run, 0), Doorbell(run, 0)
    try:
        assert first.listening and not second.listening
        t0 = time.monotonic()
        assert not second.wait(0.05)
        assert time.monotonic() - t0 >= 0.04
    finally:
        first.close()
        second.close()
        ringer.close()
    again = Doorbell(run, 0)  # the name is free once its holder closed
    assert again.listening
    again.close()


def test_with_the_job_token_the_name_is_the_jobs_own() -> None:
    """A stranger who knows the run id cannot take the name first: it is keyed by the token."""
    run = _run_id()
    squatter = Doorbell(run, 0)  # what a stranger could bind, knowing the run id
    bell, ringer, other = Doorbell(run, 0, "t" * 64), Ringer(run, 0, "t" * 64), Ringer(run, 0, "u" * 64)
    try:
        assert squatter.listening and bell.listening
        other.ring()  # another key: another name
        assert not bell.wait(0.1)
        ringer.ring()
        assert bell.wait(5.0) and not squatter.wait(0.05)
    finally:
        for sock in (squatter, bell, ringer, other):
            sock.close()


def test_the_agent_answers_the_ranks_that_rang() -> None:
    """After writing acknowledgements the agent answers every rank that rang: a rank waiting
    for its step to be held off-node wakes then, not at its next look."""
    run = _run_id()
    bell, ringer, silent = Doorbell(run, 0), Ringer(run, 0), Ringer(run, 0)
    try:
        ringer.ring()
        assert bell.wait(5.0)
        assert not ringer.wait(0.05)  # nothing acknowledged yet
        threading.Timer(0.2, bell.answer).start()
        t0 = time.monotonic()
        assert ringer.wait(30.0)
        assert time.monotonic() - t0 < 10.0
        assert not silent.wait(0.05)  # a rank that never rang is not answered
        assert not ringer.wait(0.05)  # one answer, taken once
    finally:
        bell.close()
        ringer.close()
        silent.close()


def test_a_rank_that_ended_is_forgotten_and_wake_ends_a_wait() -> None:
    run = _run_id()
    bell, gone, live = Doorbell(run, 0), Ringer(run, 0), Ringer(run, 0)
    try:
        gone.ring()
        live.ring()
        assert bell.wait(5.0)
        assert len(bell.callers) == 2
        gone.close()
        bell.answer()
        assert len(bell.callers) == 1 and live.wait(5.0)
        threading.Timer(0.2, live.wake).start()  # the rank's abort watcher, from its thread
        t0 = time.monotonic()
        assert live.wait(30.0)
        assert time.monotonic() - t0 < 10.0
    finally:
        bell.close()
        live.close()


def test_callers_are_bounded() -> None:
    """Answers go to the most recent MAX_CALLERS senders only, however many rang."""
    import recovery.doorbell as doorbell

    run = _run_id()
    bell = Doorbell(run, 0)
    ringers = [Ringer(run, 0) for _ in range(doorbell.MAX_CALLERS + 20)]
    try:
        for r in ringers:
            r.ring()
            bell.wait(0.5)
        assert len(bell.callers) == doorbell.MAX_CALLERS
        bell.answer()
        assert ringers[-1].wait(5.0) and not ringers[0].wait(0.05)
    finally:
        bell.close()
        for r in ringers:
            r.close()

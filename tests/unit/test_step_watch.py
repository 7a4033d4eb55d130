"""``StepWatch``: the engine core's rule for an overdue step, exactly (pure; times are numbers passed in)."""

from __future__ import annotations

import pytest

from trioserve.engine.step_watch import (
    FIRST_STEP_BOUND,
    STEP_FACTOR,
    STEP_FLOOR,
    STEP_WINDOW,
    StepWatch,
)


def run(watch: StepWatch, tokens: int, duration: float, now: float) -> float:
    """One step of ``tokens`` tokens that takes ``duration`` seconds from ``now``; returns its end."""
    watch.start(tokens, now)
    watch.end(now + duration)
    return now + duration


def test_before_any_step_the_bound_is_the_first_step_bound_capped_by_the_hard_timeout() -> None:
    assert StepWatch().bound(2048) == FIRST_STEP_BOUND == 60.0
    assert StepWatch(ceiling=30.0).bound(1) == 30.0
    watch = StepWatch()
    watch.start(2048, 0.0)  # a step that has not returned does not count
    assert watch.bound(2048) == FIRST_STEP_BOUND
    assert not watch.overdue(2048, 59.9) and watch.overdue(2048, 60.0)


def test_fast_steps_give_the_floor() -> None:
    watch = StepWatch()
    t = 0.0
    for _ in range(100):
        t = run(watch, 8, 0.01, t)
    assert watch.bound(8) == STEP_FLOOR == 3.0
    assert not watch.overdue(8, 2.99) and watch.overdue(8, 3.0)


def test_a_big_step_is_scaled_linearly_from_the_small_ones() -> None:
    """After 10 ms single-token decodes, a 2048-token chunk may take 4 x 2048 x 10 ms: a CPU model's
    5-9 s chunk is far inside, a hung one still shows (later than a hung decode would)."""
    watch = StepWatch()
    t = 0.0
    for _ in range(50):
        t = run(watch, 1, 0.01, t)
    for _ in range(50):
        t = run(watch, 8, 0.012, t)  # batched decodes: cheaper per token, so the lone ones rule
    assert watch.bound(2048) == pytest.approx(STEP_FACTOR * 2048 * 0.01)
    assert not watch.overdue(2048, 9.0)
    assert watch.bound(8) == STEP_FLOOR  # 8 x 10 ms x 4 is under the floor


def test_a_small_step_is_not_assumed_faster_than_a_recent_big_one() -> None:
    watch = StepWatch()
    t = run(watch, 2048, 6.0, 0.0)  # a prefill chunk
    t = run(watch, 8, 0.02, t)
    assert watch.bound(8) == pytest.approx(STEP_FACTOR * 6.0)  # the chunk's own duration counts
    assert watch.bound(4096) == pytest.approx(STEP_FACTOR * 12.0)  # scaled up from the chunk


def test_the_history_is_bounded_and_old_steps_leave_it() -> None:
    watch = StepWatch()
    t = run(watch, 512, 2.3, 0.0)
    assert watch.bound(512) == pytest.approx(STEP_FACTOR * 2.3)
    for _ in range(STEP_WINDOW - 1):
        t = run(watch, 512, 0.1, t)
    assert watch.bound(512) == pytest.approx(STEP_FACTOR * 2.3)  # still in the last 256
    t = run(watch, 512, 0.1, t)
    assert watch.bound(512) == STEP_FLOOR  # pushed out
    assert len(watch._history) == STEP_WINDOW


def test_a_step_past_its_bound_is_recorded_as_the_bound() -> None:
    """A minute of SIGSTOP must not make four minutes the next bound; a step that really got slower
    still raises it by the factor each time."""
    watch = StepWatch()
    t = 0.0
    for _ in range(10):
        t = run(watch, 4, 0.01, t)
    t = run(watch, 4, 60.0, t)  # stopped for a minute, then continued
    assert watch.bound(4) == pytest.approx(STEP_FACTOR * STEP_FLOOR)
    t = run(watch, 4, 60.0, t)
    assert watch.bound(4) == pytest.approx(STEP_FACTOR**2 * STEP_FLOOR)


def test_overdue_at_looks_again_at_the_floor_then_at_the_bound() -> None:
    watch = StepWatch()
    assert watch.overdue_at(0.0) == float("inf")
    t = run(watch, 1, 0.05, 0.0)  # the bound of a 2048-token step: 4 x 2048 x 50 ms
    watch.start(2048, t)
    assert watch.overdue_at(t) == t + STEP_FLOOR  # young: no bound computed yet
    assert watch.overdue_at(t + STEP_FLOOR) == pytest.approx(t + STEP_FACTOR * 2048 * 0.05)
    watch.end(t + 5.0)
    assert watch.overdue_at(t + 5.0) == float("inf")


def test_overdue_now_is_exactly_when_overdue_at_says() -> None:
    """The beat task sleeps until ``overdue_at`` and must find the step overdue when it wakes (for
    some start times ``start + 3.0 - start < 3.0`` in floating point: no spin on that)."""
    watch = StepWatch()
    t = run(watch, 1, 0.01, 0.0)
    start = 255.29404008730594
    assert start > t and (start + STEP_FLOOR) - start < STEP_FLOOR
    watch.start(1, start)
    at = watch.overdue_at(start)
    assert at == start + STEP_FLOOR and watch.overdue_at(at) == at
    assert not watch.overdue_now(at - 1e-9) and watch.overdue_now(at)

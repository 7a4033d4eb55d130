"""``EngineHealth``: the stall rule, exactly (pure; times are the numbers passed in)."""

from __future__ import annotations

import pytest

from trioserve.frontend.engine_health import STALL_FACTOR, STALL_FLOOR, EngineHealth, Stall
from trioserve.protocol.messages import HEARTBEAT_INTERVAL, EngineStats

BUSY = EngineStats(num_waiting=0, num_running=8)
IDLE = EngineStats(num_waiting=0, num_running=0)


def test_an_idle_engine_is_stalled_once_its_heartbeats_stop_for_the_floor() -> None:
    health = EngineHealth(0, now=0.0)
    assert STALL_FLOOR == 3 * HEARTBEAT_INTERVAL
    for t in range(1, 6):  # heartbeats every second
        assert health.state(t - 0.01) is None
        health.observe(float(t), IDLE)
    assert health.bound() == STALL_FLOOR  # heartbeat gaps are not step intervals
    assert health.state(5.0 + STALL_FLOOR - 0.01) is None
    stall = health.state(5.0 + STALL_FLOOR)
    assert stall is not None
    assert stall.silence == STALL_FLOOR and stall.bound == STALL_FLOOR
    assert stall.message == "engine 0 is stalled: nothing from it for 3.0 s (bound 3.0 s)"


def test_the_bound_follows_the_p99_of_recent_step_intervals() -> None:
    health = EngineHealth(0, now=0.0)
    t = 0.0
    for _ in range(200):  # 10 ms decode steps: the floor rules
        t += 0.01
        health.observe(t, BUSY)
    assert health.bound() == STALL_FLOOR
    for i in range(256):  # a slow model: 1 s steps, one in 64 a 2 s prefill chunk
        t += 2.0 if i % 64 == 0 else 1.0
        health.observe(t, BUSY)
    assert health.bound() == pytest.approx(STALL_FACTOR * 2.0)  # p99 of the last 256 intervals
    assert health.state(t + 7.9) is None
    assert health.state(t + 8.0) is not None
    for _ in range(256):  # back to fast steps: the slow ones leave the window
        t += 0.01
        health.observe(t, BUSY)
    assert health.bound() == STALL_FLOOR


def test_the_gap_after_an_idle_report_is_not_a_step_interval() -> None:
    health = EngineHealth(0, now=0.0)
    health.observe(1.0, BUSY)
    health.observe(1.01, IDLE)  # the idle report
    health.observe(30.0, BUSY)  # a new request, half a minute later: its first step
    assert health.bound() == STALL_FLOOR  # only the 10 ms interval counted


def test_pause_and_resume_bracket_the_readers_own_wait() -> None:
    health = EngineHealth(0, now=0.0)
    health.observe(1.0, BUSY)
    health.pause()  # the output queue is full ("block"): the reader stops reading
    assert health.state(100.0) is None and health.deadline() == float("inf")
    health.resume(100.0)
    assert health.state(100.0 + STALL_FLOOR - 0.01) is None  # the clock restarted at resume
    health.observe(100.5, BUSY)
    assert health.bound() == STALL_FLOOR  # the paused wait was not taken as a step interval


def test_update_reports_each_episode_once() -> None:
    health = EngineHealth(3, now=0.0)
    assert health.update(1.0) is None
    assert health.update(STALL_FLOOR) == ("stalled", Stall(3, STALL_FLOOR, STALL_FLOOR))
    assert health.update(STALL_FLOOR + 5) is None  # still the same episode
    health.observe(10.0, IDLE)
    assert health.update(10.0) == ("resumed", 10.0)
    assert health.update(11.0) is None
    assert health.stall_count == 1


def test_a_long_stop_does_not_blind_the_detector_afterwards() -> None:
    health = EngineHealth(0, now=0.0)
    t = 0.0
    for _ in range(10):
        t += 0.01
        health.observe(t, BUSY)
    t += 60.0  # SIGSTOP for a minute, then SIGCONT
    health.observe(t, BUSY)
    # Counted as the bound it exceeded (3 s), not as a 60 s step, and one interval in eleven is not
    # the p99: the next stop shows after the floor again.
    assert health.bound() == STALL_FLOOR
    t += 0.01
    health.observe(t, BUSY)
    assert health.state(t + STALL_FLOOR) is not None


def test_steps_that_suddenly_grow_longer_than_the_bound_raise_it_within_a_few() -> None:
    health = EngineHealth(0, now=0.0)
    t = 0.0
    for _ in range(256):
        t += 0.01
        health.observe(t, BUSY)
    stalls = 0
    for _ in range(10):  # every step now takes 5 s
        t += 5.0
        stalls += health.state(t - 0.001) is not None
        health.observe(t, BUSY)
    assert stalls <= 4
    assert health.bound() >= 4 * 5.0


def mid_step(elapsed: float, bound: float, tokens: int = 2048) -> EngineStats:
    """The stats of a heartbeat sent while a step runs (``engine/step_watch.py`` judged it)."""
    return EngineStats(
        num_waiting=0,
        num_running=8,
        step_tokens=tokens,
        step_elapsed=elapsed,
        step_bound=bound,
        step_overdue=elapsed >= bound,
    )


def test_a_long_step_with_heartbeats_arriving_is_not_a_stall() -> None:
    """After 10 ms decode steps, a 2048-token prefill chunk of 9 s (a CPU model): the engine core's
    mid-step heartbeats keep silence short, and it judges the step within its bound."""
    health = EngineHealth(0, now=0.0)
    t = 0.0
    for _ in range(256):
        t += 0.01
        health.observe(t, BUSY)
    start = t
    for second in range(1, 10):  # a heartbeat every second of the step
        assert health.state(start + second - 0.001) is None
        health.observe(start + second, mid_step(float(second), bound=80.0))
    assert health.update(start + 9.0) is None
    health.observe(start + 9.05, BUSY)  # the step returned
    assert health.state(start + 9.05) is None
    assert health.stall_count == 0
    # The heartbeat gaps bound the silence rule, not the step: 4 x 1 s, however long steps take.
    assert health.bound() == STALL_FACTOR * HEARTBEAT_INTERVAL


def test_an_overdue_report_is_a_stall_until_a_message_says_otherwise() -> None:
    health = EngineHealth(0, now=0.0)
    health.observe(1.0, BUSY)
    health.observe(2.0, mid_step(1.0, bound=3.0, tokens=8))
    assert health.state(2.0) is None
    health.observe(4.0, mid_step(3.0, bound=3.0, tokens=8))  # the engine core: the step is overdue
    assert health.overdue
    stall = health.state(4.5)
    assert stall is not None and stall.overdue
    assert stall.message == "engine 0 is stalled: its step of 8 tokens has run 3.5 s (bound 3.0 s)"
    assert health.update(4.0) == ("stalled", health.state(4.0))
    health.observe(5.0, mid_step(4.0, bound=3.0, tokens=8))  # still overdue: the same episode
    assert health.update(5.0) is None and health.state(5.0) is not None
    health.observe(6.0, BUSY)  # the step returned
    assert health.state(6.0) is None
    assert health.update(6.0) == ("resumed", 2.0)
    assert health.stall_count == 1


def test_silence_wins_over_an_overdue_report_and_pause_hides_both() -> None:
    health = EngineHealth(0, now=0.0)
    health.observe(1.0, mid_step(30.0, bound=20.0))
    stall = health.state(1.0 + STALL_FLOOR)  # then nothing: the engine core itself has stopped
    assert stall is not None and not stall.overdue
    assert "nothing from it for 3.0 s" in stall.message
    health.pause()  # the reader's own wait, or a dead engine: neither rule applies
    assert health.state(100.0) is None

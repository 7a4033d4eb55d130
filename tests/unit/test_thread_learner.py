"""The thread-count learner (issue 15): golden gate, warm pass, ranges, pacing, candidate choice,
medians, the fastest count, the drift rule, mode 1 and mode 2's transition window, mode 0.

Timings and times are plain floats injected by the tests (the learner never reads a clock); the
worker's tuner around it runs on a MockClock in ``tests/trio/test_thread_tuner.py``. Ends with a
Hypothesis state machine over random event sequences.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from trioserve.worker.thread_learner import (
    MIN_SAMPLES,
    SHADOW_EVERY,
    TRANSITION,
    WINDOW,
    LearnerRules,
    LearnerState,
    ShadowPlan,
    ThreadEvent,
    ThreadLearner,
    range_tokens,
    size_range,
)

Timing = Callable[[int], float]


def make(mode: int = 1, configured: int = 2, **kwargs: object) -> ThreadLearner:
    """A learner that shadows on every step unless told otherwise (K = 1)."""
    kwargs.setdefault("shadow_every", 1)
    return ThreadLearner(LearnerRules(mode, configured, **kwargs))  # type: ignore[arg-type]


def next_plan(learner: ThreadLearner, tokens: int, now: float = 0.0, limit: int = 1000) -> ShadowPlan:
    """Serve steps of ``tokens`` tokens until the learner asks for a shadow pass."""
    for _ in range(limit):
        plan = learner.on_served(tokens, now)
        if plan is not None:
            return plan
    raise AssertionError(f"no shadow plan in {limit} served steps")


def started(mode: int = 1, configured: int = 2, **kwargs: object) -> ThreadLearner:
    """A learner past the golden check and its warm pass: in state ``learning``."""
    learner = make(mode, configured, **kwargs)
    learner.on_golden(True, 0.0)
    warm = next_plan(learner, 1)
    assert warm.warm
    learner.on_shadow(warm, 9.0, True, 0.0)
    assert state_of(learner) == "learning"
    learner.take_events()
    learner.check_invariants()
    return learner


def shadow(learner: ThreadLearner, tokens: int, timing: Timing, now: float = 1.0) -> ShadowPlan:
    """One verified shadow pass of a step of ``tokens`` tokens, timed ``timing(count)``."""
    plan = next_plan(learner, tokens, now)
    learner.on_shadow(plan, timing(plan.count), True, now)
    learner.check_invariants()
    return plan


def learn(learner: ThreadLearner, tokens: int, timing: Timing, now: float = 1.0) -> list[ShadowPlan]:
    """Shadow passes of ``tokens``-token steps until the range's fastest count is decided."""
    plans = []
    while learner.fastest(tokens) is None:
        plans.append(shadow(learner, tokens, timing, now))
    return plans


def state_of(learner: ThreadLearner) -> LearnerState:
    """The state, read through a call (mypy would otherwise keep a narrowed attribute across calls)."""
    return learner.state


def kinds(events: list[ThreadEvent]) -> list[str]:
    return [e.kind for e in events]


def one_faster(count: int) -> float:
    """On this made-up host one thread is fastest: 1 -> 1.0 s, 2 -> 2.0 s, ..."""
    return float(count)


def more_faster(count: int) -> float:
    """On this made-up host more threads are faster: 1 -> 1.0 s, 2 -> 0.5 s, ..."""
    return 1.0 / count


# --------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("tokens", "rng"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (1000, 1024), (1024, 1024)]
)
def test_a_step_falls_in_the_smallest_power_of_two_at_or_above_its_tokens(tokens: int, rng: int) -> None:
    assert size_range(tokens) == rng
    lo, hi = range_tokens(rng)
    assert lo <= tokens <= hi


def test_range_bounds_and_refused_sizes() -> None:
    assert [range_tokens(r) for r in (1, 2, 4, 8)] == [(1, 1), (2, 2), (3, 4), (5, 8)]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            size_range(bad)  # type: ignore[arg-type]


def test_rules_defaults_and_candidates() -> None:
    rules = LearnerRules(1, 4)
    assert (rules.shadow_every, rules.min_samples, rules.transition, rules.window) == (10, 5, 8, 16)
    assert (SHADOW_EVERY, MIN_SAMPLES, TRANSITION, WINDOW) == (10, 5, 8, 16)
    assert rules.allowed == (1, 2, 3, 4)
    assert LearnerRules(1, 4, candidates=(4, 1, 2, 2)).allowed == (1, 2, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": 3},
        {"mode": -1},
        {"configured": 0},
        {"candidates": (1, 2)},  # without the configured count (4)
        {"candidates": (0, 4)},
        {"shadow_every": 0},
        {"min_samples": 0},
        {"transition": 0},
        {"window": 0},
        {"window": 2.0},
    ],
)
def test_rules_refuse_bad_values(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"mode": 1, "configured": 4}
    with pytest.raises(ValueError):
        LearnerRules(**(base | kwargs))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- mode 0


def test_mode_0_does_nothing() -> None:
    learner = make(0, 4)
    assert state_of(learner) == "off"
    learner.on_golden(True, 0.0)
    assert state_of(learner) == "off"
    assert all(learner.on_served(t, 0.0) is None for t in range(1, 200))
    learner.on_served_timing(8, 99, 0.1)  # not even checked: nothing is recorded
    learner.retire("no", 1.0)
    assert learner.serve_count(8) == 4
    assert learner.take_events() == []
    view = learner.view()
    assert view["state"] == "off" and view["ranges"] == {} and view["shadow_passes"] == 0
    assert view["reason"] is None
    learner.check_invariants()


# -------------------------------------------------------------------------------------- golden gate


def test_nothing_is_scheduled_before_the_golden_check_passes() -> None:
    learner = make(1, 2)
    assert state_of(learner) == "waiting_golden"
    assert all(learner.on_served(5, 0.0) is None for _ in range(100))
    assert learner.plans_issued == 0
    learner.check_invariants()
    learner.on_golden(True, 1.0)
    assert state_of(learner) == "warming"
    plan = learner.on_served(5, 1.0)
    assert plan is not None and plan.warm  # the very next step: K steps have long passed


def test_a_failed_golden_check_never_learns() -> None:
    learner = make(2, 2)
    learner.on_golden(False, 3.0, "logits differ from the stored ones")
    assert state_of(learner) == "retired"
    assert learner.reason == "golden check failed: logits differ from the stored ones"
    assert learner.retired_at == 3.0
    [event] = learner.take_events()
    assert (event.kind, event.reason, event.at) == ("retired", learner.reason, 3.0)
    learner.on_golden(True, 4.0)  # a later pass does not revive it
    assert state_of(learner) == "retired"
    assert all(learner.on_served(t, 5.0) is None for t in range(1, 300))
    assert learner.serve_count(7) == 2 and learner.table() == {}
    learner.check_invariants()


def test_one_allowed_count_leaves_nothing_to_learn() -> None:
    learner = make(1, 1)
    learner.on_golden(True, 0.0)
    assert state_of(learner) == "retired" and learner.reason is not None
    assert learner.reason.startswith("nothing to learn")
    assert learner.on_served(4, 0.0) is None
    learner.check_invariants()


# ---------------------------------------------------------------------------------------- warm pass


def test_the_warm_pass_comes_first_at_the_configured_count_and_is_not_a_sample() -> None:
    learner = make(1, 3)
    learner.on_golden(True, 0.0)
    warm = next_plan(learner, 6)
    assert warm.warm and warm.count == 3 and warm.range == 8 and warm.step_tokens == 6
    assert state_of(learner) == "warming"
    assert learner.on_served(6, 0.0) is None  # one plan outstanding at a time
    learner.on_shadow(warm, 50.0, True, 0.0)
    assert state_of(learner) == "learning"
    assert learner.median(6, 3) is None  # the warm time is not a sample
    assert learner.view()["shadow_seconds"] == 50.0  # but it is shadow CPU
    first = next_plan(learner, 6)
    assert not first.warm and first.count == 1
    learner.check_invariants()


def test_an_abandoned_warm_pass_is_planned_again() -> None:
    learner = make(1, 2)
    learner.on_golden(True, 0.0)
    warm = next_plan(learner, 1)
    learner.abandon(warm)
    assert state_of(learner) == "warming" and learner.plans_abandoned == 1
    again = next_plan(learner, 1)
    assert again.warm and again.plan_id != warm.plan_id
    learner.check_invariants()


def test_a_warm_pass_that_does_not_reproduce_its_own_count_retires() -> None:
    learner = make(1, 2)
    learner.on_golden(True, 0.0)
    warm = next_plan(learner, 3)
    learner.on_shadow(warm, 1.0, False, 2.0)
    assert state_of(learner) == "retired"
    assert learner.reason is not None and "warm pass" in learner.reason and "2 threads" in learner.reason
    assert "range 4" in learner.reason
    learner.check_invariants()


# ------------------------------------------------------------------------------------------- pacing


def test_at_most_one_shadow_pass_per_k_served_steps() -> None:
    learner = make(1, 2, shadow_every=3)
    learner.on_golden(True, 0.0)
    planned_on: list[int] = []
    for step in range(1, 31):
        plan = learner.on_served(4, 0.0)
        if plan is not None:
            planned_on.append(step)
            learner.on_shadow(plan, 1.0, True, 0.0)
        learner.check_invariants()
    assert planned_on == [1, 4, 7, 10, 13, 16, 19, 22, 25, 28]


def test_an_outstanding_plan_holds_back_the_next_and_the_gap_counts_from_the_last_plan() -> None:
    learner = make(1, 2, shadow_every=3)
    learner.on_golden(True, 0.0)
    warm = next_plan(learner, 4)  # served step 1
    assert all(learner.on_served(4, 0.0) is None for _ in range(10))  # steps 2..11: still outstanding
    learner.on_shadow(warm, 1.0, True, 0.0)
    plan = learner.on_served(4, 0.0)  # step 12: 11 steps since the last plan
    assert plan is not None
    learner.abandon(plan)  # an abandoned plan keeps its slot
    assert learner.on_served(4, 0.0) is None  # step 13
    assert learner.on_served(4, 0.0) is None  # step 14
    assert learner.on_served(4, 0.0) is not None  # step 15
    learner.check_invariants()


def test_the_default_pace_is_one_shadow_per_ten_steps() -> None:
    learner = ThreadLearner(LearnerRules(1, 2))
    learner.on_golden(True, 0.0)
    plans = 0
    for _ in range(100):
        plan = learner.on_served(2, 0.0)
        if plan is not None:
            plans += 1
            learner.on_shadow(plan, 0.1, True, 0.0)
    assert plans == 10
    learner.check_invariants()


# ------------------------------------------------------------------------------------------- choice


def test_the_candidate_with_the_fewest_verified_samples_goes_next_ties_to_the_smallest() -> None:
    learner = started(1, 3, min_samples=3)
    counts = [shadow(learner, 4, one_faster).count for _ in range(7)]
    assert counts == [1, 2, 3, 1, 2, 3, 1]


def test_candidate_choice_is_per_range() -> None:
    learner = started(1, 2, min_samples=3)
    assert [shadow(learner, 4, one_faster).count for _ in range(3)] == [1, 2, 1]
    assert shadow(learner, 100, one_faster).count == 1  # range 128 starts from its own zero
    assert shadow(learner, 3, one_faster).count == 2  # range 4 again: 2 has fewer samples there


def test_a_given_candidate_list_is_used() -> None:
    learner = started(1, 4, candidates=(1, 2, 4), min_samples=1)
    plans = learn(learner, 16, more_faster)
    assert [p.count for p in plans] == [1, 2, 4]
    assert learner.fastest(16) == 4


def test_an_abandoned_shadow_is_no_sample() -> None:
    learner = started(1, 2)
    plan = next_plan(learner, 4)
    learner.abandon(plan)
    assert learner.view()["ranges"]["4"]["verified"] == {"1": 0, "2": 0}  # type: ignore[index]
    assert next_plan(learner, 4).count == plan.count
    learner.check_invariants()


# ------------------------------------------------------------------------------------------ medians


def test_medians_per_range_and_count_odd_and_even() -> None:
    learner = started(1, 2, min_samples=10)
    times = {1: iter([3.0, 1.0, 2.0, 10.0]), 2: iter([5.0, 7.0, 6.0])}
    for _ in range(7):
        shadow(learner, 8, lambda c: next(times[c]))
    assert learner.median(8, 1) == 2.5  # even: the mean of the middle two of 1, 2, 3, 10
    assert learner.median(8, 2) == 6.0  # odd: the middle one
    assert learner.median(5, 1) == 2.5  # 5 tokens: the same range as 8
    assert learner.median(4, 1) is None  # another range: nothing yet
    assert learner.median(8, 3) is None  # not a candidate


def test_the_median_is_over_a_window_of_the_latest_samples() -> None:
    learner = started(1, 2, window=3, min_samples=10)
    ones = iter([100.0, 1.0, 9.0, 2.0])
    twos = iter([1.0, 1.0, 1.0, 1.0])
    for _ in range(8):
        shadow(learner, 2, lambda c: next(ones) if c == 1 else next(twos))
    assert learner.median(2, 1) == 2.0  # 100 was evicted: the median of 1, 9, 2
    assert learner.view()["ranges"]["2"]["verified"] == {"1": 4, "2": 4}  # type: ignore[index]


# ------------------------------------------------------------------------------------------ fastest


def test_the_fastest_count_is_decided_only_once_every_candidate_has_m_samples() -> None:
    learner = started(1, 3, min_samples=4)
    for _ in range(11):  # 4 + 4 + 3 samples: count 3 is one short
        shadow(learner, 16, one_faster)
        assert learner.fastest(16) is None
    assert kinds(learner.take_events()) == []
    shadow(learner, 16, one_faster, now=7.0)
    assert learner.fastest(16) == 1
    [event] = learner.take_events()
    assert (event.kind, event.range, event.count, event.at) == ("learned", 16, 1, 7.0)
    assert event.medians == ((1, 1.0), (2, 2.0), (3, 3.0))
    assert learner.table() == {16: 1}
    view = learner.view()["ranges"]["16"]  # type: ignore[index]
    assert view["status"] == "learned" and view["medians"] == {"1": 1.0, "2": 2.0, "3": 3.0}


def test_equal_medians_go_to_the_smaller_count() -> None:
    learner = started(1, 2, min_samples=2)
    learn(learner, 4, lambda c: 1.0)
    assert learner.fastest(4) == 1


def test_a_learned_range_in_mode_1_takes_no_more_shadow_passes_but_others_do() -> None:
    learner = started(1, 2, min_samples=2)
    learn(learner, 4, more_faster)
    assert learner.fastest(4) == 2
    assert all(learner.on_served(4, 2.0) is None for _ in range(50))
    assert next_plan(learner, 40).range == 64
    learner.check_invariants()


# ------------------------------------------------------------------------------------------ drift


def test_one_mismatch_retires_learning_for_good() -> None:
    learner = started(2, 2, min_samples=2)
    learn(learner, 4, one_faster)
    assert learner.fastest(4) == 1
    learner.take_events()
    plan = next_plan(learner, 6)
    learner.on_shadow(plan, 0.5, False, 9.0)
    assert state_of(learner) == "retired"
    assert learner.reason is not None
    assert f"{plan.count} threads" in learner.reason and "range 8" in learner.reason
    assert "5..8 tokens" in learner.reason
    [event] = learner.take_events()
    assert (event.kind, event.range, event.count, event.at) == ("retired", 8, plan.count, 9.0)
    assert all(learner.on_served(t, 10.0) is None for t in range(1, 300))
    assert learner.serve_count(4) == learner.serve_count(6) == 2
    assert learner.table() == {4: 1}  # the table stays for the view
    assert learner.median(6, plan.count) is None  # the drifted pass is no sample
    learner.check_invariants()


def test_a_result_that_arrives_after_retiring_only_counts_its_cost() -> None:
    learner = started(1, 2)
    plan = next_plan(learner, 4)
    learner.retire("the shadow pass raised RuntimeError", 1.0)
    assert state_of(learner) == "retired" and learner.reason == "the shadow pass raised RuntimeError"
    learner.on_shadow(plan, 2.0, True, 2.0)
    assert learner.median(4, plan.count) is None
    assert learner.view()["shadow_passes"] == 2  # the warm pass and this one
    assert learner.shadow_seconds == 11.0  # 9 (warm) + 2
    learner.retire("again", 3.0)  # once retired, stays with its first reason
    assert learner.reason == "the shadow pass raised RuntimeError"
    learner.check_invariants()


def test_logits_are_compared_as_bytes() -> None:
    learner = started(1, 2)
    plan = next_plan(learner, 4)
    learner.on_shadow_output(plan, 1.0, b"\x00\x01\x02\x03", bytearray(b"\x00\x01\x02\x03"), 1.0)
    assert state_of(learner) == "learning" and learner.median(4, plan.count) == 1.0
    plan = next_plan(learner, 4)
    learner.on_shadow_output(plan, 1.0, b"\x00\x01\x02\x03", b"\x00\x01\x02", 1.0)  # a short one
    assert state_of(learner) == "retired"
    learner = started(1, 2)
    plan = next_plan(learner, 4)
    learner.on_shadow_output(plan, 1.0, b"\x00\x01\x02\x03", b"\x00\x01\x02\x07", 1.0)  # one bit off
    assert state_of(learner) == "retired"


# -------------------------------------------------------------------------------- serving (modes)


def test_mode_1_never_changes_the_served_count() -> None:
    learner = started(1, 2, min_samples=2, transition=1)
    learn(learner, 4, one_faster)
    assert learner.fastest(4) == 1
    for _ in range(100):
        learner.on_served(4, 2.0)
        assert learner.serve_count(4) == 2
    assert "serving_changed" not in kinds(learner.take_events())
    learner.check_invariants()


def test_mode_2_serves_the_learned_count_after_exactly_w_verified_passes() -> None:
    learner = started(2, 2, min_samples=2, transition=3)
    learn(learner, 4, one_faster)
    assert learner.fastest(4) == 1 and learner.view()["ranges"]["4"]["status"] == "verifying"  # type: ignore[index]
    learner.take_events()
    for n in range(3):
        assert learner.serve_count(4) == 2, f"switched after {n} window passes"
        plan = shadow(learner, 3, one_faster, now=5.0 + n)
        assert plan.count == 1  # the window shadows the learned count only
    assert learner.serve_count(4) == 1 and learner.serve_count(3) == 1
    assert learner.serve_count(8) == 2  # another range still at the configured count
    [event] = learner.take_events()
    assert (event.kind, event.range, event.count, event.previous, event.at) == (
        "serving_changed",
        4,
        1,
        2,
        7.0,
    )
    assert all(learner.on_served(4, 8.0) is None for _ in range(50))  # done: no more shadows
    view = learner.view()["ranges"]["4"]  # type: ignore[index]
    assert view["status"] == "serving" and view["serving"] == 1 and view["transition_passes"] == 3
    learner.check_invariants()


def test_mode_2_a_mismatch_inside_the_window_retires_and_keeps_the_configured_count() -> None:
    learner = started(2, 2, min_samples=2, transition=3)
    learn(learner, 4, one_faster)
    shadow(learner, 4, one_faster)
    plan = next_plan(learner, 4)
    learner.on_shadow(plan, 1.0, False, 3.0)
    assert state_of(learner) == "retired" and learner.serve_count(4) == 2
    assert kinds(learner.take_events()) == ["learned", "retired"]  # nothing ever served at 1
    assert learner.view()["ranges"]["4"]["status"] == "learned"  # type: ignore[index]
    learner.check_invariants()


def test_mode_2_retiring_falls_back_to_the_configured_count_at_once() -> None:
    learner = started(2, 2, min_samples=1, transition=1)
    learn(learner, 4, one_faster)
    shadow(learner, 4, one_faster)
    assert learner.serve_count(4) == 1
    learner.take_events()
    learner.retire("operator asked", 4.0)
    assert learner.serve_count(4) == 2
    events = learner.take_events()
    assert [(e.kind, e.range, e.count, e.previous) for e in events] == [
        ("serving_changed", 4, 2, 1),
        ("retired", None, None, None),
    ]
    learner.check_invariants()


def test_mode_2_a_range_whose_fastest_is_the_configured_count_needs_no_window() -> None:
    learner = started(2, 2, min_samples=2)
    learn(learner, 4, more_faster)
    assert learner.fastest(4) == 2
    assert learner.view()["ranges"]["4"]["status"] == "learned"  # type: ignore[index]
    assert all(learner.on_served(4, 2.0) is None for _ in range(50))
    assert learner.serve_count(4) == 2
    learner.check_invariants()


# ------------------------------------------------------------------------------ timings and view


def test_served_timings_are_reported_but_do_not_choose() -> None:
    learner = started(1, 2, min_samples=1)
    for s in (5.0, 1.0, 3.0):
        learner.on_served_timing(4, 2, s)
    learn(learner, 4, one_faster)
    assert learner.fastest(4) == 1  # shadow timings decide, though the served ones say 2 is fast
    view = learner.view()["ranges"]["4"]  # type: ignore[index]
    assert view["served_medians"] == {"2": 3.0}
    with pytest.raises(ValueError):
        learner.on_served_timing(4, 3, 1.0)  # not an allowed count
    learner.check_invariants()


def test_the_view_is_json_and_counts_the_shadow_cpu() -> None:
    learner = started(1, 3, min_samples=1)
    learn(learner, 4, one_faster)
    view = learner.view()
    assert json.loads(json.dumps(view)) == view
    assert view["configured"] == 3 and view["mode"] == 1 and view["state"] == "learning"
    assert view["candidates"] == [1, 2, 3]
    assert view["shadow_passes"] == 4  # the warm pass and one per count
    assert view["shadow_seconds"] == 9.0 + 1.0 + 2.0 + 3.0
    assert view["shadow_thread_seconds"] == 9.0 * 3 + 1.0 * 1 + 2.0 * 2 + 3.0 * 3
    rng = view["ranges"]["4"]  # type: ignore[index]
    assert rng["tokens"] == [3, 4] and rng["fastest"] == 1 and rng["verified"] == {"1": 1, "2": 1, "3": 1}
    event = learner.take_events()[0].as_dict()
    assert json.loads(json.dumps(event)) == event and event["medians"] == {"1": 1.0, "2": 2.0, "3": 3.0}


def test_would_plan_predicts_the_next_on_served_and_changes_nothing() -> None:
    learner = make(shadow_every=3)
    assert not learner.would_plan(4)  # waiting for the golden check
    learner.on_golden(True, 0.0)
    assert learner.would_plan(4) and learner.would_plan(4)  # asking twice changes nothing
    assert learner.served_steps == 0 and learner.pending is None
    warm = learner.on_served(4, 0.0)
    assert warm is not None and warm.warm
    assert not learner.would_plan(4)  # a plan is outstanding
    learner.on_shadow(warm, 1.0, True, 0.0)
    assert [learner.would_plan(4) for _ in range(3)] == [False] * 3
    assert learner.on_served(4, 0.0) is None and learner.on_served(4, 0.0) is None
    assert learner.would_plan(4) and learner.on_served(4, 0.0) is not None
    assert not make(mode=0).would_plan(1)


def test_misuse_is_refused() -> None:
    learner = started(1, 2)
    plan = next_plan(learner, 4)
    stranger = ShadowPlan(99, 4, 4, 1)
    with pytest.raises(ValueError, match="not the outstanding"):
        learner.on_shadow(stranger, 1.0, True, 0.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            learner.on_shadow(plan, bad, True, 0.0)
    learner.on_shadow(plan, 1.0, True, 0.0)
    with pytest.raises(ValueError):
        learner.on_shadow(plan, 1.0, True, 0.0)  # reported twice
    with pytest.raises(ValueError):
        learner.abandon(plan)
    with pytest.raises(ValueError):
        learner.on_served(0, 0.0)
    learner.check_invariants()


# --------------------------------------------------------------------------- random sequences


class LearnerMachine(RuleBasedStateMachine):
    """Random served steps (in bursts, each shadow result mostly reported at once, rarely a
    mismatch), a golden check at a random point with a random outcome, late results, abandons,
    served timings and a rare retirement; checked against the invariants and a few model facts."""

    @initialize(
        mode=st.sampled_from([0, 1, 2, 2]),
        configured=st.sampled_from([2, 3, 1]),
        k=st.integers(1, 2),
        m=st.integers(1, 3),
        w=st.integers(1, 3),
        window=st.integers(1, 4),
        golden_after=st.integers(0, 6),
        golden_passes=st.sampled_from([True, True, True, False]),
    )
    def setup(
        self,
        mode: int,
        configured: int,
        k: int,
        m: int,
        w: int,
        window: int,
        golden_after: int,
        golden_passes: bool,
    ) -> None:
        self.cfg = LearnerRules(mode, configured, shadow_every=k, min_samples=m, transition=w, window=window)
        self.learner = ThreadLearner(self.cfg)
        self.now = 0.0
        self.step = 0
        self.plan_steps: list[int] = []
        self.golden_after = golden_after  # served steps before the golden check reports
        self.golden_passes = golden_passes
        self.golden_at_plan_count: int | None = None  # plans issued when the gate opened
        self.golden_done = False
        self.ever_retired = False

    def _golden(self, passed: bool) -> None:
        self.golden_done = True
        before = self.learner.state
        self.learner.on_golden(passed, self.now)
        if before == "waiting_golden" and state_of(self.learner) == "warming":
            self.golden_at_plan_count = self.learner.plans_issued

    @rule(passed=st.booleans())
    def golden_again(self, passed: bool) -> None:
        """A second golden report changes nothing once the first came."""
        if self.golden_done:
            before = self.learner.view()
            self._golden(passed)
            assert self.learner.view() == before

    @rule(
        steps=st.lists(
            st.tuples(
                st.sampled_from([3, 1, 4, 40]),  # tokens: ranges 4, 1, 4, 64
                st.sampled_from([True, True, True, False]),  # report the shadow result at once
                st.floats(0, 5),  # its seconds
                st.sampled_from([True] * 40 + [False]),  # its logits matched
            ),
            min_size=1,
            max_size=12,
        ),
        dt=st.floats(0, 1),
    )
    def served(self, steps: list[tuple[int, bool, float, bool]], dt: float) -> None:
        for tokens, report, seconds, match in steps:
            if self.step == self.golden_after:
                self._golden(self.golden_passes)
            self._serve(tokens, dt)
            if report:
                self.result(seconds, match)

    def _serve(self, tokens: int, dt: float) -> None:
        self.now += dt
        self.step += 1
        state = self.learner.state
        predicted = self.learner.would_plan(tokens)
        plan = self.learner.on_served(tokens, self.now)
        assert predicted == (plan is not None), "would_plan did not predict on_served"
        if plan is None:
            return
        assert state in ("warming", "learning"), f"a plan in state {state}"
        assert not self.ever_retired
        assert self.golden_at_plan_count is not None, "a plan before the golden check passed"
        if self.learner.plans_issued == self.golden_at_plan_count + 1:
            assert plan.warm, "the first plan after the gate is not the warm pass"
        assert plan.warm == (state == "warming")
        assert plan.range == size_range(tokens) and plan.step_tokens == tokens
        if self.plan_steps:
            assert self.step - self.plan_steps[-1] >= self.cfg.shadow_every
        self.plan_steps.append(self.step)

    @rule(seconds=st.floats(0, 5), match=st.sampled_from([True] * 12 + [False]))
    def late_result(self, seconds: float, match: bool) -> None:
        self.result(seconds, match)

    def result(self, seconds: float, match: bool) -> None:
        plan = self.learner.pending
        if plan is None:
            return
        self.learner.on_shadow(plan, seconds, match, self.now)

    @rule()
    def abandon(self) -> None:
        plan = self.learner.pending
        if plan is not None:
            self.learner.abandon(plan)

    @rule(tokens=st.sampled_from([3, 1, 40]), seconds=st.floats(0, 5))
    def served_timing(self, tokens: int, seconds: float) -> None:
        self.learner.on_served_timing(tokens, self.learner.serve_count(tokens), seconds)

    @rule(roll=st.sampled_from([False] * 9 + [True]))
    def retire(self, roll: bool) -> None:
        if roll:  # rarely: retiring ends the interesting part of a run
            self.learner.retire("test", self.now)

    @invariant()
    def consistent(self) -> None:
        learner = self.learner
        learner.check_invariants()
        if learner.state == "retired":
            self.ever_retired = True
        for tokens in (1, 2, 3, 5, 9, 17, 33):
            count = learner.serve_count(tokens)
            if self.cfg.mode != 2 or self.ever_retired:
                assert count == self.cfg.configured
            if count != self.cfg.configured:
                rec = learner.view()["ranges"][str(size_range(tokens))]  # type: ignore[index]
                assert rec["status"] == "serving" and rec["transition_passes"] == self.cfg.transition
        for event in learner.take_events():
            assert event.kind in ("learned", "retired", "serving_changed")
        assert json.loads(json.dumps(learner.view())) == learner.view()


LearnerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestLearnerMachine = LearnerMachine.TestCase

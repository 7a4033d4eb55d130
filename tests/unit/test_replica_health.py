"""Replica health: backoff, outlier ejection and its withholding rules, serve-anyway, probes.

Time is a plain float passed in (the book never reads a clock), so no MockClock is needed. Ends with a
Hypothesis state machine that drives random outcomes, ticks and resizes against a small shadow model.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from trioserve.frontend.replica_health import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    HealthEvent,
    OutlierRules,
    ReplicaHealthBook,
    backoff_duration,
)


def up(n: int) -> list[bool]:
    return [True] * n


def kinds(events: list[HealthEvent]) -> list[tuple[str, int, str]]:
    return [(e.kind, e.replica, e.reason) for e in events]


def ejected(events: list[HealthEvent]) -> list[HealthEvent]:
    return [e for e in events if e.kind == "replica_ejected"]


def book_with_answer(n: int = 2, rules: OutlierRules | None = None, now: float = 1.0) -> ReplicaHealthBook:
    """A book where every replica answered at ``now``, so for a run of timeouts that begins then,
    another replica has answered since (the ejection rule holds)."""
    book = ReplicaHealthBook(rules or OutlierRules(), n)
    for r in range(n):
        book.success(r, now)
    return book


def time_out(
    book: ReplicaHealthBook, r: int, times: list[float], ups: list[bool] | None = None
) -> list[HealthEvent]:
    events: list[HealthEvent] = []
    for t in times:
        events += book.timeout(r, t, ups or up(book.n_replicas))
    book.check_invariants()
    return events


# -------------------------------------------------------------------------------------------- rules


def test_rules_defaults_and_the_resolved_max_ejection() -> None:
    rules = OutlierRules()
    assert (rules.consecutive_timeouts, rules.base_ejection_s, rules.max_ejection_percent) == (3, 30.0, 50)
    assert rules.max_ejection_s is None and rules.max_ejection == 300.0  # ten times the base
    assert OutlierRules(base_ejection_s=600).max_ejection == 3600.0  # at most an hour
    assert OutlierRules(base_ejection_s=7200).max_ejection == 7200.0  # never below the base
    assert OutlierRules(max_ejection_s=45).max_ejection == 45.0
    assert OutlierRules(consecutive_timeouts=0).enabled is False


@pytest.mark.parametrize(
    "kwargs",
    [
        {"consecutive_timeouts": -1},
        {"consecutive_timeouts": 1.5},
        {"consecutive_timeouts": True},
        {"base_ejection_s": 0},
        {"base_ejection_s": -1.0},
        {"base_ejection_s": float("inf")},
        {"base_ejection_s": float("nan")},
        {"max_ejection_s": 10.0},  # below the base (30)
        {"max_ejection_s": float("inf")},
        {"max_ejection_percent": 101},
        {"max_ejection_percent": -1},
        {"max_ejection_percent": 50.0},
    ],
)
def test_rules_refuse_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        OutlierRules(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "pct", "cap"),
    [(3, 50, 1), (4, 50, 2), (3, 10, 1), (10, 10, 1), (10, 25, 2), (1, 50, 1), (5, 0, 1), (5, 100, 5)],
)
def test_ejection_cap_rounds_down_but_one_may_always_be_out(n: int, pct: int, cap: int) -> None:
    assert OutlierRules(max_ejection_percent=pct).ejection_cap(n) == cap


def test_book_refuses_bad_sizes_and_up_lists() -> None:
    with pytest.raises(ValueError):
        ReplicaHealthBook(OutlierRules(), 0)
    book = ReplicaHealthBook(OutlierRules(), 2)
    with pytest.raises(ValueError, match="up has 1 entries"):
        book.dispatchable([True], 0.0)
    with pytest.raises(ValueError):
        book.timeout(0, 0.0, [True, True, True])
    with pytest.raises(ValueError):
        book.tick(0.0, [True])
    with pytest.raises(IndexError):
        book.cancelled(2)
    with pytest.raises(ValueError):
        book.resize(0)


# ------------------------------------------------------------------------------------------ dispatch


def test_a_healthy_pool_dispatches_every_up_replica_in_index_order() -> None:
    book = ReplicaHealthBook(OutlierRules(), 4)
    assert book.dispatchable(up(4), 0.0) == [0, 1, 2, 3]
    assert book.dispatchable([True, False, True, False], 0.0) == [0, 2]
    assert [book.state(r, 0.0) for r in range(4)] == ["ready"] * 4
    # Backing one off leaves the others' order as it was.
    book.failure(1, 0.0)
    assert book.dispatchable(up(4), 0.05) == [0, 2, 3]
    assert book.dispatchable(up(4), 0.1) == [0, 1, 2, 3]
    book.check_invariants()


# ------------------------------------------------------------------------------------------- backoff


def test_backoff_doubles_from_a_tenth_of_a_second_to_its_cap() -> None:
    assert [backoff_duration(k) for k in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 3.2, 3.2]
    book = ReplicaHealthBook(OutlierRules(), 2)
    now, durations = 0.0, []
    for _ in range(7):
        (event,) = book.failure(0, now)
        assert (event.kind, event.replica, event.reason) == ("replica_backoff", 0, "failure")
        assert event.duration is not None
        durations.append(event.duration)
        assert book.state(0, now) == "backoff"
        now += event.duration  # wait it out: the next failure is still consecutive
        assert book.state(0, now) == "ready"
    assert durations == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 3.2])
    assert (BACKOFF_FIRST, BACKOFF_MAX) == (0.1, 3.2)
    assert book.backoffs_total == 7
    book.check_invariants()


def test_a_success_ends_the_backoff_at_once_and_starts_the_doubling_over() -> None:
    book = ReplicaHealthBook(OutlierRules(), 2)
    book.failure(0, 0.0)
    book.failure(0, 0.1)  # 0.2 s, until 0.3
    assert book.state(0, 0.2) == "backoff"
    assert book.success(0, 0.2) == []
    assert book.state(0, 0.2) == "ready"
    (event,) = book.failure(0, 1.0)
    assert event.duration == pytest.approx(0.1)
    book.check_invariants()


def test_a_timeout_backs_off_too_and_a_new_backoff_never_shortens_one_running() -> None:
    book = ReplicaHealthBook(OutlierRules(), 2)
    for _ in range(3):
        book.failure(0, 0.0)  # 0.1, 0.2, 0.4: the longest wins
    assert book.view(0, 0.0)["backoff_until"] == pytest.approx(0.4)
    events = book.timeout(1, 5.0, up(2))
    assert kinds(events) == [("replica_backoff", 1, "timeout")]
    assert book.state(1, 5.05) == "backoff"
    assert book.tick(5.1) == []  # a backoff ends without an event
    assert book.state(1, 5.1) == "ready"
    book.check_invariants()


def test_a_failure_backs_off_but_neither_counts_nor_resets_the_timeouts() -> None:
    book = book_with_answer(2)
    time_out(book, 0, [1.0, 2.0])
    book.failure(0, 3.0)
    assert book.view(0, 3.0)["consecutive_timeouts"] == 2  # not reset ...
    book.failure(0, 3.5)
    assert book.view(0, 3.5)["consecutive_timeouts"] == 2  # ... and not counted
    assert len(ejected(book.timeout(0, 4.0, up(2)))) == 1  # the third timeout still ejects
    assert book.view(0, 4.0)["failures_total"] == 2
    book.check_invariants()


def test_a_cancellation_changes_nothing() -> None:
    book = book_with_answer(2)
    time_out(book, 0, [1.0, 2.0])
    before = book.view(0, 2.5)
    assert book.cancelled(0) == []
    assert book.view(0, 2.5) == before
    assert len(ejected(book.timeout(0, 3.0, up(2)))) == 1
    book.check_invariants()


# ------------------------------------------------------------------------------------------ ejection


def test_three_consecutive_timeouts_eject_for_the_base_and_probe_at_once() -> None:
    book = book_with_answer(2)
    assert ejected(time_out(book, 0, [1.0, 2.0])) == []
    assert book.take_probes() == [0]  # the backoffs asked for one
    events = book.timeout(0, 3.0, up(2))
    assert kinds(events) == [
        ("replica_backoff", 0, "timeout"),
        ("replica_ejected", 0, "consecutive_timeouts"),
    ]
    assert events[1].duration == 30.0
    assert book.state(0, 3.0) == "ejected"
    assert book.dispatchable(up(2), 10.0) == [1]
    assert book.take_probes() == [0]
    assert (book.ejections_total, book.view(0, 3.0)["ejected_until"]) == (1, 33.0)
    book.check_invariants()


def test_after_the_cool_down_the_next_timeout_ejects_for_twice_as_long_up_to_the_max() -> None:
    book = book_with_answer(2, OutlierRules(base_ejection_s=30, max_ejection_s=100))
    time_out(book, 0, [1.0, 2.0, 3.0])  # ejected until 33
    assert book.state(0, 32.9) == "ejected"
    assert kinds(book.tick(33.0)) == [("replica_readmitted", 0, "cool_down_ended")]
    assert book.state(0, 33.0) == "ready"
    assert book.readmissions_total == 1
    durations = []
    now = 40.0
    for _ in range(3):
        book.success(1, now - 1)  # the other replica keeps answering
        (event,) = ejected(book.timeout(0, now, up(2)))  # one timeout is enough now
        assert event.reason == "timed_out_after_readmission"
        durations.append(event.duration)
        assert event.duration is not None
        now += event.duration
        assert kinds(book.tick(now)) == [("replica_readmitted", 0, "cool_down_ended")]
        now += 5
    assert durations == [60.0, 100.0, 100.0]
    assert book.view(0, now)["ejections"] == 4
    book.check_invariants()


def test_the_default_max_is_ten_times_the_base() -> None:
    book = book_with_answer(2)
    durations = [e.duration for e in ejected(time_out(book, 0, [1.0, 2.0, 3.0]))]
    now = 3.0
    for _ in range(5):
        now += 400
        book.success(1, now - 1)
        durations += [e.duration for e in ejected(book.timeout(0, now, up(2)))]
    assert durations == [30.0, 60.0, 120.0, 240.0, 300.0, 300.0]
    book.check_invariants()


def test_a_success_readmits_at_once_and_starts_over() -> None:
    book = book_with_answer(2)
    time_out(book, 0, [1.0, 2.0, 3.0])
    book.take_probes()
    book.tick(33.0)
    time_out(book, 0, [34.0])  # ejected again, level 2, until 94
    assert book.take_probes() == [0]
    assert kinds(book.success(0, 40.0)) == [("replica_readmitted", 0, "answered")]
    book.success(1, 41.0)
    assert book.take_probes() == []  # the answer dropped the pending probe
    assert book.dispatchable(up(2), 40.0) == [0, 1]
    view = book.view(0, 40.0)
    assert (view["state"], view["consecutive_timeouts"], view["ejection_level"]) == ("ready", 0, 0)
    # Three timeouts again, and the base duration again.
    assert ejected(time_out(book, 0, [41.0, 42.0])) == []
    (event,) = ejected(book.timeout(0, 43.0, up(2)))
    assert (event.reason, event.duration) == ("consecutive_timeouts", 30.0)
    book.check_invariants()


def test_an_expired_cool_down_reads_ready_before_the_tick_that_reports_it() -> None:
    book = book_with_answer(2)
    time_out(book, 0, [1.0, 2.0, 3.0])
    assert book.state(0, 40.0) == "ready"
    assert book.dispatchable(up(2), 40.0) == [0, 1]
    assert book.readmissions_total == 0  # not reported yet
    events = book.failure(1, 40.0)  # any mutator ends what is due first
    assert kinds(events) == [("replica_readmitted", 0, "cool_down_ended"), ("replica_backoff", 1, "failure")]
    assert book.readmissions_total == 1
    book.check_invariants()


def test_a_timeout_while_ejected_counts_but_does_not_extend_the_ejection() -> None:
    book = book_with_answer(2)
    time_out(book, 0, [1.0, 2.0, 3.0])
    events = book.timeout(0, 10.0, up(2))  # a request sent before the ejection, or the probe
    assert kinds(events) == [("replica_backoff", 0, "timeout")]
    view = book.view(0, 10.0)
    assert (view["consecutive_timeouts"], view["timeouts_total"], view["ejected_until"]) == (4, 4, 33.0)
    assert book.ejections_total == 1
    book.check_invariants()


def test_ejection_off_still_backs_off() -> None:
    book = book_with_answer(2, OutlierRules(consecutive_timeouts=0))
    events = time_out(book, 0, [float(t) for t in range(1, 11)])
    assert {e.kind for e in events} == {"replica_backoff"}
    assert book.state(0, 10.0) == "backoff"
    assert book.view(0, 10.0)["consecutive_timeouts"] == 10
    assert (book.ejections_total, book.withheld_total) == (0, 0)
    book.check_invariants()


def test_consecutive_timeouts_of_one_ejects_on_the_first() -> None:
    book = book_with_answer(2, OutlierRules(consecutive_timeouts=1))
    assert len(ejected(book.timeout(0, 1.0, up(2)))) == 1
    book.check_invariants()


# ------------------------------------------------------------------------------------------ withheld


def test_a_single_replica_is_never_ejected() -> None:
    book = book_with_answer(1)
    events = time_out(book, 0, [1.0, 2.0, 3.0, 4.0, 5.0])
    withheld = [e for e in events if e.kind == "replica_ejection_withheld"]
    assert [(e.replica, e.reason) for e in withheld] == [(0, "single_replica")] * 3
    assert ejected(events) == []
    assert book.state(0, 5.0) == "backoff"  # still backed off
    assert book.dispatchable(up(1), 5.0) == [0]  # and still served (serve anyway)
    assert (book.withheld_total, book.view(0, 5.0)["withheld"]) == (3, 3)
    book.check_invariants()


def test_withheld_while_no_other_replica_answered_since_the_timeouts_began() -> None:
    book = book_with_answer(2, now=0.0)  # both answered at 0, then replica 0 times out from 1.0 on
    events = time_out(book, 0, [1.0, 2.0, 3.0])
    assert kinds(events)[-1] == ("replica_ejection_withheld", 0, "no_other_replica_answered")
    assert book.state(0, 3.0) == "backoff"
    # Replica 1's answer (after replica 0's run began at 1.0) lets the next timeout eject.
    book.success(1, 3.5)
    (event,) = ejected(book.timeout(0, 4.0, up(2)))
    assert event.duration == 30.0
    book.check_invariants()


def test_an_answer_before_the_run_began_does_not_count() -> None:
    book = ReplicaHealthBook(OutlierRules(), 2)
    book.success(1, 0.9)
    events = time_out(book, 0, [1.0, 2.0, 3.0])
    assert kinds(events)[-1] == ("replica_ejection_withheld", 0, "no_other_replica_answered")
    # An answer at the very instant the run began counts ("since" includes it).
    book2 = ReplicaHealthBook(OutlierRules(), 2)
    book2.success(1, 1.0)
    assert len(ejected(time_out(book2, 0, [1.0, 2.0, 3.0]))) == 1


def test_an_answer_from_a_replica_that_is_down_or_ejected_does_not_count() -> None:
    book = ReplicaHealthBook(OutlierRules(), 2)
    book.timeout(0, 1.0, up(2))
    book.success(1, 1.5)  # answered since replica 0's run began, but then went down
    events = time_out(book, 0, [2.0, 3.0], ups=[True, False])
    assert kinds(events)[-1] == ("replica_ejection_withheld", 0, "no_other_replica_answered")
    # Replica 1 answered since replica 0's run began, and was ejected since: it is not serving.
    book = ReplicaHealthBook(OutlierRules(consecutive_timeouts=1, max_ejection_percent=100), 3)
    assert kinds(book.timeout(0, 1.0, up(3)))[-1][2] == "no_other_replica_answered"
    book.success(1, 2.0)
    book.success(2, 3.5)
    book.success(2, 4.0)
    assert len(ejected(book.timeout(1, 4.0, up(3)))) == 1  # replica 2 answered at 4.0, when 1's run began
    events = book.timeout(0, 5.0, [True, True, False])  # ... and is down now
    assert kinds(events)[-1] == ("replica_ejection_withheld", 0, "no_other_replica_answered")
    book.check_invariants()


def test_at_most_the_percentage_is_out_at_once_n3() -> None:
    book = book_with_answer(3)  # cap max(1, 3 * 50 // 100) = 1
    assert len(ejected(time_out(book, 0, [1.0, 2.0, 3.0]))) == 1
    book.success(2, 4.0)
    events = time_out(book, 1, [4.0, 5.0, 6.0])
    assert kinds(events)[-1] == ("replica_ejection_withheld", 1, "max_ejection_percent")
    # Once replica 0's cool-down ends, replica 1's next timeout may eject it (the count stayed).
    events = book.timeout(1, 34.0, up(3))
    assert kinds(events)[0] == ("replica_readmitted", 0, "cool_down_ended")  # ended first, then counted
    assert [e.replica for e in ejected(events)] == [1]
    book.check_invariants()


def test_at_most_the_percentage_is_out_at_once_n4() -> None:
    book = book_with_answer(4)  # cap 2
    for t in (1.0, 2.0, 3.0):
        time_out(book, 0, [t])
        time_out(book, 1, [t])
    assert [book.state(r, 3.0) for r in range(4)] == ["ejected", "ejected", "ready", "ready"]
    book.success(3, 4.0)
    events = time_out(book, 2, [4.0, 5.0, 6.0])
    assert kinds(events)[-1] == ("replica_ejection_withheld", 2, "max_ejection_percent")
    assert book.dispatchable(up(4), 6.0) == [3]
    book.check_invariants()


def test_a_small_percentage_still_lets_one_replica_out() -> None:
    book = book_with_answer(3, OutlierRules(max_ejection_percent=10))
    assert len(ejected(time_out(book, 0, [1.0, 2.0, 3.0]))) == 1
    book.success(2, 4.0)
    events = time_out(book, 1, [4.0, 5.0, 6.0])
    assert kinds(events)[-1] == ("replica_ejection_withheld", 1, "max_ejection_percent")
    book.check_invariants()


def test_withholding_rules_are_checked_single_replica_first_then_answered_then_percent() -> None:
    # Two replicas, both silent and one already out: "no_other_replica_answered" comes before the cap.
    book = ReplicaHealthBook(OutlierRules(consecutive_timeouts=1), 2)
    assert kinds(ReplicaHealthBook(OutlierRules(consecutive_timeouts=1), 1).timeout(0, 0.0, up(1)))[-1][
        2
    ] == ("single_replica")
    book.success(1, 1.0)
    assert len(ejected(book.timeout(0, 1.0, up(2)))) == 1
    events = book.timeout(1, 2.0, up(2))
    assert kinds(events)[-1] == ("replica_ejection_withheld", 1, "no_other_replica_answered")


# -------------------------------------------------------------------------------------- serve anyway


def test_serve_anyway_falls_back_to_backed_off_then_to_ejected_replicas() -> None:
    book = book_with_answer(3, OutlierRules(max_ejection_percent=100))
    time_out(book, 0, [1.0, 2.0, 3.0])  # 0 ejected until 33
    book.success(2, 4.0)
    time_out(book, 1, [4.0, 5.0, 6.0])  # 1 ejected until 34
    book.failure(2, 6.0)  # 2 backed off until 6.1
    ups = up(3)
    assert [book.state(r, 6.0) for r in range(3)] == ["ejected", "ejected", "backoff"]
    assert book.dispatchable(ups, 6.0) == [2]  # a backed-off replica before any ejected one
    assert book.dispatchable([True, True, False], 6.0) == [0, 1]  # then the ejected ones serve again
    assert book.dispatchable([False, True, False], 6.0) == [1]
    assert book.dispatchable([False, False, False], 6.0) == []  # only when nothing is up
    assert book.dispatchable(ups, 6.1) == [2]  # a ready replica: the ejected ones stay out
    book.check_invariants()


def test_serve_anyway_never_mixes_tiers() -> None:
    book = ReplicaHealthBook(OutlierRules(), 3)
    book.failure(0, 0.0)
    book.failure(1, 0.0)
    assert book.dispatchable(up(3), 0.0) == [2]
    assert book.dispatchable([True, True, False], 0.0) == [0, 1]


# -------------------------------------------------------------------------------------------- probes


def test_probes_are_asked_for_on_entering_a_backoff_or_an_ejection() -> None:
    book = book_with_answer(2)
    assert book.take_probes() == []
    book.failure(0, 1.0)
    book.failure(0, 1.05)  # already backed off: no second probe
    book.failure(1, 1.05)
    assert book.take_probes() == [0, 1]
    assert book.take_probes() == []  # taken means forgotten
    book.failure(0, 1.05)
    assert book.take_probes() == []  # still in the same backoff
    book.success(1, 2.0)
    time_out(book, 0, [2.0, 3.0])  # backoffs from none running (the last ended at 1.45)
    assert book.take_probes() == [0]
    book.timeout(0, 3.05, up(2))  # during the backoff, but an ejection asks again
    assert book.take_probes() == [0]
    # The probe's outcome comes back as an exchange's: a success readmits.
    assert kinds(book.success(0, 4.0)) == [("replica_readmitted", 0, "answered")]
    book.check_invariants()


# --------------------------------------------------------------------------------- queries, resize


def test_next_change_is_the_earliest_end_and_never_before_now() -> None:
    book = ReplicaHealthBook(OutlierRules(), 2)
    assert book.next_change(0.0) is None
    book.failure(1, 0.0)
    assert book.next_change(0.0) == pytest.approx(0.1)
    book.success(1, 1.0)
    time_out(book, 0, [1.0, 2.0, 3.0])  # ejected until 33, backed off until 3.4
    book.tick(3.0)
    assert book.next_change(3.0) == pytest.approx(3.4)
    assert book.next_change(10.0) == 10.0  # the backoff is due, untick'd: tick now
    book.tick(10.0)
    assert book.next_change(10.0) == 33.0
    book.tick(33.0)
    assert book.next_change(33.0) is None


def test_view_reports_every_field_as_json() -> None:
    book = book_with_answer(2)
    time_out(book, 0, [1.0, 2.0, 3.0])
    view = book.view(0, 3.0)
    assert view == {
        "state": "ejected",
        "consecutive_timeouts": 3,
        "timeouts_total": 3,
        "failures_total": 0,
        "ejections": 1,
        "readmissions": 0,
        "withheld": 0,
        "ejection_level": 1,
        "backoff_until": pytest.approx(3.4),
        "ejected_until": 33.0,
        "last_success": 1.0,
    }
    json.dumps(view)
    later = book.view(0, 100.0)
    assert (later["state"], later["backoff_until"], later["ejected_until"]) == ("ready", None, None)
    fresh = ReplicaHealthBook(OutlierRules(), 1).view(0, 0.0)
    assert fresh["last_success"] is None and fresh["state"] == "ready"
    event = HealthEvent("replica_ejected", 0, "consecutive_timeouts", 30.0)
    assert json.loads(json.dumps(event.as_dict())) == {
        "kind": "replica_ejected",
        "replica": 0,
        "reason": "consecutive_timeouts",
        "duration": 30.0,
    }


def test_resize_grows_with_fresh_replicas_and_shrinks_from_the_top() -> None:
    book = book_with_answer(3, OutlierRules(max_ejection_percent=100))
    time_out(book, 2, [1.0, 2.0, 3.0])
    assert book.take_probes() == [2]
    time_out(book, 2, [10.0])  # ask for a probe again
    book.failure(1, 10.0)
    book.resize(2)
    assert book.n_replicas == 2
    assert book.take_probes() == [1]  # replica 2's probe went with it
    assert book.ejections_total == 1  # counters stay
    book.resize(4)
    assert book.dispatchable(up(4), 10.05) == [0, 2, 3]
    assert book.view(3, 10.05)["timeouts_total"] == 0 and book.view(2, 10.05)["ejections"] == 0
    book.check_invariants()


def test_a_shrink_keeps_ejected_replicas_out_and_the_lower_cap_holds_new_ejections() -> None:
    book = book_with_answer(4)  # cap 2
    for t in (1.0, 2.0, 3.0):
        time_out(book, 0, [t])
        time_out(book, 1, [t])
    book.resize(3)  # cap 1, two already out
    assert [book.state(r, 4.0) for r in range(3)] == ["ejected", "ejected", "ready"]
    assert kinds(book.success(1, 4.0)) == [("replica_readmitted", 1, "answered")]  # one out: the cap
    events = time_out(book, 2, [4.0, 5.0, 6.0])
    assert kinds(events)[-1] == ("replica_ejection_withheld", 2, "max_ejection_percent")
    book.check_invariants()


# ----------------------------------------------------------------------------------- state machine


class HealthMachine(RuleBasedStateMachine):
    """Random outcomes, ticks, up/down flips and resizes; a shadow count and ejection history."""

    def __init__(self) -> None:
        super().__init__()
        self.book = ReplicaHealthBook(OutlierRules(), 1)
        self.now = 0.0
        self.up: list[bool] = [True]
        self.count: list[int] = [0]  # shadow consecutive timeouts
        self.level: list[int] = [0]  # shadow ejections since the last success

    @initialize(
        n=st.integers(1, 5),
        threshold=st.integers(0, 3),
        base=st.sampled_from([0.5, 1.0, 3.0]),
        factor=st.none() | st.sampled_from([1.0, 2.5, 4.0]),
        pct=st.sampled_from([0, 10, 34, 50, 100]),
    )
    def init(self, n: int, threshold: int, base: float, factor: float | None, pct: int) -> None:
        rules = OutlierRules(threshold, base, None if factor is None else base * factor, pct)
        self.book = ReplicaHealthBook(rules, n)
        self.up = [True] * n
        self.count = [0] * n
        self.level = [0] * n

    def _r(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, self.book.n_replicas - 1), label="replica")

    def _advance(self, dt: float) -> None:
        self.now += dt

    def _check_events(self, events: list[HealthEvent], culprit: int | None = None) -> None:
        book, rules = self.book, self.book.rules
        for e in events:
            assert 0 <= e.replica < book.n_replicas
            if e.kind == "replica_ejected":
                r = e.replica
                assert r == culprit and rules.enabled and book.n_replicas > 1
                assert e.duration == rules.ejection_duration(self.level[r])
                self.level[r] += 1
                out = sum(1 for o in range(book.n_replicas) if book.state(o, self.now) == "ejected")
                assert out <= rules.ejection_cap(book.n_replicas)
                # Some other up replica is serving (the one that answered).
                assert any(
                    o != r and self.up[o] and book.state(o, self.now) != "ejected"
                    for o in range(book.n_replicas)
                )
            elif e.kind == "replica_ejection_withheld":
                assert e.replica == culprit and rules.enabled
                assert e.reason in {"single_replica", "no_other_replica_answered", "max_ejection_percent"}
            elif e.kind == "replica_backoff":
                assert e.duration is not None and BACKOFF_FIRST <= e.duration <= BACKOFF_MAX
            else:
                assert e.reason in {"cool_down_ended", "answered"}

    @rule(data=st.data(), dt=st.floats(0, 2))
    def success(self, data: st.DataObject, dt: float) -> None:
        r = self._r(data)
        self._advance(dt)
        self._check_events(self.book.success(r, self.now))
        self.count[r] = 0
        self.level[r] = 0
        assert self.book.state(r, self.now) == "ready"

    @rule(data=st.data(), dt=st.floats(0, 2))
    def timeout(self, data: st.DataObject, dt: float) -> None:
        r = self._r(data)
        self._advance(dt)
        self._check_events(self.book.timeout(r, self.now, self.up), culprit=r)
        self.count[r] += 1
        assert self.book.state(r, self.now) in {"backoff", "ejected"}

    @rule(data=st.data(), dt=st.floats(0, 2))
    def failure(self, data: st.DataObject, dt: float) -> None:
        r = self._r(data)
        self._advance(dt)
        self._check_events(self.book.failure(r, self.now))

    @rule(data=st.data())
    def cancelled(self, data: st.DataObject) -> None:
        assert self.book.cancelled(self._r(data)) == []

    @rule(dt=st.floats(0, 10))
    def tick(self, dt: float) -> None:
        self._advance(dt)
        events = self.book.tick(self.now, self.up)
        assert {e.reason for e in events} <= {"cool_down_ended"}
        self._check_events(events)

    @rule(data=st.data())
    def flip_up(self, data: st.DataObject) -> None:
        r = self._r(data)
        self.up[r] = not self.up[r]

    @rule(n=st.integers(1, 5))
    def resize(self, n: int) -> None:
        self.book.resize(n)
        self.up = (self.up + [True] * n)[:n]
        self.count = (self.count + [0] * n)[:n]
        self.level = (self.level + [0] * n)[:n]

    @rule()
    def take_probes(self) -> None:
        probes = self.book.take_probes()
        assert probes == sorted(set(probes)) and all(0 <= r < self.book.n_replicas for r in probes)
        assert self.book.take_probes() == []

    @invariant()
    def consistent(self) -> None:
        book = self.book
        book.check_invariants()
        n = book.n_replicas
        assert len(self.up) == n
        for r in range(n):
            view = book.view(r, self.now)
            assert view["consecutive_timeouts"] == self.count[r]
            assert view["ejection_level"] == self.level[r]
        chosen = book.dispatchable(self.up, self.now)
        assert chosen == sorted(chosen) and all(self.up[r] for r in chosen)
        assert bool(chosen) == any(self.up), "traffic stops only when nothing is up"
        states = {book.state(r, self.now) for r in chosen}
        assert len(states) <= 1, "dispatchable mixed tiers"
        if any(self.up[r] and book.state(r, self.now) == "ready" for r in range(n)):
            assert states == {"ready"}
        change = book.next_change(self.now)
        assert change is None or change >= self.now


HealthMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestHealthMachine = HealthMachine.TestCase

"""The replica pool: deadlines without output, outcomes for the health book, probes, dispatch.

Time is a plain float passed in (the pool never reads a clock). Hand-worked cases first, then the
hung-replica scenario driven the way the engine client's ``_watch_exchanges`` shell drives the pool,
then a Hypothesis state machine that checks ``overdue`` against a shadow of every exchange's deadline.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from trioserve.frontend.replica_health import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    HealthEvent,
    OutlierRules,
    backoff_duration,
)
from trioserve.frontend.replica_pool import PROBE_PREFIX, PROBE_TIMEOUT_S, Exchange, ReplicaPool

UP2 = [True, True]


def pool2(default_timeout_s: float | None = 0.5, client_index: int = 0) -> ReplicaPool:
    return ReplicaPool(
        OutlierRules(consecutive_timeouts=3, base_ejection_s=30.0), 2, default_timeout_s, client_index
    )


def kinds(events: list[HealthEvent]) -> list[tuple[str, int, str]]:
    return [(e.kind, e.replica, e.reason) for e in events]


def of_kind(events: list[HealthEvent], kind: str) -> list[HealthEvent]:
    return [e for e in events if e.kind == kind]


def time_out(pool: ReplicaPool, rid: str, replica: int, sent_at: float) -> float:
    """Send ``rid`` to ``replica`` at ``sent_at`` and let it time out; returns when it did."""
    timeout = pool.deadline(None)
    assert timeout is not None
    pool.sent(rid, replica, timeout, sent_at)
    at = sent_at + timeout
    assert pool.overdue(at, UP2) == [(rid, replica, False)]
    pool.book.check_invariants()
    return at


def answer(pool: ReplicaPool, rid: str, replica: int, sent_at: float, at: float) -> None:
    """Send ``rid`` to ``replica`` at ``sent_at``; it finishes at ``at``."""
    pool.sent(rid, replica, pool.deadline(None), sent_at)
    pool.output(rid, True, at)
    assert rid not in pool.exchanges


# ----------------------------------------------------------------------------------------- deadline


def test_deadline_is_the_smaller_of_the_request_and_the_deployment() -> None:
    pool = pool2(default_timeout_s=0.5)
    assert pool.deadline(None) == 0.5
    assert pool.deadline(0.0) == 0.5  # 0: the request sets none
    assert pool.deadline(0.2) == 0.2
    assert pool.deadline(2.0) == 0.5
    bare = pool2(default_timeout_s=None)
    assert bare.deadline(None) is None
    assert bare.deadline(0.0) is None
    assert bare.deadline(0.3) == 0.3
    assert pool2(default_timeout_s=0.0).deadline(None) is None  # a 0 deployment timeout: none


# ----------------------------------------------------------------------------------------- tracking


def test_one_replica_without_a_deadline_tracks_nothing() -> None:
    pool = ReplicaPool(OutlierRules(), 1)
    assert not pool.track_all
    pool.sent("a", 0, None, 0.0)
    assert pool.exchanges == {}
    pool.output("a", False, 0.1)
    pool.output("a", True, 0.2)  # unknown: ignored
    assert pool.exchanges == {} and pool.events == []
    assert pool.overdue(1e9, [True]) == []
    assert pool.next_wake(0.0) is None


def test_one_replica_with_a_deadline_tracks_it() -> None:
    pool = ReplicaPool(OutlierRules(), 1, 0.5)
    pool.sent("a", 0, pool.deadline(None), 1.0)
    assert pool.exchanges == {"a": Exchange(0, 0.5, 1.5)}
    assert pool.next_wake(1.0) == 1.5
    assert pool.overdue(1.5, [True]) == [("a", 0, False)]
    # One replica is never ejected, and still dispatched to in its backoff.
    assert pool.dispatchable([0], 1.5) == [0]
    assert pool.book.state(0, 1.5) == "backoff"


def test_several_replicas_track_every_exchange_and_no_deadline_never_expires() -> None:
    pool = pool2(default_timeout_s=None)
    assert pool.track_all
    pool.sent("a", 1, None, 0.0)
    assert pool.exchanges == {"a": Exchange(1, math.inf, math.inf)}
    assert pool.overdue(1e12, UP2) == []
    assert pool.next_wake(0.0) is None  # nothing with a deadline: no wake
    pool.output("a", False, 5.0)
    assert pool.exchanges["a"].due == math.inf
    pool.output("a", True, 6.0)  # still a success: it counts for "another replica answered"
    assert pool.exchanges == {}
    assert pool.book.view(1, 6.0)["last_success"] == 6.0


# ------------------------------------------------------------------------- "no output within timeout"


def test_a_steadily_streaming_exchange_never_expires() -> None:
    pool = pool2()
    pool.sent("a", 0, 0.5, 0.0)
    for k in range(1, 26):  # an output every 0.4 s for 10 s
        t = k * 0.4
        assert pool.overdue(t - 0.2, UP2) == []
        assert pool.overdue(t, UP2) == []  # the deadline from the last output is t - 0.4 + 0.5
        pool.output("a", False, t)
        assert pool.exchanges["a"].due == t + 0.5
    assert pool.timeouts_total == [0, 0]
    pool.output("a", True, 10.2)
    assert pool.exchanges == {}
    assert pool.overdue(100.0, UP2) == []


def test_a_silent_exchange_expires_once_exactly_at_its_deadline() -> None:
    pool = pool2()
    pool.sent("a", 0, 0.5, 1.0)
    assert pool.overdue(1.5 - 1e-6, UP2) == []
    assert pool.overdue(1.5, UP2) == [("a", 0, False)]
    assert pool.overdue(1.5, UP2) == []
    assert pool.overdue(10.0, UP2) == []
    assert pool.timeouts_total == [1, 0]


def test_an_exchange_that_goes_silent_expires_timeout_after_its_last_output() -> None:
    pool = pool2()
    pool.sent("a", 0, 0.5, 0.0)
    pool.output("a", False, 0.3)
    pool.output("a", False, 0.7)
    # The heap still holds the send's deadline (0.5): a wake then only moves it.
    assert pool.next_wake(0.7) == 0.5
    assert pool.overdue(0.75, UP2) == []
    assert pool.next_wake(0.75) == 0.7 + 0.5
    assert pool.overdue(1.2 - 1e-6, UP2) == []
    assert pool.overdue(1.2, UP2) == [("a", 0, False)]


# ------------------------------------------------------------------------------------------ outcomes


def test_overdue_drops_the_exchange_counts_the_timeout_and_backs_off() -> None:
    pool = pool2()
    pool.sent("a", 1, 0.5, 0.0)
    pool.sent("b", 0, 0.5, 0.2)
    assert pool.overdue(0.5, UP2) == [("a", 1, False)]
    assert set(pool.exchanges) == {"b"}
    assert pool.timeouts_total == [0, 1]
    assert pool.book.state(1, 0.5) == "backoff"
    assert kinds(pool.events) == [("replica_backoff", 1, "timeout")]
    assert pool.events[0].duration == BACKOFF_FIRST
    assert pool.dispatchable([0, 1], 0.5) == [0]
    assert pool.dispatchable([0, 1], 0.5 + BACKOFF_FIRST - 1e-9) == [0]
    assert pool.dispatchable([0, 1], 0.5 + BACKOFF_FIRST) == [0, 1]
    pool.book.check_invariants()


def test_a_finish_is_a_success_that_ends_the_backoff_and_the_count() -> None:
    pool = pool2()
    t = time_out(pool, "a", 1, 0.0)
    pool.sent("b", 1, 0.5, 0.1)
    pool.output("b", False, 0.52)  # an output without a finish reason is no outcome
    assert pool.book.view(1, 0.52)["consecutive_timeouts"] == 1
    pool.output("b", True, 0.55)
    view = pool.book.view(1, 0.55)
    assert view["consecutive_timeouts"] == 0
    assert view["state"] == "ready" and view["backoff_until"] is None
    assert pool.dispatchable([0, 1], 0.55) == [0, 1]
    # The doubling starts over: the next timeout backs off for BACKOFF_FIRST again.
    pool.events.clear()
    time_out(pool, "c", 1, t + 1.0)
    assert [e.duration for e in of_kind(pool.events, "replica_backoff")] == [BACKOFF_FIRST]


def test_forget_neither_counts_nor_resets_and_the_third_timeout_ejects() -> None:
    pool = pool2()
    t1 = time_out(pool, "a", 0, 0.0)  # the run of timeouts on replica 0 begins at 0.5
    answer(pool, "b", 1, 0.5, t1 + 0.05)  # replica 1 answers after it began
    t2 = time_out(pool, "c", 0, 1.0)
    assert pool.book.view(0, t2)["consecutive_timeouts"] == 2
    pool.sent("d", 0, 0.5, 1.6)
    before = pool.book.view(0, 1.8)
    pool.forget("d")  # aborted or cancelled
    assert "d" not in pool.exchanges
    assert pool.book.view(0, 1.8) == before
    assert pool.overdue(2.1, UP2) == []  # its deadline (2.1) passes without a timeout
    assert pool.timeouts_total == [2, 0]
    pool.events.clear()
    t3 = time_out(pool, "e", 0, 2.2)
    assert pool.timeouts_total == [3, 0]
    ejections = of_kind(pool.events, "replica_ejected")
    assert [(e.replica, e.reason, e.duration) for e in ejections] == [(0, "consecutive_timeouts", 30.0)]
    assert pool.book.state(0, t3) == "ejected"
    assert pool.dispatchable([0, 1], t3 + 5.0) == [1]


def test_ejection_is_withheld_when_no_other_replica_answered() -> None:
    pool = pool2()
    answer(pool, "early", 1, 0.0, 0.1)  # before the first timed-out request was sent: does not count
    for k in range(3):
        time_out(pool, f"t{k}", 0, 1.0 + k)
    assert of_kind(pool.events, "replica_ejected") == []
    withheld = of_kind(pool.events, "replica_ejection_withheld")
    assert [(e.replica, e.reason) for e in withheld] == [(0, "no_other_replica_answered")]
    view = pool.book.view(0, 3.5)
    assert view["consecutive_timeouts"] == 3 and view["state"] == "backoff"


def test_a_run_of_timeouts_begins_when_its_first_request_began_waiting() -> None:
    """Three requests that hang together expire at one instant; the other replica's answer while
    they waited is what the rule asks for, so the replica is ejected, not withheld."""
    pool = pool2()
    for k in range(3):
        pool.sent(f"t{k}", 0, 0.5, 0.0)
    answer(pool, "other", 1, 0.1, 0.2)
    assert [rid for rid, _, _ in pool.overdue(0.5, UP2)] == ["t0", "t1", "t2"]
    assert kinds(of_kind(pool.events, "replica_ejected")) == [("replica_ejected", 0, "consecutive_timeouts")]
    assert of_kind(pool.events, "replica_ejection_withheld") == []
    # The deadline restarts with each output: a request that streamed until 1.0 began waiting then.
    pool2_ = pool2()
    answer(pool2_, "other", 1, 0.0, 0.6)  # before the first timed-out request's last output
    pool2_.sent("s", 0, 0.5, 0.0)
    pool2_.output("s", False, 1.0)
    pool2_.sent("u", 0, 0.5, 1.0)
    pool2_.sent("v", 0, 0.5, 1.0)
    assert len(pool2_.overdue(1.5, UP2)) == 3
    assert [e.reason for e in of_kind(pool2_.events, "replica_ejection_withheld")] == [
        "no_other_replica_answered"
    ]


def test_engine_failed_drops_its_exchanges_and_is_one_failure() -> None:
    pool = pool2()
    time_out(pool, "t", 1, 0.0)  # count 1 on replica 1
    for rid in ("a", "b", "c"):
        pool.sent(rid, 1, 0.5, 1.0)
    pool.sent("d", 0, 0.5, 1.0)
    pool.events.clear()
    pool.engine_failed(1, 1.2)
    assert set(pool.exchanges) == {"d"}
    assert kinds(pool.events) == [("replica_backoff", 1, "failure")]
    view = pool.book.view(1, 1.2)
    assert view["failures_total"] == 1
    assert view["consecutive_timeouts"] == 1  # a failure neither counts nor resets
    assert view["state"] == "backoff"
    assert pool.overdue(1.5, UP2) == [("d", 0, False)]  # a, b, c do not come back as timeouts
    assert pool.timeouts_total == [1, 1]
    pool.events.clear()
    pool.engine_failed(7, 2.0)  # an engine beyond the pool: nothing to judge
    assert pool.events == []


# -------------------------------------------------------------------------------------------- probes


def test_a_timeout_wants_one_probe_tracked_as_a_probe_exchange() -> None:
    pool = pool2(client_index=3)
    assert pool.take_probes(0.0) == []
    time_out(pool, "a", 1, 0.0)
    probes = pool.take_probes(0.5)
    assert len(probes) == 1
    rid, replica = probes[0]
    assert rid.startswith(f"{PROBE_PREFIX}3-") and replica == 1
    assert pool.take_probes(0.5) == []
    assert pool.exchanges[rid] == Exchange(1, 0.5, 1.0, probe=True)  # min(PROBE_TIMEOUT_S, 0.5)
    assert pool.probes_total == 1
    assert pool.in_flight(1) == 0  # probes are not load


@pytest.mark.parametrize(
    ("default", "expected"), [(None, PROBE_TIMEOUT_S), (0.5, 0.5), (10.0, PROBE_TIMEOUT_S)]
)
def test_a_probe_deadline_is_the_smaller_of_its_own_and_the_deployment(
    default: float | None, expected: float
) -> None:
    pool = pool2(default_timeout_s=default)
    pool.sent("a", 1, 0.5, 0.0)
    pool.overdue(0.5, UP2)
    [(rid, _)] = pool.take_probes(0.5)
    assert pool.exchanges[rid].timeout_s == expected


def test_a_probe_finish_readmits_an_ejected_replica_at_once() -> None:
    pool = pool2()
    time_out(pool, "a", 0, 0.0)
    answer(pool, "b", 1, 0.5, 0.6)
    time_out(pool, "c", 0, 1.0)
    t = time_out(pool, "d", 0, 2.0)
    assert pool.book.state(0, t) == "ejected"
    [(rid, replica)] = pool.take_probes(t)
    assert replica == 0
    pool.events.clear()
    pool.output(rid, False, t + 0.1)  # its one token
    pool.output(rid, True, t + 0.1)
    assert kinds(pool.events) == [("replica_readmitted", 0, "answered")]
    view = pool.book.view(0, t + 0.1)
    assert view["state"] == "ready"
    assert view["consecutive_timeouts"] == 0 and view["ejection_level"] == 0
    assert pool.dispatchable([0, 1], t + 0.1) == [0, 1]
    assert pool.timeouts_total == [3, 0]


def test_a_probe_expiry_is_a_failure_not_a_timeout_and_wants_another_probe() -> None:
    pool = pool2()
    t = time_out(pool, "a", 1, 0.0)
    [(p0, _)] = pool.take_probes(t)
    pool.events.clear()
    assert pool.overdue(t + 0.5 - 1e-6, UP2) == []
    assert pool.overdue(t + 0.5, UP2) == [(p0, 1, True)]
    assert pool.timeouts_total == [0, 1]  # not a timeout
    view = pool.book.view(1, t + 0.5)
    assert view["failures_total"] == 1 and view["consecutive_timeouts"] == 1
    assert view["state"] == "backoff"
    assert [(e.reason, e.duration) for e in pool.events] == [("failure", backoff_duration(1))]  # doubled
    [(p1, replica)] = pool.take_probes(t + 0.5)
    assert replica == 1 and p1 != p0
    assert pool.probes_total == 2


def test_a_success_drops_a_wanted_probe() -> None:
    pool = pool2()
    time_out(pool, "a", 1, 0.0)
    answer(pool, "b", 1, 0.2, 0.55)
    assert pool.take_probes(0.55) == []


# ---------------------------------------------------------------------------------------- next_wake


def test_next_wake_is_the_earliest_deadline_or_health_change() -> None:
    pool = pool2()
    assert pool.next_wake(0.0) is None
    pool.sent("a", 1, 0.5, 0.0)
    pool.sent("b", 0, 0.5, 0.3)
    assert pool.next_wake(0.0) == 0.5
    pool.overdue(0.5, UP2)
    assert pool.next_wake(0.5) == 0.5 + BACKOFF_FIRST  # the backoff ends before b's deadline (0.8)
    [(p, _)] = pool.take_probes(0.5)
    pool.overdue(0.6, UP2)
    assert pool.next_wake(0.6) == 0.8
    pool.output("b", True, 0.7)
    assert pool.next_wake(0.7) == 0.8  # b's entry is stale: the wake only drops it
    pool.overdue(0.8, UP2)
    assert pool.next_wake(0.8) == 1.0  # the probe's deadline
    pool.forget(p)
    pool.overdue(1.0, UP2)
    assert pool.next_wake(1.0) is None  # idle again


# -------------------------------------------------------------------------------- flags and in flight


def test_up_flags_and_in_flight() -> None:
    pool = ReplicaPool(OutlierRules(), 3, 0.5)
    assert pool.up_flags([0, 2]) == [True, False, True]
    assert pool.up_flags([]) == [False, False, False]
    assert pool.up_flags([1, 5]) == [False, True, False]  # an engine beyond the pool is ignored
    pool.sent("a", 0, 0.5, 0.0)
    pool.sent("b", 0, None, 0.0)
    pool.sent("c", 2, 0.5, 0.0)
    assert [pool.in_flight(r) for r in range(3)] == [2, 0, 1]
    pool.overdue(0.5, [True, True, True])  # a and c time out; probes wanted for 0 and 2
    assert sorted(r for _, r in pool.take_probes(0.5)) == [0, 2]
    assert [pool.in_flight(r) for r in range(3)] == [1, 0, 0]  # probes excluded


def test_dispatch_serves_anyway_from_an_ejected_replica_when_nothing_else_is_up() -> None:
    pool = pool2()
    time_out(pool, "a", 0, 0.0)
    answer(pool, "b", 1, 0.5, 0.6)
    time_out(pool, "c", 0, 1.0)
    t = time_out(pool, "d", 0, 2.0)
    assert pool.dispatchable([0, 1], t + 5.0) == [1]
    assert pool.dispatchable([0], t + 5.0) == [0]
    assert pool.dispatchable([], t + 5.0) == []


# ------------------------------------------------------------------------------ hung replica, end to end

STEP = 1 / 16  # the simulated shell's period (exact in binary, so times add up exactly)


@dataclass
class Sim:
    """A shell around the pool: every STEP it runs ``overdue`` and ``take_probes`` (the watcher),
    replica 0 finishes whatever it holds, replica 1 finishes only once recovered, and every replica
    in ``dispatchable`` with nothing in flight gets one new request."""

    pool: ReplicaPool = field(default_factory=pool2)
    t: float = 0.0
    k: int = 0
    recovered: bool = False
    sent_ids: int = 0
    log: list[tuple[float, HealthEvent]] = field(default_factory=list)
    dispatch: list[tuple[float, list[int]]] = field(default_factory=list)
    states: list[str] = field(default_factory=list)  # replica 1's state at each step, as dispatched
    probes: list[tuple[float, str]] = field(default_factory=list)
    expired: list[tuple[float, str, int, bool]] = field(default_factory=list)

    def step(self) -> None:
        pool, t = self.pool, self.k * STEP
        self.t = t
        self.expired += [(t, rid, r, probe) for rid, r, probe in pool.overdue(t, UP2)]
        self.probes += [(t, rid) for rid, r in pool.take_probes(t) if r == 1]
        for rid, ex in list(pool.exchanges.items()):
            if ex.replica == 0 or self.recovered:
                pool.output(rid, True, t)
        up = pool.dispatchable([0, 1], t)
        self.dispatch.append((t, up))
        self.states.append(pool.book.state(1, t))
        for r in up:
            if pool.in_flight(r) == 0:
                pool.sent(f"r{self.sent_ids}", r, pool.deadline(None), t)
                self.sent_ids += 1
        self.log += [(t, e) for e in pool.events]
        pool.events.clear()
        pool.book.check_invariants()
        self.k += 1

    def run_until(self, end: float) -> None:
        while self.k * STEP < end:
            self.step()

    def first(self, kind: str, after: float = -1.0) -> tuple[float, HealthEvent]:
        return next((t, e) for t, e in self.log if e.kind == kind and t > after)


def test_a_hung_replica_is_ejected_after_three_timeouts_and_readmitted_by_a_probe() -> None:
    sim = Sim()
    sim.run_until(10.0)
    pool = sim.pool
    t_eject, ejection = sim.first("replica_ejected")
    assert (ejection.replica, ejection.reason, ejection.duration) == (1, "consecutive_timeouts", 30.0)
    assert pool.timeouts_total == [0, 3]  # replica 0 answers steadily; 1's third real timeout ejects it
    assert [e for _, e in sim.log if e.kind == "replica_ejection_withheld"] == []
    real_timeouts = [t for t, _, r, probe in sim.expired if r == 1 and not probe]
    assert len(real_timeouts) == 3 and real_timeouts[-1] == t_eject
    # Before the ejection replica 1 is out of dispatch exactly while it is backed off.
    before = [(t, up, state) for (t, up), state in zip(sim.dispatch, sim.states, strict=True) if t < t_eject]
    assert {state for _, _, state in before} == {"ready", "backoff"}
    for t, up, state in before:
        assert up == ([0] if state == "backoff" else [0, 1]), t
    # Every probe that expired was a failure: its own backoff, no count.
    probe_expiries = [t for t, _, r, probe in sim.expired if probe]
    assert probe_expiries and all(r == 1 for _, _, r, probe in sim.expired if probe)
    assert len(of_kind([e for _, e in sim.log], "replica_backoff")) == 3 + len(probe_expiries)

    # The cool-down: replica 1 gets nothing for exactly base_ejection_s, then is readmitted.
    sim.run_until(t_eject + 30.0)
    during = [up for t, up in sim.dispatch if t >= t_eject]
    assert during and all(up == [0] for up in during)
    assert pool.timeouts_total == [0, 3]  # no real request reached it meanwhile
    # Probes keep going through the cool-down (each backoff's end asks for one), so when it ends
    # the replica may still be backed off by the last probe's failure: its first real request comes
    # at most one backoff and a probe's deadline later.
    pace = BACKOFF_MAX + 0.5 + STEP
    while not [e for t, e in sim.log if t > t_eject and e.kind == "replica_ejected"]:
        sim.step()  # up to the step of the re-ejection
        assert sim.t < t_eject + 30.0 + pace + 0.5
    t_back, back = sim.first("replica_readmitted")
    assert (back.reason, t_back) == (
        "cool_down_ended",
        min(t for t, _ in sim.dispatch if t >= t_eject + 30.0),
    )
    # Still hung: its first request after readmission times out and re-ejects it, for twice as long.
    t_again, again = sim.first("replica_ejected", after=t_eject)
    assert (again.reason, again.duration) == ("timed_out_after_readmission", 60.0)
    assert t_again >= t_back + 0.5
    assert any(1 in up for t, up in sim.dispatch if t_back <= t <= t_again - 0.5)
    assert pool.timeouts_total == [0, 4]

    # It recovers: the next probe (sent within one backoff and a deadline) finishes and readmits it.
    sim.recovered = True
    while not [e for t, e in sim.log if t > t_again and e.kind == "replica_readmitted"]:
        sim.step()
        assert sim.t < t_again + pace + STEP
    t_ok, ok = sim.first("replica_readmitted", after=t_again)
    assert (ok.replica, ok.reason, t_ok) == (1, "answered", sim.t)
    assert sim.dispatch[-1] == (sim.t, [0, 1])
    assert pool.book.view(1, sim.t)["consecutive_timeouts"] == 0
    sim.run_until(sim.t + 5.0)
    assert pool.timeouts_total == [0, 4]
    assert all(up == [0, 1] for t, up in sim.dispatch if t >= t_ok)


def test_a_hung_ejected_replica_keeps_being_probed_through_its_cool_down() -> None:
    """Once its backoff outgrows a probe's deadline, a probe's expiry lands inside the backoff it was
    sent for; the backoff's end asks for the next probe while the replica is still ejected (else a
    replica that recovers mid-cool-down would wait for the cool-down's end)."""
    sim = Sim()
    sim.run_until(10.0)
    t_eject, _ = sim.first("replica_ejected")
    sim.run_until(t_eject + 30.0)
    probe_times = [t_eject] + [t for t, _ in sim.probes if t > t_eject] + [t_eject + 30.0]
    pace = BACKOFF_MAX + 0.5 + STEP  # the longest backoff plus a probe's deadline, plus the shell's lag
    assert max(b - a for a, b in itertools.pairwise(probe_times)) <= pace


# ---------------------------------------------------------------------------------- state machine


class PoolMachine(RuleBasedStateMachine):
    """Random sends, outputs, forgets, engine failures, probes and clock steps against a shadow of
    every tracked exchange's (replica, timeout, due, probe). ``overdue`` must return exactly the
    shadow's exchanges due by ``now``: so each id at most once, never after it ended otherwise."""

    pool: ReplicaPool
    shadow: dict[str, tuple[int, float, float, bool]]

    @initialize(
        n=st.integers(1, 3),
        default=st.sampled_from([None, 0.5, 1.0]),
        threshold=st.sampled_from([0, 1, 3]),
        base=st.sampled_from([0.5, 30.0]),
    )
    def start(self, n: int, default: float | None, threshold: int, base: float) -> None:
        self.pool = ReplicaPool(
            OutlierRules(consecutive_timeouts=threshold, base_ejection_s=base), n, default
        )
        self.shadow = {}
        self.now = 0.0
        self.ids: list[str] = []
        self.ended: set[str] = set()  # finished, forgotten, failed with the engine, or expired
        self.timeouts = [0] * n

    def _pick(self, index: int) -> str:
        return self.ids[index % len(self.ids)]

    @rule(replica=st.integers(0, 2), request=st.sampled_from([None, 0.0, 0.3, 0.5, 1.0]))
    def send(self, replica: int, request: float | None) -> None:
        pool = self.pool
        r = replica % pool.n
        rid = f"q{len(self.ids)}"
        self.ids.append(rid)
        timeout = pool.deadline(request)
        pool.sent(rid, r, timeout, self.now)
        if timeout is not None or pool.n > 1:
            t = math.inf if timeout is None else timeout
            self.shadow[rid] = (r, t, self.now + t, False)

    @precondition(lambda self: bool(self.ids))
    @rule(index=st.integers(0, 10**6), finished=st.booleans())
    def output(self, index: int, finished: bool) -> None:
        rid = self._pick(index)
        self.pool.output(rid, finished, self.now)
        if rid in self.shadow:
            r, t, _, probe = self.shadow[rid]
            if finished:
                del self.shadow[rid]
                self.ended.add(rid)
            else:
                self.shadow[rid] = (r, t, self.now + t, probe)

    @precondition(lambda self: bool(self.ids))
    @rule(index=st.integers(0, 10**6))
    def forget(self, index: int) -> None:
        rid = self._pick(index)
        self.pool.forget(rid)
        self.shadow.pop(rid, None)
        self.ended.add(rid)

    @rule(replica=st.integers(0, 2))
    def engine_failed(self, replica: int) -> None:
        r = replica % self.pool.n
        self.pool.engine_failed(r, self.now)
        for rid in [rid for rid, (owner, *_) in self.shadow.items() if owner == r]:
            del self.shadow[rid]
            self.ended.add(rid)

    @rule()
    def take_probes(self) -> None:
        for rid, r in self.pool.take_probes(self.now):
            assert rid.startswith(PROBE_PREFIX) and rid not in self.shadow
            ex = self.pool.exchanges[rid]
            self.ids.append(rid)
            self.shadow[rid] = (r, ex.timeout_s, self.now + ex.timeout_s, True)

    @rule(
        dt=st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0]) | st.floats(0.0, 3.0),
        ups=st.lists(st.booleans(), min_size=3, max_size=3),
    )
    def tick(self, dt: float, ups: list[bool]) -> None:
        self.now += dt  # the clock never goes back
        pool = self.pool
        expired = pool.overdue(self.now, ups[: pool.n])
        ids = [rid for rid, _, _ in expired]
        assert len(ids) == len(set(ids))
        assert not set(ids) & self.ended  # never after it ended some other way (or expired already)
        due = {rid for rid, (_, _, d, _) in self.shadow.items() if d <= self.now}
        assert set(ids) == due
        for rid, r, probe in expired:
            owner, _, _, was_probe = self.shadow.pop(rid)
            assert (r, probe) == (owner, was_probe)
            self.ended.add(rid)
            if not probe:
                self.timeouts[r] += 1

    @invariant()
    def matches_the_shadow(self) -> None:
        pool = self.pool
        assert {rid: (ex.replica, ex.timeout_s, ex.due, ex.probe) for rid, ex in pool.exchanges.items()} == (
            self.shadow
        )
        assert pool.timeouts_total == self.timeouts
        for r in range(pool.n):
            assert pool.in_flight(r) == sum(1 for o, _, _, p in self.shadow.values() if o == r and not p)
        wake = pool.next_wake(self.now)
        finite = [d for _, _, d, _ in self.shadow.values() if d != math.inf]
        if finite:  # the wake is never later than the earliest deadline (it may be earlier: stale)
            assert wake is not None and wake <= min(finite)
        pool.book.check_invariants()


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase

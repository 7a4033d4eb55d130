"""The dispatch policies (``frontend/dispatch.py``): vLLM's load score and round-robin, pure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.frontend.dispatch import POLICY_NAMES, DpScore, RoundRobin, make_policy
from trioserve.protocol.messages import LoadReport, LoadSnapshot


def _snapshot(*loads: tuple[int, int, float], seq: int = 1) -> LoadSnapshot:
    """Engines 0, 1, ... with (waiting, running, kv usage)."""
    return LoadSnapshot(seq, [LoadReport(i, w, r, kv) for i, (w, r, kv) in enumerate(loads)])


def _send(policy: DpScore | RoundRobin, ready: set[int]) -> int:
    engine = policy.pick(ready)
    assert engine is not None
    policy.sent(engine)
    return engine


@pytest.mark.parametrize(("kv", "penalty"), [(0.0, 0.0), (0.5, 0.0), (0.75, 6.0), (1.0, 12.0)])
def test_waiting_penalty_grows_from_half_to_full_kv_usage(kv: float, penalty: float) -> None:
    policy = DpScore(2)
    policy.update(_snapshot((4, 2, kv), (0, 0, 0.0)))
    # 4 waiting + 2 running, plus 0 at <= 50 % usage, 1.5 x waiting at 75 %, 3 x waiting at 100 %.
    assert policy.score(0) == 6.0 + penalty


def test_no_waiting_no_penalty_even_with_a_full_cache() -> None:
    policy = DpScore(2)
    policy.update(_snapshot((0, 7, 1.0), (0, 8, 0.0)))
    assert policy.score(0) == 7.0
    assert policy.pick({0, 1}) == 0


def test_the_penalty_steers_away_from_a_kv_bound_queue() -> None:
    policy = DpScore(2)
    # Same queue, same load; engine 0's cache is full, so its queue drains slowly.
    policy.update(_snapshot((4, 4, 1.0), (4, 4, 0.4)))
    assert policy.score(0) == 8.0 + 12.0
    assert policy.score(1) == 8.0
    assert policy.pick({0, 1}) == 1


def test_own_in_flight_times_api_servers_beats_a_stale_snapshot() -> None:
    policy = DpScore(2, api_server_count=2)
    for _ in range(3):
        policy.sent(0)  # before any snapshot: no bumps, just the in-flight count
    policy.update(_snapshot((0, 0, 0.0), (0, 0, 0.0)))  # the coordinator has not seen them yet
    assert policy.score(0) == 6.0  # 2 API servers x 3 in flight
    assert policy.score(1) == 0.0
    assert policy.pick({0, 1}) == 1
    # The coordinator's count wins where it is larger (other API servers load engine 1).
    policy.update(_snapshot((0, 0, 0.0), (1, 9, 0.0), seq=2))
    assert policy.score(1) == 10.0
    assert policy.pick({0, 1}) == 0
    # Requests that end lower the floor.
    for _ in range(3):
        policy.done(0)
    assert policy.score(0) == 0.0


def test_bumps_between_snapshots_spread_a_burst() -> None:
    policy = DpScore(3)
    policy.update(_snapshot((0, 3, 0.0), (0, 5, 0.0), (0, 5, 0.0)))
    # Without the bumps every request of the burst would go to engine 0 (3 < 5 until the next
    # snapshot); with them engine 0 fills up to the others, then ties rotate.
    assert [_send(policy, {0, 1, 2}) for _ in range(5)] == [0, 0, 1, 2, 0]
    assert policy.score(0) == 6.0  # 3 running + 3 bumped


def test_bumps_count_for_every_api_server_and_a_snapshot_replaces_them() -> None:
    policy = DpScore(2, api_server_count=2)
    policy.update(_snapshot((0, 1, 0.0), (0, 1, 0.0)))
    assert _send(policy, {0, 1}) == 0
    assert policy.score(0) == 3.0  # 1 running + 2 (one per API server) waiting
    policy.update(_snapshot((1, 1, 0.0), (0, 1, 0.0), seq=2))  # the engine saw it: bumps are gone
    assert policy.score(0) == 2.0
    assert policy.snapshot_seq == 2


def test_bumped_waiting_requests_pay_the_penalty_too() -> None:
    policy = DpScore(2)
    policy.update(_snapshot((0, 0, 1.0), (0, 2, 0.0)))
    assert policy.score(0) == 0.0  # nothing waits: no penalty
    policy.sent(0)
    assert policy.score(0) == 1.0 + 3.0  # the bump waits on a full cache


def test_ties_rotate_over_the_engines() -> None:
    policy = DpScore(3)
    picks = []
    for _ in range(4):
        engine = _send(policy, {0, 1, 2})
        policy.done(engine)  # each one ends before the next: always a tie
        picks.append(engine)
    assert picks == [0, 1, 2, 0]


def test_ties_rotate_over_the_tied_engines_only() -> None:
    policy = DpScore(3)
    policy.update(_snapshot((0, 0, 0.0), (0, 9, 0.0), (0, 0, 0.0)))
    picks = []
    for _ in range(4):
        engine = _send(policy, {0, 1, 2})
        policy.done(engine)
        policy.update(_snapshot((0, 0, 0.0), (0, 9, 0.0), (0, 0, 0.0)))
        picks.append(engine)
    assert picks == [0, 2, 0, 2]


@pytest.mark.parametrize(
    ("num_engines", "api_servers", "starts"),
    [(2, 2, [0, 1]), (4, 2, [0, 2]), (2, 4, [0, 0, 1, 1]), (3, 3, [0, 1, 2])],
)
def test_api_servers_without_load_information_start_on_different_engines(
    num_engines: int, api_servers: int, starts: list[int]
) -> None:
    ready = set(range(num_engines))
    for policy_class in (DpScore, RoundRobin):
        firsts = [policy_class(num_engines, api_servers, i).pick(ready) for i in range(api_servers)]
        assert firsts == starts


def test_not_ready_engines_are_never_picked() -> None:
    policy = DpScore(3)
    policy.update(_snapshot((0, 0, 0.0), (9, 9, 1.0), (0, 0, 0.0)))
    assert policy.pick({1}) == 1  # the only ready one, however loaded
    assert policy.pick({1, 2}) == 2
    assert policy.pick({1, 7, -1}) == 1  # indexes that are no engine are ignored
    assert policy.pick(set()) is None
    assert policy.pick({3, 4}) is None


def test_a_snapshot_that_omits_an_engine_counts_it_as_idle() -> None:
    policy = DpScore(2)
    policy.update(LoadSnapshot(1, [LoadReport(1, 2, 2, 0.0), LoadReport(5, 0, 0, 0.0)]))  # 5: no engine
    assert policy.coordinator_load(0) == (0, 0, 0.0)
    assert policy.coordinator_load(1) == (2, 2, 0.0)
    assert policy.pick({0, 1}) == 0


def test_done_never_drops_below_zero_and_unknown_engines_are_ignored() -> None:
    policy = DpScore(2)
    policy.done(0)
    policy.sent(9)
    policy.done(9)
    assert policy.in_flight(0) == 0
    assert policy.score(0) == policy.score(1) == 0.0


def test_round_robin_rotates_over_ready_engines() -> None:
    policy = RoundRobin(3)
    assert [_send(policy, {0, 1, 2}) for _ in range(4)] == [0, 1, 2, 0]
    assert [_send(policy, {0, 2}) for _ in range(3)] == [2, 0, 2]
    policy.update(_snapshot((0, 0, 0.0), (0, 0, 0.0), (99, 99, 1.0)))  # load is ignored
    assert policy.pick({0, 1, 2}) == 0
    assert policy.pick(set()) is None


def test_make_policy() -> None:
    assert POLICY_NAMES == ("dplb", "round-robin", "prefix", "least-outstanding-bytes")
    for name in POLICY_NAMES:
        assert make_policy(name, 2, 1, 0).name == name
    # least-outstanding-bytes places at admission (replica_slots.py); an add without a replica
    # still gets one, in turn.
    placed = make_policy("least-outstanding-bytes", 2, 1, 0)
    assert [_send(placed, {0, 1}) for _ in range(3)] == [0, 1, 0]
    with pytest.raises(ValueError, match="unknown dispatch policy 'fastest'"):
        make_policy("fastest", 2, 1, 0)
    with pytest.raises(ValueError, match="client_index"):
        make_policy("dplb", 2, 2, 2)


_loads = st.tuples(st.integers(0, 50), st.integers(0, 50), st.floats(0.0, 1.0))
_ops = st.one_of(
    st.tuples(st.just("sent"), st.integers(0, 5)),
    st.tuples(st.just("done"), st.integers(0, 5)),
    st.tuples(st.just("update"), st.lists(_loads, min_size=0, max_size=6)),
)


@settings(max_examples=300, deadline=None)
@given(
    num_engines=st.integers(1, 6),
    api_servers=st.integers(1, 4),
    client=st.integers(0, 3),
    ops=st.lists(_ops, max_size=30),
    ready=st.sets(st.integers(-1, 7)),
)
def test_pick_returns_a_ready_engine_of_minimal_score(
    num_engines: int,
    api_servers: int,
    client: int,
    ops: list[tuple[str, object]],
    ready: set[int],
) -> None:
    policy = DpScore(num_engines, api_servers, client % api_servers)
    for seq, (op, arg) in enumerate(ops):
        if op == "update":
            assert isinstance(arg, list)
            policy.update(_snapshot(*arg, seq=seq))
        else:
            assert isinstance(arg, int)
            getattr(policy, op)(arg)
    engines = ready & set(range(num_engines))
    engine = policy.pick(ready)
    if not engines:
        assert engine is None
        return
    assert engine in engines
    assert policy.score(engine) == min(policy.score(e) for e in engines)

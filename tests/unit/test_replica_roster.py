"""The roster's rules (frontend/replica_roster.py): which ranks are wanted, which drain, and when a
draining rank is owed ``ClientDone``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve.frontend.replica_roster import Roster


def test_the_wanted_ranks_are_those_below_desired() -> None:
    roster = Roster(4, 2)
    assert [roster.wanted(r) for r in range(5)] == [True, True, False, False, False]
    assert Roster(3).desired == 3  # default: every rank
    with pytest.raises(ValueError, match="capacity"):
        Roster(0)


def test_desired_is_clamped_to_one_through_capacity() -> None:
    roster = Roster(3)
    roster.resize(0, ())
    assert roster.desired == 1  # one replica is always wanted
    roster.resize(9, ())
    assert roster.desired == 3


def test_a_shrink_drains_the_joined_ranks_past_it_and_owes_them_done() -> None:
    roster = Roster(4)
    assert roster.resize(2, [0, 1, 3]) == [3]  # rank 2 never joined: nothing to drain
    assert roster.owes(3) and not roster.owes(2)
    roster.joined(2)  # it joins later: it is owed ClientDone as well
    assert roster.owes(2)
    roster.joined(1)  # a wanted rank is owed nothing
    assert not roster.owes(1)
    roster.check_invariants()


def test_done_waits_for_the_adds_already_placed_and_for_a_reachable_engine() -> None:
    roster = Roster(3)
    roster.resize(1, [0, 1, 2])
    assert roster.done_due(reachable=[0, 1, 2], placed=[1, 2]) is None  # adds queued for both
    assert roster.done_due(reachable=[0, 2], placed=[2]) is None  # 1 is down: not now
    assert roster.done_due(reachable=[0, 1, 2], placed=[2]) == 1
    assert roster.done_due(reachable=[0, 1, 2], placed=[2]) is None  # sent once
    assert roster.done_due(reachable=[0, 1, 2], placed=[]) == 2
    assert roster.done_due(reachable=[0, 1, 2], placed=[]) is None


def test_growing_again_forgives_what_was_owed_and_retired_clears_it() -> None:
    roster = Roster(3)
    roster.resize(1, [0, 1, 2])
    roster.resize(2, [0, 1, 2])
    assert not roster.owes(1) and roster.owes(2)
    roster.retired(2)
    assert not roster.owes(2)
    roster.check_invariants()


@given(
    st.integers(1, 6),
    st.lists(
        st.tuples(st.sampled_from(["resize", "joined", "retired", "done"]), st.integers(0, 7)), max_size=40
    ),
)
def test_invariants_hold_and_only_unwanted_ranks_are_owed(capacity: int, ops: list[tuple[str, int]]) -> None:
    roster = Roster(capacity)
    joined: set[int] = set()
    for op, n in ops:
        rank = n % capacity
        if op == "resize":
            for r in roster.resize(n, joined):
                assert r in joined and not roster.wanted(r)
        elif op == "joined":
            joined.add(rank)
            roster.joined(rank)
        elif op == "retired":
            joined.discard(rank)
            roster.retired(rank)
        else:
            done = roster.done_due(reachable=joined, placed=())
            assert done is None or (done in joined and not roster.wanted(done))
        roster.check_invariants()

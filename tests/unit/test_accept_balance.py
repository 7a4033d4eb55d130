"""The least-loaded accept rule (``accept_balance.py``) and the shared array it reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioserve.frontend.edge.accept_balance import (
    ABSENT,
    DEFER_CHECKS,
    AcceptDeferral,
    ConnectionLoads,
)


def _checks_before_racing(index: int, loads: list[int]) -> int:
    """How many intervals server ``index`` waits on one wake if the loads stay as given."""
    checks = 0
    while AcceptDeferral.defer(index, loads, checks):
        checks += 1
    return checks


def test_the_least_loaded_server_races_at_once() -> None:
    assert not AcceptDeferral.defer(1, [4, 2, 3], 0)
    assert _checks_before_racing(1, [4, 2, 3]) == 0


def test_tied_servers_all_race() -> None:
    loads = [2, 2, 5]
    assert AcceptDeferral.least_loaded(0, loads)
    assert AcceptDeferral.least_loaded(1, loads)
    assert not AcceptDeferral.defer(0, loads, 0)
    assert not AcceptDeferral.defer(1, loads, 0)


def test_a_more_loaded_server_defers_exactly_five_checks_then_races() -> None:
    loads = [3, 1]
    assert DEFER_CHECKS == 5
    assert [AcceptDeferral.defer(0, loads, checks) for checks in range(7)] == [True] * 5 + [False] * 2
    assert _checks_before_racing(0, loads) == 5


def test_a_load_that_changes_meanwhile_ends_the_deferral() -> None:
    loads = [3, 1]
    assert AcceptDeferral.defer(0, loads, 0)
    assert AcceptDeferral.defer(0, loads, 1)
    loads[0] = 1  # two of its connections closed: now tied, so it races
    assert not AcceptDeferral.defer(0, loads, 2)
    loads = [3, 1]
    loads[1] = 4  # the peer took connections: this one is least loaded now
    assert not AcceptDeferral.defer(0, loads, 2)


def test_a_single_server_never_defers() -> None:
    assert not AcceptDeferral.defer(0, [100], 0)


def test_nobody_defers_to_an_absent_server() -> None:
    assert not AcceptDeferral.defer(0, [50, ABSENT], 0)
    assert AcceptDeferral.defer(0, [50, ABSENT, 7], 0)


def test_loads_round_trip_through_two_mappings_of_one_file(tmp_path: Path) -> None:
    path = tmp_path / "connections"
    with ConnectionLoads.create(path, 3) as supervisor:
        assert supervisor.read() == [ABSENT] * 3  # nothing published yet
        with ConnectionLoads.open(path, 3) as a, ConnectionLoads.open(path, 3) as b:
            a.publish(0, 7)
            b.publish(1, 2**64 - 2)  # the whole unsigned 64-bit range
            assert b.read() == [7, 2**64 - 2, ABSENT]
            assert a.read() == [7, 2**64 - 2, ABSENT]
            a.publish(0, 0)
            b.retire(1)
            assert supervisor.read() == [0, ABSENT, ABSENT]


def test_open_refuses_a_file_of_the_wrong_size(tmp_path: Path) -> None:
    path = tmp_path / "connections"
    ConnectionLoads.create(path, 2).close()
    with pytest.raises(ValueError, match="not 3 slots"):
        ConnectionLoads.open(path, 3)
    with pytest.raises(ValueError, match="at least one"):
        ConnectionLoads.create(path, 0)

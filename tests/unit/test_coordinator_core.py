"""The DP coordinator's publication rule (``coordinator/core.py``): pure, times passed in."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.coordinator.core import KEEPALIVE_INTERVAL, CoordinatorCore
from trioserve.protocol.messages import COORDINATOR_PUBLISH_INTERVAL, LoadReport


def test_the_intervals_are_the_published_ones() -> None:
    assert COORDINATOR_PUBLISH_INTERVAL == 0.1
    assert KEEPALIVE_INTERVAL == 1.0


def test_first_check_publishes_at_once_even_with_nothing_heard() -> None:
    core = CoordinatorCore(2)
    assert core.next_due() == -math.inf
    snapshot = core.due(5.0)
    assert snapshot is not None
    assert (snapshot.seq, snapshot.engines) == (1, [])
    assert core.next_due() == 6.0  # nothing changed: the keep-alive


def test_a_change_is_published_at_most_every_interval() -> None:
    core = CoordinatorCore(2)
    assert core.report(LoadReport(1, 0, 2, 0.1))
    first = core.due(0.0)
    assert first is not None
    assert first.engines == [LoadReport(1, 0, 2, 0.1)]
    core.report(LoadReport(0, 1, 0, 0.0))
    assert core.next_due() == pytest.approx(0.1)
    assert core.due(0.05) is None  # too soon after the last publication
    core.report(LoadReport(0, 3, 1, 0.2))  # a burst within one interval: one publication, the latest
    snapshot = core.due(0.1)
    assert snapshot is not None
    assert snapshot.seq == 2
    assert snapshot.engines == [LoadReport(0, 3, 1, 0.2), LoadReport(1, 0, 2, 0.1)]  # index order
    assert core.due(0.15) is None


def test_only_a_change_publishes_before_the_keepalive() -> None:
    core = CoordinatorCore(1)
    core.report(LoadReport(0, 1, 1, 0.5))
    assert core.due(0.0) is not None
    core.report(LoadReport(0, 1, 1, 0.5))  # the same again: no news
    assert core.next_due() == 1.0
    assert core.due(0.2) is None
    assert core.due(0.999) is None


def test_keepalive_each_second_when_nothing_changes() -> None:
    core = CoordinatorCore(1)
    core.report(LoadReport(0, 0, 1, 0.0))
    times = []
    now = 0.0
    for _ in range(4):
        snapshot = core.due(now)
        assert snapshot is not None
        assert snapshot.engines == [LoadReport(0, 0, 1, 0.0)]
        times.append(now)
        now = core.next_due()
        assert core.due(now - 0.01) is None
    assert times == [0.0, 1.0, 2.0, 3.0]
    assert core.seq == 4


def test_a_change_after_a_quiet_spell_goes_out_at_once() -> None:
    core = CoordinatorCore(1)
    assert core.due(0.0) is not None
    core.report(LoadReport(0, 1, 0, 0.0))
    assert core.next_due() == pytest.approx(0.1)
    assert core.due(0.7) is not None  # more than an interval since the last publication


@pytest.mark.parametrize(
    "bad",
    [
        LoadReport(2, 0, 0, 0.0),  # no such engine
        LoadReport(-1, 0, 0, 0.0),
        LoadReport(0, -1, 0, 0.0),
        LoadReport(0, 0, -1, 0.0),
        LoadReport(0, 0, 0, 1.5),
        LoadReport(0, 0, 0, -0.1),
        LoadReport(0, 0, 0, math.nan),
    ],
)
def test_invalid_reports_are_dropped_and_counted(bad: LoadReport) -> None:
    core = CoordinatorCore(2)
    assert core.due(0.0) is not None
    assert not core.report(bad)
    assert core.bad_reports == 1
    assert core.reports == 0
    assert core.next_due() == 1.0  # no change
    snapshot = core.due(1.0)
    assert snapshot is not None
    assert snapshot.engines == []


_report = st.builds(
    LoadReport, st.integers(0, 2), st.integers(0, 3), st.integers(0, 3), st.sampled_from([0.0, 0.6])
)


@settings(max_examples=200, deadline=None)
@given(arrivals=st.lists(st.tuples(st.floats(0.0, 5.0), _report), max_size=40))
def test_publications_are_spaced_and_carry_the_latest_state(arrivals: list[tuple[float, LoadReport]]) -> None:
    """A publisher that checks at ``next_due`` and after each report (as the shell does)."""
    core = CoordinatorCore(3)
    arrivals.sort(key=lambda a: a[0])
    published: list[float] = []
    latest: dict[int, LoadReport] = {}
    pending = list(arrivals)
    now = 0.0
    end = 7.0
    while now <= end:
        if pending and pending[0][0] <= core.next_due():
            now, report = pending.pop(0)
            core.report(report)
            latest[report.engine_index] = report
        else:
            now = max(now, core.next_due())
        snapshot = core.due(now)
        if snapshot is not None:
            published.append(now)
            # Whatever went out is the latest of every engine heard from.
            assert snapshot.engines == [latest[i] for i in sorted(latest)]
            assert snapshot.seq == len(published)
    gaps = [b - a for a, b in itertools.pairwise(published)]
    assert all(COORDINATOR_PUBLISH_INTERVAL - 1e-9 <= gap <= KEEPALIVE_INTERVAL + 1e-9 for gap in gaps)
    last = core.due(math.inf)  # nothing is left unpublished: a final check adds no news
    assert last is not None
    assert last.engines == [latest[i] for i in sorted(latest)]

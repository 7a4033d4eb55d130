"""When an engine reports its load to the DP coordinator (``engine/load_report.py``): pure."""

from __future__ import annotations

import pytest

from trioserve.engine.load_report import LoadReporter
from trioserve.protocol.messages import LoadReport


def test_first_check_reports_then_nothing_until_a_change() -> None:
    reporter = LoadReporter(3)
    assert reporter.check(0.0, 2, 1, 0.25) == LoadReport(3, 2, 1, 0.25)
    assert reporter.check(0.5, 2, 1, 0.25) is None
    assert reporter.check(0.6, 2, 2, 0.25) == LoadReport(3, 2, 2, 0.25)
    assert reporter.sent == 2


def test_a_change_within_min_interval_is_held_until_it_passes() -> None:
    reporter = LoadReporter(0)
    assert reporter.check(0.0, 0, 0, 0.0) is not None
    assert reporter.check(0.004, 1, 0, 0.0) is None  # 4 ms after the last report
    assert reporter.next_due() == pytest.approx(0.01)
    assert reporter.check(0.008, 2, 0, 0.0) is None
    assert reporter.check(0.01, 2, 1, 0.0) == LoadReport(0, 2, 1, 0.0)  # the state then
    assert reporter.next_due() == pytest.approx(1.01)


def test_a_change_that_reverts_before_it_was_sent_is_no_news() -> None:
    reporter = LoadReporter(0)
    reporter.check(0.0, 1, 1, 0.0)
    assert reporter.check(0.005, 2, 1, 0.0) is None
    assert reporter.check(0.006, 1, 1, 0.0) is None
    assert reporter.next_due() == 1.0
    assert reporter.check(0.02, 1, 1, 0.0) is None


def test_keepalive_every_second_when_nothing_changes() -> None:
    reporter = LoadReporter(1)
    reporter.check(0.0, 0, 4, 0.5)
    assert reporter.check(0.999, 0, 4, 0.5) is None
    assert reporter.next_due() == 1.0
    assert reporter.check(1.0, 0, 4, 0.5) == LoadReport(1, 0, 4, 0.5)
    assert reporter.check(2.0, 0, 4, 0.5) is not None


@pytest.mark.parametrize(
    ("before", "after", "news"),
    [
        (0.50, 0.505, False),
        (0.50, 0.51, True),
        (0.56, 0.57, True),  # 0.57 - 0.56 is a hair under 0.01 in binary floating point
        (0.57, 0.56, True),
        (0.30, 0.295, False),
        (0.0, 1.0, True),
    ],
)
def test_kv_usage_is_news_from_one_percentage_point(before: float, after: float, news: bool) -> None:
    reporter = LoadReporter(0)
    reporter.check(0.0, 1, 1, before)
    assert (reporter.check(0.5, 1, 1, after) is not None) is news


def test_a_slow_kv_drift_is_reported_once_it_adds_up() -> None:
    reporter = LoadReporter(0)
    reporter.check(0.0, 0, 1, 0.500)
    assert reporter.check(0.1, 0, 1, 0.504) is None
    assert reporter.check(0.2, 0, 1, 0.508) is None
    assert reporter.check(0.3, 0, 1, 0.512) == LoadReport(0, 0, 1, 0.512)  # 1.2 points since 0.500


def test_intervals_are_checked() -> None:
    with pytest.raises(ValueError, match="min_interval"):
        LoadReporter(0, min_interval=2.0, max_interval=1.0)

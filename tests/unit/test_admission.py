"""Admission rules, in the order they are checked, and slot accounting."""

from __future__ import annotations

import pytest

from trioserve.frontend.admission import Admission, AdmissionLimits
from trioserve.frontend.errors import ApiError


def refusal(admission: Admission) -> ApiError:
    with pytest.raises(ApiError) as exc:
        admission.admit()
    return exc.value


def test_concurrency_limit_is_429_and_slots_come_back() -> None:
    admission = Admission(AdmissionLimits(max_concurrent_requests=2))
    a, b = admission.admit(), admission.admit()
    err = refusal(admission)
    assert (err.status, err.retry_after) == (429, 1)
    a.release()
    a.release()  # idempotent: every exit path may release
    assert admission.in_flight == 1
    admission.admit()
    b.release()
    assert admission.in_flight == 1
    assert admission.rejected == {"max_concurrent_requests": 1}


def test_overload_rules_are_503() -> None:
    admission = Admission(AdmissionLimits(max_pending_renders=1, max_num_seqs_waiting=5, max_loop_lag=0.2))
    with admission.rendering_slot():
        assert refusal(admission).status == 503
    assert admission.rendering == 0
    admission.engine_waiting = 5
    assert refusal(admission).status == 503
    admission.engine_waiting = 0
    admission.loop_lag = 0.3
    err = refusal(admission)
    assert err.status == 503 and "300 ms behind" in err.message
    assert admission.rejected == {"max_pending_renders": 1, "max_num_seqs_waiting": 1, "loop_lag": 1}
    assert admission.in_flight == 0


def test_zero_means_no_limit() -> None:
    admission = Admission(AdmissionLimits())
    admission.loop_lag, admission.engine_waiting = 10.0, 10**6
    tickets = [admission.admit() for _ in range(1000)]
    assert admission.in_flight == len(tickets)

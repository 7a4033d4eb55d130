"""Admission rules, in the order they are checked, and slot accounting."""

from __future__ import annotations

import pytest

from trioserve.config import AdmissionConfig, override
from trioserve.frontend.request.admission import Admission, DelayGate
from trioserve.frontend.request.errors import ApiError


def _limits(**limits: float) -> AdmissionConfig:
    """Only the limits given; every other one off (0)."""
    off = {name: 0 for name in AdmissionConfig.__struct_fields__}
    return override(AdmissionConfig(), **{**off, **limits})


def refusal(admission: Admission) -> ApiError:
    with pytest.raises(ApiError) as exc:
        admission.admit()
    return exc.value


def test_concurrency_limit_is_429_and_slots_come_back() -> None:
    admission = Admission(_limits(max_concurrent_requests=2))
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
    admission = Admission(_limits(max_pending_renders=1, max_num_seqs_waiting=5, max_loop_lag_ms=200))
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
    admission = Admission(_limits())
    admission.loop_lag, admission.engine_waiting = 10.0, 10**6
    admission.observe_output_delay(10.0)
    tickets = [admission.admit() for _ in range(1000)]
    assert admission.in_flight == len(tickets)


def test_delay_gate_shuts_above_the_budget_and_opens_at_half() -> None:
    gate = DelayGate(0.2)
    samples = [0.0, 0.15, 0.2, 0.21, 0.19, 0.15, 0.101, 0.1, 0.15, 0.3, 0.05]
    states = [gate.observe(d) for d in samples]
    # 0.2 itself is within the budget; above it the gate shuts and stays shut until <= 0.1.
    assert states == [False, False, False, True, True, True, True, False, False, True, False]
    assert gate.shut_count == 2
    assert not DelayGate(0.0).observe(100.0)  # 0: off


def test_output_delay_sheds_with_503_until_the_backlog_drains() -> None:
    admission = Admission(_limits(max_output_delay_ms=200, max_concurrent_requests=10))
    first = admission.admit()
    admission.observe_output_delay(0.35)
    err = refusal(admission)
    assert (err.status, err.retry_after) == (503, 1)
    assert "waits 350 ms" in err.message and "under 100 ms" in err.message
    admission.observe_output_delay(0.15)  # better, but not yet under half the budget
    assert refusal(admission).status == 503
    admission.observe_output_delay(0.08)
    second = admission.admit()
    assert admission.in_flight == 2  # refusals never took a slot
    assert admission.rejected == {"output_delay": 2}
    first.release()
    second.release()

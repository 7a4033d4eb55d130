"""The engine's stats-only messages (``engine.output_pump.Heartbeat``) and admission's rule on stale
engine stats: pure, no clock but the numbers passed in."""

from __future__ import annotations

import math

from trioserve.config import AdmissionConfig, override
from trioserve.engine.output_pump import Heartbeat
from trioserve.frontend.request.admission import STATS_MAX_AGE, Admission
from trioserve.frontend.request.errors import ApiError
from trioserve.protocol.messages import EngineStats


def _limits(**limits: float) -> AdmissionConfig:
    """Only the limits given; every other one off (0)."""
    off = {name: 0 for name in AdmissionConfig.__struct_fields__}
    return override(AdmissionConfig(), **{**off, **limits})


def test_idle_report_goes_to_the_clients_that_did_not_just_get_the_last_step() -> None:
    beat = Heartbeat(3, interval=1.0)
    assert beat.owed(0.0, has_work=False) == [0, 1, 2]  # the first check greets every API server
    for client in range(3):
        beat.sent(client, 0.0)
    assert beat.owed(0.1, has_work=True) == []
    beat.sent(0, 0.2)  # the step in which the last request (client 0's) finished
    assert beat.owed(0.2, has_work=False) == [1, 2]  # 0 already has that step's stats
    for client in (1, 2):
        beat.sent(client, 0.2)
    assert beat.owed(0.3, has_work=False) == []  # reported once, not again
    assert beat.next_due() == 1.2


def test_heartbeats_while_idle_and_to_a_client_that_only_waits_while_busy() -> None:
    beat = Heartbeat(2, interval=1.0)
    for client in beat.owed(0.0, has_work=False):
        beat.sent(client, 0.0)
    # Idle: both hear from the engine once per interval, exactly when due.
    due = beat.next_due()
    assert due == 1.0 and beat.owed(due, has_work=False) == [0, 1]
    for client in (0, 1):
        beat.sent(client, due)
    # Busy with client 0's requests only (a step every 10 ms): client 1's requests all wait, and
    # it still hears the engine's stats every interval; client 0 never needs a heartbeat.
    owed_at = []
    for i in range(1, 301):
        now = 1.0 + i / 100
        beat.sent(0, now)
        owed = beat.owed(now, has_work=True)
        assert owed in ([], [1])
        if owed:
            owed_at.append(now)
            beat.sent(1, now)
    assert owed_at == [2.0, 3.0, 4.0]


def test_next_due_is_exactly_when_owed() -> None:
    """A loop that sleeps until ``next_due`` must find the heartbeat owed when it wakes (no spin on a
    rounding error: for some ``last``, ``last + 1.0 - last < 1.0`` in floating point)."""
    beat = Heartbeat(1, interval=1.0)
    beat.owed(0.0, has_work=False)
    beat.sent(0, 3.5249084225973104)
    due = beat.next_due()
    assert due - 3.5249084225973104 < 1.0  # the rounding that would make ``now - last >= interval`` false
    assert beat.owed(due, has_work=False) == [0]
    assert Heartbeat(0).next_due() == math.inf


def test_admission_never_refuses_on_stale_engine_stats() -> None:
    admission = Admission(_limits(max_num_seqs_waiting=2))
    busy = EngineStats(num_waiting=65, num_running=256)
    admission.observe_engine_stats([(busy, 0.5)])
    try:
        admission.admit()
    except ApiError as exc:
        assert exc.status == 503 and "65 requests are waiting" in exc.message
    else:
        raise AssertionError("fresh stats over the cap must refuse")
    # The same counts, older than the bound: unknown, so not a reason to refuse.
    admission.observe_engine_stats([(busy, STATS_MAX_AGE + 0.1)])
    assert admission.engine_waiting == 0 and admission.engine_stats_stale == 1
    admission.admit().release()
    # Several engines: only the fresh ones count.
    admission.observe_engine_stats([(busy, STATS_MAX_AGE * 2), (EngineStats(1, 3), 0.1)])
    assert admission.engine_waiting == 1
    admission.admit().release()
    assert admission.rejected == {"max_num_seqs_waiting": 1}

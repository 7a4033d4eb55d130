"""Admission control: refuse at the door, fast and loudly, instead of queueing into TTFT.

A request takes a slot before it is rendered and gives it back on every exit path (finished, failed,
disconnected, aborted, cancelled): ``Serving`` holds the ticket in a ``try`` and its response releases
it when it leaves the active set. Which status a refusal gets, and why:

- **429** when this API server already has ``--max-concurrent-requests`` in flight: a per-server
  capacity limit; the client (or its balancer) should retry later or elsewhere.
- **503** when the server is overloaded: the renderer queue is full (``--max-pending-renders``), the
  engine's waiting queue is at ``--max-num-seqs-waiting``, or the event loop lags more than
  ``--max-loop-lag-ms`` (then every stream already running is late too, and a new one would only add
  to that).

Both carry ``Retry-After``. Pure: the caller feeds it the loop lag and the engine's queue stats.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from trioserve.frontend.errors import ApiError


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_concurrent_requests: int = 0  # 0: no limit
    max_pending_renders: int = 0  # 0: no limit
    max_num_seqs_waiting: int = 0  # 0: no limit
    max_loop_lag: float = 0.0  # seconds; 0: no shedding
    retry_after: int = 1


class Ticket:
    """One admitted request's slot; ``release`` is idempotent so every exit path may call it."""

    __slots__ = ("_admission", "released")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission.in_flight -= 1


class Admission:
    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.in_flight = 0
        self.rendering = 0
        self.engine_waiting = 0  # from the engine's latest stats
        self.loop_lag = 0.0  # seconds, from the loop-lag monitor
        self.rejected: Counter[str] = Counter()  # by reason

    def _refuse(self, status: int, reason: str, message: str) -> ApiError:
        self.rejected[reason] += 1
        return ApiError(status, message, retry_after=self.limits.retry_after)

    def admit(self) -> Ticket:
        """A slot for a new request, or the ApiError (429/503) that refuses it."""
        lim = self.limits
        if lim.max_loop_lag and self.loop_lag > lim.max_loop_lag:
            raise self._refuse(
                503,
                "loop_lag",
                f"server overloaded: its event loop is {self.loop_lag * 1e3:.0f} ms behind "
                f"(limit {lim.max_loop_lag * 1e3:.0f} ms); retry later",
            )
        if lim.max_concurrent_requests and self.in_flight >= lim.max_concurrent_requests:
            raise self._refuse(
                429,
                "max_concurrent_requests",
                f"this server is at its limit of {lim.max_concurrent_requests} concurrent requests; "
                "retry later",
            )
        if lim.max_pending_renders and self.rendering >= lim.max_pending_renders:
            raise self._refuse(
                503,
                "max_pending_renders",
                f"server overloaded: {self.rendering} requests are waiting to render",
            )
        if lim.max_num_seqs_waiting and self.engine_waiting >= lim.max_num_seqs_waiting:
            raise self._refuse(
                503,
                "max_num_seqs_waiting",
                f"server overloaded: {self.engine_waiting} requests are waiting in the engine",
            )
        self.in_flight += 1
        return Ticket(self)

    @contextmanager
    def rendering_slot(self) -> Iterator[None]:
        self.rendering += 1
        try:
            yield
        finally:
            self.rendering -= 1

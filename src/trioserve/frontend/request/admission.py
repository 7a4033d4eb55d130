"""Admission control: refuse at the door, fast and loudly, instead of queueing into TTFT.

A request takes a slot before it is rendered and gives it back on every exit path (finished, failed,
disconnected, aborted, cancelled): ``Serving`` holds the ticket in a ``try`` and its response releases
it when it leaves the active set. Which status a refusal gets, and why:

- **429** when this API server already has ``--max-concurrent-requests`` in flight: a per-server
  capacity limit; the client (or its balancer) should retry later or elsewhere.
- **503** when the server is overloaded: the renderer queue is full (``--max-pending-renders``), the
  engine's waiting queue is at ``--max-num-seqs-waiting``, the event loop lags more than
  ``--max-loop-lag-ms`` (then every stream already running is late too, and a new one would only add
  to that), or engine output waits longer than ``--max-output-delay-ms`` before the output handler
  takes it (the API server cannot keep up with the streams it has; a new one would wait that long for
  its first token, and slow every other one further): then ``DelayGate`` refuses new requests until
  the delay is back under half the budget. This is the default that refuses at the door on its own: it
  needs no capacity figure, only a latency budget.

- **503** when an engine is *stalled* (``engine_health.py``: nothing has arrived from it for longer
  than its stall bound, so its steps or its heartbeat stopped): a new request would hang with it.

Both carry ``Retry-After``. Pure: the caller feeds it the loop lag, the output delay, the engines'
queue stats with their age, and an engine stall.

Rule on engine stats: stats older than ``STATS_MAX_AGE`` (3 * ``HEARTBEAT_INTERVAL``; an engine that
works sends them every step and one that idles every interval) are *unknown*, and admission never
refuses on unknown stats (a stalled engine is refused on its own, above). Frozen counts from before a
disconnect storm must not lock the server out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from trioserve.config import AdmissionConfig
from trioserve.frontend.engine_health import Stall
from trioserve.frontend.request.errors import ApiError
from trioserve.protocol.messages import HEARTBEAT_INTERVAL, EngineStats

STATS_MAX_AGE = 3 * HEARTBEAT_INTERVAL  # seconds; older engine stats are unknown


class DelayGate:
    """Hysteresis on a delay signal, so shedding does not flap: the gate shuts when a sample exceeds
    ``budget`` and opens again only once a sample is at or below ``budget * resume`` (in between it
    keeps its state). ``budget`` 0: never shuts."""

    __slots__ = ("budget", "delay", "resume", "shut", "shut_count")

    def __init__(self, budget: float, resume: float = 0.5) -> None:
        self.budget = budget
        self.resume = resume
        self.delay = 0.0  # the latest sample, seconds
        self.shut = False
        self.shut_count = 0  # times it shut (one per shedding episode)

    def observe(self, delay: float) -> bool:
        """Feed one sample (seconds); returns whether the gate is now shut."""
        self.delay = delay
        if not self.budget:
            return False
        if delay > self.budget:
            if not self.shut:
                self.shut = True
                self.shut_count += 1
        elif delay <= self.budget * self.resume:
            self.shut = False
        return self.shut


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
    def __init__(self, limits: AdmissionConfig, retry_after: int = 1) -> None:
        """``limits``: a 0 turns that limit off. ``retry_after``: the refusals' Retry-After (s)."""
        self.limits = limits
        self.retry_after = retry_after
        self.in_flight = 0
        self.rendering = 0
        self.engine_waiting = 0  # from the engines' latest stats that are not stale
        self.engine_stats_stale = 0  # engines whose stats are older than STATS_MAX_AGE
        self.engine_stall: Stall | None = None  # a stalled engine, from ``EngineHealth``
        self.loop_lag = 0.0  # seconds, from the loop-lag monitor
        # How long engine output produced now would wait before the output handler takes it
        # (seconds): the caller feeds the estimate (``observe_output_delay``) before each ``admit``.
        self.output_delay = DelayGate(limits.max_output_delay_ms / 1e3)
        self.rejected: Counter[str] = Counter()  # by reason

    def observe_output_delay(self, delay: float) -> None:
        self.output_delay.observe(delay)

    def observe_engine_stats(self, stats: list[tuple[EngineStats, float]]) -> None:
        """Each engine's latest stats with their age (seconds); stale ones count as unknown."""
        fresh = [s for s, age in stats if age <= STATS_MAX_AGE]
        self.engine_waiting = sum(s.num_waiting for s in fresh)
        self.engine_stats_stale = len(stats) - len(fresh)

    def _refuse(self, status: int, reason: str, message: str) -> ApiError:
        self.rejected[reason] += 1
        return ApiError(status, message, retry_after=self.retry_after)

    def admit(self) -> Ticket:
        """A slot for a new request, or the ApiError (429/503) that refuses it."""
        lim = self.limits
        stall = self.engine_stall
        if stall is not None:
            raise self._refuse(503, "engine_stalled", f"server unavailable: {stall.message}; retry later")
        max_lag = lim.max_loop_lag_ms / 1e3
        if max_lag and self.loop_lag > max_lag:
            raise self._refuse(
                503,
                "loop_lag",
                f"server overloaded: its event loop is {self.loop_lag * 1e3:.0f} ms behind "
                f"(limit {lim.max_loop_lag_ms:.0f} ms); retry later",
            )
        gate = self.output_delay
        if gate.shut:
            raise self._refuse(
                503,
                "output_delay",
                f"server overloaded: engine output waits {gate.delay * 1e3:.0f} ms here before reaching "
                f"clients (budget {lim.max_output_delay_ms:.0f} ms; new requests are refused until it "
                f"is under {lim.max_output_delay_ms * gate.resume:.0f} ms); retry later",
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

"""When an engine core tells the DP coordinator its load. Pure: the caller passes the time (its trio
clock) and the scheduler's counts.

The busy loop calls ``check(now, waiting, running, kv_usage)`` after each step (and when it goes
idle); a returned ``LoadReport`` is to be pushed to the coordinator now, and counts as sent.

Rules:

- **on change**: report when the waiting or running count differs from the last report, or KV usage
  moved by at least one percentage point (``KV_STEP``) from the last *reported* value (so a slow drift
  is reported once it adds up), and at least ``min_interval`` (10 ms) has passed since the last report.
  A change that comes sooner is held: the next check after ``min_interval`` reports the state then.
- **keep-alive**: report anyway once ``max_interval`` (1 s) has passed since the last report, changed
  or not (a coordinator that restarted learns the state within a second).
- The first check reports at once.

Invariants: reports are at least ``min_interval`` apart; a check at or after ``next_due`` reports
when the state it is given differs from the last report, and one at or after ``last +
max_interval`` always reports. The coordinator publishes at most every 100 ms anyway, so
``min_interval`` only bounds the engine's own cost (one small message per 10 ms at most).
"""

from __future__ import annotations

import math

from trioserve.protocol.messages import LoadReport

KV_STEP = 0.01  # a KV usage change this large (1 percentage point) is news
MIN_INTERVAL = 0.01  # seconds between two reports, at least
MAX_INTERVAL = 1.0  # seconds between two reports, at most
_EPS = 1e-9  # 0.57 - 0.56 < 0.01 in binary floating point


class LoadReporter:
    __slots__ = ("_last", "_last_sent", "_pending", "engine_index", "max_interval", "min_interval", "sent")

    def __init__(
        self, engine_index: int, min_interval: float = MIN_INTERVAL, max_interval: float = MAX_INTERVAL
    ) -> None:
        if not 0 <= min_interval <= max_interval:
            raise ValueError(f"need 0 <= min_interval <= max_interval, got {min_interval}, {max_interval}")
        self.engine_index = engine_index
        self.min_interval = min_interval
        self.max_interval = max_interval
        self._last: LoadReport | None = None  # the last report sent
        self._last_sent = -math.inf
        self._pending = False  # the last check saw a change it could not report yet
        self.sent = 0

    def _changed(self, waiting: int, running: int, kv_usage: float) -> bool:
        last = self._last
        return (
            last is None
            or waiting != last.num_waiting
            or running != last.num_running
            or abs(kv_usage - last.kv_usage) >= KV_STEP - _EPS
        )

    def check(self, now: float, waiting: int, running: int, kv_usage: float) -> LoadReport | None:
        """The report to send now, or None."""
        changed = self._changed(waiting, running, kv_usage)
        since = now - self._last_sent
        if not ((changed and since >= self.min_interval) or now >= self._last_sent + self.max_interval):
            self._pending = changed
            return None
        self._pending = False
        self._last_sent = now
        self._last = LoadReport(self.engine_index, waiting, running, kv_usage)
        self.sent += 1
        return self._last

    def next_due(self) -> float:
        """When a check would next report, if the state stays as the last check saw it (an idle loop
        sleeps until then)."""
        return self._last_sent + (self.min_interval if self._pending else self.max_interval)

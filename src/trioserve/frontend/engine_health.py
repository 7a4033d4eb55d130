"""Is an engine still stepping? A pure detector of a stalled engine core (or a hung worker behind it).

An engine talks to each API server at least every ``HEARTBEAT_INTERVAL``: busy, one message per step
(or a heartbeat when none of its running requests is ours); idle, a heartbeat. All of them come from
its busy loop between steps, so silence means the loop is not stepping: a forward that hangs (a
SIGSTOPped or deadlocked worker) or a stopped engine process. Nothing else tells: the process is
alive, its sockets are open.

**Rule.** The engine is *stalled* once nothing has arrived from it for longer than

    bound = max(floor, factor * p99 of its recent step intervals)

with ``floor`` = 3 * ``HEARTBEAT_INTERVAL`` (3 s: an idle engine has missed two heartbeats) and
``factor`` = 4. A step interval is the time between two consecutive messages where the first one's
stats show work (waiting or running requests); gaps that follow an idle report are heartbeat gaps and
are not step intervals. The last ``window`` (256) intervals count, so the bound follows the engine:
10 ms decode steps give the floor, a CPU model whose prefill chunks take 2 s gives 8 s. An interval
that ended a stall is recorded as the bound it exceeded, not its length (it may be a stopped process
rather than a step; a minute of SIGSTOP must not raise the bound to four minutes). What the rule
cannot know is a step far longer than any before it (a huge prefill right after start-up): that reads
as a stall until the step ends, and ends the stall then; if steps that long go on, the bound grows
to them within a few (once they are more than 1 % of the window).

While the API server itself stops reading (its output queue is full under the ``block`` policy) the
silence is its own: ``pause`` and ``resume`` bracket that, and the clock restarts at ``resume``.

Time is the API server's trio clock at arrival, passed in; the engine's own timestamps (another
process's wall clock, maybe another host's) are never compared with it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from trioserve.protocol.messages import HEARTBEAT_INTERVAL, EngineStats

STALL_FLOOR = 3 * HEARTBEAT_INTERVAL  # seconds
STALL_FACTOR = 4.0
STALL_WINDOW = 256  # step intervals remembered


@dataclass(frozen=True, slots=True)
class Stall:
    """Why an engine is stalled (as of ``state``)."""

    engine_index: int
    silence: float  # seconds since anything arrived from it
    bound: float

    @property
    def message(self) -> str:
        return (
            f"engine {self.engine_index} is stalled: nothing from it for {self.silence:.1f} s "
            f"(bound {self.bound:.1f} s)"
        )


class EngineHealth:
    __slots__ = (
        "_bound",
        "_busy",
        "_intervals",
        "_last",
        "_last_bound",
        "_paused",
        "engine_index",
        "factor",
        "floor",
        "stall_count",
        "stalled_since",
    )

    def __init__(
        self,
        engine_index: int,
        now: float,
        *,
        floor: float = STALL_FLOOR,
        factor: float = STALL_FACTOR,
        window: int = STALL_WINDOW,
    ) -> None:
        self.engine_index = engine_index
        self.floor = floor
        self.factor = factor
        self._intervals: deque[float] = deque(maxlen=window)
        self._bound: float | None = floor  # None: recompute from the intervals
        self._last_bound = floor  # the latest computed bound
        self._last = now  # the engine joined: the clock starts
        self._busy = False  # the last message's stats showed work
        self._paused = False
        self.stalled_since: float | None = None  # set by ``update`` (the watcher's view)
        self.stall_count = 0  # stall episodes ``update`` saw begin

    # ---- fed by the reader of the engine's socket ----------------------------------------------------

    def observe(self, now: float, stats: EngineStats | None = None) -> None:
        """A message from the engine arrived (``stats``: the queue stats it carried, if any)."""
        if self._busy and not self._paused:
            # An interval that ended a stall counts as the bound it exceeded: it may be a stopped
            # process, not a step, and a minute of SIGSTOP must not blind the detector afterwards.
            # (The bound as last computed: re-sorting the window per message would cost more than
            # the rest of this method; it is recomputed when read.)
            self._intervals.append(min(now - self._last, self._last_bound))
            self._bound = None
        self._last = now
        if stats is not None:
            self._busy = bool(stats.num_running or stats.num_waiting)

    def pause(self) -> None:
        """The reader stops reading for a while (its consumer is full): silence is not the engine's."""
        self._paused = True

    def resume(self, now: float) -> None:
        self._paused = False
        self._last = now

    # ---- read by /health, admission, metrics, the watcher ------------------------------------------

    def bound(self) -> float:
        bound = self._bound
        if bound is None:
            ordered = sorted(self._intervals)
            p99 = ordered[int(0.99 * (len(ordered) - 1))]
            bound = self._bound = self._last_bound = max(self.floor, self.factor * p99)
        return bound

    def silence(self, now: float) -> float:
        return 0.0 if self._paused else max(0.0, now - self._last)

    def deadline(self) -> float:
        """When it becomes stalled if nothing arrives (infinite while paused)."""
        return float("inf") if self._paused else self._last + self.bound()

    def state(self, now: float) -> Stall | None:
        """None while healthy; else why it is stalled (from ``deadline()`` on)."""
        if now < self.deadline():
            return None
        return Stall(self.engine_index, now - self._last, self.bound())

    def update(self, now: float) -> tuple[str, float] | None:
        """Track stall episodes for logs and counters: ``("stalled", silence)`` when one begins,
        ``("resumed", duration)`` when it ends, else None."""
        stall = self.state(now)
        if stall is not None and self.stalled_since is None:
            self.stalled_since = self._last
            self.stall_count += 1
            return ("stalled", stall.silence)
        if stall is None and self.stalled_since is not None:
            duration = self._last - self.stalled_since
            self.stalled_since = None
            return ("resumed", duration)
        return None

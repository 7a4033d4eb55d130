"""Is an engine still stepping? A pure detector of a stalled engine core (or a hung worker behind it).

An engine talks to each API server at least every ``HEARTBEAT_INTERVAL``: busy, one message per step
(or a heartbeat when none of its running requests is ours); idle, a heartbeat; and in the middle of a
step that runs longer, a heartbeat too, with the step's state in its stats. So two questions have two
answers, and the engine is *stalled* when either says so:

1. **Is the engine core alive?** Silence answers it: even mid-step, its messages are at most about a
   heartbeat interval apart, so only a stopped or hung engine core process goes silent.
2. **Is the running step overdue?** Only the engine core can judge (it knows the step's token count
   and how long its steps took: ``engine/step_watch.py``), and it says so in every message sent while
   the step runs (``EngineStats.step_overdue``): a forward that hangs (a SIGSTOPped or deadlocked
   worker) is told that way. Silence alone cannot tell a hang from a long step: a CPU model's
   2048-token prefill chunk takes 5-9 s after a run of 10 ms decode steps.

Nothing else tells: the process is alive, its sockets are open.

**Rule.** The engine is *stalled* while the last message from it reported its running step overdue
(until a message says otherwise: the step returned), or once nothing has arrived from it for longer than

    bound = max(floor, factor * p99 of its recent step intervals)

with ``floor`` = 3 * ``HEARTBEAT_INTERVAL`` (3 s: an idle engine has missed two heartbeats) and
``factor`` = 4. A step interval is the time between two consecutive messages where the first one's
stats show work (waiting or running requests); gaps that follow an idle report are heartbeat gaps and
are not step intervals. The last ``window`` (256) intervals count, so the bound follows the engine.
With mid-step heartbeats no interval is much longer than a heartbeat interval, so the bound stays at
or near the floor whatever the steps take (from an engine core without them, 10 ms decode steps give
the floor and 2 s prefill chunks 8 s). An interval that ended a stall is recorded as the
bound it exceeded, not its length (a minute of SIGSTOP must not raise the bound to four minutes).

While the API server itself stops reading (its output queue is full under the ``block`` policy) the
silence is its own: ``pause`` and ``resume`` bracket that, and the clock restarts at ``resume``. While
paused the engine is not stalled by either rule (a dead engine's health is paused too: it is reported
as dead, not stalled).

Time is the API server's trio clock at arrival, passed in; the engine's own timestamps (another
process's wall clock, maybe another host's) are never compared with it. An overdue step's reported
``step_elapsed`` is a duration: the time since its message arrived is added to it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from trioserve.protocol.messages import HEARTBEAT_INTERVAL, EngineStats

STALL_FLOOR = 3 * HEARTBEAT_INTERVAL  # seconds
STALL_FACTOR = 4.0
STALL_WINDOW = 256  # step intervals remembered


@dataclass(frozen=True, slots=True)
class Stall:
    """Why an engine is stalled (as of ``state``): silent for longer than ``bound``, or (``step_tokens``
    > 0) its running step reported overdue."""

    engine_index: int
    silence: float  # seconds since anything arrived from it
    bound: float  # its silence bound
    step_tokens: int = 0  # an overdue step: its scheduled tokens (0: a silent engine) ...
    step_elapsed: float = 0.0  # ... how long it has run (as reported, plus the time since) ...
    step_bound: float = 0.0  # ... and the engine's bound for it

    @property
    def overdue(self) -> bool:
        return self.step_tokens > 0

    @property
    def reason(self) -> str:
        if self.overdue:
            return (
                f"its step of {self.step_tokens} tokens has run {self.step_elapsed:.1f} s "
                f"(bound {self.step_bound:.1f} s)"
            )
        return f"nothing from it for {self.silence:.1f} s (bound {self.bound:.1f} s)"

    @property
    def message(self) -> str:
        return f"engine {self.engine_index} is stalled: {self.reason}"


class EngineHealth:
    __slots__ = (
        "_bound",
        "_busy",
        "_intervals",
        "_last",
        "_last_bound",
        "_overdue",
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
        self._overdue: EngineStats | None = None  # the last message's stats, if they say overdue
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
            self._overdue = stats if stats.step_overdue else None

    @property
    def overdue(self) -> bool:
        """The last message reported the engine's running step overdue."""
        return self._overdue is not None

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
        """None while healthy; else why it is stalled: silent from ``deadline()`` on (that wins: the
        engine core itself has stopped), or its step reported overdue."""
        if self._paused:
            return None
        silence = now - self._last
        if now >= self.deadline():
            return Stall(self.engine_index, silence, self.bound())
        step = self._overdue
        if step is None:
            return None
        return Stall(
            self.engine_index,
            silence,
            self.bound(),
            step_tokens=max(step.step_tokens, 1),
            step_elapsed=step.step_elapsed + max(0.0, silence),
            step_bound=step.step_bound,
        )

    def update(
        self, now: float
    ) -> tuple[Literal["stalled"], Stall] | tuple[Literal["resumed"], float] | None:
        """Track stall episodes for logs and counters: ``("stalled", why)`` when one begins,
        ``("resumed", duration)`` when it ends (``duration``: from the last message before it to the
        one that ended it), else None."""
        stall = self.state(now)
        if stall is not None and self.stalled_since is None:
            # Silent: since the last message. Overdue: since the message that said so (this is
            # called on its arrival).
            self.stalled_since = self._last
            self.stall_count += 1
            return ("stalled", stall)
        if stall is None and self.stalled_since is not None:
            duration = self._last - self.stalled_since
            self.stalled_since = None
            return ("resumed", duration)
        return None

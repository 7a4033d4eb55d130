"""Is the running step overdue? A pure judge, kept by the engine core, of how long a step may take here.

An API server can tell whether the engine core is alive (its messages keep coming, mid-step too), not
whether the step it is running should have ended: a 2048-token prefill chunk of a CPU model takes
seconds (SmolLM2-135M on one thread: 2.3 s for 512 tokens, 5-9 s for 2048) where its decode steps take
tens of milliseconds. Only the engine core knows the size of each step and how long steps took on this
model and hardware, so it judges, and says so in its stats (``EngineStats.step_overdue``).

**Rule.** A step of ``tokens`` scheduled tokens that has run for ``elapsed`` seconds is *overdue* once
``elapsed >= bound(tokens)``, where

    bound(tokens) = min(ceiling, max(floor, factor * max over recent steps i of
                                      duration_i * max(1, tokens / tokens_i)))

with ``floor`` = 3 s, ``factor`` = 4 and the last ``window`` (256) completed steps. Each recent step
predicts the new one: at least its own duration (a smaller step is not assumed faster, so a decode
right after a long prefill is not judged by the decodes), and linearly more for more tokens. Linear
scaling from smaller steps overestimates a big step (a batch of tokens costs less per token than a lone
decode token), which only makes a hang in a big step slower to show, never a false alarm.

- Before any step has completed the bound is ``first`` (60 s): nothing is known yet, and the first
  forwards may allocate and warm up.
- ``ceiling`` (the worker's hard ``--worker-step-timeout``, when there is one) caps every bound: by
  then the worker executor fails the step anyway.
- A step that ran past its bound is recorded as that bound, not its length: it may have been a stopped
  worker, and a minute of SIGSTOP must not make four minutes the next bound. Steps that really became
  slower still raise the bound by ``factor`` per overdue step, so it catches up within a few.

Time is whatever clock the caller passes (the engine core's trio clock); this module never reads one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

STEP_FLOOR = 3.0  # seconds: no step is overdue sooner
STEP_FACTOR = 4.0
FIRST_STEP_BOUND = 60.0  # seconds, before any step has completed
STEP_WINDOW = 256  # completed steps remembered


@dataclass(frozen=True, slots=True)
class RunningStep:
    number: int  # steps started before this one
    tokens: int
    started: float


class StepWatch:
    __slots__ = ("_history", "ceiling", "factor", "first", "floor", "running", "started_count")

    def __init__(
        self,
        *,
        floor: float = STEP_FLOOR,
        factor: float = STEP_FACTOR,
        first: float = FIRST_STEP_BOUND,
        window: int = STEP_WINDOW,
        ceiling: float | None = None,
    ) -> None:
        self.floor = floor
        self.factor = factor
        self.first = first
        self.ceiling = float("inf") if ceiling is None else ceiling
        self._history: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, duration)
        self.running: RunningStep | None = None
        self.started_count = 0

    def start(self, tokens: int, now: float) -> RunningStep:
        """A step of ``tokens`` scheduled tokens begins (the busy loop, right before the forward)."""
        step = self.running = RunningStep(self.started_count, tokens, now)
        self.started_count += 1
        return step

    def end(self, now: float) -> RunningStep | None:
        """The running step returned: it joins the history (capped at its bound, see the rules). Cheap
        for a step shorter than the floor (its bound need not be computed)."""
        step = self.running
        if step is None:
            return None
        self.running = None
        duration = now - step.started
        if duration >= self.min_bound:
            duration = min(duration, self.bound(step.tokens))
        self._history.append((max(step.tokens, 1), duration))
        return step

    @property
    def min_bound(self) -> float:
        """No bound is lower: a step younger than this is never overdue."""
        return min(self.floor, self.first, self.ceiling)

    def bound(self, tokens: int) -> float:
        """How long a step of ``tokens`` tokens may run before it is overdue (O(window))."""
        history = self._history
        if not history:
            return min(self.first, self.ceiling)
        predicted = max(duration * max(1.0, tokens / done) for done, duration in history)
        return min(self.ceiling, max(self.floor, self.factor * predicted))

    def overdue(self, tokens: int, elapsed: float) -> bool:
        """Whether a step of ``tokens`` tokens that has run ``elapsed`` seconds is overdue (the bound
        is only computed for one older than ``min_bound``)."""
        return elapsed >= self.min_bound and elapsed >= self.bound(tokens)

    def overdue_at(self, now: float) -> float:
        """When to look again whether the running step is overdue (infinite with none running): the
        moment it becomes overdue once it is older than ``min_bound``; before that, that age, so that a
        loop asking per step never computes the bound of a short one."""
        step = self.running
        if step is None:
            return float("inf")
        if now < step.started + self.min_bound:
            return step.started + self.min_bound
        return step.started + self.bound(step.tokens)

    def overdue_now(self, now: float) -> bool:
        """Whether the running step is overdue at ``now``: exactly ``now >= overdue_at(now)`` (not
        ``now - started >= bound``, which can round the other way, so a loop woken at
        ``overdue_at`` would find it not yet overdue and wake again at once, forever)."""
        return self.running is not None and now >= self.overdue_at(now)

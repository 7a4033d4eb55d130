"""Learn a CPU worker's intra-op thread count from its traffic, with bit-exact shadow passes.

A pure decision object (issue 15, seed 002 "Learn the thread count from traffic", design §10): no
torch, no trio, no I/O, no clock. The worker serves each step, then tells the learner; the learner
says whether to re-run that step as a timed *shadow pass* at some thread count, and the worker reports
how long the shadow took and whether its logits' bytes equal the served answer's. Times (``now``) and
timings (``seconds``) are plain floats passed in; logits are compared as ``bytes``.

Modes (``TRIOSERVE_CPU_ADAPTIVE_THREADS``):

- ``0``: off. Nothing is learned or scheduled; ``serve_count`` is always the configured count.
- ``1``: learn and report. Every step is served at the configured count; the learned table goes to
  the log (``learned`` events) and to ``view()``. Point ``--worker-threads`` at it to apply it.
- ``2``: also serve the learned count of a range once it passed the transition window (below).

States: ``off`` (mode 0) | ``waiting_golden`` -> ``warming`` -> ``learning`` -> ``retired`` (with a
reason). ``retired`` is final: nothing is scheduled again and every step is served at the configured
count from then on.

Rules:

- **Golden gate.** Nothing is scheduled before ``on_golden(True)``: the worker's start-up golden check
  (a fixed prompt whose output it computes and compares) must pass first. A failed golden check
  retires at once (reason ``golden check failed``), so a host that fails it never learns. With fewer
  than two allowed counts there is nothing to choose; the gate then retires with reason
  ``nothing to learn``.
- **Warm pass first.** The first shadow after the gate is a *warm* pass at the configured count: it
  brings the shadow path's caches in (weights, scratch buffers, the OpenMP team) so they stay out of
  the timings. Its time is not a sample. It must still reproduce the served answer (same count, same
  input): if it does not, the host is not even deterministic at one count, and learning retires.
- **Ranges.** Timings are kept per input-size range: a step of ``t >= 1`` tokens (all tokens the
  forward computes, prefill and decode together) falls in range ``size_range(t)``, the smallest power
  of two ``>= t``. Range ``r`` holds ``r // 2 + 1 .. r`` tokens: 1 -> 1, 2 -> 2, 3..4 -> 4, 5..8 -> 8.
- **Candidates.** The allowed counts: ``1 .. configured``, or a given list that must hold the
  configured count. The configured count is a candidate like the others: its timings also come from
  shadow passes, so every count is timed the same way (a shadow re-runs an input the served pass has
  just brought into the caches; served passes are timed separately and only reported).
- **Pacing (the shadow cost bound).** At most one shadow pass is *planned* per ``shadow_every`` (K,
  default 10) served steps: a plan is made on a served step only if at least K served steps have
  passed since the step of the previous plan, and only one plan is outstanding at a time. So shadow
  forwards are at most one per K served forwards (plus nothing else), about 1/K more forward work;
  a shadow at fewer threads than the configured count takes longer but no more CPU time in total,
  roughly. ``view()`` reports the shadow passes run and their seconds (wall, and wall x threads).
  An abandoned plan (the worker could not run it) still used its slot.
  ``would_plan(t)`` says, changing nothing, whether ``on_served(t)`` called next would plan: the
  worker copies a served step's logits only for a step that will be shadowed.
- **Choice.** A plan for a step whose range is still learning takes the candidate with the fewest
  verified samples in that range (ties: the smallest count). A range in its transition window always
  shadows its learned count. A range that is done (learned in mode 1, or learned at the configured
  count, or serving) plans nothing: the learned setting reflects the load seen while learning (seed:
  "relearn by restarting the worker").
- **Exactness (the drift rule).** A shadow pass counts only if its logits reproduced the served answer
  bit for bit. One mismatch, at any count and in any range, retires learning for good with a reason
  naming the range and the count, and ``serve_count`` falls back to the configured count at once.
- **Medians.** Per range and count, the verified timings are kept in a window of the latest
  ``window`` (default 16) samples; the median is over that window (even sizes: the mean of the middle
  two). The verified *count* is not bounded by the window.
- **Fastest.** A range's fastest count is decided once, when every candidate has at least
  ``min_samples`` (M, default 5) verified samples in it: the smallest median, ties to the smaller count.
  It is logged (``learned``, with the medians). It is not revised afterwards.
- **Transition window (mode 2).** A range whose fastest count differs from the configured one then
  shadows only that count, on further served steps of the range. After ``transition`` (W, default 8)
  more verified passes (W more real inputs of that range, each bit-identical to the served answer)
  ``serve_count`` returns the learned count for the range, from the next step on (``serving_changed``
  event). So a learned count has matched M + W served answers of its range before it serves one. A
  mismatch inside the window retires like any other. Bit-identity across counts is a property of the
  host and its kernels (input-dependent drift on x86): a host that drifts only on inputs the window
  never saw can still move an answer, so mode 2 is for hosts whose records vouch for them.
- **Retiring** keeps the learned table for the view, turns ranges that were verifying or serving back
  to ``learned``, logs ``serving_changed`` back to the configured count for each range that served a
  learned count, and logs ``retired`` with the reason. A shadow result that arrives after retiring
  only adds to the shadow totals.

Events (``take_events``, an outbox the shell drains and logs): ``learned`` (range, fastest count,
medians), ``retired`` (reason; range and count when a pass drifted), ``serving_changed`` (range, the
count now served, the previous one).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from trioserve.protocol.thread_report import (
    REASON_CHARS,
    LearnerState,
    RangeStatus,
    ThreadRange,
    WorkerThreads,
)

SHADOW_EVERY = 10  # K: at most one shadow pass per this many served steps
MIN_SAMPLES = 5  # M: verified samples per candidate and range before the fastest is decided
TRANSITION = 8  # W: further verified passes of the learned count before mode 2 serves it
WINDOW = 16  # the latest verified samples per range and count that the median is taken over

ThreadEventKind = Literal["learned", "retired", "serving_changed"]
Bytes = bytes | bytearray | memoryview  # a logits tensor's bytes (e.g. ``tensor.numpy().tobytes()``)


def size_range(tokens: int) -> int:
    """The input-size range of a step of ``tokens`` tokens: the smallest power of two >= tokens."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"a step has at least one token, got {tokens!r}")
    return 1 << (tokens - 1).bit_length()


def range_tokens(rng: int) -> tuple[int, int]:
    """The token counts range ``rng`` holds, first and last: ``(rng // 2 + 1, rng)``."""
    return rng // 2 + 1, rng


def _positive(name: str, value: int, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _check_seconds(seconds: float) -> None:
    if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"a timing must be a finite number of seconds >= 0, got {seconds!r}")


@dataclass(frozen=True, slots=True)
class LearnerRules:
    """The learner's settings. ``candidates`` empty: every count ``1 .. configured``."""

    mode: int
    configured: int
    candidates: tuple[int, ...] = ()
    shadow_every: int = SHADOW_EVERY
    min_samples: int = MIN_SAMPLES
    transition: int = TRANSITION
    window: int = WINDOW

    def __post_init__(self) -> None:
        if self.mode not in (0, 1, 2) or isinstance(self.mode, bool):
            raise ValueError(f"mode must be 0, 1 or 2, got {self.mode!r}")
        _positive("configured", self.configured)
        for count in self.candidates:
            _positive("a candidate count", count)
        if self.candidates and self.configured not in self.candidates:
            raise ValueError(f"candidates {list(self.candidates)} must hold the configured count")
        _positive("shadow_every", self.shadow_every)
        _positive("min_samples", self.min_samples)
        _positive("transition", self.transition)
        _positive("window", self.window)

    @property
    def allowed(self) -> tuple[int, ...]:
        """The candidate counts, ascending and distinct."""
        if self.candidates:
            return tuple(sorted(set(self.candidates)))
        return tuple(range(1, self.configured + 1))


@dataclass(frozen=True, slots=True)
class ShadowPlan:
    """Re-run the step just served (``step_tokens`` tokens, in ``range``) at ``count`` threads, time
    it, and compare its logits' bytes with the served ones. ``warm``: the warm pass (not a sample)."""

    plan_id: int
    step_tokens: int
    range: int
    count: int
    warm: bool = False


@dataclass(frozen=True, slots=True)
class ThreadEvent:
    """Something the shell logs. ``at``: the ``now`` of the call that caused it."""

    kind: ThreadEventKind
    at: float
    reason: str = ""
    range: int | None = None
    count: int | None = None
    previous: int | None = None  # serving_changed: the count served before
    medians: tuple[tuple[int, float], ...] = ()  # learned: (count, median seconds), ascending count

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "at": self.at,
            "reason": self.reason,
            "range": self.range,
            "count": self.count,
            "previous": self.previous,
            "medians": {str(c): m for c, m in self.medians},
        }


class _Range:
    """One input-size range's record."""

    __slots__ = (
        "fastest",
        "learned_at",
        "samples",
        "served",
        "serving_since",
        "status",
        "steps",
        "transition_passes",
        "verified",
    )

    def __init__(self, allowed: Sequence[int], window: int) -> None:
        self.steps = 0  # served steps of this range
        self.samples: dict[int, deque[float]] = {c: deque(maxlen=window) for c in allowed}
        self.verified: dict[int, int] = dict.fromkeys(allowed, 0)  # all verified passes, unbounded
        self.served: dict[int, deque[float]] = {}  # served passes' own timings, per count served
        self.status: RangeStatus = "learning"
        self.fastest: int | None = None
        self.transition_passes = 0  # verified passes of ``fastest`` after it was decided (mode 2)
        self.learned_at: float | None = None
        self.serving_since: float | None = None


def _median(window: deque[float]) -> float | None:
    return statistics.median(window) if window else None


class ThreadLearner:
    """The learning rules of the module docstring, for one CPU worker."""

    def __init__(self, rules: LearnerRules) -> None:
        self.rules = rules
        self._allowed = rules.allowed
        self.state: LearnerState = "off" if rules.mode == 0 else "waiting_golden"
        self.reason: str | None = None
        self.retired_at: float | None = None
        self._ranges: dict[int, _Range] = {}
        self._pending: ShadowPlan | None = None
        self._next_id = 0
        self.served_steps = 0
        self._last_plan_step: int | None = None  # the served step the latest plan was made on
        self.plans_issued = 0
        self.plans_abandoned = 0
        self.shadow_passes = 0  # results received (warm ones and late ones included)
        self.shadow_seconds = 0.0  # their wall time
        self.shadow_thread_seconds = 0.0  # their wall time x their thread count (a CPU bound)
        self._events: list[ThreadEvent] = []

    # ------------------------------------------------------------------------------------ inputs

    def on_golden(self, passed: bool, now: float, detail: str = "") -> None:
        """The start-up golden check's outcome; only the first one, while waiting for it, counts."""
        if self.state != "waiting_golden":
            return
        if not passed:
            self._retire("golden check failed" + (f": {detail}" if detail else ""), now)
        elif len(self._allowed) < 2:
            self._retire(f"nothing to learn: one allowed count ({self._allowed[0]})", now)
        else:
            self.state = "warming"

    def on_served(self, step_tokens: int, now: float) -> ShadowPlan | None:
        """A step of ``step_tokens`` tokens was served (its answer is out): what to shadow, if anything."""
        rng = size_range(step_tokens)
        self.served_steps += 1
        if self.state == "off":
            return None
        self._range(rng).steps += 1
        choice = self._choose(rng, self.served_steps)
        if choice is None:
            return None
        count, warm = choice
        return self._plan(step_tokens, rng, count, warm=warm)

    def would_plan(self, step_tokens: int) -> bool:
        """Whether ``on_served(step_tokens)``, called next, would return a plan (changes nothing): the
        worker keeps the served logits' bytes only for a step that will be shadowed."""
        if self.state == "off":
            return False
        return self._choose(size_range(step_tokens), self.served_steps + 1) is not None

    def on_shadow(self, plan: ShadowPlan, seconds: float, logits_match: bool, now: float) -> None:
        """The outstanding ``plan`` ran for ``seconds``; ``logits_match``: its logits' bytes equal
        the served answer's."""
        _check_seconds(seconds)
        self._take_pending(plan)
        self.shadow_passes += 1
        self.shadow_seconds += seconds
        self.shadow_thread_seconds += seconds * plan.count
        if self.state not in ("warming", "learning"):
            return  # retired while it ran: only its cost is counted
        lo, hi = range_tokens(plan.range)
        if not logits_match:
            which = "the warm pass at the configured count" if plan.warm else "a shadow pass"
            self._retire(
                f"drift: {which} at {plan.count} threads did not reproduce the served answer "
                f"(range {plan.range}: {lo}..{hi} tokens)",
                now,
                rng=plan.range,
                count=plan.count,
            )
            return
        if plan.warm:
            self.state = "learning"
            return
        record = self._range(plan.range)
        record.samples[plan.count].append(float(seconds))
        record.verified[plan.count] += 1
        if record.status == "learning":
            if all(record.verified[c] >= self.rules.min_samples for c in self._allowed):
                self._decide(plan.range, record, now)
        elif record.status == "verifying" and plan.count == record.fastest:
            record.transition_passes += 1
            if record.transition_passes >= self.rules.transition:
                record.status = "serving"
                record.serving_since = now
                self._events.append(
                    ThreadEvent(
                        "serving_changed",
                        now,
                        "transition window passed",
                        plan.range,
                        record.fastest,
                        self.rules.configured,
                    )
                )

    def on_shadow_output(
        self, plan: ShadowPlan, seconds: float, served_logits: Bytes, shadow_logits: Bytes, now: float
    ) -> None:
        """``on_shadow`` with the two logits tensors' bytes: they match only if equal byte for byte."""
        self.on_shadow(plan, seconds, bytes(served_logits) == bytes(shadow_logits), now)

    def abandon(self, plan: ShadowPlan) -> None:
        """The worker could not run the outstanding ``plan``: drop it (its pacing slot stays used)."""
        self._take_pending(plan)
        self.plans_abandoned += 1

    def on_served_timing(self, step_tokens: int, count: int, seconds: float) -> None:
        """A served pass of ``step_tokens`` tokens took ``seconds`` at ``count`` threads (reported
        only: the choice of the fastest count uses shadow timings)."""
        _check_seconds(seconds)
        if self.state == "off":
            return
        if count not in self._allowed:
            raise ValueError(f"{count} threads is not an allowed count {list(self._allowed)}")
        served = self._range(size_range(step_tokens)).served
        served.setdefault(count, deque(maxlen=self.rules.window)).append(float(seconds))

    def retire(self, reason: str, now: float) -> None:
        """Stop learning for good (say a shadow pass raised); nothing happens once retired or off."""
        if self.state in ("warming", "learning", "waiting_golden"):
            self._retire(reason, now)

    # ----------------------------------------------------------------------------------- queries

    def serve_count(self, step_tokens: int) -> int:
        """The thread count to serve a step of ``step_tokens`` tokens at."""
        record = self._ranges.get(size_range(step_tokens))
        serving = self.rules.mode == 2 and self.state == "learning"
        if serving and record is not None and record.status == "serving" and record.fastest is not None:
            return record.fastest
        return self.rules.configured

    @property
    def pending(self) -> ShadowPlan | None:
        """The plan handed out and not yet reported or abandoned."""
        return self._pending

    def median(self, step_tokens_or_range: int, count: int) -> float | None:
        """The median verified shadow time of ``count`` in the range of ``step_tokens_or_range``."""
        record = self._ranges.get(size_range(step_tokens_or_range))
        if record is None or count not in record.samples:
            return None
        return _median(record.samples[count])

    def fastest(self, step_tokens_or_range: int) -> int | None:
        """The range's fastest count once decided, else None."""
        record = self._ranges.get(size_range(step_tokens_or_range))
        return None if record is None else record.fastest

    def table(self) -> dict[int, int]:
        """The learned table: range -> fastest count, for the ranges decided so far."""
        return {r: rec.fastest for r, rec in sorted(self._ranges.items()) if rec.fastest is not None}

    def take_events(self) -> list[ThreadEvent]:
        """The events since the last call, oldest first; the outbox is emptied."""
        events, self._events = self._events, []
        return events

    def report(self, rank: int = 0) -> WorkerThreads:
        """The learner as the worker reports it to /metrics and the inventory (protocol/thread_report.py)."""
        rules = self.rules
        ranges = {
            rng: ThreadRange(
                tokens=range_tokens(rng),
                status=rec.status,
                fastest=rec.fastest,
                serving=self.serve_count(rng),
                steps=rec.steps,
                medians={c: statistics.median(w) for c, w in rec.samples.items() if w},
                verified=dict(rec.verified),
                served_medians={c: statistics.median(w) for c, w in sorted(rec.served.items()) if w},
                transition_passes=rec.transition_passes,
                learned_at=rec.learned_at,
                serving_since=rec.serving_since,
            )
            for rng, rec in sorted(self._ranges.items())
        }
        return WorkerThreads(
            rank=rank,
            configured=rules.configured,
            mode=rules.mode,
            state=self.state,
            reason=None if self.reason is None else self.reason[:REASON_CHARS],
            retired_at=self.retired_at,
            candidates=list(self._allowed),
            shadow_every=rules.shadow_every,
            min_samples=rules.min_samples,
            transition_window=rules.transition,
            window=rules.window,
            served_steps=self.served_steps,
            shadow_plans=self.plans_issued,
            shadow_passes=self.shadow_passes,
            shadow_abandoned=self.plans_abandoned,
            shadow_seconds=self.shadow_seconds,
            shadow_thread_seconds=self.shadow_thread_seconds,
            ranges=ranges,
        )

    def view(self) -> dict[str, object]:
        """``report()`` as JSON-able builtins (counts and ranges as string keys), for tests and benches."""
        view: dict[str, object] = msgspec.json.decode(msgspec.json.encode(self.report()))
        return view

    # --------------------------------------------------------------------------------- internals

    def _range(self, rng: int) -> _Range:
        record = self._ranges.get(rng)
        if record is None:
            record = self._ranges[rng] = _Range(self._allowed, self.rules.window)
        return record

    def _choose(self, rng: int, served_steps: int) -> tuple[int, bool] | None:
        """The pacing and choice rules: (count, warm) to shadow on served step ``served_steps`` of
        range ``rng``, or None."""
        if self.state not in ("warming", "learning") or self._pending is not None:
            return None
        last = self._last_plan_step
        if last is not None and served_steps - last < self.rules.shadow_every:
            return None
        if self.state == "warming":
            return self.rules.configured, True
        record = self._ranges.get(rng)
        if record is None or record.status == "learning":
            verified = record.verified if record is not None else dict.fromkeys(self._allowed, 0)
            return min(self._allowed, key=lambda c: (verified[c], c)), False
        if record.status == "verifying":
            assert record.fastest is not None
            return record.fastest, False
        return None  # learned or serving: this range is done

    def _plan(self, step_tokens: int, rng: int, count: int, *, warm: bool) -> ShadowPlan:
        plan = ShadowPlan(self._next_id, step_tokens, rng, count, warm)
        self._next_id += 1
        self._pending = plan
        self._last_plan_step = self.served_steps
        self.plans_issued += 1
        return plan

    def _take_pending(self, plan: ShadowPlan) -> None:
        if self._pending is None or plan != self._pending:
            raise ValueError(f"{plan} is not the outstanding shadow plan ({self._pending})")
        self._pending = None

    def _decide(self, rng: int, record: _Range, now: float) -> None:
        medians: list[tuple[int, float]] = []
        for c in self._allowed:
            m = _median(record.samples[c])
            assert m is not None  # every candidate has >= min_samples >= 1 samples
            medians.append((c, m))
        fastest = min(medians, key=lambda cm: (cm[1], cm[0]))[0]
        record.fastest = fastest
        record.learned_at = now
        if self.rules.mode == 2 and fastest != self.rules.configured:
            record.status = "verifying"
        else:
            record.status = "learned"
        self._events.append(ThreadEvent("learned", now, "", rng, fastest, medians=tuple(medians)))

    def _retire(self, reason: str, now: float, rng: int | None = None, count: int | None = None) -> None:
        self.state = "retired"
        self.reason = reason
        self.retired_at = now
        for r, rec in sorted(self._ranges.items()):
            if rec.status == "serving":
                assert rec.fastest is not None
                self._events.append(
                    ThreadEvent("serving_changed", now, "retired", r, self.rules.configured, rec.fastest)
                )
            if rec.status in ("serving", "verifying"):
                rec.status = "learned"
        self._events.append(ThreadEvent("retired", now, reason, rng, count))

    # -------------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Recheck every relation between the stored fields; raise AssertionError on any break."""

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise AssertionError(message)

        rules = self.rules
        allowed = self._allowed
        require(list(allowed) == sorted(set(allowed)) and rules.configured in allowed, "bad candidates")
        require((self.state == "off") == (rules.mode == 0), "state off iff mode 0")
        require((self.state == "retired") == (self.reason is not None), "a reason iff retired")
        require((self.state == "retired") == (self.retired_at is not None), "retired_at iff retired")
        if self.state == "off":
            require(not self._ranges and self.plans_issued == 0, "mode 0 recorded something")
        if self.state == "waiting_golden":
            require(self.plans_issued == 0, "a plan before the golden check")
        if self.state == "warming":
            require(self.shadow_passes == 0, "a shadow result while still warming")
        require(
            self.plans_issued == self.shadow_passes + self.plans_abandoned + (self._pending is not None),
            "plans issued != results + abandoned + outstanding",
        )
        bound = 0 if self.served_steps == 0 else (self.served_steps - 1) // rules.shadow_every + 1
        require(self.plans_issued <= bound, "more than one shadow plan per shadow_every served steps")
        require(self._next_id == self.plans_issued, "plan ids out of step")
        pending = self._pending
        if pending is not None:
            require(pending.count in allowed, "a plan at a count not allowed")
            require(pending.range == size_range(pending.step_tokens), "a plan in the wrong range")
            require(
                not pending.warm or pending.count == rules.configured, "a warm pass off the configured count"
            )
            if self.state == "learning":
                require(not pending.warm, "a warm plan after warming")
                rec = self._ranges[pending.range]
                require(rec.status in ("learning", "verifying"), "a plan for a finished range")
                require(rec.status != "verifying" or pending.count == rec.fastest, "window off its count")
        require(self.shadow_seconds >= 0 and self.shadow_thread_seconds >= self.shadow_seconds, "bad totals")
        samples_total = 0
        for rng, rec in self._ranges.items():
            require(rng == size_range(rng), f"range {rng} is not a power of two")
            require(set(rec.samples) == set(allowed) == set(rec.verified), f"range {rng}: counts differ")
            require(set(rec.served) <= set(allowed), f"range {rng}: served at a count not allowed")
            for c in allowed:
                n = rec.verified[c]
                require(len(rec.samples[c]) == min(n, rules.window), f"range {rng}: window of {c} off")
                samples_total += n
            full = all(rec.verified[c] >= rules.min_samples for c in allowed)
            require((rec.fastest is None) == (rec.status == "learning"), f"range {rng}: fastest vs status")
            if rec.fastest is not None:
                require(rec.fastest in allowed, f"range {rng}: fastest not allowed")
                require(rec.learned_at is not None, f"range {rng}: learned without a time")
            if rec.status == "learning" and self.state == "learning":
                require(not full, f"range {rng}: every candidate sampled but undecided")
            if rec.status in ("verifying", "serving"):
                require(rules.mode == 2 and self.state == "learning", f"range {rng}: a window outside mode 2")
                require(rec.fastest != rules.configured, f"range {rng}: a window for the configured count")
            if rec.status == "verifying":
                require(rec.transition_passes < rules.transition, f"range {rng}: window passed, not serving")
            if rec.status == "serving":
                require(rec.transition_passes == rules.transition, f"range {rng}: served before its window")
                require(rec.serving_since is not None, f"range {rng}: serving without a time")
            require(rec.transition_passes <= rules.transition, f"range {rng}: window overrun")
            require(rules.mode == 2 or rec.transition_passes == 0, f"range {rng}: a window outside mode 2")
            require(self.serve_count(rng) in allowed, f"range {rng}: serves a count not allowed")
            if rules.mode != 2 or self.state != "learning":
                require(self.serve_count(rng) == rules.configured, f"range {rng}: serves a learned count")
        warm_results = 1 if self.state == "learning" or (self.state == "retired" and samples_total) else 0
        require(samples_total + warm_results <= self.shadow_passes, "more samples than shadow passes")

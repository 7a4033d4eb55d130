"""Replica health: which replicas of a pool may take requests, after their timeouts and failures.

A pure decision object (design §10, seed 002 "Eject a replica that keeps timing out"): no I/O, no
clock. The shell reports how each exchange with a replica ended, passes the time in (``now``, seconds
on one monotonic clock that never goes back) and the transport's view of which replicas are up
(``up[r]``: ready and alive, as the engine client sees it), and logs the ``HealthEvent`` list each
mutator returns. A replica whose forward hangs can keep answering its health check, so readiness alone
never takes it out of dispatch; the outcomes reported here do.

Outcomes. Every exchange with replica ``r`` (a request, or a health probe) ends one way, and the shell
calls exactly one verb: ``success`` (it answered), ``timeout`` (it ran past its deadline),
``failure`` (an error from the replica or its transport), ``cancelled`` (the caller went away, or the
request was refused before the replica took it).

Rules:

- **Backoff.** A timeout or a failure takes the replica out of dispatch for a short backoff:
  ``BACKOFF_FIRST`` (0.1 s) the first time, doubling with each further timeout or failure up to
  ``BACKOFF_MAX`` (3.2 s). A success ends a running backoff at once and starts the doubling over. A new
  backoff never ends before one already running would.
- **Count.** A timeout adds one to the replica's consecutive timeouts; a success sets it to zero.
  A failure or a cancellation neither counts nor resets it (a failure still backs off; a cancellation
  changes nothing at all).
- **Ejection** (off when ``consecutive_timeouts`` is 0; backoff still happens). A replica whose count
  reaches ``consecutive_timeouts`` is ejected: out of dispatch for ``base_ejection_s``. When that
  cool-down ends it is readmitted (reason ``cool_down_ended``) but keeps its *ejection level*: its
  next timeout (not another ``consecutive_timeouts``) ejects it again, for twice as long as the last
  time, at most ``max_ejection_s``. A success readmits it at once (reason ``answered``) and resets both
  count and level. A timeout while ejected counts (and backs off) but neither extends nor repeats the
  ejection.
- **Withheld.** An ejection a rule holds back is reported (``replica_ejection_withheld``, with the
  rule as reason) and not made; the count stays, so a later timeout ejects once the rules allow.
  Checked in this order:
  ``single_replica``: a pool of one replica never ejects it;
  ``no_other_replica_answered``: eject only while another ready replica (up and not ejected) has had
  a success at or after the start of this replica's current run of timeouts, so a model that is slow
  on every replica keeps them all. The run starts when its first timed-out exchange began waiting
  (``timeout``'s ``began``: its send or last output), not when the deadline fired: several requests
  that hang together expire at one instant, and an answer elsewhere while they waited is the
  evidence the rule asks for;
  ``max_ejection_percent``: at most ``max(1, floor(n * max_ejection_percent / 100))`` replicas are
  ejected at once (one may always be, whatever the percentage).
- **Serve anyway.** ``dispatchable`` returns the up replicas that are neither ejected nor backed off;
  when there are none, the up replicas that are backed off but not ejected; when there are none of
  those either, the up ejected ones. One tier, never a mix (the dispatch policy then picks among them
  by load, so a mix would give an ejected replica an equal share); within a tier in index order. So
  traffic stops only when no replica is up.
- **Probes.** A replica that enters a backoff (from none running) or an ejection wants a health probe at
  once, and so does an ejected one whose backoff ends (no real request reaches it, so a hung one is
  probed at its backoff's pace through the whole cool-down); ``take_probes`` hands those out and forgets
  them, and a success drops a pending one (the answer told what the probe would have). The probe must
  exercise the path that timed out (a tiny request, not a liveness ping: a hung forward can still answer
  ``/health``), and its outcome comes back through ``success`` / ``timeout`` / ``failure`` like any
  exchange's.
- **Time.** Queries (``state``, ``dispatchable``, ``view``, ``next_change``) read the times against
  ``now`` and change nothing, so they are right even when the shell's timer is late; the readmission
  events (and counters) of expired cool-downs come from the next ``tick`` or mutator, which first ends
  every backoff and cool-down due by its ``now``. ``next_change`` says when to tick.
- **Counters.** ``ejections_total``, ``readmissions_total``, ``withheld_total``, ``backoffs_total``
  only grow (they feed ``/metrics``); ``resize`` keeps them when it drops replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

BACKOFF_FIRST = 0.1  # seconds out of dispatch after the first timeout or failure
BACKOFF_MAX = 3.2  # the doubling stops here
MAX_EJECTION_DEFAULT_CAP = 3600.0  # the default max ejection is ten times the base, at most an hour

HealthEventKind = Literal[
    "replica_ejected", "replica_readmitted", "replica_ejection_withheld", "replica_backoff"
]
ReplicaState = Literal["ready", "backoff", "ejected"]


@dataclass(frozen=True, slots=True)
class OutlierRules:
    """The ``outlier_detection`` settings, in seconds (the config's ``*_ms`` divided by 1000)."""

    consecutive_timeouts: int = 3  # 0 turns ejection off
    base_ejection_s: float = 30.0
    max_ejection_s: float | None = None  # None: ten times the base, at most an hour (never below base)
    max_ejection_percent: int = 50

    def __post_init__(self) -> None:
        ct = self.consecutive_timeouts
        if isinstance(ct, bool) or not isinstance(ct, int) or ct < 0:
            raise ValueError(f"consecutive_timeouts must be an integer >= 0, got {ct!r}")
        base = self.base_ejection_s
        if not (isinstance(base, int | float) and 0 < base < float("inf")):
            raise ValueError(f"base_ejection_s must be a finite number > 0, got {base!r}")
        top = self.max_ejection_s
        if top is not None and not (isinstance(top, int | float) and base <= top < float("inf")):
            raise ValueError(f"max_ejection_s must be finite and >= base_ejection_s ({base}), got {top!r}")
        pct = self.max_ejection_percent
        if isinstance(pct, bool) or not isinstance(pct, int) or not 0 <= pct <= 100:
            raise ValueError(f"max_ejection_percent must be an integer in 0..100, got {pct!r}")

    @property
    def enabled(self) -> bool:
        return self.consecutive_timeouts > 0

    @property
    def max_ejection(self) -> float:
        """The longest ejection, resolved: the setting, or ten times the base capped at an hour."""
        if self.max_ejection_s is not None:
            return float(self.max_ejection_s)
        return max(float(self.base_ejection_s), min(10 * self.base_ejection_s, MAX_EJECTION_DEFAULT_CAP))

    def ejection_duration(self, level: int) -> float:
        """How long the ejection of a replica ejected ``level`` times before (in this run) lasts."""
        # The exponent is capped: 2.0 ** level overflows a float past about 1024.
        return min(self.base_ejection_s * 2.0 ** min(level, 64), self.max_ejection)

    def ejection_cap(self, n_replicas: int) -> int:
        """How many of ``n_replicas`` may be ejected at once: the percentage rounded down, at least 1."""
        return max(1, n_replicas * self.max_ejection_percent // 100)


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """Something the shell logs (and counts): ``duration`` in seconds for an ejection or a backoff.

    Reasons: ``replica_ejected``: ``consecutive_timeouts`` (the count reached the threshold) or
    ``timed_out_after_readmission`` (the first timeout after a cool-down); ``replica_readmitted``:
    ``cool_down_ended`` or ``answered``; ``replica_ejection_withheld``: the rule (``single_replica``,
    ``no_other_replica_answered``, ``max_ejection_percent``); ``replica_backoff``: ``timeout`` or
    ``failure``.
    """

    kind: HealthEventKind
    replica: int
    reason: str
    duration: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "replica": self.replica, "reason": self.reason, "duration": self.duration}


def backoff_duration(level: int) -> float:
    """The backoff after ``level`` earlier ones in a row: 0.1, 0.2, 0.4, ... capped at 3.2 s."""
    return min(BACKOFF_FIRST * 2.0 ** min(level, 64), BACKOFF_MAX)


class _Replica:
    """One replica's health. ``None`` times mean "not in that state" (as last stored; see Time)."""

    __slots__ = (
        "backoff_level",
        "backoff_until",
        "consecutive_timeouts",
        "ejected_until",
        "ejection_level",
        "ejections",
        "failures_total",
        "last_success",
        "readmissions",
        "streak_start",
        "timeouts_total",
        "withheld",
    )

    def __init__(self) -> None:
        self.backoff_until: float | None = None
        self.backoff_level = 0  # backoffs since the last success: the next lasts backoff_duration(level)
        self.consecutive_timeouts = 0
        self.streak_start: float | None = None  # when the current run of timeouts began (None: no run)
        self.ejected_until: float | None = None
        self.ejection_level = 0  # ejections since the last success: the next lasts base * 2**level
        self.last_success: float | None = None
        self.timeouts_total = 0
        self.failures_total = 0
        self.ejections = 0
        self.readmissions = 0
        self.withheld = 0

    def ejected_at(self, now: float) -> bool:
        return self.ejected_until is not None and self.ejected_until > now

    def backed_off_at(self, now: float) -> bool:
        return self.backoff_until is not None and self.backoff_until > now


class ReplicaHealthBook:
    """Health of replicas ``0 .. n_replicas - 1`` under ``rules`` (see the module docstring)."""

    def __init__(self, rules: OutlierRules, n_replicas: int) -> None:
        if n_replicas < 1:
            raise ValueError(f"need n_replicas >= 1, got {n_replicas}")
        self.rules = rules
        self._replicas = [_Replica() for _ in range(n_replicas)]
        self._probes: set[int] = set()
        self.ejections_total = 0
        self.readmissions_total = 0
        self.withheld_total = 0
        self.backoffs_total = 0

    @property
    def n_replicas(self) -> int:
        return len(self._replicas)

    # ------------------------------------------------------------------------------------ outcomes

    def success(self, r: int, now: float) -> list[HealthEvent]:
        """Replica ``r`` answered: readmit it if ejected, end its backoff, start count and levels over."""
        events = self._expire(now)
        rep = self._replicas[r]
        if rep.ejected_until is not None:
            rep.ejected_until = None
            self._readmit(r, "answered", events)
        rep.backoff_until = None
        rep.backoff_level = 0
        rep.consecutive_timeouts = 0
        rep.streak_start = None
        rep.ejection_level = 0
        rep.last_success = now
        self._probes.discard(r)
        return events

    def timeout(
        self, r: int, now: float, up: Sequence[bool], began: float | None = None
    ) -> list[HealthEvent]:
        """An exchange with ``r`` ran past its deadline: count it, back off, and eject if the rules
        allow. ``began``: when that exchange's deadline started running (its send, or its last
        output; default ``now``): the first timeout of a run starts the run there."""
        self._check_up(up)
        events = self._expire(now)
        rep = self._replicas[r]
        rep.timeouts_total += 1
        rep.consecutive_timeouts += 1
        if rep.streak_start is None:
            rep.streak_start = now if began is None else min(began, now)
        self._back_off(r, now, "timeout", events)
        rules = self.rules
        # Once ejected in this run the count is already >= the threshold (only a success lowers it,
        # and it also clears the level), so "the next timeout ejects again" needs no extra case.
        if (
            rules.enabled
            and rep.ejected_until is None
            and rep.consecutive_timeouts >= rules.consecutive_timeouts
        ):
            held = self._withholding_rule(r, up)
            if held is not None:
                rep.withheld += 1
                self.withheld_total += 1
                events.append(HealthEvent("replica_ejection_withheld", r, held))
            else:
                duration = rules.ejection_duration(rep.ejection_level)
                reason = "consecutive_timeouts" if rep.ejection_level == 0 else "timed_out_after_readmission"
                rep.ejected_until = now + duration
                rep.ejection_level += 1
                rep.ejections += 1
                self.ejections_total += 1
                self._probes.add(r)
                events.append(HealthEvent("replica_ejected", r, reason, duration))
        return events

    def failure(self, r: int, now: float) -> list[HealthEvent]:
        """An exchange with ``r`` failed: back off; the consecutive-timeout count is left as it is."""
        events = self._expire(now)
        self._replicas[r].failures_total += 1
        self._back_off(r, now, "failure", events)
        return events

    def cancelled(self, r: int) -> list[HealthEvent]:
        """An exchange with ``r`` was cancelled or refused: it tells nothing about ``r``'s health."""
        if not 0 <= r < len(self._replicas):
            raise IndexError(f"no replica {r}")
        return []

    def tick(self, now: float, up: Sequence[bool] | None = None) -> list[HealthEvent]:
        """End every backoff and cool-down due by ``now`` (readmission events for the cool-downs).

        ``up`` is optional and only checked for its length: ending a cool-down does not depend on it.
        """
        if up is not None:
            self._check_up(up)
        return self._expire(now)

    # ------------------------------------------------------------------------------------- queries

    def state(self, r: int, now: float) -> ReplicaState:
        rep = self._replicas[r]
        if rep.ejected_at(now):
            return "ejected"
        if rep.backed_off_at(now):
            return "backoff"
        return "ready"

    def dispatchable(self, up: Sequence[bool], now: float) -> list[int]:
        """The replicas that may take a request now, by the serve-anyway tiers (module docstring)."""
        self._check_up(up)
        tiers: dict[ReplicaState, list[int]] = {"ready": [], "backoff": [], "ejected": []}
        for r in range(len(self._replicas)):
            if up[r]:
                tiers[self.state(r, now)].append(r)
        return tiers["ready"] or tiers["backoff"] or tiers["ejected"]

    def take_probes(self) -> list[int]:
        """The replicas waiting for a health probe, in index order; they stop waiting."""
        probes = sorted(self._probes)
        self._probes.clear()
        return probes

    def next_change(self, now: float) -> float | None:
        """When the earliest backoff or cool-down ends (``now`` if one is already due), else None."""
        ends = [t for rep in self._replicas for t in (rep.backoff_until, rep.ejected_until) if t is not None]
        return max(now, min(ends)) if ends else None

    def view(self, r: int, now: float) -> dict[str, object]:
        """Replica ``r`` for the inventory (JSON-able; times on the caller's clock, None when not set)."""
        rep = self._replicas[r]
        return {
            "state": self.state(r, now),
            "consecutive_timeouts": rep.consecutive_timeouts,
            "timeouts_total": rep.timeouts_total,
            "failures_total": rep.failures_total,
            "ejections": rep.ejections,
            "readmissions": rep.readmissions,
            "withheld": rep.withheld,
            "ejection_level": rep.ejection_level,
            "backoff_until": rep.backoff_until if rep.backed_off_at(now) else None,
            "ejected_until": rep.ejected_until if rep.ejected_at(now) else None,
            "last_success": rep.last_success,
        }

    # --------------------------------------------------------------------------------------- resize

    def resize(self, n_replicas: int) -> None:
        """Grow with fresh replicas, or drop the highest indices (their pending probes too).

        Book totals stay. Replicas ejected before a shrink stay ejected even if the smaller pool's
        ejection cap is lower; the cap only holds back new ejections.
        """
        if n_replicas < 1:
            raise ValueError(f"need n_replicas >= 1, got {n_replicas}")
        del self._replicas[n_replicas:]
        self._replicas.extend(_Replica() for _ in range(n_replicas - len(self._replicas)))
        self._probes = {r for r in self._probes if r < n_replicas}

    # ------------------------------------------------------------------------------------ internals

    def _check_up(self, up: Sequence[bool]) -> None:
        if len(up) != len(self._replicas):
            raise ValueError(f"up has {len(up)} entries for {len(self._replicas)} replicas")

    def _expire(self, now: float) -> list[HealthEvent]:
        events: list[HealthEvent] = []
        for r, rep in enumerate(self._replicas):
            if rep.ejected_until is not None and rep.ejected_until <= now:
                rep.ejected_until = None
                self._readmit(r, "cool_down_ended", events)  # the level stays: see Ejection
            if rep.backoff_until is not None and rep.backoff_until <= now:
                rep.backoff_until = None  # the level stays until a success
                if rep.ejected_until is not None:
                    # Still ejected: no real request will test it, so the next probe goes now (a
                    # hung replica is probed at its backoff's pace all through its cool-down).
                    self._probes.add(r)
        return events

    def _readmit(self, r: int, reason: str, events: list[HealthEvent]) -> None:
        self._replicas[r].readmissions += 1
        self.readmissions_total += 1
        events.append(HealthEvent("replica_readmitted", r, reason))

    def _back_off(self, r: int, now: float, reason: str, events: list[HealthEvent]) -> None:
        rep = self._replicas[r]
        duration = backoff_duration(rep.backoff_level)
        if not rep.backed_off_at(now):
            self._probes.add(r)  # entering a backoff: probe at once
        until = now + duration
        rep.backoff_until = until if rep.backoff_until is None else max(rep.backoff_until, until)
        rep.backoff_level += 1
        self.backoffs_total += 1
        events.append(HealthEvent("replica_backoff", r, reason, duration))

    def _withholding_rule(self, r: int, up: Sequence[bool]) -> str | None:
        """The rule that holds back ejecting ``r`` now, or None (called after ``_expire``)."""
        replicas = self._replicas
        n = len(replicas)
        if n == 1:
            return "single_replica"
        start = replicas[r].streak_start
        assert start is not None  # r has just timed out
        answered = False
        for o, other in enumerate(replicas):
            last = other.last_success
            if o != r and up[o] and other.ejected_until is None and last is not None and last >= start:
                answered = True
                break
        if not answered:
            return "no_other_replica_answered"
        ejected = sum(1 for rep in replicas if rep.ejected_until is not None)
        if ejected >= self.rules.ejection_cap(n):
            return "max_ejection_percent"
        return None

    # ----------------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Recheck every relation between the stored fields; raise AssertionError on any break."""

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise AssertionError(message)

        rules = self.rules
        require(len(self._replicas) >= 1, "no replicas")
        require(all(0 <= r < len(self._replicas) for r in self._probes), "a probe for a replica not there")
        for r, rep in enumerate(self._replicas):
            counts = (
                rep.consecutive_timeouts,
                rep.timeouts_total,
                rep.failures_total,
                rep.ejections,
                rep.readmissions,
                rep.withheld,
                rep.backoff_level,
                rep.ejection_level,
            )
            require(all(c >= 0 for c in counts), f"replica {r}: a negative count")
            require(rep.consecutive_timeouts <= rep.timeouts_total, f"replica {r}: run longer than total")
            require(
                (rep.streak_start is None) == (rep.consecutive_timeouts == 0),
                f"replica {r}: a run of timeouts without a start, or the reverse",
            )
            require(
                rep.ejections == rep.readmissions + (rep.ejected_until is not None),
                f"replica {r}: ejections != readmissions + (ejected now)",
            )
            require(rep.ejection_level <= rep.ejections, f"replica {r}: ejection level above its ejections")
            require(rep.ejected_until is None or rep.ejection_level >= 1, f"replica {r}: ejected at level 0")
            if rep.ejection_level > 0:
                require(rules.enabled, f"replica {r}: an ejection level with ejection off")
                require(
                    rep.consecutive_timeouts >= rules.consecutive_timeouts,
                    f"replica {r}: an ejection level without the run of timeouts behind it",
                )
            require(rep.backoff_until is None or rep.backoff_level >= 1, f"replica {r}: backoff at level 0")
            require(rules.enabled or rep.ejections == 0, f"replica {r}: ejected with ejection off")
        require(self.ejections_total >= sum(rep.ejections for rep in self._replicas), "ejections_total low")
        require(
            self.readmissions_total >= sum(rep.readmissions for rep in self._replicas),
            "readmissions_total low",
        )
        require(self.withheld_total >= sum(rep.withheld for rep in self._replicas), "withheld_total low")

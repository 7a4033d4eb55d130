"""One API server's exchanges with its replicas (data-parallel ranks): deadlines, outcomes, probes.

The engine client tells this pool about every engine request it sends (``sent``), every output that
comes back (``output``), every request that ends otherwise (``forget``: aborted, cancelled) and every
engine that dies (``engine_failed``); the pool turns those into the outcomes the health book
(``frontend/replica_health.py``) judges replicas by, and says which replicas may take new requests
(``dispatchable``). Pure: time is passed in; the engine client's ``_watch_exchanges`` task is the shell
that calls ``overdue`` and sends probes.

An *exchange* is one engine request (one choice of one HTTP request) on one replica, from the moment
its add is sent. Its **deadline** is ``timeout_s`` without output: the request's own ``timeout_ms`` or
the deployment's ``--request-timeout-ms``, whichever is smaller (0/None: none). It is measured from the
send to the first output and then between consecutive outputs, so time waiting in the engine's queue
counts and a long, steadily streaming answer never runs past it. (A whole-request limit would make
every long answer a "timeout" and eject healthy replicas for serving long outputs.)

Rules:

- An exchange that finishes (its output carries a finish reason) is a **success** for its replica.
- An exchange whose deadline passes is a **timeout**: ``overdue`` drops it and returns its id; the
  caller fails its HTTP request with 504 and aborts it at the engine.
- An exchange that is aborted or cancelled is forgotten: it neither counts nor resets the count.
- An engine that dies is one **failure** of its replica (not one per request it held).
- A replica that enters a backoff or an ejection is probed at once: a one-token request sent to it
  even though it is out of dispatch (``take_probes``). A probe is an exchange with deadline
  ``probe_timeout_s``; its success is the replica's success (it readmits it); its timeout is a
  failure (another backoff, no count), so a hung replica is probed at its backoff's pace, 0.1 s
  doubling to 3.2 s, and the count of timeouts comes from real requests only.
- With one replica and no deadline nothing is tracked (the per-token path pays nothing); with several
  every exchange is tracked, since any answer counts for the "another replica answered" rule.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from trioserve.frontend.replica_health import HealthEvent, OutlierRules, ReplicaHealthBook

PROBE_PREFIX = "probe-"
PROBE_TIMEOUT_S = 2.0  # a probe's deadline without a deployment timeout (else the smaller)


@dataclass(slots=True)
class Exchange:
    """One engine request in flight on ``replica``; ``due``: when it times out (inf: no deadline)."""

    replica: int
    timeout_s: float  # inf: no deadline
    due: float
    probe: bool = False


@dataclass(slots=True)
class ReplicaPool:
    """The exchanges of one API server; ``rules`` and ``default_timeout_s`` (None: no deployment
    deadline) from the dispatch config, ``n`` replicas."""

    rules: OutlierRules
    n: int
    default_timeout_s: float | None = None
    client_index: int = 0
    book: ReplicaHealthBook = field(init=False)
    exchanges: dict[str, Exchange] = field(default_factory=dict)
    events: list[HealthEvent] = field(default_factory=list)  # outbox: the shell logs and clears it
    timeouts_total: list[int] = field(init=False)
    sent_total: list[int] = field(init=False)  # engine requests sent, per replica (probes not)
    probes_total: int = 0
    _heap: list[tuple[float, str]] = field(default_factory=list)  # (due, id), lazily corrected
    _probe_ids: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.book = ReplicaHealthBook(self.rules, self.n)
        self.timeouts_total = [0] * self.n
        self.sent_total = [0] * self.n

    @property
    def track_all(self) -> bool:
        """Whether every exchange is tracked (several replicas), not only those with a deadline."""
        return self.n > 1

    def deadline(self, request_timeout_s: float | None) -> float | None:
        """An exchange's timeout: the smaller of the request's and the deployment's (None: none)."""
        given = [t for t in (request_timeout_s, self.default_timeout_s) if t]
        return min(given) if given else None

    # ---- the engine client's reports --------------------------------------------------------------

    def sent(self, request_id: str, replica: int, timeout_s: float | None, now: float) -> None:
        """An add left for ``replica``; ``timeout_s`` as ``deadline`` gives it."""
        if replica < self.n:
            self.sent_total[replica] += 1
        if timeout_s is None and not self.track_all:
            return
        timeout = math.inf if timeout_s is None else timeout_s
        self.exchanges[request_id] = Exchange(replica, timeout, now + timeout)
        if timeout != math.inf:
            heapq.heappush(self._heap, (now + timeout, request_id))

    def output(self, request_id: str, finished: bool, now: float) -> None:
        """An output of ``request_id`` arrived (``finished``: it carries a finish reason)."""
        ex = self.exchanges.get(request_id)
        if ex is None:
            return
        if finished:
            del self.exchanges[request_id]
            if ex.replica < self.book.n_replicas:  # else a draining replica's: no longer judged
                self.events += self.book.success(ex.replica, now)
        else:
            ex.due = now + ex.timeout_s  # the heap entry is corrected when it comes up

    def forget(self, request_id: str) -> None:
        """Aborted or cancelled: no outcome."""
        self.exchanges.pop(request_id, None)

    def engine_failed(self, replica: int, now: float) -> None:
        """``replica``'s engine died: one failure; its exchanges end without an outcome of their own
        (their requests fail with the engine)."""
        for rid in [rid for rid, ex in self.exchanges.items() if ex.replica == replica]:
            del self.exchanges[rid]
        if replica < self.book.n_replicas:
            self.events += self.book.failure(replica, now)

    # ---- the shell's clock ---------------------------------------------------------------------------

    def overdue(self, now: float, up: Sequence[bool]) -> list[tuple[str, int, bool]]:
        """The exchanges whose deadline has passed by ``now``, dropped, as (id, replica, probe);
        each is a timeout of its replica (a probe's: a failure). The caller fails a real one's HTTP
        request with 504 and aborts both kinds at the engine."""
        heap: list[tuple[float, str]] = self._heap
        expired: list[tuple[str, int, bool]] = []
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            ex = self.exchanges.get(rid)
            if ex is None:
                continue  # ended meanwhile
            if ex.due > now:
                heapq.heappush(heap, (ex.due, rid))  # output came since: its deadline moved
                continue
            del self.exchanges[rid]
            expired.append((rid, ex.replica, ex.probe))
            if ex.replica >= self.book.n_replicas:
                continue  # a draining replica's: it fails with 504, and the replica is not judged
            if ex.probe:
                self.events += self.book.failure(ex.replica, now)
                continue
            self.timeouts_total[ex.replica] += 1
            self.events += self.book.timeout(ex.replica, now, up, began=ex.due - ex.timeout_s)
        self.events += self.book.tick(now, up)
        return expired

    def next_wake(self, now: float) -> float | None:
        """When ``overdue`` has something to do next: the earliest deadline (perhaps stale: then it
        only corrects the heap) or health change; None: nothing pending."""
        deadline = self._heap[0][0] if self._heap else None
        change = self.book.next_change(now)
        if deadline is None or change is None:
            return change if deadline is None else deadline
        return min(deadline, change)

    def take_probes(self, now: float) -> list[tuple[str, int]]:
        """The probes to send now, as (request id, replica), each tracked as a probe exchange."""
        out = []
        timeout = min(PROBE_TIMEOUT_S, self.default_timeout_s or PROBE_TIMEOUT_S)
        pending = {ex.replica for ex in self.exchanges.values() if ex.probe}
        for replica in self.book.take_probes():
            if replica in pending:
                continue  # its outcome asks again: a failure's backoff, or that backoff's end
            rid = f"{PROBE_PREFIX}{self.client_index}-{next(self._probe_ids)}"
            self.exchanges[rid] = Exchange(replica, timeout, now + timeout, probe=True)
            heapq.heappush(self._heap, (now + timeout, rid))
            self.probes_total += 1
            out.append((rid, replica))
        return out

    def resize(self, desired: int) -> None:
        """The replicas wanted now are ``0 .. desired - 1`` (a resize, ``frontend/replica_roster.py``):
        the health book judges only those; a replica wanted again starts with fresh health. Totals
        and exchanges in flight stay (a draining replica's still end, with no verdict)."""
        self.book.resize(max(1, min(desired, self.n)))

    def dispatchable(self, up: Sequence[int], now: float) -> list[int]:
        """Of the ``up`` replicas, those the health book lets take new requests (it serves anyway
        from the backed-off or ejected ones when nothing else is up)."""
        if self.n == 1:
            return list(up)
        return self.book.dispatchable(self.up_flags(up), now)

    def up_flags(self, up: Sequence[int]) -> list[bool]:
        """``up`` (engine indices) as the book's per-replica flags."""
        n = self.book.n_replicas
        flags = [False] * n
        for i in up:
            if i < n:
                flags[i] = True
        return flags

    def in_flight(self, replica: int) -> int:
        return sum(1 for ex in self.exchanges.values() if ex.replica == replica and not ex.probe)

"""The DP coordinator's rule: what it knows of each engine, and when it publishes. Pure: the caller
passes the time (its trio clock).

Engines push a ``LoadReport`` when their load changes (``engine/load_report.py``); the coordinator
keeps the latest per engine and publishes a ``LoadSnapshot`` of all of them to every API server
(``frontend/coordinator_link.py`` feeds it to the dispatch policy).

Rules:

- **report**: a valid report (engine index in 0..num_engines-1, counts >= 0, KV usage a number in
  0..1) replaces that engine's previous one; an invalid one is dropped and counted (``bad_reports``),
  it never reaches an API server. A report equal to the one held changes nothing.
- **publish on change**: when some engine's report differs from what the last publication said,
  publish once at least ``interval`` (``COORDINATOR_PUBLISH_INTERVAL``, 100 ms) has passed since the
  last publication. A burst of reports within one interval becomes one publication of the latest.
- **keep-alive**: publish anyway once ``keepalive`` (1 s) has passed since the last publication, so an
  API server that just (re)started and subscribed gets the state within a second, and a silent
  coordinator can be told from an idle deployment.
- The first check publishes at once (there was no last publication).

Invariants: publications are at least ``interval`` apart and at most ``keepalive`` apart (for a caller
that checks at ``next_due``); ``seq`` counts publications from 1; a snapshot lists the engines heard
from, in index order, each with its latest report; nothing that changed stays unpublished past
``interval`` after the last publication.

KV events (``KvEvents``, for the API servers' ``prefix`` dispatch policy): the coordinator keeps a
*mirror* of each engine's cached block keys and forwards the changes, batched:

- **kv**: a valid ``KvEvents`` (engine index in range, keys in 0..2**64-1) updates that engine's
  mirror (``cleared`` empties it first; then removals, then stores) and the engine's pending
  changes, coalesced per key (latest wins; after a ``cleared`` the pending batch is the mirror
  itself, sent with ``cleared``). An invalid one is dropped and counted (``bad_kv``). A mirror
  holds at most ``max_engine_keys`` (262,144) keys; stores past that are dropped and counted
  (``kv_dropped_keys``): the index is a hint, and a real engine's ledger has fewer blocks.
- **forward with the publications**: pending changes make the state "changed", so they go out with
  the next publication (at most ``interval`` after the last), right after its snapshot
  (``take_kv``): per engine, in messages of at most ``MAX_KV_EVENT_KEYS`` keys, ``cleared`` on the
  first, numbered by one ``kv_seq`` across engines so a subscriber can tell it missed some.
- **re-sync**: every ``kv_resync`` (5 s), at the next publication, each engine heard from is sent
  whole (``cleared`` + its mirror) instead of its changes. A subscriber that missed messages (its
  queue was full, it restarted) is exact again within ``kv_resync`` + ``keepalive``; until then its
  index is a stale hint, which can only misroute a request, never corrupt one.

Bounds: pending changes per engine are at most two mirrors' worth of keys (what was removed was in
the mirror; what is stored is in it), so one publication carries at most
``2 * max_engine_keys / MAX_KV_EVENT_KEYS`` messages per engine; typically a few keys.

Not covered: an engine that stops reporting (dead) keeps its last report until it reports again; its
death reaches the API servers by its own link (``EngineDead``, process exit), which takes it out of
the dispatch policy's ``ready`` set.
"""

from __future__ import annotations

import math

from trioserve.protocol.kv_batch import chunk_kv_events
from trioserve.protocol.messages import (
    COORDINATOR_PUBLISH_INTERVAL,
    KvEvents,
    LoadReport,
    LoadSnapshot,
)

KEEPALIVE_INTERVAL = 1.0  # seconds: an unchanged state is re-published this often
KV_RESYNC_INTERVAL = 5.0  # seconds: every engine's whole mirror is re-published this often
MAX_ENGINE_KEYS = 1 << 18  # block keys mirrored per engine, at most
_MAX_KEY = (1 << 64) - 1


class CoordinatorCore:
    __slots__ = (
        "_changed",
        "_kv_cleared",
        "_kv_heard",
        "_kv_last_resync",
        "_kv_removed",
        "_kv_stored",
        "_last_published",
        "_loads",
        "_mirror",
        "bad_kv",
        "bad_reports",
        "interval",
        "keepalive",
        "kv_dropped_keys",
        "kv_resync",
        "kv_seq",
        "max_engine_keys",
        "num_engines",
        "reports",
        "seq",
    )

    def __init__(
        self,
        num_engines: int,
        interval: float = COORDINATOR_PUBLISH_INTERVAL,
        keepalive: float = KEEPALIVE_INTERVAL,
        *,
        kv_resync: float = KV_RESYNC_INTERVAL,
        max_engine_keys: int = MAX_ENGINE_KEYS,
    ) -> None:
        if num_engines < 1 or not 0 < interval <= keepalive:
            raise ValueError(
                "need num_engines >= 1 and 0 < interval <= keepalive, "
                f"got {num_engines}, {interval}, {keepalive}"
            )
        self.num_engines = num_engines
        self.interval = interval
        self.keepalive = keepalive
        self._loads: list[LoadReport | None] = [None] * num_engines
        self._changed = False  # some report differs from the last publication
        self._last_published = -math.inf
        self.seq = 0  # publications so far
        self.reports = 0  # valid reports received
        self.bad_reports = 0
        # KV events (see the module docstring), per engine.
        self.kv_resync = kv_resync
        self.max_engine_keys = max_engine_keys
        self._mirror: list[set[int]] = [set() for _ in range(num_engines)]
        self._kv_stored: list[set[int]] = [set() for _ in range(num_engines)]
        self._kv_removed: list[set[int]] = [set() for _ in range(num_engines)]
        self._kv_cleared = [False] * num_engines
        self._kv_heard = [False] * num_engines
        self._kv_last_resync = -math.inf
        self.kv_seq = 0  # KvEvents published so far
        self.bad_kv = 0
        self.kv_dropped_keys = 0

    def report(self, load: LoadReport) -> bool:
        """Stores ``load`` if it is valid (returns whether it was); the caller wakes its publisher
        when it returns True, so a change goes out at ``next_due``."""
        i = load.engine_index
        counts_ok = load.num_waiting >= 0 and load.num_running >= 0
        if not (0 <= i < self.num_engines and counts_ok and 0.0 <= load.kv_usage <= 1.0):
            self.bad_reports += 1  # NaN fails the range check too
            return False
        self.reports += 1
        if self._loads[i] != load:
            self._loads[i] = load
            self._changed = True
        return True

    def kv(self, events: KvEvents) -> bool:
        """Applies one engine's ``KvEvents`` if valid (returns whether it was; the caller wakes its
        publisher when True)."""
        i = events.engine_index
        keys_ok = all(0 <= k <= _MAX_KEY for k in events.stored) and all(
            0 <= k <= _MAX_KEY for k in events.removed
        )
        if not (0 <= i < self.num_engines and keys_ok):
            self.bad_kv += 1
            return False
        mirror, stored, removed = self._mirror[i], self._kv_stored[i], self._kv_removed[i]
        self._kv_heard[i] = True
        if events.cleared:
            mirror.clear()
            stored.clear()
            removed.clear()
            self._kv_cleared[i] = True
        cleared = self._kv_cleared[i]
        for key in events.removed:
            if key in mirror:
                mirror.discard(key)
                stored.discard(key)
                if not cleared:  # after a clear the batch is the mirror: nothing to remove
                    removed.add(key)
        for key in events.stored:
            if key in mirror:
                continue
            if len(mirror) >= self.max_engine_keys:
                self.kv_dropped_keys += 1
                continue
            mirror.add(key)
            removed.discard(key)
            stored.add(key)
        if cleared or stored or removed:
            self._changed = True
        return True

    def take_kv(self, now: float) -> list[KvEvents]:
        """The KV messages to publish right after the snapshot ``due`` returned at ``now``: every
        engine's pending changes, or every engine whole when a re-sync is due. They count as sent."""
        if now >= self._kv_last_resync + self.kv_resync:
            self._kv_last_resync = now
            for i in range(self.num_engines):
                if self._kv_heard[i]:
                    self._kv_cleared[i] = True
                    self._kv_stored[i] = set(self._mirror[i])
                    self._kv_removed[i].clear()
        messages: list[KvEvents] = []
        for i in range(self.num_engines):
            cleared, stored, removed = self._kv_cleared[i], self._kv_stored[i], self._kv_removed[i]
            if not (cleared or stored or removed):
                continue
            messages += chunk_kv_events(
                i, list(stored), list(removed), cleared=cleared, first_seq=self.kv_seq + len(messages) + 1
            )
            stored.clear()
            removed.clear()
            self._kv_cleared[i] = False
        self.kv_seq += len(messages)
        return messages

    def mirror(self, engine: int) -> frozenset[int]:
        """The block keys ``engine`` holds, as its events say."""
        return frozenset(self._mirror[engine])

    def due(self, now: float) -> LoadSnapshot | None:
        """The snapshot to publish now, or None; a returned snapshot counts as published at ``now``."""
        # ``last + interval`` exactly as ``next_due`` computes it, so a loop woken then finds it due.
        if now < self.next_due():
            return None
        self._last_published = now
        self._changed = False
        self.seq += 1
        return LoadSnapshot(self.seq, [load for load in self._loads if load is not None])

    def next_due(self) -> float:
        """When the next publication is due if no report arrives meanwhile (the publisher sleeps until
        then, or until a report wakes it)."""
        return self._last_published + (self.interval if self._changed else self.keepalive)

    def load(self, engine: int) -> LoadReport | None:
        """The latest valid report from ``engine`` (None: none yet)."""
        return self._loads[engine]

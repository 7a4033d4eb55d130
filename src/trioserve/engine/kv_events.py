"""KV events: the block keys an engine's prefix cache stores and evicts, for the DP coordinator (and
through it every API server's ``prefix`` dispatch policy, ``frontend/dispatch.py``). vLLM's KV events,
reduced to what dispatch needs.

``KvEventLog`` is pure: the KV ledger calls ``stored(key)`` when it registers a block under its hash
and ``removed(key)`` when it forgets one (eviction, or reuse of an evictable block); keys are
``protocol.block_hash.block_key`` of the hash. The engine-core shell calls ``flush_kv_events`` where it
sends its load reports (after every step, and when it goes idle), which turns what the log holds into
``KvEvents`` messages on the coordinator's PUSH.

Rules:

- **coalesced per key, latest wins**: a key stored and then removed before a flush is sent as removed,
  removed and then stored as stored; ``stored`` and ``removed`` of one batch are disjoint. (A removal
  the receiver never heard stored is harmless: it removes nothing.)
- **batch per flush**: one flush sends everything pending, split into messages of at most
  ``MAX_KV_EVENT_KEYS`` keys; nothing pending, nothing sent.
- **bounded**: at most ``max_pending`` (65,536) keys wait between flushes. Past that the log drops
  them all and the next flush is a **re-sync**: a first message with ``cleared`` and then every key
  the ledger holds (``all_keys``), chunked the same way. So the log's memory is bounded whatever the
  churn, and what the receiver ends up with is exact again after the re-sync.
- **re-sync also** on the first flush (a fresh log: the coordinator knows nothing of this engine), after
  a message could not be sent (``send_failed``: the PUSH was full, so the coordinator missed news), and
  every ``resync_interval`` (30 s) anyway, so a coordinator that restarted learns the cache again.

The ledger holds at most ``num_blocks`` keys, so a re-sync is at most ``num_blocks / 4096`` messages.
Nothing here affects correctness: the engine looks up its own full hashes; the events only steer which
engine a request is sent to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from trioserve.engine.scheduler import Scheduler
from trioserve.protocol.codec import coordinator_input_codec
from trioserve.protocol.kv_batch import chunk_kv_events
from trioserve.protocol.messages import KvEvents

MAX_PENDING_KEYS = 65536  # keys held between two flushes before the log gives up and re-syncs
ENGINE_RESYNC_INTERVAL = 30.0  # seconds between two full re-syncs, at most


class KvEventLog:
    __slots__ = (
        "_last_resync",
        "_removed",
        "_resync",
        "_stored",
        "max_pending",
        "overflows",
        "resync_interval",
        "resyncs",
        "seq",
    )

    def __init__(
        self, max_pending: int = MAX_PENDING_KEYS, resync_interval: float = ENGINE_RESYNC_INTERVAL
    ) -> None:
        if max_pending < 1 or resync_interval <= 0:
            raise ValueError(
                f"need max_pending >= 1 and resync_interval > 0, got {max_pending}, {resync_interval}"
            )
        self.max_pending = max_pending
        self.resync_interval = resync_interval
        self._stored: set[int] = set()
        self._removed: set[int] = set()
        self._resync = True  # the first flush lists everything: the coordinator knows nothing yet
        self._last_resync = -math.inf
        self.seq = 0  # messages made so far (the last one's seq)
        self.overflows = 0  # times pending keys were dropped for a re-sync
        self.resyncs = 0

    @property
    def num_pending(self) -> int:
        return len(self._stored) + len(self._removed)

    def stored(self, key: int) -> None:
        """The ledger registered a block under a hash with this key."""
        if self._resync:
            return  # the re-sync due lists the ledger's keys as they are then
        self._removed.discard(key)
        self._stored.add(key)
        self._bound()

    def removed(self, key: int) -> None:
        """The ledger forgot the block registered under this key."""
        if self._resync:
            return
        self._stored.discard(key)
        self._removed.add(key)
        self._bound()

    def _bound(self) -> None:
        if len(self._stored) + len(self._removed) > self.max_pending:
            self._stored.clear()
            self._removed.clear()
            if not self._resync:
                self.overflows += 1
            self._resync = True  # the re-sync says all there is to say

    def send_failed(self) -> None:
        """A message of the last flush was not sent: the next flush re-syncs."""
        self._stored.clear()
        self._removed.clear()
        self._resync = True

    def take(self, engine_index: int, now: float, all_keys: Callable[[], Iterable[int]]) -> list[KvEvents]:
        """The messages to send now (see the rules); ``all_keys`` lists the ledger's keys for a
        re-sync. What is returned counts as sent (call ``send_failed`` if one was not)."""
        if self._resync or now >= self._last_resync + self.resync_interval:
            self._stored.clear()
            self._removed.clear()
            self._resync = False
            self._last_resync = now
            self.resyncs += 1
            messages = chunk_kv_events(
                engine_index, list(all_keys()), [], cleared=True, first_seq=self.seq + 1
            )
        elif self._stored or self._removed:
            stored, removed = list(self._stored), list(self._removed)
            self._stored.clear()
            self._removed.clear()
            messages = chunk_kv_events(engine_index, stored, removed, cleared=False, first_seq=self.seq + 1)
        else:
            return []
        self.seq += len(messages)
        return messages


_CODEC = coordinator_input_codec()


def flush_kv_events(core: object, engine_index: int, now: float, send: Callable[[list[bytes]], bool]) -> None:
    """The shell's one call (``engine/core.py``, beside each load report): sends what the core's KV
    ledger stored and evicted since the last call. Cores without a prefix cache (the mock, or prefix
    caching off) send nothing. The first call attaches a ``KvEventLog`` to the ledger, so an engine
    without a coordinator never collects events. ``send`` must not block (False: not sent)."""
    scheduler = getattr(core, "scheduler", None)
    if not isinstance(scheduler, Scheduler) or not scheduler.config.enable_prefix_caching:
        return
    ledger = scheduler.ledger
    log = ledger.kv_events
    if log is None:
        log = ledger.kv_events = KvEventLog()
    for message in log.take(engine_index, now, ledger.cached_keys):
        if not send([_CODEC.encode(message)]):
            log.send_failed()
            return

"""KV events end to end in pure parts: the engine's log (``engine/kv_events.py``) fed by the KV ledger,
the coordinator's mirror and forwarding (``coordinator/core.py``), and the API server's index
(``frontend/dispatch.PrefixIndex``), which must end up holding exactly what the ledger holds."""

from __future__ import annotations

import math
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_scheduler import Driver, cfg, make_add
from trioserve.coordinator.core import CoordinatorCore
from trioserve.engine.kv_events import KvEventLog, flush_kv_events
from trioserve.engine.kv_ledger import KVLedger
from trioserve.frontend.dispatch import PrefixIndex
from trioserve.protocol.block_hash import block_hashes, block_key
from trioserve.protocol.codec import coordinator_input_codec
from trioserve.protocol.kv_batch import chunk_kv_events
from trioserve.protocol.messages import MAX_KV_EVENT_KEYS, KvEvents, LoadReport


def _apply(index: PrefixIndex, messages: list[KvEvents]) -> None:
    for m in messages:
        index.apply(m)


# ------------------------------------------------------------------------------------ chunking


@settings(max_examples=100, deadline=None)
@given(stored=st.integers(0, 30), removed=st.integers(0, 30), cleared=st.booleans(), cap=st.integers(1, 8))
def test_chunks_are_bounded_complete_and_cleared_first(
    stored: int, removed: int, cleared: bool, cap: int
) -> None:
    s, r = list(range(stored)), list(range(100, 100 + removed))
    messages = chunk_kv_events(3, s, r, cleared=cleared, first_seq=7, max_keys=cap)
    assert all(len(m.stored) + len(m.removed) <= cap for m in messages)
    assert [k for m in messages for k in m.stored] == s
    assert [k for m in messages for k in m.removed] == r
    assert [m.seq for m in messages] == list(range(7, 7 + len(messages)))
    assert [m.cleared for m in messages] == [cleared and i == 0 for i in range(len(messages))]
    assert len(messages) == max(math.ceil((stored + removed) / cap), 1 if cleared else 0)


# ------------------------------------------------------------------------------- the engine's log


def test_the_first_flush_is_a_resync_then_changes_latest_wins() -> None:
    log = KvEventLog()
    log.stored(1)  # before the first flush: the re-sync lists what the ledger holds then
    first = log.take(0, 0.0, lambda: [1, 2])
    assert first == [KvEvents(0, [1, 2], [], True, 1)]
    assert log.take(0, 0.1, list) == []  # nothing new
    log.stored(3)
    log.removed(3)  # stored then removed: removed
    log.removed(2)
    log.stored(2)  # removed then stored: stored
    (changes,) = log.take(0, 0.2, list)
    assert (sorted(changes.stored), sorted(changes.removed), changes.cleared, changes.seq) == (
        [2],
        [3],
        False,
        2,
    )


def test_overflow_send_failure_and_the_interval_each_resync() -> None:
    log = KvEventLog(max_pending=3, resync_interval=30.0)
    log.take(0, 0.0, list)
    for key in range(4):  # one more than may wait
        log.stored(key)
    assert log.overflows == 1 and log.num_pending == 0
    assert log.take(0, 1.0, lambda: [9]) == [KvEvents(0, [9], [], True, 2)]
    log.stored(5)
    log.send_failed()  # the coordinator missed news: tell it everything
    assert log.take(0, 2.0, lambda: [5, 9])[0].cleared
    log.stored(6)
    assert not log.take(0, 3.0, list)[0].cleared
    assert log.take(0, 32.0, lambda: [5, 6, 9])[0].cleared  # the periodic re-sync
    assert log.resyncs == 4


def test_the_ledger_reports_what_it_registers_and_forgets() -> None:
    ledger = KVLedger(4, 2)
    log = ledger.kv_events = KvEventLog()
    log.take(0, 0.0, ledger.cached_keys)
    hashes = block_hashes(list(range(8)), 2)  # 4 blocks
    ledger.allocate("a", 8)
    ledger.cache_blocks("a", hashes, 8)
    ledger.free("a")  # evictable, still cached
    (stored,) = log.take(0, 1.0, ledger.cached_keys)
    assert sorted(stored.stored) == sorted(block_key(h) for h in hashes) and stored.removed == []
    ledger.allocate("b", 4)  # two fresh blocks: the two least recent evictable ones are reused
    (removed,) = log.take(0, 2.0, ledger.cached_keys)
    assert len(removed.removed) == 2 and removed.stored == []
    assert set(ledger.cached_keys()) == {block_key(h) for h in hashes} - set(removed.removed)


def test_flush_sends_a_real_schedulers_events_and_nothing_for_other_cores() -> None:
    driver = Driver(cfg(num_blocks=8, block_size=4))
    sent: list[bytes] = []

    def send(frames: list[bytes]) -> bool:
        sent.extend(frames)
        return True

    core = SimpleNamespace(scheduler=driver.s)  # what the shell passes: a core with a scheduler
    flush_kv_events(core, 1, 0.0, send)  # the first flush: an empty re-sync
    driver.add(make_add("a", 13, max_tokens=3))
    driver.run()
    flush_kv_events(core, 1, 1.0, send)
    codec = coordinator_input_codec()
    messages = [codec.decode(f) for f in sent]
    assert all(isinstance(m, KvEvents) and m.engine_index == 1 for m in messages)
    index = PrefixIndex(2)
    _apply(index, [m for m in messages if isinstance(m, KvEvents)])
    keys = driver.s.ledger.cached_keys()
    assert len(keys) == 3  # 15 computed tokens: 3 full blocks
    assert index.match(1, tuple(keys)) == 3
    before = len(sent)
    flush_kv_events(object(), 0, 2.0, send)  # a core without a ledger (the mock)
    assert len(sent) == before

    failing = Driver(cfg(num_blocks=8, block_size=4))
    flush_kv_events(SimpleNamespace(scheduler=failing.s), 0, 0.0, lambda frames: False)
    log = failing.s.ledger.kv_events
    assert log is not None
    failing.add(make_add("b", 9, max_tokens=1))
    failing.run()
    assert log.num_pending == 0  # a re-sync is owed: nothing is collected meanwhile


# ------------------------------------------------------------------------------- the coordinator


def test_the_coordinator_forwards_changes_with_the_next_publication() -> None:
    core = CoordinatorCore(2)
    assert core.due(0.0) is not None
    assert core.take_kv(0.0) == []  # nothing heard
    assert core.kv(KvEvents(1, [10, 11], [], True, 1))
    assert core.next_due() == 0.1  # a change: published within the interval
    assert core.due(0.05) is None
    assert core.due(0.1) is not None
    assert core.take_kv(0.1) == [KvEvents(1, [10, 11], [], True, 1)]  # a cleared batch is the mirror
    core.kv(KvEvents(1, [12], [10], False, 2))
    core.kv(KvEvents(1, [10], [12], False, 3))  # coalesced: 10 back, 12 gone again
    core.kv(KvEvents(1, [], [99], False, 4))  # never stored: no news
    assert core.due(0.2) is not None
    # Latest wins per key: 10 stored (again, harmless), 12 removed (never published, harmless).
    assert core.take_kv(0.2) == [KvEvents(1, [10], [12], False, 2)]
    assert core.mirror(1) == {10, 11}


def test_the_coordinator_resyncs_every_engine_heard_every_five_seconds() -> None:
    core = CoordinatorCore(3, kv_resync=5.0)
    core.kv(KvEvents(0, [1, 2], [], True))
    core.kv(KvEvents(2, [], [], True))
    core.due(0.0)
    assert [m.engine_index for m in core.take_kv(0.0)] == [0, 2]
    core.report(LoadReport(0, 1, 0, 0.0))
    core.due(1.0)
    assert core.take_kv(1.0) == []
    core.due(5.0)  # a keep-alive
    resync = core.take_kv(5.0)
    assert [(m.engine_index, sorted(m.stored), m.cleared) for m in resync] == [
        (0, [1, 2], True),
        (2, [], True),
    ]
    assert [m.seq for m in resync] == [3, 4]  # one count across engines


def test_the_coordinator_drops_bad_events_and_caps_its_mirror() -> None:
    core = CoordinatorCore(2, max_engine_keys=3)
    assert not core.kv(KvEvents(2, [1], []))
    assert not core.kv(KvEvents(0, [-1], []))
    assert not core.kv(KvEvents(0, [1 << 64], []))
    assert core.bad_kv == 3
    assert core.kv(KvEvents(0, [1, 2, 3, 4, 5], [], True))
    assert core.kv_dropped_keys == 2 and len(core.mirror(0)) == 3


def test_a_big_batch_goes_out_in_bounded_messages() -> None:
    core = CoordinatorCore(1)
    core.kv(KvEvents(0, list(range(MAX_KV_EVENT_KEYS * 2 + 5)), [], True))
    core.due(0.0)
    messages = core.take_kv(0.0)
    assert len(messages) == 3
    assert all(len(m.stored) <= MAX_KV_EVENT_KEYS for m in messages)
    assert [m.cleared for m in messages] == [True, False, False]


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 5), st.integers(1, 20)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("flush"), st.just(0), st.just(0)),
        st.tuples(st.just("publish"), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, small_pending=st.booleans())
def test_the_api_servers_index_ends_up_holding_what_the_ledger_holds(
    ops: list[tuple[str, int, int]], small_pending: bool
) -> None:
    """Ledger -> engine log -> coordinator -> index, with overflows and coalescing on the way: after a
    last flush and publication, the index holds exactly the ledger's keys."""
    ledger = KVLedger(12, 2)
    ledger.kv_events = KvEventLog(max_pending=3 if small_pending else 1000)
    core = CoordinatorCore(1)
    index = PrefixIndex(1)
    now = 0.0
    live: set[str] = set()

    def flush() -> None:
        assert ledger.kv_events is not None
        for m in ledger.kv_events.take(0, now, ledger.cached_keys):
            assert core.kv(m)

    def publish() -> None:
        if core.due(now) is not None:
            _apply(index, core.take_kv(now))

    for step, (op, a, b) in enumerate(ops):
        now = step * 0.05
        rid = f"r{a}"
        if op == "add" and rid not in live:
            tokens = [a * 7 + (i % 3) for i in range(b)]  # prompts that share prefixes
            cached = ledger.lookup_prefix(block_hashes(tokens, 2), len(tokens))
            if ledger.allocate(rid, len(tokens), cached) is not None:
                ledger.cache_blocks(rid, block_hashes(tokens, 2), len(tokens))
                live.add(rid)
        elif op == "free" and rid in live:
            ledger.free(rid)
            live.discard(rid)
        elif op == "flush":
            flush()
        elif op == "publish":
            publish()
        ledger.check_invariants()
    now += 1.0
    flush()
    publish()
    want = set(ledger.cached_keys())
    assert core.mirror(0) == want
    assert index.num_keys(0) == (len(want), 0)
    assert all(index.match(0, (k,)) == 1 for k in want)

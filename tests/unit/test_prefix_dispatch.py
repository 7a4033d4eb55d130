"""Prefix-aware dispatch (``frontend/dispatch.py``'s ``prefix`` policy) and the hashing it shares with
the engine (``protocol/block_hash.py``): the API server's keys for a prompt are the engine's, the rule
(longest cached prefix within the load bound, else dplb) and the index's bounds."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine import block_hash as engine_block_hash
from trioserve.engine.kv_ledger import KVLedger
from trioserve.engine.request import Request
from trioserve.frontend.dispatch import (
    PREFIX_LOAD_RATIO,
    PREFIX_LOAD_SLACK,
    DpScore,
    PrefixAware,
    PrefixIndex,
    RequestKey,
    make_policy,
)
from trioserve.protocol import block_hash
from trioserve.protocol.block_hash import block_key, prefix_block_keys
from trioserve.protocol.messages import (
    AddRequest,
    EngineReady,
    KvEvents,
    LoadReport,
    LoadSnapshot,
    SamplingParams,
)


def _add(tokens: list[int], salt: str | None = None, **sampling: int) -> AddRequest:
    return AddRequest("r", tokens, SamplingParams(4, **sampling), 0.0, cache_salt=salt)


def _engines(block_size: int, n: int = 2) -> dict[int, EngineReady]:
    return {i: EngineReady(i, 100 + i, "model", 512, 8, 1000, 64, block_size) for i in range(n)}


# ------------------------------------------------------------------------------------ the hashing


def test_the_engine_module_re_exports_the_same_functions() -> None:
    assert engine_block_hash.hash_block is block_hash.hash_block
    assert engine_block_hash.extend_block_hashes is block_hash.extend_block_hashes
    assert engine_block_hash.root_hash is block_hash.root_hash


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 200_000), max_size=120),
    block_size=st.sampled_from([1, 2, 4, 16]),
    salt=st.one_of(st.none(), st.text(max_size=8)),
)
def test_api_server_keys_equal_the_engines_for_the_same_prompt_block_size_and_salt(
    tokens: list[int], block_size: int, salt: str | None
) -> None:
    # The engine's side: the Request the input pump builds from the add, its blocks as the ledger
    # registers them, and only those a lookup can hit (it always leaves the last token to compute).
    engine = Request.from_add(_add(tokens, salt), block_size=block_size, now=0.0)
    hittable = max(len(tokens) - 1, 0) // block_size
    engine_keys = [block_key(h) for h in engine.block_hashes[:hittable]]
    assert prefix_block_keys(tokens, block_size, salt) == engine_keys
    # And the policy's key for the request, with the block size the engines' Ready carries.
    key = PrefixAware(2).request_key(_add(tokens, salt), _engines(block_size))
    if engine_keys:
        assert key == RequestKey(tuple(engine_keys), len(tokens), block_size)
    else:
        assert key is None


def test_the_keys_are_the_ledgers_registered_blocks() -> None:
    tokens = list(range(1000, 1037))  # 9 full blocks of 4 and one token
    request = Request.from_add(_add(tokens), block_size=4, now=0.0)
    ledger = KVLedger(16, 4)
    ledger.allocate("r", len(tokens))
    ledger.cache_blocks("r", request.block_hashes, len(tokens))
    assert set(prefix_block_keys(tokens, 4)) == set(ledger.cached_keys())


def test_a_salt_or_another_block_size_gives_other_keys() -> None:
    tokens = list(range(64))
    plain = prefix_block_keys(tokens, 16)
    assert len(plain) == 3  # 63 tokens a lookup may cover: 3 full blocks
    assert set(plain).isdisjoint(prefix_block_keys(tokens, 16, "tenant-a"))
    assert prefix_block_keys(tokens, 16, "tenant-a") != prefix_block_keys(tokens, 16, "tenant-b")
    assert set(plain).isdisjoint(prefix_block_keys(tokens, 8))
    assert prefix_block_keys(tokens, 16, max_blocks=2) == plain[:2]


def test_no_key_without_a_prefix_cache_a_full_block_or_for_prompt_logprobs() -> None:
    policy = PrefixAware(2)
    long = list(range(100))
    assert policy.request_key(_add(long), _engines(0)) is None  # the engines keep no prefix cache
    assert policy.request_key(_add(long), {}) is None  # none joined yet
    assert policy.request_key(_add(list(range(16))), _engines(16)) is None  # no block before the last token
    assert policy.request_key(_add(long, prompt_logprobs=1), _engines(16)) is None  # the cache is skipped
    key = policy.request_key(_add(long), _engines(16))
    assert key is not None and len(key.blocks) == 6
    assert DpScore(2).request_key(_add(long), _engines(16)) is None


# -------------------------------------------------------------------------------------- the rule


def _key(blocks: int, tokens: int | None = None, block_size: int = 16, base: int = 0) -> RequestKey:
    return RequestKey(tuple(range(base, base + blocks)), tokens or blocks * block_size + 1, block_size)


def _stored(engine: int, keys: range | list[int], cleared: bool = False) -> KvEvents:
    return KvEvents(engine, list(keys), [], cleared)


def _loads(*counts: tuple[int, int]) -> LoadSnapshot:
    return LoadSnapshot(1, [LoadReport(i, w, r, 0.0) for i, (w, r) in enumerate(counts)])


def test_the_engine_holding_the_prefix_wins_when_load_is_even() -> None:
    policy = PrefixAware(2)
    policy.apply_kv(_stored(1, range(10)))
    assert policy.pick({0, 1}, _key(10)) == 1
    assert policy.pick({0, 1}, _key(10, base=50)) == 0  # nobody holds that one: dplb's pick
    assert policy.pick({0, 1}) == 0  # no key: dplb's pick
    assert policy.pick({0}, _key(10)) == 0  # only ready engines
    assert policy.pick(set(), _key(10)) is None


def test_the_longest_prefix_wins_and_only_leading_blocks_count() -> None:
    policy = PrefixAware(3)
    policy.apply_kv(_stored(0, range(3)))
    policy.apply_kv(_stored(1, range(6)))
    policy.apply_kv(_stored(2, range(1, 10)))  # everything but the first block: no prefix at all
    assert policy.index.match(2, _key(10).blocks) == 0
    assert policy.pick({0, 1, 2}, _key(10)) == 1


def test_a_loaded_engine_keeps_a_prefix_only_within_the_bound() -> None:
    policy = PrefixAware(2)
    policy.apply_kv(_stored(1, range(10)))
    key = _key(10)  # wholly cached on engine 1: share 160/161
    share = 160 / 161
    policy.update(_loads((0, 4), (0, 7)))
    margin = share * (PREFIX_LOAD_SLACK + PREFIX_LOAD_RATIO * 4)  # 5.96
    assert margin >= 7 - 4
    assert policy.pick({0, 1}, key) == 1
    policy.update(_loads((0, 4), (0, 10)))  # 6 more than the least loaded: over the bound
    assert margin < 10 - 4
    assert policy.pick({0, 1}, key) == 0
    # Half cached: half the margin.
    half = RequestKey(key.blocks[:5], 161, 16)
    policy.update(_loads((0, 4), (0, 7)))
    assert (80 / 161) * (PREFIX_LOAD_SLACK + PREFIX_LOAD_RATIO * 4) < 3
    assert policy.pick({0, 1}, half) == 0


def test_among_allowed_engines_a_tie_in_prefix_goes_to_the_less_loaded() -> None:
    policy = PrefixAware(3)
    for engine in (1, 2):
        policy.apply_kv(_stored(engine, range(8)))
    policy.update(_loads((0, 0), (0, 3), (0, 2)))
    assert policy.pick({0, 1, 2}, _key(8)) == 2


def test_sent_requests_are_expected_until_events_say_otherwise() -> None:
    policy = PrefixAware(2)
    key = _key(8)
    first = policy.pick({0, 1}, key)
    assert first == 0
    policy.sent(0, key)
    # dplb alone rotates to engine 1 now; the expected prefix keeps the next one on engine 0.
    plain = DpScore(2)
    plain.sent(0)
    assert plain.pick({0, 1}) == 1
    assert policy.pick({0, 1}, key) == 0
    policy.apply_kv(KvEvents(0, [], [3]))  # the engine evicted block 3: the prefix is 3 blocks now
    assert policy.index.match(0, key.blocks) == 3
    policy.apply_kv(KvEvents(0, [], [], cleared=True))  # a re-sync: the engine's truth...
    assert policy.index.match(0, key.blocks) == 3  # ...but the request may be newer than its mirror
    policy.apply_kv(KvEvents(0, [], [], cleared=True))  # a second: it never came true
    assert policy.index.match(0, key.blocks) == 0
    assert policy.pick({0, 1}, key) == 1  # dplb's rotation again


def test_a_re_sync_keeps_what_was_sent_since_the_one_before() -> None:
    """A re-sync's mirror can predate a request sent just before it arrives (the request's blocks
    stored, their events still on the way): expected keys survive one re-sync, not two; a key sent
    again counts from then."""
    index = PrefixIndex(1)
    index.expect(0, (1, 2, 3))
    index.apply(KvEvents(0, [], [], cleared=True))
    assert index.match(0, (1, 2, 3)) == 3
    index.expect(0, (5, 3))  # sent after that re-sync (3 again)
    index.apply(KvEvents(0, [9], [], cleared=True))  # a second: 1 and 2 never came true
    assert [index.match(0, (k,)) for k in (1, 2, 3, 5, 9)] == [0, 0, 1, 1, 1]
    assert index.num_keys(0) == (1, 2)
    index.apply(KvEvents(0, [], [], cleared=True))  # a third: 5 and 3 never came true either
    assert index.num_keys(0) == (0, 0)


def test_the_index_is_bounded() -> None:
    index = PrefixIndex(1, max_keys=10, max_expected=5)
    index.apply(_stored(0, range(20)))
    assert index.num_keys(0) == (10, 0)
    index.expect(0, tuple(range(100, 108)))
    assert index.num_keys(0) == (10, 5)  # least recently sent dropped first
    assert index.match(0, tuple(range(103, 108))) == 5
    assert index.match(0, (100,)) == 0
    index.apply(KvEvents(7, [1], [], True))  # no such engine: ignored
    assert index.num_keys(0) == (10, 5)


def test_make_policy_knows_prefix() -> None:
    policy = make_policy("prefix", 2, 1, 0)
    assert isinstance(policy, PrefixAware) and policy.name == "prefix"
    with pytest.raises(ValueError, match="slack"):
        PrefixAware(2, slack=-1)


_load = st.tuples(st.integers(0, 30), st.integers(0, 30), st.floats(0.0, 1.0))


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(_load, min_size=1, max_size=5),
    held=st.lists(st.integers(0, 12), min_size=5, max_size=5),
    ready_mask=st.lists(st.booleans(), min_size=5, max_size=5),
    num_blocks=st.integers(1, 12),
    extra_tokens=st.integers(1, 40),
    sends=st.lists(st.integers(0, 4), max_size=6),
)
def test_the_rule_holds_for_any_loads_and_holdings(
    loads: list[tuple[int, int, float]],
    held: list[int],
    ready_mask: list[bool],
    num_blocks: int,
    extra_tokens: int,
    sends: list[int],
) -> None:
    n = len(loads)
    policy = PrefixAware(n)
    plain = DpScore(n)
    snapshot = LoadSnapshot(1, [LoadReport(i, w, r, kv) for i, (w, r, kv) in enumerate(loads)])
    for p in (policy, plain):
        p.update(snapshot)
        for engine in sends:
            p.sent(engine % n)
    for engine in range(n):
        policy.apply_kv(_stored(engine, range(held[engine])))
    ready = {i for i in range(n) if ready_mask[i]}
    key = _key(num_blocks, num_blocks * 16 + extra_tokens)
    picked = policy.pick(ready, key)
    base = plain.pick(ready)
    assert policy.load.score(0) == plain.score(0)  # the same load view as dplb's
    if base is None:
        assert picked is None
        return
    assert picked in ready
    least = plain.score(base)
    matches = {e: min(held[e], num_blocks) for e in ready}
    if max(matches.values()) == 0:
        assert picked == base  # nobody holds the first block: exactly dplb
    # The bound: never more loaded than the least loaded plus the whole margin, scaled by its share.
    share = matches[picked] * 16 / key.num_tokens
    assert policy.score(picked) - least <= share * (PREFIX_LOAD_SLACK + PREFIX_LOAD_RATIO * least) + 1e-9
    # Longest among the allowed: no allowed engine holds a longer prefix.
    for engine in ready:
        allowed = policy.score(engine) - least <= (matches[engine] * 16 / key.num_tokens) * (
            PREFIX_LOAD_SLACK + PREFIX_LOAD_RATIO * least
        )
        if allowed:
            assert matches[engine] <= matches[picked]
    assert policy.pick(ready, key) == picked  # pick changes nothing


def test_a_long_prompt_hashes_at_most_max_dispatch_blocks() -> None:
    """The work per request is bounded: MAX_DISPATCH_BLOCKS hashes, as many lookups per engine."""
    policy = PrefixAware(4)
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(300)]
    policy.apply_kv(KvEvents(2, keys, []))
    key = policy.request_key(_add(list(range(10_000))), _engines(16, 4))
    assert key is not None and len(key.blocks) == policy.max_blocks == 256
    assert policy.pick({0, 1, 2, 3}, key) == 0

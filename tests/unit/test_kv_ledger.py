"""The KV ledger: hand-worked cases, then a Hypothesis state machine with a shadow KV memory.

The state machine keeps what a model runner would have written into every block slot. Whenever a
prefix lookup returns blocks, their shadow content must equal the tokens the request asked for: that is
the property prefix caching exists to keep (a hit never serves another prompt's KV, and never KV that
is not written yet or was overwritten since).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from trioserve.engine.block_hash import block_hashes, hash_block, root_hash
from trioserve.engine.kv_ledger import KVLedger


def computed(ledger: KVLedger, rid: str, tokens: list[int], num_tokens: int | None = None) -> None:
    """Pretend a step computed ``tokens`` (or its first ``num_tokens``) for ``rid``: register its blocks."""
    n = len(tokens) if num_tokens is None else num_tokens
    ledger.cache_blocks(rid, block_hashes(tokens, ledger.block_size), n)


# ------------------------------------------------------------------------------------------ hashes


def test_block_hashes_chain_over_the_prefix_and_the_salt() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the partial last block has no hash
    assert a == block_hashes([1, 2, 3, 4, 5, 6], 2)  # deterministic
    assert a[0] == hash_block(root_hash(None), [1, 2])
    assert a[1] == hash_block(a[0], [3, 4])
    # The same block after a different prefix hashes differently.
    assert block_hashes([9, 9, 3, 4], 2)[1] != a[1]
    # A salt changes every hash of the chain; an empty salt is a salt.
    salted = block_hashes([1, 2, 3, 4], 2, "tenant")
    assert not set(salted) & set(a)
    assert block_hashes([1, 2], 2, "") != block_hashes([1, 2], 2, None)
    assert all(len(h) == 32 for h in a)


# ------------------------------------------------------------------------------------ hand-worked


def test_fresh_ledger_hands_out_ascending_ids_and_grows_tables_by_block() -> None:
    ledger = KVLedger(num_blocks=4, block_size=4)
    assert ledger.allocate("a", 5) == [0, 1]
    assert ledger.allocate("a", 8) == []  # still fits in two blocks
    assert ledger.allocate("a", 9) == [2]
    assert ledger.block_table("a") == [0, 1, 2]
    assert (ledger.num_used_blocks, ledger.num_free_blocks, ledger.usage) == (3, 1, 0.75)
    ledger.check_invariants()


def test_allocate_that_does_not_fit_returns_none_and_changes_nothing() -> None:
    ledger = KVLedger(num_blocks=4, block_size=2)
    assert ledger.allocate("a", 6) == [0, 1, 2]
    before = copy.deepcopy(vars(ledger))
    assert ledger.allocate("a", 10) is None  # needs 2 more, 1 free
    assert ledger.allocate("b", 3) is None  # a new request needs 2, 1 free
    assert vars(ledger) == before
    assert not ledger.has_blocks("b")
    ledger.check_invariants()


def test_freed_full_blocks_stay_findable_and_a_hit_never_covers_the_whole_prompt() -> None:
    ledger = KVLedger(num_blocks=8, block_size=4)
    prompt = list(range(10))
    ledger.allocate("a", 10)
    computed(ledger, "a", prompt)
    ledger.free("a")
    # Both full blocks are kept for reuse; the partial third one is empty again.
    assert (ledger.num_evictable_blocks, ledger.num_used_blocks) == (2, 0)
    hashes = block_hashes(prompt, 4)
    assert ledger.lookup_prefix(hashes, 10) == [0, 1]
    # A prompt of exactly the two cached blocks: only the first may be reused, so the last token of
    # the prompt is computed (the model needs it to produce the first output's logits).
    assert ledger.lookup_prefix(hashes, 8) == [0]
    assert ledger.lookup_prefix(hashes, 4) == []
    # Taking the hit revives the evictable blocks (out of the free pool, references back to 1).
    assert ledger.allocate("b", 10, [0, 1]) == [2]
    assert ledger.block_table("b") == [0, 1, 2]
    assert [ledger.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]
    assert ledger.num_evictable_blocks == 0
    ledger.check_invariants()


def test_shared_blocks_are_reference_counted() -> None:
    ledger = KVLedger(num_blocks=8, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    ledger.allocate("a", 5)
    computed(ledger, "a", tokens)
    hit = ledger.lookup_prefix(block_hashes(tokens, 2), 5)
    assert hit == [0, 1]
    assert ledger.allocate("b", 5, hit) == [3]
    assert [ledger.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    ledger.free("a")
    assert [ledger.ref_count(b) for b in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert ledger.num_used_blocks == 3  # 0 and 1 are still held by b
    ledger.free("b")
    assert ledger.num_used_blocks == 0
    assert ledger.num_evictable_blocks == 2
    ledger.check_invariants()


def test_allocation_uses_empty_blocks_first_then_evicts_least_recently_freed_tail_first() -> None:
    ledger = KVLedger(num_blocks=6, block_size=1)
    ledger.allocate("old", 2)  # blocks 0, 1
    computed(ledger, "old", [1, 2])
    ledger.allocate("new", 2)  # blocks 2, 3
    computed(ledger, "new", [3, 4])
    ledger.free("old")  # freed in reverse: 1 then 0
    ledger.free("new")  # then 3, 2
    assert ledger.num_empty_blocks == 2  # 4 and 5 were never used
    # Two empty blocks go first; no cached block is lost for them.
    assert ledger.allocate("x", 2) == [4, 5]
    assert ledger.num_evictable_blocks == 4
    # Then eviction, least recently freed first, and within a request its tail before its head.
    assert ledger.allocate("y", 3) == [1, 0, 3]
    assert ledger.cached_block(block_hashes([1, 2], 1)[0]) is None
    assert ledger.cached_block(block_hashes([3, 4], 1)[0]) == 2  # "new"'s head survives
    assert ledger.cached_block(block_hashes([3, 4], 1)[1]) is None
    ledger.check_invariants()


def test_hits_count_against_the_free_pool_when_they_revive_evictable_blocks() -> None:
    ledger = KVLedger(num_blocks=3, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    ledger.allocate("a", 5)
    computed(ledger, "a", tokens)
    ledger.free("a")
    hit = ledger.lookup_prefix(block_hashes(tokens, 2), 5)
    assert hit == [0, 1]
    # 3 free blocks, but 2 of them are the hit: a 7-token request needs 2 more, only 1 is left.
    before = copy.deepcopy(vars(ledger))
    assert ledger.allocate("b", 7, hit) is None
    assert vars(ledger) == before
    assert ledger.allocate("b", 6, hit) == [2]
    ledger.check_invariants()


def test_the_same_block_computed_twice_keeps_one_findable_copy() -> None:
    ledger = KVLedger(num_blocks=4, block_size=2)
    tokens = [7, 7, 7]
    ledger.allocate("a", 3)
    ledger.allocate("b", 3)  # admitted before a's blocks were computed: no hit
    computed(ledger, "a", tokens)
    computed(ledger, "b", tokens)
    assert ledger.cached_block(block_hashes(tokens, 2)[0]) == 0
    ledger.free("b")
    assert (ledger.num_empty_blocks, ledger.num_evictable_blocks) == (2, 0)  # b's copy is not cached
    ledger.check_invariants()


def test_blocks_are_registered_only_once_their_tokens_are_computed() -> None:
    ledger = KVLedger(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    hashes = block_hashes(tokens, 2)
    ledger.allocate("a", 5)
    ledger.cache_blocks("a", hashes, 3)  # one full block computed
    assert ledger.lookup_prefix(hashes, 5) == [0]
    ledger.cache_blocks("a", hashes, 5)
    assert ledger.lookup_prefix(hashes, 5) == [0, 1]
    ledger.check_invariants()


def test_different_salts_never_share() -> None:
    ledger = KVLedger(num_blocks=4, block_size=2)
    tokens = [1, 2, 3]
    ledger.allocate("a", 3)
    ledger.cache_blocks("a", block_hashes(tokens, 2, "alice"), 3)
    assert ledger.lookup_prefix(block_hashes(tokens, 2, "bob"), 3) == []
    assert ledger.lookup_prefix(block_hashes(tokens, 2, "alice"), 3) == [0]


def test_evict_forgets_cached_blocks_but_not_blocks_in_use() -> None:
    ledger = KVLedger(num_blocks=4, block_size=1)
    ledger.allocate("a", 2)
    computed(ledger, "a", [1, 2])
    ledger.allocate("b", 2)
    computed(ledger, "b", [3, 4])
    ledger.free("a")
    assert ledger.evict(1) == 1  # a's tail (block 1) goes first
    assert ledger.cached_block(block_hashes([1, 2], 1)[0]) == 0
    assert ledger.evict() == 1
    assert ledger.num_evictable_blocks == 0
    assert ledger.cached_block(block_hashes([3, 4], 1)[1]) == 3  # b holds it
    ledger.check_invariants()


def test_misuse_is_an_error() -> None:
    ledger = KVLedger(num_blocks=4, block_size=2)
    ledger.allocate("a", 3)
    with pytest.raises(ValueError, match="already has blocks"):
        ledger.allocate("a", 3, [1])
    with pytest.raises(ValueError, match="exceed"):
        ledger.allocate("b", 1, [0, 1])
    with pytest.raises(ValueError):
        KVLedger(num_blocks=0, block_size=2)
    ledger.free("never-allocated")  # a no-op
    ledger.check_invariants()


# ------------------------------------------------------------------------------- state machine


class LedgerMachine(RuleBasedStateMachine):
    """Random allocate / grow / compute / free / evict sequences against a shadow KV memory."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = KVLedger(1, 1)
        self.content: list[list[int | None]] = []  # what the "runner" wrote in each block slot
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.num_allocated: dict[str, int] = {}  # token slots allocated
        self.next_id = 0

    @initialize(num_blocks=st.integers(1, 10), block_size=st.integers(1, 3))
    def init(self, num_blocks: int, block_size: int) -> None:
        self.ledger = KVLedger(num_blocks, block_size)
        self.content = [[None] * block_size for _ in range(num_blocks)]

    def _hashes(self, rid: str) -> list[bytes]:
        return block_hashes(self.tokens[rid], self.ledger.block_size)

    def _unchanged_after(self, before: dict[str, Any]) -> None:
        assert vars(self.ledger) == before, "a failed allocate changed the ledger"

    # A tiny vocabulary so that prompts share prefixes often.
    @rule(target=requests, prompt=st.lists(st.integers(0, 1), min_size=1, max_size=10), data=st.data())
    def add(self, prompt: list[int], data: st.DataObject) -> str | None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        ledger = self.ledger
        bs = ledger.block_size
        hit = ledger.lookup_prefix(block_hashes(prompt, bs), len(prompt))
        assert len(hit) * bs < len(prompt)
        for i, block in enumerate(hit):
            assert self.content[block] == prompt[i * bs : (i + 1) * bs], "a hit served other tokens"
        start = len(hit) * bs
        target = data.draw(st.integers(start + 1, len(prompt)), label="first chunk end")
        before = copy.deepcopy(vars(ledger))
        new = ledger.allocate(rid, target, hit)
        if new is None:
            self._unchanged_after(before)
            return None
        assert ledger.block_table(rid) == [*hit, *new]
        self.tokens[rid] = list(prompt)
        self.num_computed[rid] = start
        self.num_allocated[rid] = target
        return rid

    @rule(rid=requests)
    def compute(self, rid: str | None) -> None:
        """The step ran: write the allocated tokens' KV, then register the full blocks."""
        if rid not in self.tokens:
            return
        bs = self.ledger.block_size
        table = self.ledger.block_table(rid)
        for pos in range(self.num_computed[rid], self.num_allocated[rid]):
            self.content[table[pos // bs]][pos % bs] = self.tokens[rid][pos]
        self.num_computed[rid] = self.num_allocated[rid]
        self.ledger.cache_blocks(rid, self._hashes(rid), self.num_computed[rid])

    @rule(rid=requests, new_tokens=st.lists(st.integers(0, 1), max_size=3), data=st.data())
    def grow(self, rid: str | None, new_tokens: list[int], data: st.DataObject) -> None:
        """Outputs arrive (or a prefill continues): allocate slots for more tokens."""
        if rid not in self.tokens or self.num_computed[rid] < self.num_allocated[rid]:
            return  # the previous chunk is not computed yet
        self.tokens[rid].extend(new_tokens)
        if self.num_computed[rid] == len(self.tokens[rid]):
            return
        target = data.draw(st.integers(self.num_computed[rid] + 1, len(self.tokens[rid])), label="chunk end")
        before = copy.deepcopy(vars(self.ledger))
        old_table = list(self.ledger.block_table(rid))
        new = self.ledger.allocate(rid, target)
        if new is None:
            self._unchanged_after(before)
            return
        assert self.ledger.block_table(rid) == old_table + new
        self.num_allocated[rid] = target

    @rule(rid=consumes(requests))
    def free(self, rid: str | None) -> None:
        if rid not in self.tokens:
            return
        self.ledger.free(rid)
        for d in (self.tokens, self.num_computed, self.num_allocated):
            del d[rid]

    @precondition(lambda self: self.ledger.num_evictable_blocks > 0)
    @rule(max_blocks=st.none() | st.integers(1, 3))
    def evict(self, max_blocks: int | None) -> None:
        before = self.ledger.num_evictable_blocks
        evicted = self.ledger.evict(max_blocks)
        assert evicted == (before if max_blocks is None else min(before, max_blocks))

    @invariant()
    def consistent(self) -> None:
        ledger = self.ledger
        ledger.check_invariants()
        held: set[int] = set()
        for rid, allocated in self.num_allocated.items():
            table = ledger.block_table(rid)
            assert len(table) == ledger.blocks_for(allocated)
            held.update(table)
        assert ledger.num_used_blocks == len(held)


LedgerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestLedgerMachine = LedgerMachine.TestCase

"""The KV ledger: which KV-cache blocks exist, who holds them, and which prefixes they cache.

Pure bookkeeping that never sees a tensor (design §7): a pool of ``num_blocks`` blocks of
``block_size`` token slots, referenced by block id from each request's block table. The model runner
owns the memory; this class only decides which ids each request writes and reads.

Every block is in exactly one of three states:

- *used*: reference count > 0 (held by one request, or shared through a prefix hit by several);
- *evictable*: count 0, but it holds a full block whose KV is written and whose hash is registered, so a
  later request with the same prefix can take it back (a prefix hit) until it is reused for new data;
- *empty*: count 0 and no hash.

Rules:

- Allocation takes empty blocks first and evicts only when none are left, least recently freed first
  (an LRU over evictable blocks), so the cache keeps as much as the pool allows.
- A request frees its blocks in *reverse* table order, so its tail becomes least recent: a prefix is only
  useful from its first block on, and evicting a head would strand the blocks behind it.
- A hash is registered only for a block whose KV is fully written (``cache_blocks`` runs after the step
  that computed it), so a hit never reads KV that is still being computed.
- One block per hash. Two requests that compute the same block at the same time keep one copy findable;
  the other copy is an ordinary block that becomes empty when freed.
- A hit never covers a whole prompt: ``lookup_prefix`` stops one token short, because the last prompt
  token must go through the model to produce the logits of the first output token.
- ``allocate`` either succeeds completely or returns None and changes nothing.

KV events: with a ``KvEventLog`` attached (``kv_events``, by ``engine/kv_events.flush_kv_events`` when
there is a DP coordinator to tell), every hash registered is reported ``stored`` and every hash
forgotten ``removed``, by its ``block_key``; without one nothing is collected.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from trioserve.engine.block_hash import BlockHash, block_key

if TYPE_CHECKING:
    from trioserve.engine.kv_events import KvEventLog


class KVLedger:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        # Empty blocks as a stack; reversed so a fresh ledger hands out 0, 1, 2, ... (readable tests).
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        # Evictable blocks, least recently freed first. OrderedDict: O(1) append, pop-front, remove.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._num_used = 0
        self._tables: dict[str, list[int]] = {}
        # Per request: how many leading blocks of its table went through hash registration (or came
        # from a prefix hit); cache_blocks resumes from there.
        self._num_hashed: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up, cumulative (as recorded by the scheduler)
        self.prefix_hits = 0  # tokens found, cumulative
        self.kv_events: KvEventLog | None = None  # told of every hash registered and forgotten

    # ---------------------------------------------------------------------------------------- counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: empty plus evictable."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_empty_blocks(self) -> int:
        return len(self._empty)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (evictable blocks count as free), 0..1."""
        return self._num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    @property
    def block_tables(self) -> Mapping[str, Sequence[int]]:
        """Every request's block table (the ledger's own dict: read only)."""
        return self._tables

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (the ledger's own list: do not mutate)."""
        return self._tables[request_id]

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block registered under ``block_hash``, used or evictable, if any."""
        return self._block_of.get(block_hash)

    # ------------------------------------------------------------------------------------ operations

    def lookup_prefix(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """The cached blocks that match the longest prefix of a ``num_tokens``-token sequence.

        Looks at no more than ``(num_tokens - 1) // block_size`` blocks, so at least one token is
        always left to compute. Changes nothing: pass the result to ``allocate`` before any other
        ledger operation (which could evict these blocks).
        """
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        found: list[int] = []
        block_of = self._block_of
        for i in range(limit):
            block = block_of.get(block_hashes[i])
            if block is None:
                break
            found.append(block)
        return found

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup in the stats (the scheduler calls this once per admitted request)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate(
        self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` token slots; return the new block ids.

        On a request's first call, ``cached_blocks`` (from ``lookup_prefix``) become the head of its
        table and their references grow; they are not part of the returned list. Returns ``[]`` when
        the table is already big enough, and None (changing nothing) when the free blocks do not
        suffice.
        """
        table = self._tables.get(request_id)
        if table is not None:
            if cached_blocks:
                raise ValueError(f"request {request_id!r} already has blocks; cached blocks come first")
            need = -(-num_tokens // self.block_size) - len(table)
            if need <= 0:
                return []
            if need > len(self._empty) + len(self._evictable):
                return None
            new = [self._take_free_block() for _ in range(need)]
            table.extend(new)
            return new

        need = -(-num_tokens // self.block_size) - len(cached_blocks)
        if need < 0:
            raise ValueError(f"{len(cached_blocks)} cached blocks exceed {num_tokens} tokens")
        ref = self._ref
        # A hit on an evictable block takes it out of the free pool too.
        num_revived = sum(1 for block in cached_blocks if ref[block] == 0)
        if need > len(self._empty) + len(self._evictable) - num_revived:
            return None
        for block in cached_blocks:
            if ref[block] == 0:
                del self._evictable[block]
                self._num_used += 1
            ref[block] += 1
        new = [self._take_free_block() for _ in range(need)]
        self._tables[request_id] = [*cached_blocks, *new]
        self._num_hashed[request_id] = len(cached_blocks)
        return new

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Register the request's blocks that are full of computed tokens under their hashes.

        Call after the step that computed them; ``block_hashes`` are the request's chained hashes.
        """
        start = self._num_hashed[request_id]
        table = self._tables[request_id]
        end = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        if end <= start:
            return
        hash_of = self._hash_of
        block_of = self._block_of
        for i in range(start, end):
            block = table[i]
            block_hash = block_hashes[i]
            # A block past the hit prefix was freshly allocated, so it has no hash yet.
            if block_hash not in block_of:
                block_of[block_hash] = block
                hash_of[block] = block_hash
                if self.kv_events is not None:
                    self.kv_events.stored(block_key(block_hash))
        self._num_hashed[request_id] = end

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks no one holds become evictable (hashed) or empty."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        del self._num_hashed[request_id]
        ref = self._ref
        hash_of = self._hash_of
        for block in reversed(table):
            ref[block] -= 1
            if ref[block] == 0:
                self._num_used -= 1
                if hash_of[block] is None:
                    self._empty.append(block)
                else:
                    self._evictable[block] = None

    def evict(self, max_blocks: int | None = None) -> int:
        """Forget up to ``max_blocks`` evictable blocks (all by default), least recent first.

        Returns how many were evicted. Blocks in use keep their hashes.
        """
        count = 0
        while self._evictable and (max_blocks is None or count < max_blocks):
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
            self._empty.append(block)
            count += 1
        return count

    def _take_free_block(self) -> int:
        if self._empty:
            block = self._empty.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
        self._ref[block] = 1
        self._num_used += 1
        return block

    def _unregister(self, block: int) -> None:
        block_hash = self._hash_of[block]
        assert block_hash is not None
        del self._block_of[block_hash]
        self._hash_of[block] = None
        if self.kv_events is not None:
            self.kv_events.removed(block_key(block_hash))

    def cached_keys(self) -> list[int]:
        """The ``block_key`` of every hash registered now (a KV-event re-sync lists them)."""
        return [block_key(h) for h in self._block_of]

    # ------------------------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Recompute every count from scratch and compare; raise AssertionError on any mismatch."""

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise AssertionError(message)

        n = self.num_blocks
        require(len(self._ref) == n and len(self._hash_of) == n, "per-block arrays have the wrong size")
        require(all(r >= 0 for r in self._ref), "negative reference count")
        empty = set(self._empty)
        evictable = set(self._evictable)
        require(len(empty) == len(self._empty), "a block is twice in the empty stack")
        require(not empty & evictable, "a block is both empty and evictable")
        used = {b for b in range(n) if self._ref[b] > 0}
        require(self._num_used == len(used), f"used counter {self._num_used} != {len(used)}")
        require(not used & (empty | evictable), "a referenced block is in the free pool")
        require(len(empty) + len(evictable) + len(used) == n, "empty + evictable + used != total")
        require(all(self._hash_of[b] is None for b in empty), "an empty block has a hash")
        require(all(self._hash_of[b] is not None for b in evictable), "an evictable block has no hash")

        expected_ref = [0] * n
        for rid, table in self._tables.items():
            require(len(set(table)) == len(table), f"request {rid!r} holds a block twice")
            for block in table:
                expected_ref[block] += 1
            require(0 <= self._num_hashed[rid] <= len(table), f"request {rid!r} hashed past its table")
        require(self._tables.keys() == self._num_hashed.keys(), "tables and hash cursors disagree")
        require(expected_ref == self._ref, "reference counts differ from the block tables")

        for block_hash, block in self._block_of.items():
            require(self._hash_of[block] == block_hash, f"hash map points at block {block} with another hash")
        num_hashed_blocks = sum(1 for h in self._hash_of if h is not None)
        require(num_hashed_blocks == len(self._block_of), "a block has a hash the map does not know")

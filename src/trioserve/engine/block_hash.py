"""The prefix cache's chained block hashes: moved to ``protocol/block_hash.py`` (the API server's
``prefix`` dispatch policy computes the same hashes and may not import the engine). Re-exported here
so engine code and tests keep importing them from the engine."""

from __future__ import annotations

from trioserve.protocol.block_hash import (
    BlockHash,
    block_hashes,
    block_key,
    extend_block_hashes,
    hash_block,
    prefix_block_keys,
    root_hash,
)

__all__ = [
    "BlockHash",
    "block_hashes",
    "block_key",
    "extend_block_hashes",
    "hash_block",
    "prefix_block_keys",
    "root_hash",
]

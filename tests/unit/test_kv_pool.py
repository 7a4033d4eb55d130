"""The KV pool's memory (worker/paged_attention.py, ``zeroed``): on the CPU an anonymous mapping that
reads as zero, takes writes, and is resident from the start (populated, not faulted in by the steps
that first write it)."""

from __future__ import annotations

import os

import torch

from trioserve.worker.paged_attention import PagedKVCache, zeroed


def test_the_pool_reads_zero_and_keeps_what_is_written() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pool = zeroed((3, 2, 4, 8), dtype, torch.device("cpu"))
        assert pool.shape == (3, 2, 4, 8) and pool.dtype == dtype and pool.is_contiguous()
        assert torch.equal(pool, torch.zeros_like(pool))
        pool[1, :, 2] = 1.5
        assert pool.sum().item() == 1.5 * 2 * 8 and pool[2].abs().sum().item() == 0


def test_each_layer_has_its_own_keys_and_values() -> None:
    cache = PagedKVCache(3, 4, 16, 2, 8, torch.float32, torch.device("cpu"))
    assert len(cache.keys) == len(cache.values) == 3
    for tensor in (*cache.keys, *cache.values):
        assert tensor.shape == (4, 16, 2, 8) and tensor.is_contiguous()  # blocks, positions, heads, dim
    cache.keys[1][0, 0, 0, 0] = 7.0
    others = [t for i, t in enumerate((*cache.keys, *cache.values)) if i != 1]
    assert all(t.abs().sum().item() == 0 for t in others)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_pool_is_resident_before_anything_is_written() -> None:
    before = resident_bytes()
    pool = zeroed((256, 1024, 1024), torch.uint8, torch.device("cpu"))  # 256 MiB
    assert resident_bytes() - before > 200 << 20  # a lazy mapping: next to nothing
    assert pool[:128].sum().item() == 0

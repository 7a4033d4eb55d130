"""A paged KV cache addressed by the scheduler's block tables, and the attention function that reads it:
called by the own decoder's attention (``worker/decoder_model.py``), and plugged into transformers'
models through their attention-function registry (``attach_to_transformers``).

One forward pass computes every scheduled token of every request as one flat sequence
``[1, T]``: prefill chunks and decodes together, each token at its own position. The model runs with
no transformers cache (``use_cache=False``); RoPE is applied from ``position_ids``, and the attention
function registered here does the rest for each layer:

1. write this step's keys and values into their blocks, at ``(position // block_size, position %
   block_size)`` through each request's block table;
2. decodes (one new token each) attend to their whole context: read in place through the block
   tables by the native kernel (``worker/native_kernels.py``) when the cache has one, else in one
   batched SDPA call, gathered through the block tables and padded to the longest, with a mask;
3. each prefill chunk attends causally to its own context: straight to its fresh keys when the chunk
   starts at position 0 (nothing to read back), else to the keys read back through its block table
   (a prefix-cache hit or an earlier chunk).

A prefill chunk that starts at position 0 needs no mask (SDPA's ``is_causal``) and reads nothing back.

The own decoder passes no mask, and transformers skips its own mask construction for an attention
implementation it has no mask function for, so the ``attention_mask`` argument is ``None`` here and
this module owns all masking. With transformers this relies on the ``AttentionInterface`` call
contract of transformers 5.23 (``module, query, key, value, attention_mask, scaling=..., **kwargs``
with query ``[B, H, T, D]`` and a ``[B, T, H, D]`` result), which is why pyproject pins that version.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trioserve.worker.native_kernels import NativeKernels

ATTN_IMPLEMENTATION = "trioserve_paged"


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """A chunk of ``end - start`` query tokens in the flat batch for one request."""

    start: int  # first query row in the flat batch
    end: int
    blocks: torch.Tensor | None  # [1, n] block table of the context; None: only this chunk (from 0)
    mask: torch.Tensor | None  # [chunk, n * block_size] bool, True where a query may attend


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where every token of one forward pass goes and what each one attends to."""

    write_blocks: torch.Tensor  # [T] block of each token computed this step
    write_offsets: torch.Tensor  # [T] its offset in that block
    decode_rows: torch.Tensor  # [B] flat rows of the decode tokens
    decode_blocks: torch.Tensor  # [B, n] block tables of the decodes, padded with block 0
    decode_mask: torch.Tensor  # [B, 1, 1, n * block_size] bool, True on each context's positions
    decode_lens: torch.Tensor  # [B] int64, each decode's context length (its own token included)
    prefills: tuple[PrefillSpan, ...]


class PagedKVCache:
    """Per-layer keys and values, ``[num_blocks, block_size, kv_heads, head_dim]`` each.

    Positions before heads inside a block, so that reading a context back is one ``index_select`` of
    whole blocks (contiguous copies, several times faster on the CPU than gathering slot by slot)
    whose result already is ``[batch, positions, heads, dim]``: SDPA takes its ``transpose(1, 2)`` as a
    strided view, with no second copy. (Heads first, as before, needed that second copy into
    ``[batch, heads, positions, dim]``: one layer's decode attention over 192-token contexts, timed
    alone, took 0.5 instead of 2.2-2.4 ms for 32 sequences of the tiny model's heads and 1.3-1.9
    instead of 2.1-3.1 ms for SmolLM2's; whole steps: ``docs/benchmarks.md``.)
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pages: mmap.mmap | None = None,
        native: NativeKernels | None = None,
    ) -> None:
        self.block_size = block_size
        self.native = native  # decode attention read in place; None: gathered for SDPA
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        pool = zeroed((2 * num_layers, *shape), dtype, device, pages)
        self.keys = list(pool[:num_layers])
        self.values = list(pool[num_layers:])


def zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pages: mmap.mmap | None = None
) -> torch.Tensor:
    """A zero tensor for the KV pool, resident from the start. On the CPU, an anonymous private mapping
    with ``MAP_POPULATE``: the kernel hands out zeroed pages and maps them all in one call, where
    ``torch.zeros`` takes a page fault per page and then writes each page again (2 GiB on this VM:
    0.8-3.2 s against 2.9-4.9 s; docs/benchmarks.md). Not populated lazily on purpose: with the prefix
    cache, freed blocks stay cached and new ones keep coming from pages never touched, and each first
    write's fault made the served tiny model 30 % slower until the pool had been used once. Without
    ``MAP_POPULATE`` (not Linux) the pages fault in as first written. Elsewhere: ``torch.zeros``.
    ``pages``: such a mapping, populated on a thread from before torch's imports
    (``worker/kv_prefault.py``: start-up), exactly the pool's size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if pages is not None and len(pages) != nbytes:
        raise ValueError(f"a KV pool of {nbytes} bytes was handed {len(pages)} prefaulted bytes")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buffer = pages if pages is not None else mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # it keeps the mapping alive


def gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` block tables -> ``[B, kv_heads, n * block_size, dim]`` keys or values: one copy of the
    blocks, seen through a transposed (strided) view."""
    batch, n = blocks.shape
    _, size, heads, dim = cache.shape
    picked = cache.index_select(0, blocks.reshape(-1)).view(batch, n * size, heads, dim)
    return picked.transpose(1, 2)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    trioserve_layout: BatchLayout | None = None,
    trioserve_cache: PagedKVCache | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    if trioserve_layout is None or trioserve_cache is None:
        raise RuntimeError("paged attention needs a batch layout: run the model through ModelRunner")
    layout, cache = trioserve_layout, trioserve_cache
    layer: int = module.layer_idx  # type: ignore[assignment]
    key_cache, value_cache = cache.keys[layer], cache.values[layer]
    # [1, H, T, D] -> [T, H, D]: the flat batch, one row per token.
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    key_cache[layout.write_blocks, layout.write_offsets] = k
    value_cache[layout.write_blocks, layout.write_offsets] = v

    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if q.shape[0] and not layout.prefills and layout.decode_rows.numel() == q.shape[0]:
        # A step of decodes only: its rows are 0 .. T - 1 in order (``ModelRunner._layout``), so the
        # queries go to the decode attention and its result is the output, with no gather or scatter.
        decoded = _decode_attention(q.contiguous(), cache, layer, layout, num_kv_heads, scaling)
        return decoded.unsqueeze(0), None
    out = torch.empty_like(q)
    if layout.decode_rows.numel():
        out[layout.decode_rows] = _decode_attention(
            q[layout.decode_rows], cache, layer, layout, num_kv_heads, scaling
        )
    gqa = num_heads != num_kv_heads
    for span in layout.prefills:
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.blocks is None:
            ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
            vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            ks, vs = gather(key_cache, span.blocks), gather(value_cache, span.blocks)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scaling, enable_gqa=gqa)
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _decode_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    layout: BatchLayout,
    num_kv_heads: int,
    scaling: float | None,
) -> torch.Tensor:
    """One query token per request. Grouped-query heads are folded into the query axis: query head
    ``h`` reads kv head ``h // group`` (transformers' ``repeat_kv`` order), so ``[B, H, D]`` viewed as
    ``[B, Hkv, group, D]`` attends to ``[B, Hkv, L, D]`` with no copy of the keys per head."""
    batch, num_heads, dim = q.shape
    if cache.native is not None:
        scale = scaling if scaling is not None else dim**-0.5  # SDPA's default
        blocks, lens = layout.decode_blocks, layout.decode_lens
        return cache.native.decode(
            q, cache.keys[layer], cache.values[layer], blocks, lens, scale, torch.get_num_threads()
        )
    group = num_heads // num_kv_heads
    qd = q.view(batch, num_kv_heads, group, dim)
    kd = gather(cache.keys[layer], layout.decode_blocks)
    vd = gather(cache.values[layer], layout.decode_blocks)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=layout.decode_mask, scale=scaling)
    return o.reshape(batch, num_heads, dim)


def attach_to_transformers(model: Any) -> None:
    """Make a transformers model's attention ``paged_attention`` (registered under
    ``ATTN_IMPLEMENTATION``; transformers is imported here, not with this module)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

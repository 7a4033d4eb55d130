"""Linear layers whose weights are reordered once, at load (issue 18, item 2): the CPU worker's matrix
products in float32, on the native kernel's column blocks (``BlockedLinear``, ``native/blocked_linear.c``)
where the native kernels built, else on oneDNN's layout (``PackedLinear``).

torch's ``F.linear`` on the CPU multiplies by the weight as stored, row-major, every call; oneDNN's
``_linear_pointwise`` on a weight packed by ``_reorder_linear_weight`` skips that per-call work. On
this machine, one thread, float32 (``docs/benchmarks.md``): SmolLM2's MLP products at 8 rows 0.24 ->
0.15 ms, its LM head (576 x 49,152) at 8 rows 18.6 -> 7.6 ms and at 32 rows 32.7 -> 19.0 ms; the tiny
model's LM head at 32 rows 4.3 -> 2.6 ms. The same products, summed in another order: results differ
from ``F.linear``'s by float32 rounding (the runner's greedy tests against ``generate()`` run on both).

Rules:

- ``pack_linears`` replaces every ``nn.Linear`` of a CPU float32 model in place, tensor-parallel
  shards included (it runs after sharding: a shard's weight is what gets packed).
- oneDNN's packing takes a batch-size hint; ``BATCH_HINT`` rows (a hint of 1 made 8- and 32-row
  products 1.3-1.8x slower here, 8 to 128 all gave the same).
- The native blocks read a weight near the core's memory bandwidth at a few rows, where oneDNN's
  layout reads it at about half (``bench/linear_products.py``: one thread, weights not in cache, 1-8
  rows 1.4-2.1x faster, 32 rows 1.04-1.09x, 1,024 rows within 3 %, both near the core's peak), so
  with them no oneDNN copy is kept. Each splits its column blocks over torch's thread count at the call.
- Except below ``MIN_BLOCKED_IN`` inputs, where the product is mostly its output's writes and oneDNN
  is faster where torch has it (the tiny model's LM head, 64 -> 49,152: at 32 rows 2.71 against 2.99
  ms, at 128 rows 8.93 against 11.4 ms).
- A blocked weight of whole column blocks that nothing else holds, or only a plain ``nn.Embedding``
  (a tied LM head), is packed over its own memory, and the tied embedding then reads its rows out of
  the packed copy (``PackedEmbedding``): no new memory to fault in at start-up (SmolLM2's fresh
  copies, 540 MB, took 0.9 s of its load on this VM, where memory its host has just taken back is
  slow to touch again). Any other weight (padded, or held by something else) gets its own copy.
"""

from __future__ import annotations

from typing import Final, cast

import torch
from torch import nn

from trioserve.worker.native_kernels import BLOCK, NativeKernels, packed_size
from trioserve.worker.packed_store import PackedStore

BATCH_HINT: Final = 32
MIN_BLOCKED_IN: Final = 128


def available() -> bool:
    """oneDNN is in this torch build with the two operators used here."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(  # type: ignore[no-untyped-call]
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward on a packed copy of its weight (``[out, in]`` in oneDNN's layout)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
            self.bias: torch.Tensor | None = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out


class BlockedLinear(nn.Module):
    """``nn.Linear``'s forward by ``blocked_linear.c`` on its weight packed in column blocks."""

    def __init__(
        self,
        linear: nn.Linear,
        kernels: NativeKernels,
        in_place: bool = False,
        packed: torch.Tensor | None = None,
    ) -> None:
        """``in_place``: the weight's own memory becomes the packed copy (``pack_linears`` says when);
        ``packed``: the packed copy itself, made before (``packed_store.py``)."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kernels = kernels
        with torch.no_grad():
            weight = linear.weight.detach()
            if packed is not None:
                if packed.shape != (packed_size(self.out_features, self.in_features),):
                    raise ValueError("a packed copy of another size than this linear's")
                self.packed = packed
            else:
                self.packed = (
                    kernels.pack_linear_in_place(weight) if in_place else kernels.pack_linear(weight)
                )
            self.bias: torch.Tensor | None = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.packed, self.out_features, self.bias, torch.get_num_threads())


class PackedEmbedding(nn.Module):
    """A tied ``nn.Embedding`` read out of its LM head's packed copy: token t's row is column
    ``t % BLOCK`` of block ``t // BLOCK`` (``native/blocked_linear.c``'s layout), one gather."""

    def __init__(self, packed: torch.Tensor, embedding: nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.blocks = packed.view(-1, self.embedding_dim, BLOCK)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks[ids // BLOCK, :, ids % BLOCK]  # [*ids.shape, dim]


def _plain_embedding(module: nn.Module) -> bool:
    return type(module) is nn.Embedding and module.max_norm is None


def pack_linears(
    model: nn.Module, kernels: NativeKernels | None = None, store: PackedStore | None = None
) -> int:
    """Replace each ``nn.Linear`` of ``model`` with a ``BlockedLinear`` on ``kernels``, or a
    ``PackedLinear`` without them or (where oneDNN is here) below ``MIN_BLOCKED_IN`` inputs; returns
    how many. With a ``store``, the blocked copies come from it when it has them, else they are packed
    and saved there (``worker/packed_store.py``)."""
    onednn = available()
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    holders: dict[int, list[str]] = {}  # a weight's memory -> the modules holding it
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(param.data_ptr(), []).append(name)

    def blocked(module: nn.Linear) -> bool:
        return kernels is not None and (module.in_features >= MIN_BLOCKED_IN or not onednn)

    plan = [(name, m.out_features, m.in_features) for name, m in targets if blocked(m)]
    sizes = [packed_size(out, into) for _, out, into in plan]
    stored = store.load(plan, sum(sizes)) if store is not None and plan else None
    copies: list[torch.Tensor] = []
    offset = 0  # into ``stored``: the sizes of the copies so far
    for name, module in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if kernels is not None and blocked(module):
            others = [other for other in holders[module.weight.data_ptr()] if other != name]
            tied = [other for other in others if _plain_embedding(model.get_submodule(other))]
            alone = others == tied and len(tied) <= 1  # nothing but a tied embedding holds it
            in_place = alone and module.out_features % BLOCK == 0 and module.weight.is_contiguous()
            size = sizes[len(copies)]
            given = None if stored is None else stored[offset : offset + size]
            offset += size
            linear = BlockedLinear(module, kernels, in_place and given is None, given)
            copies.append(linear.packed)
            for other in tied if alone and (in_place or given is not None) else []:
                owner, _, attr = other.rpartition(".")  # the embedding now reads the packed copy
                embedding = PackedEmbedding(linear.packed, cast(nn.Embedding, model.get_submodule(other)))
                setattr(model.get_submodule(owner) if owner else model, attr, embedding)
            packed: nn.Module = linear
        else:
            packed = PackedLinear(module)
        setattr(parent, leaf, packed)
    if store is not None and plan and stored is None:
        store.save(plan, copies)
    return len(targets)

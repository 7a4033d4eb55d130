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
- A tied LM head gets its own packed copy; the embedding keeps the shared original. Every other
  blocked weight is packed into one scratch buffer and copied back over its own memory, which then
  holds the packed copy: no new memory per weight to fault in at start-up (SmolLM2: ~430 MB, which
  on this VM took ~1 s to fault in when its host had just taken it back).
"""

from __future__ import annotations

from collections import Counter
from typing import Final

import torch
from torch import nn

from trioserve.worker.native_kernels import NativeKernels, packed_size

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
            self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out


class BlockedLinear(nn.Module):
    """``nn.Linear``'s forward by ``blocked_linear.c`` on its weight packed in column blocks."""

    def __init__(
        self, linear: nn.Linear, kernels: NativeKernels, scratch: torch.Tensor | None = None
    ) -> None:
        """With ``scratch`` (at least ``packed_size`` floats) the weight is packed there and copied
        back over the weight's own memory, which becomes the packed copy: for a weight nothing else
        holds (``pack_linears`` decides)."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kernels = kernels
        with torch.no_grad():
            weight = linear.weight.detach()
            size = packed_size(*weight.shape)
            if scratch is not None and weight.is_contiguous() and weight.numel() == size:
                self.packed = weight.view(-1).copy_(kernels.pack_linear(weight, scratch[:size]))
            else:
                self.packed = kernels.pack_linear(weight)
            self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.packed, self.out_features, self.bias, torch.get_num_threads())


def pack_linears(model: nn.Module, kernels: NativeKernels | None = None) -> int:
    """Replace each ``nn.Linear`` of ``model`` with a ``BlockedLinear`` on ``kernels``, or a
    ``PackedLinear`` without them or (where oneDNN is here) below ``MIN_BLOCKED_IN`` inputs; returns
    how many."""
    onednn = available()
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    held = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    own = [m.weight.numel() for _, m in targets if held[m.weight.data_ptr()] == 1]
    scratch = torch.empty(max(own, default=0)) if kernels is not None else None  # one, reused
    for name, module in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if kernels is not None and (module.in_features >= MIN_BLOCKED_IN or not onednn):
            alone = held[module.weight.data_ptr()] == 1  # not tied: its memory can take the packing
            packed: nn.Module = BlockedLinear(module, kernels, scratch if alone else None)
        else:
            packed = PackedLinear(module)
        setattr(parent, leaf, packed)
    return len(targets)

"""The gated MLPs of Llama- and Qwen3-style models with their middle, ``SiLU(gate) * up``, in one native
pass (``native/silu_mul.c``; issue 18, item 2).

transformers computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with torch's CPU SiLU, which
is not vectorised here, and a separate multiply: in a 1,024-token prefill of SmolLM2 those two were
~180 ms of 2.7 s (``docs/benchmarks.md``). ``fuse_silu_mlps`` gives each such MLP a forward that runs
the same three products (whatever modules they are: packed, blocked, tensor-parallel shards) and
``NativeKernels.silu_mul`` between them, or, for more than ``GATED_FROM`` rows on blocked weights,
the gate and up products and the SiLU in one pass (``NativeKernels.gated_linear``): their outputs
never go to memory (SmolLM2's 576 -> 1,536 pair on one core, two interleaved runs: 2,048 rows
129-159 -> 102-112 and 66-124 -> 59-67 ms; 128 rows level; ``docs/benchmarks.md``).

Rules:

- An MLP is taken when it has ``gate_proj``, ``up_proj``, ``down_proj`` and an ``act_fn`` that is
  SiLU (``nn.SiLU`` or transformers' ``SiLUActivation``); any other is left as it is.
- The forward is set on the instance, so the module, its hooks and its place in the model stay.
- The gate product is overwritten with the result: it is this forward's own temporary.
- The one-pass form is taken when gate and up are both ``BlockedLinear`` of one shape without bias;
  its result is bit-equal to the three-step form's, so which one runs changes no output.
- Up to ``GATED_FROM`` rows (decode steps of up to that many streams) the products stay apart: there
  the step waits on reading the weights, which the blocked kernel spreads over its tiles (at 32 and
  64 rows the one pass was level to 18 % slower, at 128 level).
- The result differs from torch's by the exp's rounding (about 2 ulp): the runner's greedy tests
  against ``generate()`` run with it.
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch import nn

from trioserve.worker.native_kernels import NativeKernels
from trioserve.worker.packed_linear import BlockedLinear

GATED_FROM: Final = 128  # rows; past them the one pass was level (128) or faster (1,024 and up)


def _is_silu(module: Any) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _pair(gate: Any, up: Any) -> bool:
    """Gate and up are blocked weights of one shape without bias: ``gated_linear.c`` takes them."""
    return (
        isinstance(gate, BlockedLinear)
        and isinstance(up, BlockedLinear)
        and gate.bias is None
        and up.bias is None
        and (gate.in_features, gate.out_features) == (up.in_features, up.out_features)
    )


def fuse_silu_mlps(model: nn.Module, kernels: NativeKernels) -> int:
    """Give every SiLU-gated MLP of ``model`` the fused forward; returns how many."""
    count = 0
    for module in model.modules():
        if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")) and _is_silu(
            getattr(module, "act_fn", None)
        ):

            def forward(x: torch.Tensor, mlp: Any = module) -> torch.Tensor:
                # the products looked up at each call: whatever replaced them (packing, sharding) runs
                gate, up = mlp.gate_proj, mlp.up_proj
                if x.numel() > GATED_FROM * x.shape[-1] and _pair(gate, up):
                    middle = kernels.gated_linear(
                        x, gate.packed, up.packed, gate.out_features, torch.get_num_threads()
                    )
                else:
                    middle = kernels.silu_mul(gate(x), up(x))
                out: torch.Tensor = mlp.down_proj(middle)
                return out

            module.forward = forward
            count += 1
    return count

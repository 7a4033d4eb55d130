"""The gated MLPs of Llama- and Qwen3-style models with their middle, ``SiLU(gate) * up``, in one native
pass (``native/silu_mul.c``; issue 18, item 2).

transformers computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with torch's CPU SiLU, which
is not vectorised here, and a separate multiply: in a 1,024-token prefill of SmolLM2 those two were
~180 ms of 2.7 s (``docs/benchmarks.md``). ``fuse_silu_mlps`` gives each such MLP a forward that runs
the same three products (whatever modules they are: packed, blocked, tensor-parallel shards) and
``NativeKernels.silu_mul`` between them.

Rules:

- An MLP is taken when it has ``gate_proj``, ``up_proj``, ``down_proj`` and an ``act_fn`` that is
  SiLU (``nn.SiLU`` or transformers' ``SiLUActivation``); any other is left as it is.
- The forward is set on the instance, so the module, its hooks and its place in the model stay.
- The gate product is overwritten with the result: it is this forward's own temporary.
- The result differs from torch's by the exp's rounding (about 2 ulp): the runner's greedy tests
  against ``generate()`` run with it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trioserve.worker.native_kernels import NativeKernels


def _is_silu(module: Any) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def fuse_silu_mlps(model: nn.Module, kernels: NativeKernels) -> int:
    """Give every SiLU-gated MLP of ``model`` the fused forward; returns how many."""
    count = 0
    for module in model.modules():
        if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")) and _is_silu(
            getattr(module, "act_fn", None)
        ):

            def forward(x: torch.Tensor, mlp: Any = module) -> torch.Tensor:
                # the products looked up at each call: whatever replaced them (packing, sharding) runs
                out: torch.Tensor = mlp.down_proj(kernels.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
                return out

            module.forward = forward
            count += 1
    return count

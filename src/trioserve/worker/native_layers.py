"""Llama- and Qwen3-style norms and attention with their elementwise work on native kernels
(``native/rms_norm.c``, ``native/rope.c``; issue 18, item 2).

In a prefill every elementwise op runs over thousands of rows that do not stay in the CPU's caches
from one op to the next: in 32 prompts of 128 tokens through SmolLM2 here, torch's multiplies, adds,
concatenations, powers and means of the RMSNorms and the rotary embedding took 0.9 s of an 8.2-s
step (``docs/benchmarks.md``). ``native_layers`` gives each such module a forward that does the same
math in one pass.

Rules:

- Only the own decoder's norms and attention (``worker/decoder_model.py``) and transformers' classes
  named in ``NORMS`` and ``ATTENTIONS`` are taken (the families the runner's tests check against
  ``generate()``); any other module keeps its forward. Forwards are set on the instance, so the
  module, its hooks and its place in the model stay.
- A norm whose input is not a contiguous float32 CPU tensor runs transformers' forward.
- The attention forward is transformers' (5.23) for these classes, and the own decoder's, step for
  step: the three projections (whatever modules they are: packed, blocked, tensor-parallel shards,
  looked up at each call), Qwen3's per-head norms, the rotary embedding, the attention function, the
  output projection, except that the rotary embedding is applied in place on the projections' outputs (this
  forward's own temporaries) and the attention function is ``paged_attention`` itself: the runner
  installs this forward only on a model it runs with that attention (no transformers cache).
- Results differ from torch's by float32 rounding (a fused multiply-add, another summation order):
  the runner's greedy tests against ``generate()`` run with them.
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch import nn

from trioserve.worker import decoder_model
from trioserve.worker.native_kernels import NativeKernels
from trioserve.worker.paged_attention import paged_attention

NORMS: Final = frozenset({"LlamaRMSNorm", "Qwen3RMSNorm"})
ATTENTIONS: Final = frozenset({"LlamaAttention", "Qwen3Attention"})


def native_layers(model: nn.Module, kernels: NativeKernels) -> int:
    """Set the native forwards on ``model``'s norms and attention modules; returns how many."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, decoder_model.RMSNorm) or name in NORMS:
            module.forward = _norm_forward(module, kernels)
        elif isinstance(module, decoder_model.Attention) or name in ATTENTIONS:
            module.forward = _attention_forward(module, kernels)
        else:
            continue
        count += 1
    return count


def _norm_forward(norm: Any, kernels: NativeKernels) -> Any:
    original = norm.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != torch.float32 or not hidden_states.is_contiguous():
            out: torch.Tensor = original(hidden_states)
            return out
        return kernels.rms_norm(hidden_states, norm.weight, float(norm.variance_epsilon))

    return forward


def _attention_forward(attn: Any, kernels: NativeKernels) -> Any:
    qk_norms = hasattr(attn, "q_norm")  # Qwen3: RMSNorm over each head before the rotary embedding
    window = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}

    def forward(
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if past_key_values is not None:
            raise RuntimeError("the native attention forward runs without a transformers cache")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        query = attn.q_proj(hidden_states).view(hidden_shape)  # [1, T, H, D]
        key = attn.k_proj(hidden_states).view(hidden_shape)
        value = attn.v_proj(hidden_states).view(hidden_shape)
        if qk_norms:
            query, key = attn.q_norm(query), attn.k_norm(key)
        cos, sin = position_embeddings
        query = kernels.rope(query.contiguous(), cos, sin)
        key = kernels.rope(key.contiguous(), cos, sin)
        out, _ = paged_attention(
            attn,
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attention_mask,
            scaling=attn.scaling,
            **window,
            **kwargs,
        )
        result: torch.Tensor = attn.o_proj(out.reshape(*input_shape, -1).contiguous())
        return result, None

    return forward

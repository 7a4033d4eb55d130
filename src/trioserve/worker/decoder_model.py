"""The worker's own Llama- and Qwen3-style decoder, in plain torch: the model the runner serves without
importing transformers' model classes (issue 18, item 5: those imports were 3.1 s of the worker's 4.9 s
of imports here, torch itself 1.7 s; docs/benchmarks.md).

Rules:

- The math is transformers' (5.23) for ``LlamaForCausalLM`` and ``Qwen3ForCausalLM``, op for op and
  in the same order (the RMSNorm in float32, the rotary embedding's ``cos``/``sin`` from
  ``position * inv_freq``, ``q * cos + rotate_half(q) * sin``, the residual adds): with torch's own
  kernels its logits are transformers' bit for bit, and the runner's greedy tests compare it with
  ``generate()``.
- The module tree and every attribute the runner's passes look up are transformers' names
  (``model.layers[i].self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ``lm_head``,
  ``layer_idx``, ``head_dim``, ``scaling``, ``variance_epsilon``, ``act_fn``): packing
  (``packed_linear.py``, whose store keys on those names), the fused SiLU, ``native_layers`` and
  tensor parallelism's ``shard_model`` take it as they take transformers' model, and a checkpoint's
  tensor names are its parameter names.
- There is no transformers cache and no attention mask: the attention is ``paged_attention``, with
  the runner's ``BatchLayout`` and ``PagedKVCache`` passed down every forward.
- ``build`` makes the tree's parameters on the ``meta`` device (no memory, no initialisation) and
  ``assign`` puts the checkpoint's tensors in place; a tied LM head is the embedding's parameter, as
  in transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trioserve.worker.decoder_spec import DecoderSpec, RopeSpec
from trioserve.worker.paged_attention import BatchLayout, PagedKVCache, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)


def inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """The rotary embedding's inverse frequencies, ``[head_dim / 2]`` float32."""
    base = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope.llama3 is None:
        return base
    factor, low, high, original = rope.llama3
    # Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, those between interpolated.
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > original / low, base / factor, base)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeSpec, head_dim: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq(rope, head_dim), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, device: torch.device) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = spec.head_dim
        self.num_key_value_groups = spec.num_attention_heads // spec.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        q_out, kv_out = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        bias = spec.attention_bias
        self.q_proj = nn.Linear(spec.hidden_size, q_out, bias=bias, device=device)
        self.k_proj = nn.Linear(spec.hidden_size, kv_out, bias=bias, device=device)
        self.v_proj = nn.Linear(spec.hidden_size, kv_out, bias=bias, device=device)
        self.o_proj = nn.Linear(q_out, spec.hidden_size, bias=bias, device=device)
        if spec.model_type == "qwen3":  # a norm over each head before the rotary embedding
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, device)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # (``native_layers`` may replace this forward with its own of the same signature.)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        if hasattr(self, "q_norm"):
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # [1, H, T, D]
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        query = (query * cos) + (rotate_half(query) * sin)
        key = (key * cos) + (rotate_half(key) * sin)
        out, _ = paged_attention(self, query, key, value, attention_mask, scaling=self.scaling, **kwargs)
        result: torch.Tensor = self.o_proj(out.reshape(*input_shape, -1).contiguous())
        return result, None


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, device: torch.device) -> None:
        super().__init__()
        hidden, inner, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, device=device)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, device: torch.device) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, device)
        self.mlp = MLP(spec, device)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        layout: BatchLayout,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=None,
            trioserve_layout=layout,
            trioserve_cache=cache,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class DecoderStack(nn.Module):
    """transformers' ``LlamaModel``/``Qwen3Model``: ``CausalLM.model``."""

    def __init__(self, spec: DecoderSpec, device: torch.device) -> None:
        super().__init__()
        # Given its weight, not initialised: ``normal_`` on ``meta`` imports torch._dynamo (1.3 s here).
        weight = torch.empty(spec.vocab_size, spec.hidden_size, device=device)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=weight, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, device) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)
        self.rotary_emb = RotaryEmbedding(spec.rope, spec.head_dim)  # computed here, on the CPU


@dataclass(frozen=True, slots=True)
class CausalLMOutput:
    logits: torch.Tensor  # [1, kept rows, vocab]


class CausalLM(nn.Module):
    def __init__(self, spec: DecoderSpec, device: torch.device) -> None:
        super().__init__()
        self.config = spec
        self.model = DecoderStack(spec, device)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, device=device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # The final norm's weight, which no pass replaces (packing does the embedding and the linears).
    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: torch.Tensor,
        trioserve_layout: BatchLayout,
        trioserve_cache: PagedKVCache,
        use_cache: bool = False,
    ) -> CausalLMOutput:
        """``[1, T]`` tokens at ``[1, T]`` positions -> the logits of the rows ``logits_to_keep``
        (indices into ``T``); the keyword names are those the runner gives transformers' models."""
        if use_cache:
            raise ValueError("the own decoder keeps its keys and values in the paged cache only")
        stack = self.model
        hidden_states = stack.embed_tokens(input_ids)
        position_embeddings = stack.rotary_emb(hidden_states, position_ids)
        for layer in stack.layers:
            hidden_states = layer(hidden_states, position_embeddings, trioserve_layout, trioserve_cache)
        hidden_states = stack.norm(hidden_states)
        return CausalLMOutput(self.lm_head(hidden_states[:, logits_to_keep, :]))


def build(spec: DecoderSpec) -> CausalLM:
    """The module tree with no tensors behind its parameters (``meta``): ``assign`` fills it. (The
    ``meta`` device is named to each constructor, not set as the default: torch runs several factory
    functions on ``meta`` through Python references that import torch._dynamo, over a second.)"""
    return CausalLM(spec, torch.device("meta"))


def assign(model: CausalLM, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> CausalLM:
    """Put each of ``model``'s parameters' checkpoint tensor in place, as ``dtype`` (no copy where it
    already is). Raises ``ValueError`` on a missing or misshapen tensor
    or one the model has no place for (a tied checkpoint's own ``lm_head.weight`` and old checkpoints'
    ``rotary_emb.inv_freq`` aside: transformers ignores those too)."""
    tied = model.config.tie_word_embeddings
    ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")}
    if tied:
        ignored.add("lm_head.weight")
    expected = dict(model.named_parameters())  # a tied head's parameter once, as the embedding's
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - ignored)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    for name, param in expected.items():
        tensor = tensors[name]
        if tensor.shape != param.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(param.shape)}")
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor.to(dtype), requires_grad=False))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model

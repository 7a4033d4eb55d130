"""``native/rms_norm.c`` and ``native/rope.c`` against transformers' own functions, and
``worker/native_layers.py``: which modules take the native forwards, and the fallbacks. The attention
forward inside a whole model is checked by the runner's greedy tests against ``generate()``
(``tests/unit/test_model_runner.py``), which run with it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tests.unit.test_model_runner import tiny_model
from trioserve.worker.native_kernels import NativeKernels, build
from trioserve.worker.native_layers import native_layers


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return NativeKernels(build())


@pytest.mark.parametrize(("rows", "n"), [(1, 576), (37, 64), (5, 1), (3, 17)])
def test_rms_norm_is_transformers(kernels: NativeKernels, rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * n)
    norm = LlamaRMSNorm(n, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g))
    x = torch.randn(2, rows, n, generator=g) * 3
    kept = x.clone()
    with torch.no_grad():
        want = norm(x)
    got = kernels.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    assert torch.equal(x, kept)  # a new tensor: the input is the layer's residual


def test_rms_norm_of_zeros_is_zeros_and_refusals(kernels: NativeKernels) -> None:
    assert torch.equal(kernels.rms_norm(torch.zeros(3, 8), torch.ones(8), 1e-6), torch.zeros(3, 8))
    for x, w in ((torch.zeros(3, 8).t(), torch.ones(3)), (torch.zeros(3, 8), torch.ones(7))):
        with pytest.raises(ValueError, match="unsupported"):
            kernels.rms_norm(x, w, 1e-6)
    with pytest.raises(ValueError, match="unsupported"):
        kernels.rms_norm(torch.zeros(3, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize(
    ("heads", "dim", "scaling"), [(9, 64, None), (4, 16, None), (2, 2, None), (3, 32, "yarn")]
)
def test_rope_is_apply_rotary_pos_emb(
    kernels: NativeKernels, heads: int, dim: int, scaling: str | None
) -> None:
    """In place, against transformers' function on the cos and sin of its own rotary embedding for
    scattered positions (a flat batch's), a rope scaling included."""
    config = LlamaConfig(
        hidden_size=heads * dim,
        num_attention_heads=heads,
        head_dim=dim,
        max_position_embeddings=4096,
    )
    if scaling is not None:  # yarn scales cos and sin too (its attention scaling)
        config = LlamaConfig(
            hidden_size=heads * dim,
            num_attention_heads=heads,
            head_dim=dim,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": scaling,
                "factor": 2.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 2048,
            },
        )
    rotary = LlamaRotaryEmbedding(config)
    assert rotary.rope_type == (scaling or "default")
    g = torch.Generator().manual_seed(heads * dim)
    positions = torch.randint(0, 4000, (1, 23), generator=g)
    x = torch.randn(1, 23, heads, dim, generator=g)
    cos, sin = rotary(x, positions)
    want, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    inplace = x.clone()
    got = kernels.rope(inplace, cos, sin)
    assert got.data_ptr() == inplace.data_ptr()
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_rope_refuses_what_it_cannot_read(kernels: NativeKernels) -> None:
    cos = sin = torch.zeros(1, 5, 8)
    for x in (torch.zeros(1, 5, 2, 8).transpose(1, 2), torch.zeros(2, 5, 2, 8), torch.zeros(1, 4, 2, 8)):
        with pytest.raises(ValueError, match="unsupported"):
            kernels.rope(x, cos, sin)
    with pytest.raises(ValueError, match="unsupported"):
        kernels.rope(torch.zeros(1, 5, 2, 7), torch.zeros(1, 5, 7), torch.zeros(1, 5, 7))


@pytest.mark.parametrize(("family", "per_layer"), [("llama", 3), ("qwen3", 5)])
def test_which_modules_take_the_native_forwards(kernels: NativeKernels, family: str, per_layer: int) -> None:
    """Each layer's attention and norms (Qwen3's per-head ones too) and the final norm; nothing else."""
    model = copy.deepcopy(tiny_model(family))
    layers = model.config.num_hidden_layers
    assert native_layers(model, kernels) == per_layer * layers + 1
    taken = {type(m).__name__ for m in model.modules() if "forward" in vars(m)}
    assert (
        taken == {"LlamaAttention", "LlamaRMSNorm"}
        if family == "llama"
        else {"Qwen3Attention", "Qwen3RMSNorm"}
    )


class OtherNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.variance_epsilon = 1e-6


def test_other_classes_are_left_alone(kernels: NativeKernels) -> None:
    norm = OtherNorm()
    assert native_layers(nn.Sequential(norm, nn.Linear(4, 4)), kernels) == 0
    assert "forward" not in vars(norm)


def test_a_norm_off_the_kernels_contract_runs_transformers(kernels: NativeKernels) -> None:
    norm = LlamaRMSNorm(8)
    assert native_layers(norm, kernels) == 1
    x = torch.randn(8, 3).t()  # not contiguous
    with torch.no_grad():
        want = LlamaRMSNorm.forward(norm, x)
        torch.testing.assert_close(norm(x), want, rtol=0, atol=0)
        doubled = x.contiguous().double()
        torch.testing.assert_close(norm(doubled), LlamaRMSNorm.forward(norm, doubled), rtol=0, atol=0)


def test_the_attention_forward_refuses_a_transformers_cache(kernels: NativeKernels) -> None:
    model: Any = copy.deepcopy(tiny_model("llama"))
    native_layers(model, kernels)
    attn = model.model.layers[0].self_attn
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    cos = sin = torch.zeros(1, 3, model.config.head_dim)
    with pytest.raises(RuntimeError, match="without a transformers cache"):
        attn(hidden, (cos, sin), None, past_key_values=object())

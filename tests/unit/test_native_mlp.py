"""``worker/native_mlp.py``: every SiLU-gated MLP of the tiny Llama and Qwen3 takes the fused forward
and the model's logits stay torch's to float32 rounding; an MLP with another activation is left
alone; the fused forward calls whatever products the MLP holds when it runs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit.test_model_runner import tiny_model
from trioserve.worker.native_kernels import NativeKernels, build
from trioserve.worker.native_mlp import fuse_silu_mlps


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return NativeKernels(build())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_gated_mlp_and_the_same_logits(kernels: NativeKernels, family: str) -> None:
    model = tiny_model(family)
    fused = copy.deepcopy(model)
    assert fuse_silu_mlps(fused, kernels) == model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want, got = model(ids).logits, fused(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
        self.act_fn = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


def test_another_activation_is_left_alone(kernels: NativeKernels) -> None:
    mlp = GeluMLP()
    assert fuse_silu_mlps(nn.Sequential(mlp), kernels) == 0
    assert "forward" not in vars(mlp)


def test_the_products_are_looked_up_at_each_call(kernels: NativeKernels) -> None:
    mlp: Any = GeluMLP()
    mlp.act_fn = nn.SiLU()
    assert fuse_silu_mlps(mlp, kernels) == 1
    x = torch.randn(3, 4)
    replaced = nn.Linear(4, 8)
    mlp.up_proj = replaced  # as packing or sharding would, after the fusion
    with torch.no_grad():
        want = mlp.down_proj(nn.functional.silu(mlp.gate_proj(x)) * replaced(x))
        torch.testing.assert_close(mlp(x), want)

"""``worker/native_mlp.py``: every SiLU-gated MLP of the tiny Llama and Qwen3 takes the fused forward
and the model's logits stay torch's to float32 rounding; an MLP with another activation is left
alone; the fused forward calls whatever products the MLP holds when it runs. ``gated_linear.c`` (the
gate and up products and the SiLU in one pass) is bit-equal to the products then ``silu_mul.c`` at
every row count a tile or panel ends on, widths that fill no whole block, split over threads; the MLP
takes it past ``GATED_FROM`` rows on blocked weights without bias, and only there."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit.test_model_runner import tiny_model
from trioserve.worker.native_kernels import NativeKernels, build
from trioserve.worker.native_mlp import GATED_FROM, fuse_silu_mlps
from trioserve.worker.packed_linear import BlockedLinear


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


def gate_and_up(kernels: NativeKernels, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 7 + k)
    gate, up = (kernels.pack_linear(torch.randn(n, k, generator=g) * 0.1) for _ in range(2))
    return gate, up


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 64, 64),
        (9, 64, 64),
        (13, 576, 1536),
        (100, 96, 80),
        (200, 1536, 40),
        (257, 1536, 7),
        (141, 576, 14 * 32 + 5),
        (300, 576, 1536),
        (1000, 100, 448),
    ],
)
def test_the_one_pass_equals_the_products_then_silu_mul(
    kernels: NativeKernels, m: int, k: int, n: int
) -> None:
    """Rows a tile leaves over (13, 100), panels crossed (k = 1,536 holds 64 rows a panel), widths of
    part of a half block (7), of more than half of one (40, 80); past 128 rows of 12 or more blocks,
    AVX-512's 14-row tiles over a copy of x (141 rows, a partial last block; 300 rows, 168 a panel;
    1,000 rows, 980 a panel): every value bit-equal."""
    pg, pu = gate_and_up(kernels, k, n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = kernels.silu_mul(kernels.linear(x, pg, n), kernels.linear(x, pu, n))
    assert torch.equal(kernels.gated_linear(x, pg, pu, n), want)
    x3 = x.reshape(1, m, k)  # a model's [batch, tokens, hidden]
    assert torch.equal(kernels.gated_linear(x3, pg, pu, n), want.reshape(1, m, n))


def test_the_one_pass_split_over_threads_is_bit_identical(kernels: NativeKernels) -> None:
    pg, pu = gate_and_up(kernels, 576, 1536)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(5))
    one = kernels.gated_linear(x, pg, pu, 1536)
    for threads in (2, 3):
        assert torch.equal(kernels.gated_linear(x, pg, pu, 1536, threads), one)
    assert kernels.gated_linear(x[:0], pg, pu, 1536).shape == (0, 1536)


def test_the_one_pass_refuses_what_it_cannot_read(kernels: NativeKernels) -> None:
    pg, pu = gate_and_up(kernels, 64, 64)
    x = torch.randn(9, 64)
    for bad in ((x.double(), pg, pu, 64), (x, pg, pu[:-1], 64), (x, pg, pu, 96), (x[:, :32], pg, pu, 64)):
        with pytest.raises(ValueError, match="unsupported"):
            kernels.gated_linear(*bad)


class SiluMLP(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(128, 64, bias=bias), nn.Linear(128, 64, bias=bias)
        self.down_proj = nn.Linear(64, 128)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


@pytest.mark.parametrize("bias", [False, True])
def test_the_mlp_takes_the_one_pass_past_a_decode_steps_rows(
    kernels: NativeKernels, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlp: Any = SiluMLP(bias)
    want_mlp = copy.deepcopy(mlp)
    mlp.gate_proj, mlp.up_proj = BlockedLinear(mlp.gate_proj, kernels), BlockedLinear(mlp.up_proj, kernels)
    assert fuse_silu_mlps(mlp, kernels) == 1
    calls: list[int] = []
    real = kernels.gated_linear

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(kernels, "gated_linear", counted)
    for rows in (1, GATED_FROM, GATED_FROM + 1, 2 * GATED_FROM + 3):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            torch.testing.assert_close(mlp(x), want_mlp(x), rtol=1e-5, atol=1e-5)
    assert calls == ([] if bias else [GATED_FROM + 1, 2 * GATED_FROM + 3])

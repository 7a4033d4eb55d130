"""``worker/packed_linear.py``: oneDNN-packed linears compute what ``nn.Linear`` does, to float32
rounding, on 2-D and 3-D inputs of any row count, with and without bias; every ``nn.Linear`` of a model
is replaced and nothing else is touched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trioserve.worker.packed_linear import PackedLinear, available, pack_linears

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN linear operators")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (1, 33, 48), (200, 48)])
def test_same_products_as_the_linear(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape)
    with torch.no_grad():
        want = linear(x)
    got = packed(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_linear_of_a_model_and_only_those() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(30, 16)
    head = nn.Linear(16, 30, bias=False)
    head.weight = embed.weight  # tied, as in SmolLM2
    model = nn.Sequential(embed, nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.LayerNorm(16), head)
    before = embed.weight.detach().clone()
    ids = torch.tensor([[1, 5, 29]])
    with torch.no_grad():
        want = model(ids)
    assert pack_linears(model) == 2
    assert [type(m).__name__ for m in model.modules()].count("Linear") == 0
    assert isinstance(model[0], nn.Embedding) and isinstance(model[2], nn.LayerNorm)
    torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(embed.weight, before)  # the shared weight itself is left as it was

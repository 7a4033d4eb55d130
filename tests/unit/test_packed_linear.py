"""``worker/packed_linear.py``: packed linears, in oneDNN's layout and in the native kernel's column
blocks (``native/blocked_linear.c``), compute what ``nn.Linear`` does, to float32 rounding, on 2-D and
3-D inputs of every row count a tile can hold and more, with and without bias, output widths that fill
no whole block; the blocked one splits over threads bit-identically; every ``nn.Linear`` of a model is
replaced (below ``MIN_BLOCKED_IN`` inputs by oneDNN's), an untied weight packed over its own memory,
and nothing else is touched."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from trioserve.worker.native_kernels import BLOCK, NativeKernels, build, packed_size
from trioserve.worker.packed_linear import (
    MIN_BLOCKED_IN,
    BlockedLinear,
    PackedEmbedding,
    PackedLinear,
    available,
    pack_linears,
)


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return NativeKernels(build())


@pytest.fixture(params=["onednn", "blocked"])
def pack(request: pytest.FixtureRequest, kernels: NativeKernels) -> Callable[[nn.Linear], nn.Module]:
    if request.param == "onednn":
        if not available():
            pytest.skip("this torch has no oneDNN linear operators")
        return PackedLinear
    return lambda linear: BlockedLinear(linear, kernels)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "shape", [(1, 48), (3, 48), (4, 48), (7, 48), (8, 48), (9, 48), (1, 33, 48), (200, 48), (0, 48)]
)
@pytest.mark.parametrize("out", [80, 2 * BLOCK, 5])
def test_same_products_as_the_linear(
    pack: Callable[[nn.Linear], nn.Module], bias: bool, shape: tuple[int, ...], out: int
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, out, bias=bias)
    packed = pack(linear)
    x = torch.randn(*shape)
    with torch.no_grad():
        want = linear(x)
        got = packed(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [10, 11, 12, 13, 32, 137])
def test_every_tiling_of_the_rows(kernels: NativeKernels, rows: int) -> None:
    """Past 8 rows the products go in tiles of a few rows by half a block, the last rows of a panel
    by the whole block, and panels of x hold fewer rows the more inputs there are (1,536 inputs: 60
    rows a panel on AVX2, 64 on AVX-512), while later tiles prefetch the next weights: every row count
    here leaves another remainder, against a weight of several blocks and a partial last one."""
    torch.manual_seed(3)
    weight, bias = torch.randn(3 * BLOCK + 5, 1536), torch.randn(3 * BLOCK + 5)
    packed = kernels.pack_linear(weight)
    x = torch.randn(rows, 1536)
    got = kernels.linear(x, packed, weight.shape[0], bias, threads=1)
    torch.testing.assert_close(got, x @ weight.t() + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("inputs", [100, 576])
@pytest.mark.parametrize("rows", [129, 140, 141, 155, 300, 1000])
def test_a_prefills_tiles_write_the_bits_of_a_decodes(
    kernels: NativeKernels, bias: bool, inputs: int, rows: int
) -> None:
    """Past 128 rows, with AVX-512, the full blocks go in 14-row tiles over a copy of x (the rows a
    tile, a panel or the copy leave over differ here, 576 inputs: 168 rows a panel, 100: 980), the
    partial last block in the tiles above; every output is the same sum in the same order as the
    tiles of up to 8 rows a decode step takes, so the bits are equal, split over threads or not."""
    torch.manual_seed(4)
    weight = torch.randn(14 * BLOCK + 5, inputs)
    b = torch.randn(weight.shape[0]) if bias else None
    packed = kernels.pack_linear(weight)
    x = torch.randn(rows, inputs)
    got = kernels.linear(x, packed, weight.shape[0], b, threads=1)
    by_eight = torch.cat(
        [kernels.linear(x[r : r + 8], packed, weight.shape[0], b, threads=1) for r in range(0, rows, 8)]
    )
    assert torch.equal(got, by_eight)
    assert torch.equal(kernels.linear(x, packed, weight.shape[0], b, threads=2), got)
    want = x @ weight.t() + (b if b is not None else 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_non_contiguous_input(kernels: NativeKernels) -> None:
    torch.manual_seed(1)
    linear = nn.Linear(40, 70)
    x = torch.randn(40, 6).t()  # [6, 40], strides (1, 6)
    with torch.no_grad():
        torch.testing.assert_close(BlockedLinear(linear, kernels)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_split_over_threads_is_bit_identical(kernels: NativeKernels) -> None:
    """Blocks split over 1, 2, 3 and 7 threads write the same bits (each output is one block's sum,
    whichever thread runs it), down to ranges of a single block."""
    torch.manual_seed(2)
    weight, bias = torch.randn(7 * BLOCK - 3, 256), torch.randn(7 * BLOCK - 3)
    packed = kernels.pack_linear(weight)
    x = torch.randn(1024, 256)  # enough work for 7 threads (MIN_MACS_PER_THREAD)
    one = kernels.linear(x, packed, weight.shape[0], bias, threads=1)
    torch.testing.assert_close(one, x @ weight.t() + bias, rtol=1e-4, atol=1e-4)
    for threads in (2, 3, 7, 16):
        assert torch.equal(kernels.linear(x, packed, weight.shape[0], bias, threads=threads), one)


def test_refuses_what_it_cannot_read(kernels: NativeKernels) -> None:
    weight = torch.randn(40, 16)
    packed = kernels.pack_linear(weight)
    for bad in (
        lambda: kernels.pack_linear(weight.double()),
        lambda: kernels.pack_linear(weight[0]),
        lambda: kernels.linear(torch.randn(3, 17), packed, 40),  # in features
        lambda: kernels.linear(torch.randn(3, 16), packed, 70),  # out features: another block count
        lambda: kernels.linear(torch.randn(3, 16).double(), packed, 40),
        lambda: kernels.linear(torch.randn(3, 16), packed, 40, torch.randn(39)),
    ):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("layout", ["onednn", "blocked"])
def test_every_linear_of_a_model_and_only_those(kernels: NativeKernels, layout: str) -> None:
    """Each ``nn.Linear`` replaced (in the blocked layout from ``MIN_BLOCKED_IN`` inputs), nothing else."""
    if not available():
        pytest.skip("this torch has no oneDNN linear operators")
    torch.manual_seed(0)
    wide = MIN_BLOCKED_IN
    embed = nn.Embedding(30, wide)
    head = nn.Linear(wide, 30, bias=False)
    head.weight = embed.weight  # tied, as in SmolLM2
    narrow_in = nn.Linear(BLOCK, wide)
    model = nn.Sequential(embed, nn.Linear(wide, BLOCK), nn.ReLU(), narrow_in, nn.LayerNorm(wide), head)
    before = embed.weight.detach().clone()
    untied_weight_ptr = model[1].weight.data_ptr()
    ids = torch.tensor([[1, 5, 29]])
    with torch.no_grad():
        want = model(ids)
        assert pack_linears(model, kernels if layout == "blocked" else None) == 3
        kind = BlockedLinear if layout == "blocked" else PackedLinear
        assert isinstance(model[1], kind) and isinstance(model[5], kind)
        assert isinstance(model[3], PackedLinear)  # 32 inputs: oneDNN's either way
        assert [type(m).__name__ for m in model.modules()].count("Linear") == 0
        assert isinstance(model[0], nn.Embedding) and isinstance(model[4], nn.LayerNorm)
        torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(embed.weight, before)  # the shared weight itself is left as it was
    if layout == "blocked":  # the untied weight packed over its own memory, the tied one copied
        assert model[1].packed.data_ptr() == untied_weight_ptr
        assert model[5].packed.data_ptr() != embed.weight.data_ptr()


def test_packed_into_a_given_buffer(kernels: NativeKernels) -> None:
    weight = torch.randn(2 * BLOCK + 5, 24)
    size = packed_size(*weight.shape)
    buffer = torch.empty(size + 7)
    into = buffer[7:]
    assert kernels.pack_linear(weight, into).data_ptr() == into.data_ptr()
    assert torch.equal(into, kernels.pack_linear(weight))
    for bad in (buffer[: size - 1], torch.empty(2 * size)[::2]):
        with pytest.raises(ValueError, match="contiguous floats"):
            kernels.pack_linear(weight, bad)


def test_in_place_packing_takes_over_the_weight(kernels: NativeKernels) -> None:
    linear = nn.Linear(40, 2 * BLOCK)  # whole blocks: the packed copy is the weight's size
    x = torch.randn(5, 40)
    with torch.no_grad():
        want = linear(x)
        copied = kernels.pack_linear(linear.weight)
        blocked = BlockedLinear(linear, kernels, in_place=True)
        assert blocked.packed.data_ptr() == linear.weight.data_ptr()
        assert torch.equal(blocked.packed, copied)
        torch.testing.assert_close(blocked(x), want, rtol=1e-5, atol=1e-5)
    for bad in (torch.randn(BLOCK + 3, 8), torch.randn(8, 2 * BLOCK).t(), torch.randn(BLOCK, 8).double()):
        with pytest.raises(ValueError, match="in place"):
            kernels.pack_linear_in_place(bad)


def test_a_tied_head_of_whole_blocks_packs_in_place_and_the_embedding_reads_it(
    kernels: NativeKernels,
) -> None:
    """A tied LM head (SmolLM2's case) over its own memory; the embedding becomes a
    ``PackedEmbedding`` giving the same rows; a head whose weight something else holds is copied."""
    torch.manual_seed(4)
    embed = nn.Embedding(3 * BLOCK, MIN_BLOCKED_IN)
    head = nn.Linear(MIN_BLOCKED_IN, 3 * BLOCK, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, nn.LayerNorm(MIN_BLOCKED_IN), head)
    ids = torch.tensor([[0, 1, BLOCK - 1, BLOCK, 3 * BLOCK - 1], [7, 7, 40, 2, 95]])
    storage = embed.weight.data_ptr()
    with torch.no_grad():
        want_rows, want = embed(ids), model(ids)
        assert pack_linears(model, kernels) == 1
        assert isinstance(model[0], PackedEmbedding) and isinstance(model[2], BlockedLinear)
        assert model[2].packed.data_ptr() == storage
        assert torch.equal(model[0](ids), want_rows)
        torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)
    other = nn.Linear(MIN_BLOCKED_IN, 2 * BLOCK)
    shared = nn.ModuleDict({"a": other, "b": nn.Linear(MIN_BLOCKED_IN, 2 * BLOCK)})
    shared["b"].weight = other.weight  # held by another linear: neither may take the memory over
    pack_linears(shared, kernels)
    assert shared["a"].packed.data_ptr() != shared["b"].packed.data_ptr()

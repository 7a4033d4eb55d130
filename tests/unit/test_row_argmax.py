"""``row_argmax`` (worker/sampler.py) is ``torch.argmax(dim=-1)`` exactly: the first maximal index
of each row, ties, NaN (ranked highest), infinities and rows of -inf included, for widths with and
without a tail shorter than a block."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.worker.sampler import ARGMAX_CHUNK, row_argmax

SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, 1.0]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.sampled_from([10, 4 * ARGMAX_CHUNK, 4 * ARGMAX_CHUNK + 7, 49152, 50_001]),
    levels=st.sampled_from([0, 3, 1000]),  # 0: continuous values; else few distinct ones (ties)
    seed=st.integers(0, 2**31 - 1),
    specials=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 60_000), st.sampled_from(SPECIALS)), max_size=6
    ),
    minus_inf_row=st.booleans(),
)
def test_it_is_argmax(
    rows: int,
    width: int,
    levels: int,
    seed: int,
    specials: list[tuple[int, int, float]],
    minus_inf_row: bool,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen)
    if levels:
        x = torch.randint(0, levels, (rows, width), generator=gen).float()
    for r, c, value in specials:
        x[r % rows, c % width] = value
    if minus_inf_row:
        x[0] = float("-inf")
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_the_max_in_the_tail_and_across_blocks() -> None:
    width = 4 * ARGMAX_CHUNK + 5
    x = torch.zeros(3, width)
    x[0, width - 1] = 1.0  # only in the tail
    x[1, 2 * ARGMAX_CHUNK + 3] = 2.0  # a later block
    x[1, width - 2] = 2.0  # tied, in the tail: the first one wins
    x[2, ARGMAX_CHUNK - 1] = x[2, ARGMAX_CHUNK] = 3.0  # tied across a block edge
    assert row_argmax(x).tolist() == [width - 1, 2 * ARGMAX_CHUNK + 3, ARGMAX_CHUNK - 1]

"""The draw (worker/sampler.py, stage 7): inverting each row's cumulative sum picks token ``i`` with
probability ``p_i`` and never a token the cuts removed; a seeded row's token depends on its seed and
output index only. Each test runs on torch's draw and on the native kernel's."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from trioserve.worker.native_kernels import NativeKernels, build
from trioserve.worker.sampler import Sampler, SamplingRow

CPU = torch.device("cpu")
MakeSampler = Callable[[int], Sampler]


@pytest.fixture(params=["native", "torch"])
def make(request: pytest.FixtureRequest) -> MakeSampler:
    native = NativeKernels(build()) if request.param == "native" else None
    return lambda vocab: Sampler(CPU, vocab, native)


def test_tokens_come_with_their_probability_and_cut_tokens_never(make: MakeSampler) -> None:
    vocab, n = 5000, 10000
    logits = torch.full((vocab,), -30.0)
    logits[[5, 700, 3000, vocab - 1]] = torch.tensor([2.0, 1.0, 0.0, 1.5])  # the last column too
    probs = torch.softmax(logits, dim=-1)
    torch.manual_seed(0)
    tokens = make(vocab).sample(logits.repeat(n, 1), [SamplingRow(1.0)] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    for token in (5, 700, 3000, vocab - 1):
        expected = n * float(probs[token])
        assert abs(int(counts[token]) - expected) < 5 * math.sqrt(expected), (
            token,
            int(counts[token]),
            expected,
        )
    # top_k 2 leaves tokens 5 and vocab - 1: nothing else, ever, in their 1 : e^-0.5 ratio.
    tokens = make(vocab).sample(logits.repeat(n, 1), [SamplingRow(1.0, top_k=2)] * n)
    seen = set(tokens)
    assert seen == {5, vocab - 1}, seen
    share = tokens.count(5) / n
    assert abs(share - 1 / (1 + math.exp(-0.5))) < 0.02, share


def test_a_seeded_row_ignores_its_neighbours_and_the_global_generator(make: MakeSampler) -> None:
    vocab = 1000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    row = SamplingRow(1.0, seed=42, output_index=7)
    torch.manual_seed(1)
    alone = make(vocab).sample(logits[1:2].clone(), [row])
    torch.manual_seed(2)
    batched = make(vocab).sample(logits.clone(), [SamplingRow(1.0), row, SamplingRow(0.0)])
    assert batched[1] == alone[0]
    assert batched[2] == int(logits[2].argmax())
    other_index = make(vocab).sample(logits[1:2].clone(), [SamplingRow(1.0, seed=42, output_index=8)])
    draws = {
        make(vocab).sample(logits[1:2].clone(), [SamplingRow(1.0, seed=42, output_index=i)])[0]
        for i in range(20)
    }
    assert len(draws) > 1 and other_index[0] in draws  # the index moves the draw

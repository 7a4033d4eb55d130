"""The mock engine's logprobs: the contract's shape (``protocol/messages.py:TokenLogprobs``), made up
but consistent, reproducible with a seed, and absent unless asked for."""

from __future__ import annotations

import random

from trioserve.mock.core import MockCore, mock_logprobs
from trioserve.protocol.messages import AddRequest, RequestOutput, SamplingParams, TokenLogprobs


def _run(core: MockCore, steps: int) -> list[RequestOutput]:
    outs = []
    for _ in range(steps):
        if core.schedule() is None:
            break
        outs += [o for group in core.update().values() for o in group]
    return outs


def _check(entry: TokenLogprobs, token: int, k: int) -> None:
    assert entry.token_id == token
    assert entry.logprob < 0 and entry.rank >= 1
    assert len(entry.top_ids) == k == len(entry.top_logprobs) == len(set(entry.top_ids))
    assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
    if k:
        assert (entry.rank == 1) == (entry.logprob == entry.top_logprobs[0])
        if entry.rank <= k:
            assert entry.top_ids[entry.rank - 1] == token
            assert entry.top_logprobs[entry.rank - 1] == entry.logprob
        else:
            assert token not in entry.top_ids and entry.logprob < entry.top_logprobs[-1]


def test_mock_logprobs_are_consistent() -> None:
    rng = random.Random(1)
    ranks = set()
    for i in range(500):
        k = i % 6
        entry = mock_logprobs(rng, i % 50, k, 50)
        _check(entry, i % 50, k)
        ranks.add(entry.rank == 1)
    assert ranks == {True, False}  # both cases occur


def test_outputs_carry_logprobs_only_when_asked() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=8, max_model_len=64)
    core.add(AddRequest("plain", [1, 2, 3], SamplingParams(3), 0.0))
    core.add(AddRequest("lp", [1, 2, 3], SamplingParams(3, logprobs=2), 0.0))
    core.add(AddRequest("prompt", [1, 2, 3], SamplingParams(3, logprobs=0, prompt_logprobs=1), 0.0))
    core.add(AddRequest("prompt-only", [4, 5], SamplingParams(2, prompt_logprobs=0), 0.0))
    outs = _run(core, 4)
    by_id: dict[str, list[RequestOutput]] = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in by_id["plain"])
    for o in by_id["lp"]:
        assert o.logprobs is not None and len(o.logprobs) == 1 and o.prompt_logprobs is None
        _check(o.logprobs[0], o.new_token_ids[0], 2)
    first, *rest = by_id["prompt"]
    assert first.prompt_logprobs is not None and all(o.prompt_logprobs is None for o in rest)
    assert first.prompt_logprobs[0] is None
    for entry, token in zip(first.prompt_logprobs[1:], [2, 3], strict=True):
        assert entry is not None
        _check(entry, token, 1)
    only = by_id["prompt-only"]
    assert only[0].prompt_logprobs is not None and len(only[0].prompt_logprobs) == 2
    assert all(o.logprobs is None for o in only)


def test_seeded_logprobs_repeat() -> None:
    def once() -> list[TokenLogprobs]:
        core = MockCore(vocab_size=1000, max_num_seqs=8, max_model_len=64, seed=7)
        core.add(AddRequest("a", [1, 2], SamplingParams(5, seed=3, logprobs=4), 0.0))
        return [entry for o in _run(core, 5) for entry in o.logprobs or []]

    assert once() == once() and len(once()) == 5

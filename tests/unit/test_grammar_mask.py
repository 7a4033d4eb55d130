"""worker/grammar.py's mask arithmetic against ``masked_fill`` with the bits read one by one, and the
matcher state's bookkeeping on llguidance itself."""

from __future__ import annotations

import llguidance
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.worker.grammar import GrammarState, apply_bitmask, bitmask_bias, bitmask_words, only_eos


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        for t in range(vocab):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[i, word]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 200),
    batch=st.integers(1, 6),
    data=st.data(),
    narrower=st.booleans(),
)
def test_apply_bitmask_is_masked_fill_of_the_bits(
    vocab: int, batch: int, data: st.DataObject, narrower: bool
) -> None:
    rows = sorted(data.draw(st.sets(st.integers(0, batch - 1), min_size=1)))
    words = bitmask_words(vocab) - (1 if narrower and vocab > 32 else 0)  # a padded vocabulary
    seed = data.draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int32)
    if data.draw(st.booleans()):  # sparse masks too, the common case inside JSON
        bitmask &= torch.randint(0, 2, (len(rows), words), generator=g, dtype=torch.int32) * -1
    logits = torch.randn(batch, vocab, generator=g)
    expected = reference(logits, bitmask, rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_bitmask_keeps_the_dtype_and_exact_values(dtype: torch.dtype) -> None:
    logits = torch.randn(3, 70).to(dtype)
    bitmask = torch.zeros(1, bitmask_words(70), dtype=torch.int32)
    bitmask[0, 0] = 0b1011  # tokens 0, 1, 3
    before = logits.clone()
    apply_bitmask(logits, bitmask, [1])
    assert logits.dtype == dtype
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = [0, 1, 3]
    assert torch.equal(logits[1, kept], before[1, kept])
    others = [t for t in range(70) if t not in kept]
    assert bool(torch.isneginf(logits[1, others]).all())


def test_bias_is_zero_or_minus_infinity() -> None:
    bitmask = torch.tensor([[-1, 0]], dtype=torch.int32)
    bias = bitmask_bias(bitmask, 64)
    assert bias.dtype == torch.float32
    assert bool((bias[0, :32] == 0).all()) and bool(torch.isneginf(bias[0, 32:]).all())
    assert not bool(torch.signbit(bias[0, :32]).any())  # +0.0: x + bias is x, -0.0 included


@pytest.mark.parametrize("eos", [0, 31, 32, 63, 70])
def test_only_eos(eos: int) -> None:
    row = torch.full((bitmask_words(80),), -1, dtype=torch.int32)
    only_eos(row, eos)
    allowed = [t for t in range(80) if (int(row[t // 32]) >> (t % 32)) & 1]
    assert allowed == [eos]
    only_eos(row, None)
    assert bool((row == -1).all())


@pytest.fixture(scope="module")
def byte_tokenizer() -> llguidance.LLTokenizer:
    """A 256-token byte vocabulary plus EOS (256), built from a tokenizer.json (no model needed)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.ByteFallback()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=257, eos_token=256)


def test_state_takes_tokens_once_and_fails_on_a_refused_one(byte_tokenizer: llguidance.LLTokenizer) -> None:
    grammar = llguidance.grammar_from("regex", "ab+")
    state = GrammarState(llguidance.LLMatcher(byte_tokenizer, grammar, log_level=0), eos=256)
    state.take([ord("a"), ord("b")])
    assert state.accepted == 2 and not state.failed
    state.take([ord("z")])
    assert state.failed and state.accepted == 3
    state.take([ord("b")])  # a failed state takes nothing more
    assert state.accepted == 3


def test_a_worker_without_a_tokenizer_fails_the_request_not_itself() -> None:
    from trioserve.worker.grammar import GrammarBook

    book = GrammarBook(None, 300)
    state = book.state(llguidance.grammar_from("regex", "a+"), eos=7)
    assert not state.failed and state.matcher is None  # built on the mask thread, beside the forward
    bias = book.start([state]).result()
    assert state.failed
    assert torch.isneginf(bias[0]).sum() == 299 and bias[0, 7] == 0  # only its EOS

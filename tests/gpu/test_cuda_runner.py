"""The model runner on CUDA against transformers' ``generate()`` on the same GPU: the CPU runner tests
of ``tests/unit/test_model_runner.py`` (greedy token for token, float32: alone, batched with chunked
prefill, mid-decode arrivals, prefix-cache hits, preemption; seeded sampling repeats; min_tokens)
collected again with the tiny models on the GPU, the embedded SmolLM2's greedy output, and a
throughput smoke test that prints the decode rate."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.multiproc.test_embedded_model_convert import NEEDS_EMBEDDED_MODEL

# The CPU runner tests, collected again here with this module's ``model`` (on the GPU): their
# ``generate()`` reference runs on the model's device.
from tests.unit.test_model_runner import (
    Engine,
    prompt,
    reference_greedy,
    test_alone_matches_generate,
    test_batched_with_other_requests_and_chunked_prefill,
    test_min_tokens_bans_eos_then_eos_stops,
    test_preemption_by_recompute_matches_generate,
    test_prefix_cache_hit_matches_generate,
    test_requests_arriving_mid_decode,
    test_same_seed_same_tokens_whatever_the_batch,
    tiny_model,
)

CUDA = torch.device("cuda")


@pytest.fixture(params=["llama", "qwen3"], scope="module")
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param).to(CUDA)


__all__ = [
    "test_alone_matches_generate",
    "test_batched_with_other_requests_and_chunked_prefill",
    "test_min_tokens_bans_eos_then_eos_stops",
    "test_preemption_by_recompute_matches_generate",
    "test_prefix_cache_hit_matches_generate",
    "test_requests_arriving_mid_decode",
    "test_same_seed_same_tokens_whatever_the_batch",
]


def test_the_runner_is_on_the_gpu(model: Any) -> None:
    engine = Engine(model)
    assert engine.runner.device.type == "cuda"
    assert engine.runner.cache.keys[0].device.type == "cuda"


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from transformers import AutoModelForCausalLM

    from trioserve.models.embedded_model import ensure_default_model

    folder = ensure_default_model()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(CUDA).eval()


@NEEDS_EMBEDDED_MODEL
def test_smollm2_matches_generate(smollm2: Any) -> None:
    prompts = {f"q{i}": prompt(80 + i, 12 + 9 * i) for i in range(3)}
    expected = {rid: reference_greedy(smollm2, p, 16) for rid, p in prompts.items()}
    engine = Engine(smollm2, max_num_batched_tokens=32, num_blocks=128, max_model_len=512)
    for rid, p in prompts.items():
        engine.add(rid, p, 16)
    assert engine.run() == expected


@NEEDS_EMBEDDED_MODEL
def test_smollm2_decode_throughput_smoke(smollm2: Any) -> None:
    """32 sequences of 64 tokens: every sequence gets all its tokens, each a vocabulary id; the rate
    is printed (``-s``) for the report, not asserted (shared machines)."""
    engine = Engine(smollm2, max_num_seqs=32, max_num_batched_tokens=2048, num_blocks=1024, max_model_len=512)
    for i in range(32):
        engine.add(f"t{i}", prompt(200 + i, 32), 64)
    engine.step()  # the prefills
    torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = engine.run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    assert all(len(t) == 64 for t in tokens.values())
    vocab = engine.runner.vocab_size
    assert all(0 <= tok < vocab for t in tokens.values() for tok in t)
    print(f"\nCUDA SmolLM2 float32, 32 sequences: {32 * 63 / seconds:,.0f} decode tokens/s")
